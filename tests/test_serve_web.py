"""pp-serve as a browser and a llama-server user meet it: API keys, CORS, the metrics of a queue, and the chat page
driven in a real headless Chromium (Debian's chromium and chromedriver, installed by ``make install``).

One stub server for the module, with three keys (a flag, and two in PP_API_KEY), one CORS origin and room for one
generation at a time. Expected answers come from the driver's own stub pipeline, never from the server's code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from conftest import REPO, clean_env
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from serving import Server

from pp_worker.driver.chat import chat_format
from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import run_pipeline
from pp_worker.serve.cli import parse_args
from pp_worker.worker.engines.stub import STUB_MAX_CONTEXT

STAGES = 2
FLAG_KEY, ENV_KEYS = "flag-key-0c9f2d71", ["env-key-5be04a13", "env-key-e7716c88"]
ORIGIN = "http://page.test"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# headless, and quiet: the machine has no network, and without these Chromium keeps trying to reach Google's
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1100,760"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--stub", "--stages", str(STAGES), "--concurrency", "1", "--api-key", FLAG_KEY,
                "--cors-origin", ORIGIN, "--log-level", "debug"],
               env={"PP_STUB_DELAY_MS": "5", "PP_API_KEY": ",".join(ENV_KEYS)}, key=FLAG_KEY)
    yield s
    s.stop()
    assert not [k for k in (FLAG_KEY, *ENV_KEYS) if k in s.stderr], "an API key is in the server's log"


KEYED = [("GET", "/v1/models", None), ("GET", "/v1/models/stub", None), ("GET", "/stages", None),
         ("GET", "/metrics", None), ("GET", "/props", None), ("GET", "/nowhere", None),
         ("POST", "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2}),
         ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2}),
         ("POST", "/tokenize", {"content": "a b"}), ("POST", "/detokenize", {"tokens": [1, 2]})]


@pytest.mark.parametrize("method, path, body", KEYED, ids=[f"{m} {p}" for m, p, _ in KEYED])
def test_every_endpoint_needs_a_key(server: Server, method: str, path: str, body: dict | None) -> None:
    data = json.dumps(body).encode() if body is not None else None
    for authorization in ("", f"Bearer {FLAG_KEY}x", f"Basic {FLAG_KEY}", f"Bearer {FLAG_KEY[:-1]}"):
        status, headers, raw = server.fetch(path, data, {"Authorization": authorization}, method)
        error = json.loads(raw)["error"]
        assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (authorization, status, raw)
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    status, _, raw = server.fetch(path, data, method=method)  # the server's key
    assert status == (404 if path == "/nowhere" else 200), raw


def test_health_and_the_page_need_no_key(server: Server) -> None:
    for path in ("/health", "/", "/static/chat.js", "/static/chat.css"):
        status, _, _ = server.fetch(path, headers={"Authorization": ""})
        assert status == 200, path


def test_each_key_is_accepted_from_the_flag_and_the_variable(server: Server) -> None:
    for key in (FLAG_KEY, *ENV_KEYS):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["stub"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-a-key", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_no_key_is_ever_logged(server: Server) -> None:
    """Requests with each key, and with wrong ones, then the log (uvicorn at debug level, its access log included)
    up to a last request whose line shows it has all been written."""
    for key in (FLAG_KEY, *ENV_KEYS, FLAG_KEY + "-wrong"):
        server.fetch("/v1/models", headers={"Authorization": f"Bearer {key}"})
        server.fetch("/v1/completions", b'{"model": "m", "prompt": "a", "max_tokens": 1}',
                     {"Authorization": f"Bearer {key}"})
    server.fetch("/health?probe=last")
    server.wait_for("the access log's last line", lambda: "/health?probe=last" in server.stderr)
    leaked = [line for line in server.lines if any(k in line for k in (FLAG_KEY, *ENV_KEYS))]
    assert not leaked, leaked


def test_keys_and_origins_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# the operators' keys\nk1\n\n  k2  \n")
    monkeypatch.setenv("PP_API_KEY", "k3, k4")
    args = parse_args(["--stub", "--api-key", "k0,k5", "--api-key-file", str(key_file), "--cors-origin", "*"])
    assert sorted(args.keys) == ["k0", "k1", "k2", "k3", "k4", "k5"] and args.cors_origin == ["*"]
    assert "PP_API_KEY" not in os.environ  # the stage workers inherit this environment
    for refused in (["--api-key", ""], ["--api-key", " , "], ["--api-key-file", str(tmp_path / "none")],
                    ["--cors-origin", "http://page.test/"], ["--cors-origin", "page.test"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--stub", *refused])
        assert e.value.code == 2, refused


def test_cors_answers_the_listed_origin_only(server: Server) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, "
                 "content-type", "Authorization": ""}  # a browser's preflight carries no key
    status, headers, _ = server.fetch("/v1/chat/completions", headers={**preflight, "Origin": ORIGIN}, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = server.fetch("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"},
                                      method="OPTIONS")
    assert status == 400 and "access-control-allow-origin" not in headers
    _, headers, _ = server.fetch("/v1/models", headers={"Origin": ORIGIN})
    assert headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = server.fetch("/v1/models", headers={"Origin": ORIGIN, "Authorization": ""})
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN  # so the page can read the 401
    _, headers, _ = server.fetch("/v1/models", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in headers


def test_metrics_show_the_queue_and_the_generation_in_flight(server: Server) -> None:
    """One generation at a time (--concurrency 1): an endless one runs, a second waits its turn."""
    endless = server.client().completions.create(model="m", prompt="a b c", max_tokens=100000, stream=True)
    next(iter(endless))
    waiting: list = []
    second = threading.Thread(target=lambda: waiting.append(server.client().completions.create(
        model="m", prompt="d e", max_tokens=3)))
    second.start()
    try:
        server.wait_for("the second request to wait", lambda: server.get("/health")["waiting"] == 1)
        metrics = server.metrics()
        assert metrics[("pp_serve_generations_in_flight", ())] == 1 and metrics[("pp_serve_queue_depth", ())] == 1
        for stage in map(str, range(STAGES)):
            assert metrics[("pp_serve_stage_kv_sessions", (("stage", stage),))] == 1  # the running one's
    finally:
        endless.close()  # the client leaves: the waiting one runs
        second.join(60)
    assert waiting[0].usage.completion_tokens == 3
    server.wait_for("sessions released", lambda: server.sessions() == [{}] * STAGES)


# --- the chat page, in a browser ---------------------------------------------------------------------------------
# One Chromium for the module; each test opens the page afresh: the server's key in the tab (as the key dialog keeps
# it), and localStorage (conversations, settings) cleared unless the test is about what it keeps.
KEY_STORE = "pp-serve-api-key"  # chat.js's sessionStorage name
PAGE_FILES = {"/": "text/html", "/static/chat.js": "text/javascript", "/static/chat.css": "text/css",
              "/static/marked.umd.js": "text/javascript", "/static/purify.min.js": "text/javascript",
              "/static/marked.LICENSE.txt": "text/plain", "/static/purify.LICENSE.txt": "text/plain"}


def test_the_page_files_are_served_with_their_types_and_headers(server: Server) -> None:
    for path, kind in PAGE_FILES.items():
        status, headers, body = server.fetch(path, headers={"Authorization": ""})
        assert status == 200 and headers["content-type"].split(";")[0] == kind, (path, status, headers)
        assert headers["x-content-type-options"] == "nosniff" and "default-src 'self'" in \
            headers["content-security-policy"], (path, headers)
        assert body


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: make install (or apt-get install chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # a driver path: no download
    try:
        yield driver
    finally:
        driver.quit()


def driver_run(turns: list[tuple[str, str]], max_tokens: int, sampling: Sampling | None = None) -> Generation:
    """The driver's own generation for the conversation, rendered as pp-serve renders it for the stub (plain
    format)."""
    prompt = chat_format(None).render(turns)
    return run_pipeline([prompt], stages=STAGES, stub=True, max_tokens=max_tokens, sampling=sampling).generations[0]


def expected_answer(turns: list[tuple[str, str]], max_tokens: int, sampling: Sampling | None = None) -> str:
    """The driver's own answer to the conversation, without the leading space the page trims."""
    return driver_run(turns, max_tokens, sampling).text.lstrip()


def open_page(d: WebDriver, server: Server, *, keep: bool = False) -> None:
    d.get(server.url + "/")
    d.execute_script(f"sessionStorage.setItem('{KEY_STORE}', arguments[0]);"
                     + ("" if keep else "localStorage.clear();"), server.key)
    d.refresh()
    WebDriverWait(d, 30).until(lambda _: d.find_element(By.ID, "model").text == "stub")


def settings(d: WebDriver, **values: str) -> None:
    """Settings typed in (ids with _ for -), the panel opened first."""
    if not d.find_element(By.ID, "settings").is_displayed():
        d.find_element(By.ID, "settings-toggle").click()
    for name, value in values.items():
        field = d.find_element(By.ID, name.replace("_", "-"))
        field.clear()
        field.send_keys(value)


def say(d: WebDriver, text: str) -> list[str]:
    """A prompt sent; the answers on the page once this one has its stats."""
    answered = len(d.find_elements(By.CSS_SELECTOR, ".assistant .stats"))
    d.find_element(By.ID, "prompt").send_keys(text + Keys.ENTER)
    wait_stats(d, answered + 1)
    return answers(d)


def wait_stats(d: WebDriver, n: int) -> list[str]:
    """The stats lines once ``n`` answers have theirs (an answer has them once it is over)."""
    WebDriverWait(d, 30).until(lambda _: len(d.find_elements(By.CSS_SELECTOR, ".assistant .stats")) == n
                               and not d.find_elements(By.CSS_SELECTOR, ".streaming"))
    return [e.text for e in d.find_elements(By.CSS_SELECTOR, ".assistant .stats")]


def answers(d: WebDriver) -> list[str]:
    return [e.get_attribute("textContent") for e in d.find_elements(By.CSS_SELECTOR, ".assistant .text")]


def tool(d: WebDriver, message: int, label: str) -> None:
    """Click a message's button (Copy, Edit, Regenerate); ``message`` counts every message, user's and answers."""
    d.find_elements(By.CSS_SELECTOR, ".message")[message].find_element(
        By.XPATH, f".//div[@class='tools']/button[text()='{label}']").click()


def test_the_chat_page_streams_an_answer_in_a_real_browser(server: Server, browser: WebDriver,
                                                           tmp_path: Path) -> None:
    d, wait = browser, WebDriverWait(browser, 30)
    d.get(server.url + "/")
    d.execute_script("sessionStorage.clear(); localStorage.clear()")
    d.refresh()
    # no key yet: the page asks for one; a wrong one is refused, the right one kept
    wait.until(lambda _: d.find_element(By.ID, "key").is_displayed())
    d.find_element(By.ID, "key").send_keys("wrong" + Keys.ENTER)
    wait.until(lambda _: "refused" in d.find_element(By.ID, "key-message").text)
    d.find_element(By.ID, "key").send_keys(ENV_KEYS[1] + Keys.ENTER)
    wait.until(lambda _: d.find_element(By.ID, "model").text == "stub")  # read from /props
    assert d.find_element(By.ID, "ctx").text == f"ctx {STUB_MAX_CONTEXT}"
    settings(d, system="be brief", temperature="0", max_tokens="12")
    # every state the answer's text goes through, as the DOM shows it
    d.execute_script("""window.seen = [];
        new MutationObserver(() => { const t = document.querySelector('.assistant .text');
          if (t && t.textContent !== window.seen[window.seen.length - 1]) window.seen.push(t.textContent); })
        .observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});""")
    d.find_element(By.ID, "prompt").send_keys("hello there pipeline" + Keys.ENTER)
    stats = wait_stats(d, 1)[0]
    answer = expected_answer([("system", "be brief"), ("user", "hello there pipeline")], 12)
    assert answers(d) == [answer]
    seen = d.execute_script("return window.seen")
    assert len(seen) > 2 and all(answer.startswith(t) for t in seen), seen  # it came in pieces
    assert stats.startswith("12 tokens · ") and "tok/s · TTFT " in stats and "cut at max tokens" in stats, stats
    # a second turn carries the first (the conversation), then Stop and a new conversation
    second = expected_answer([("system", "be brief"), ("user", "hello there pipeline"), ("assistant", answer),
                              ("user", "and then")], 12)
    assert say(d, "and then") == [answer, second]
    d.save_screenshot(str(tmp_path / "chat.png"))
    _stop_and_start_over(d, server, wait)
    resources = d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(server.url + "/") for r in resources), resources  # nothing from elsewhere
    assert (tmp_path / "chat.png").read_bytes().startswith(b"\x89PNG")


def _stop_and_start_over(d: WebDriver, server: Server, wait: WebDriverWait) -> None:
    """A long answer stopped once it has begun: the server cancels it (its sessions go), and the answer keeps its
    stats, its tokens counted as they came; then a new conversation."""
    settings(d, max_tokens="4000")  # minutes of stub generation
    d.find_element(By.ID, "prompt").send_keys("a long one" + Keys.ENTER)

    def third_answer_begun(_: WebDriver) -> bool:
        texts = d.find_elements(By.CSS_SELECTOR, ".assistant .text")
        return len(texts) == 3 and len(texts[2].get_attribute("textContent").split()) > 2

    wait.until(third_answer_begun)
    d.find_element(By.ID, "stop").click()
    stats = wait_stats(d, 3)[-1]
    assert stats.startswith("~") and "tok/s · TTFT " in stats and stats.endswith(" · stopped"), stats
    # a stub token is a word; a piece of text comes per token, but shifted by the few characters the server holds
    # back as a possible stop string (the plain format's "\nUser:")
    words = len(answers(d)[2].split())
    assert abs(int(stats[1:].split()[0]) - words) <= 2, (stats, words)
    server.wait_for("the stopped generation's sessions released", lambda: server.sessions() == [{}] * STAGES)
    d.find_element(By.ID, "new-chat").click()
    assert d.find_elements(By.CSS_SELECTOR, ".message") == []
    assert d.find_element(By.ID, "empty").is_displayed()


def test_conversations_are_kept_across_reloads(server: Server, browser: WebDriver) -> None:
    """Two conversations, a reload, a switch, a delete, a reload: each shows what it held."""
    d = browser
    open_page(d, server)
    settings(d, max_tokens="5")
    first = say(d, "one two three")
    d.find_element(By.ID, "new-chat").click()
    second = say(d, "four five")
    open_page(d, server, keep=True)
    titles = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations .open")]
    assert titles == ["four five", "one two three"]  # the last used first; the current one shown
    assert answers(d) == second and d.find_element(By.CSS_SELECTOR, "#conversations .active .open").text == "four five"
    assert d.find_element(By.ID, "max-tokens").get_attribute("value") == "5"  # the settings are kept too
    d.find_elements(By.CSS_SELECTOR, "#conversations .open")[1].click()
    assert answers(d) == first and len(wait_stats(d, 1)) == 1
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, ".user .text")] == ["one two three"]
    # a long answer streaming into the one shown: deleting the other leaves it streaming there; a new chat stops it
    settings(d, max_tokens="4000")
    tool(d, 1, "Regenerate")
    text = d.find_element(By.CSS_SELECTOR, ".assistant .text")
    WebDriverWait(d, 30).until(lambda _: len(text.get_attribute("textContent").split()) > 2)
    d.find_element(By.XPATH, "//li[button[text()='four five']]/button[@class='delete']").click()
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations .open")] == ["one two three"]
    words = len(d.find_element(By.CSS_SELECTOR, ".assistant .text").get_attribute("textContent").split())
    WebDriverWait(d, 30).until(lambda _: len(d.find_element(By.CSS_SELECTOR, ".assistant .text").get_attribute(
        "textContent").split()) > words + 2)
    d.find_element(By.ID, "new-chat").click()
    server.wait_for("the answer's sessions released", lambda: server.sessions() == [{}] * STAGES)
    d.find_element(By.CSS_SELECTOR, "#conversations .open").click()
    assert wait_stats(d, 1)[0].endswith(" · stopped")
    first = answers(d)
    open_page(d, server, keep=True)
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations .open")] == ["one two three"]
    assert answers(d) == first
    d.find_element(By.CSS_SELECTOR, "#conversations .delete").click()  # the one shown: the page starts over
    assert d.find_elements(By.CSS_SELECTOR, ".message, #conversations li") == []
    open_page(d, server, keep=True)
    assert d.find_elements(By.CSS_SELECTOR, ".message, #conversations li") == []
    # what another page of this origin left under that name is not taken for conversations (nor breaks the page)
    d.execute_script("localStorage.setItem('pp-serve-conversations', '{\"not\": \"a list\"}')")
    open_page(d, server, keep=True)
    assert d.find_elements(By.CSS_SELECTOR, ".message, #conversations li") == []
    settings(d, max_tokens="3")
    say(d, "still works")


def test_regenerate_edit_and_copy(server: Server, browser: WebDriver) -> None:
    d = browser
    open_page(d, server)
    d.execute_cdp_cmd("Browser.grantPermissions", {"origin": server.url,
                                                   "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    settings(d, max_tokens="8")
    first = say(d, "alpha beta")[0]
    assert first == expected_answer([("user", "alpha beta")], 8)
    say(d, "gamma")
    # regenerate the first answer with fewer tokens: the turns after it go, the answer is the new one's
    settings(d, max_tokens="3")
    tool(d, 1, "Regenerate")
    wait_stats(d, 1)
    assert answers(d) == [expected_answer([("user", "alpha beta")], 3)] and len(d.find_elements(
        By.CSS_SELECTOR, ".message")) == 2
    # edit the user's message: it is sent again in place
    tool(d, 0, "Edit")
    editor = d.find_element(By.CSS_SELECTOR, ".message.user .editor")
    editor.clear()
    editor.send_keys("delta epsilon")
    d.find_element(By.XPATH, "//button[text()='Save and send']").click()
    wait_stats(d, 1)
    edited = expected_answer([("user", "delta epsilon")], 3)
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, ".user .text")] == ["delta epsilon"]
    assert answers(d) == [edited]
    # edit the answer: kept as written, and the next turn sends it so
    tool(d, 1, "Edit")
    editor = d.find_element(By.CSS_SELECTOR, ".message.assistant .editor")
    editor.clear()
    editor.send_keys("7 7 7")
    d.find_element(By.XPATH, "//button[text()='Save']").click()
    assert answers(d) == ["7 7 7"]
    assert say(d, "zeta")[1] == expected_answer([("user", "delta epsilon"), ("assistant", "7 7 7"), ("user", "zeta")],
                                                3)
    # copy: the message's text in the clipboard
    tool(d, 3, "Copy")
    WebDriverWait(d, 10).until(lambda _: d.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], () => arguments[0](null))") == answers(d)[1])


def test_every_sampling_setting_reaches_the_sampler(server: Server, browser: WebDriver) -> None:
    """The settings the page offers, all set: the answer is the driver's own with that sampling (and not greedy, nor
    the one without either penalty). Its stats show the prompt tokens the server reused: none (stub mode)."""
    d = browser
    open_page(d, server)
    settings(d, system="be brief", temperature="0.9", top_k="20", top_p="0.95", min_p="0.02", repeat_penalty="1.3",
             presence_penalty="0.7", frequency_penalty="-0.4", max_tokens="10", seed="1234")
    sampling = Sampling(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
                        presence_penalty=0.7, frequency_penalty=-0.4, seed=1234)
    turns = [("system", "be brief"), ("user", "pick some words")]
    run = driver_run(turns, 10, sampling)
    sampled = run.text.lstrip()
    others = [expected_answer(turns, 10), expected_answer(turns, 10, replace(sampling, presence_penalty=None)),
              expected_answer(turns, 10, replace(sampling, frequency_penalty=None))]
    assert sampled not in others, (sampled, others)
    assert say(d, "pick some words") == [sampled]
    stats = wait_stats(d, 1)[0]
    assert f" ms · cached 0 of {len(run.prompt_tokens)} prompt tokens · " in stats, stats
    open_page(d, server, keep=True)  # the settings are kept, the penalties with the others
    fields = d.find_elements(By.CSS_SELECTOR, "#settings input")
    assert [f.get_attribute("value") for f in fields] == ["0.9", "20", "0.95", "0.02", "1.3", "0.7", "-0.4", "10",
                                                          "1234"]
    settings(d)
    d.find_element(By.ID, "reset-settings").click()  # back to the server's defaults: greedy
    assert [f.get_attribute("value") for f in fields] == [""] * len(fields)
    assert d.find_element(By.ID, "presence-penalty").get_attribute("placeholder") == "default (0)"  # from /props
    tool(d, 1, "Regenerate")
    wait_stats(d, 1)
    assert answers(d) == [expected_answer([("user", "pick some words")], server_max_tokens(server))]


def server_max_tokens(server: Server) -> int:
    return server.get("/props")["default_generation_settings"]["params"]["n_predict"]


# The model's side of a stream, as the page sees it: its fetch of /v1/chat/completions answered here, in pieces of
# arguments[1] characters, so the test chooses the model's output (a stub pipeline's is digits); the usage counts
# arguments[2] prompt tokens (3 if not given), of which arguments[3] reused (prompt_tokens_details left out if not).
FAKE_STREAM = """
const [text, size, prompt = 3, cached] = arguments, real = window.fetch, encoder = new TextEncoder();
const sse = (o) => encoder.encode(`data: ${JSON.stringify(o)}\\n\\n`);
window.fetch = (url, init) => {
  if (url !== "/v1/chat/completions") return real(url, init);
  const body = new ReadableStream({ async start(c) {
    let n = 0;
    for (let i = 0; i < text.length; i += size, n++) {
      c.enqueue(sse({ choices: [{ index: 0, delta: { content: text.slice(i, i + size) }, finish_reason: null }] }));
      await new Promise((r) => setTimeout(r, 1));
    }
    c.enqueue(sse({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] }));
    const details = cached === undefined ? {} : { prompt_tokens_details: { cached_tokens: cached } };
    c.enqueue(sse({ choices: [], usage: { prompt_tokens: prompt, completion_tokens: n, total_tokens: prompt + n,
                                          ...details } }));
    c.enqueue(encoder.encode("data: [DONE]\\n\\n"));
    c.close();
  } });
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""
MARKDOWN = """ # A title

Some **bold** text and `inline <code>`.

- one
- two

```python
print("<b>hi</b>")
```

<script>window.pwned = "script"</script><img src="x" onerror="window.pwned = 'img'">
[a link](javascript:window.pwned='link') <b onmouseover="window.pwned = 'hover'">hover</b>
<div style="position:fixed;inset:0">cover</div>
"""


def test_model_output_is_rendered_as_markdown_and_sanitized(server: Server, browser: WebDriver) -> None:
    d = browser
    open_page(d, server)
    d.execute_script(FAKE_STREAM, MARKDOWN, 7)
    d.find_element(By.ID, "prompt").send_keys("show me markdown" + Keys.ENTER)
    stats = wait_stats(d, 1)[0]
    assert stats.startswith(f"{-(-len(MARKDOWN) // 7)} tokens · ") and "TTFT" in stats, stats  # the usage's count
    assert "cached" not in stats, stats  # the usage says nothing of reuse
    text = d.find_element(By.CSS_SELECTOR, ".assistant .text")
    find = text.find_elements
    assert [e.text for e in find(By.TAG_NAME, "h1")] == ["A title"]
    assert [e.text for e in find(By.TAG_NAME, "strong")] == ["bold"]
    assert [e.text for e in find(By.TAG_NAME, "li")] == ["one", "two"]
    assert [e.get_attribute("textContent") for e in find(By.CSS_SELECTOR, "p > code")] == ["inline <code>"]
    code = text.find_element(By.CSS_SELECTOR, "pre > code")
    assert code.get_attribute("textContent") == 'print("<b>hi</b>")\n' and "language-python" in code.get_attribute(
        "class")
    # the markup in the output is inert: no script, no handler, no javascript: link, no style
    assert find(By.TAG_NAME, "script") == [] and find(By.CSS_SELECTOR, "[style]") == []
    handlers = d.execute_script("""return [...arguments[0].querySelectorAll('*')].flatMap(
        (e) => [...e.attributes].map((a) => a.name).filter((n) => n.startsWith('on')))""", text)
    assert handlers == []
    link = text.find_element(By.LINK_TEXT, "a link")
    assert not (link.get_attribute("href") or "").startswith("javascript:")
    webdriver.ActionChains(d).move_to_element(text.find_element(By.XPATH, ".//b[text()='hover']")).click(link).perform()
    assert d.execute_script("return window.pwned") is None
    # a code block's own Copy button copies its code
    d.execute_cdp_cmd("Browser.grantPermissions", {"origin": server.url,
                                                   "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    text.find_element(By.CSS_SELECTOR, "pre > .copy-code").click()
    WebDriverWait(d, 10).until(lambda _: d.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], () => arguments[0](null))") == 'print("<b>hi</b>")\n')


def test_the_stats_show_the_prompt_tokens_the_server_reused(server: Server, browser: WebDriver) -> None:
    """The stub pipeline reuses no prefix, so the server's reply is chosen here: 812 of 830 prompt tokens reused,
    shown after the time to first token, and still there after a reload."""
    d = browser
    open_page(d, server)
    d.execute_script(FAKE_STREAM, "a b c", 1, 830, 812)
    d.find_element(By.ID, "prompt").send_keys("again" + Keys.ENTER)
    stats = wait_stats(d, 1)[0]
    assert re.fullmatch(rf"5 tokens · [\d.]+ tok/s · TTFT \d+ ms · cached 812 of 830 prompt tokens · context "
                        rf"835/{STUB_MAX_CONTEXT}", stats), stats
    open_page(d, server, keep=True)
    assert wait_stats(d, 1) == [stats]


def test_a_browser_gets_a_loading_page_while_the_stages_warm_up(browser: WebDriver, tmp_path: Path) -> None:
    """A server whose stages wait for a gate file: the browser sees the loading page (an API client still its JSON
    503), which turns into the chat page by itself once the gate opens and the stages are up."""
    gate = tmp_path / "gate"
    slow = f"sh -c 'until test -e {gate}; do sleep 0.05; done; exec {shlex.quote(sys.executable)} -m pp_worker'"
    proc = subprocess.Popen([sys.executable, "-m", "pp_worker.serve", "--port", "0", "--stub", "--stages", "2",
                             "--launcher", slow], cwd=REPO, env=clean_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        url = re.search(r"warming up on (http://\S+)", proc.stderr.readline()).group(1)  # type: ignore[union-attr]
        for accept, kind in (("text/html,application/xhtml+xml,*/*;q=0.8", "text/html"), ("*/*", "application/json")):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url + "/", headers={"Accept": accept}), timeout=10)
            assert e.value.code == 503 and e.value.headers["Content-Type"].split(";")[0] == kind, accept
        d = browser
        d.get(url + "/")
        assert d.find_element(By.ID, "loading").is_displayed() and "loading" in d.title
        assert d.find_elements(By.ID, "model") == []
        gate.touch()
        WebDriverWait(d, 60).until(lambda _: d.find_elements(By.ID, "model") and
                                   d.find_element(By.ID, "model").text == "stub")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_failed_answer_shows_its_error_and_can_be_regenerated(server: Server, browser: WebDriver) -> None:
    """A value the server refuses (top_p 0: a 400): the answer shows the server's message, the next turn is sent
    without it, and Regenerate with the value fixed answers."""
    d = browser
    open_page(d, server)
    settings(d, top_p="0", max_tokens="4")
    d.find_element(By.ID, "prompt").send_keys("eta theta" + Keys.ENTER)
    error = WebDriverWait(d, 30).until(lambda _: d.find_elements(By.CSS_SELECTOR, ".assistant .error"))[0].text
    assert "top_p" in error and d.find_elements(By.CSS_SELECTOR, ".assistant .stats") == []
    settings(d, top_p="1")
    assert say(d, "iota")[1] == expected_answer([("user", "eta theta"), ("user", "iota")], 4)
    tool(d, 1, "Regenerate")
    wait_stats(d, 1)
    assert answers(d) == [expected_answer([("user", "eta theta")], 4)]
