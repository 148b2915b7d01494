"""pp-serve as a browser and a llama-server user meet it: API keys, CORS, the metrics of a queue, and the chat page
driven in a real headless Chromium (Debian's chromium and chromedriver, installed by ``make install``).

One stub server for the module, with three keys (a flag, and two in PP_API_KEY), one CORS origin and room for one
generation at a time. Expected answers come from the driver's own stub pipeline, never from the server's code.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from serving import Server

from pp_worker.driver.chat import chat_format
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
@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: make install (or apt-get install chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # a driver path: no download
    try:
        yield driver
    finally:
        driver.quit()


def expected_answer(turns: list[tuple[str, str]], max_tokens: int) -> str:
    """The driver's own answer to the conversation, rendered as pp-serve renders it for the stub (plain format)."""
    prompt = chat_format(None).render(turns)
    return run_pipeline([prompt], stages=STAGES, stub=True, max_tokens=max_tokens).generations[0].text


def test_the_chat_page_streams_an_answer_in_a_real_browser(server: Server, browser: WebDriver,
                                                           tmp_path: Path) -> None:
    d, wait = browser, WebDriverWait(browser, 30)
    d.get(server.url + "/")
    # no key yet: the page asks for one; a wrong one is refused, the right one kept
    wait.until(lambda _: d.find_element(By.ID, "key").is_displayed())
    d.find_element(By.ID, "key").send_keys("wrong" + Keys.ENTER)
    wait.until(lambda _: "refused" in d.find_element(By.ID, "key-message").text)
    d.find_element(By.ID, "key").send_keys(ENV_KEYS[1] + Keys.ENTER)
    wait.until(lambda _: d.find_element(By.ID, "model").text == "stub")  # read from /props
    assert d.find_element(By.ID, "ctx").text == f"ctx {STUB_MAX_CONTEXT}"
    # settings: a system prompt, greedy, 12 tokens
    d.find_element(By.ID, "settings-toggle").click()
    d.find_element(By.ID, "system").send_keys("be brief")
    d.find_element(By.ID, "temperature").send_keys("0")
    d.find_element(By.ID, "max-tokens").send_keys("12")
    # every state the answer's text goes through, as the DOM shows it
    d.execute_script("""window.seen = [];
        new MutationObserver(() => { const t = document.querySelector('.assistant .text');
          if (t && t.textContent !== window.seen[window.seen.length - 1]) window.seen.push(t.textContent); })
        .observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});""")
    d.find_element(By.ID, "prompt").send_keys("hello there pipeline" + Keys.ENTER)
    stats = wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".assistant .stats"))[0].text
    answer = expected_answer([("system", "be brief"), ("user", "hello there pipeline")], 12)
    assert d.find_element(By.CSS_SELECTOR, ".assistant .text").get_attribute("textContent") == answer.lstrip()
    seen = d.execute_script("return window.seen")
    assert len(seen) > 2 and all(answer.lstrip().startswith(t) for t in seen), seen  # it came in pieces
    assert stats.startswith("12 tokens · ") and "tok/s · TTFT " in stats and "cut at max tokens" in stats, stats
    # a second turn carries the first (the conversation), then Stop and Clear
    d.find_element(By.ID, "prompt").send_keys("and then" + Keys.ENTER)
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, ".assistant .stats")) == 2)
    second = expected_answer([("system", "be brief"), ("user", "hello there pipeline"), ("assistant", answer),
                              ("user", "and then")], 12)
    assert d.find_elements(By.CSS_SELECTOR, ".assistant .text")[1].get_attribute("textContent") == second.lstrip()
    d.save_screenshot(str(tmp_path / "chat.png"))
    _stop_and_clear(d, server, wait)
    resources = d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(server.url + "/") for r in resources), resources  # nothing from elsewhere
    assert (tmp_path / "chat.png").read_bytes().startswith(b"\x89PNG")


def _stop_and_clear(d: WebDriver, server: Server, wait: WebDriverWait) -> None:
    """A long answer stopped once it has begun: the server cancels it (its sessions go); then the page is cleared."""
    max_tokens = d.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("4000")  # minutes of stub generation
    d.find_element(By.ID, "prompt").send_keys("a long one" + Keys.ENTER)

    def third_answer_begun(_: WebDriver) -> bool:
        texts = d.find_elements(By.CSS_SELECTOR, ".assistant .text")
        return len(texts) == 3 and bool(texts[2].get_attribute("textContent"))

    wait.until(third_answer_begun)
    d.find_element(By.ID, "stop").click()
    wait.until(lambda _: "stopped" in d.find_elements(By.CSS_SELECTOR, ".assistant .stats")[-1].text)
    server.wait_for("the stopped generation's sessions released", lambda: server.sessions() == [{}] * STAGES)
    d.find_element(By.ID, "clear").click()
    assert d.find_elements(By.CSS_SELECTOR, ".message") == []
    assert d.find_element(By.ID, "empty").is_displayed()
