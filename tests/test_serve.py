"""pp-serve end to end in stub mode: the official ``openai`` client against a real server on 127.0.0.1.

Expected text never comes from the server's code: it comes from the driver (``run_pipeline``) running the same
prompt through its own stub stages, or from the same server serving one request at a time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from serving import Server, request_id

from pp_worker.driver.chat import chat_format
from pp_worker.driver.generation import Sampling
from pp_worker.driver.pipeline import run_pipeline
from pp_worker.serve.cli import _launch, parse_args

PROMPTS = [f"prompt {i} " + " ".join(f"w{i * j}" for j in range(i + 1)) for i in range(8)]
STAGES = 3


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # 5 ms per forward op: generations overlap visibly, and a long one lasts long enough to be cancelled
    s = Server(["--stub", "--stages", str(STAGES)], env={"PP_STUB_DELAY_MS": "5"})
    yield s
    s.stop()


def driver_text(prompt: str, max_tokens: int, sampling: Sampling | None = None) -> tuple[str, int, int]:
    """(text, prompt tokens, generated tokens) of the same prompt through the driver's own stub pipeline."""
    g = run_pipeline([prompt], stages=STAGES, stub=True, max_tokens=max_tokens, sampling=sampling).generations[0]
    return g.text, len(g.prompt_tokens), len(g.tokens)


def test_models_and_health(server: Server) -> None:
    assert [m.id for m in server.client().models.list().data] == ["stub"]
    health = server.get("/health")
    assert health["status"] == "ok" and health["stages"] == STAGES


def test_completion_streamed_or_not_equals_the_driver(server: Server) -> None:
    text, n_prompt, n_gen = driver_text(PROMPTS[3], 12)
    client = server.client()
    r = client.completions.create(model="any-name", prompt=PROMPTS[3], max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert r.model == "stub"  # any model name is accepted; the answer names the served one
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1, "the text came in pieces"


def test_chat_renders_the_model_format(server: Server) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there pipeline"}]
    prompt = chat_format(None).render([("system", "be brief"), ("user", "hello there pipeline")])
    text, n_prompt, _ = driver_text(prompt, 6)
    client = server.client()
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == n_prompt and r.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="m", messages=messages, max_completion_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text


def test_stop_string_cuts_the_text_and_ends_the_generation(server: Server) -> None:
    full, _, _ = driver_text(PROMPTS[5], 40)
    stop = full.split()[6]  # a word the text reaches after a few tokens
    expected = full[: full.find(stop)]
    for stream in (False, True):
        r = server.client().completions.create(model="m", prompt=PROMPTS[5], max_tokens=40, stop=[stop, "zz"],
                                               stream=stream)
        if stream:
            chunks = [c.choices[0] for c in r]
            text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.completion_tokens < 40, "the generation went on past the stop string"
        assert (text, finish) == (expected, "stop")


def test_sampling_fields_and_seed_reach_the_workers(server: Server) -> None:
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=11)
    text, _, _ = driver_text(PROMPTS[2], 10, sampling)
    greedy, _, _ = driver_text(PROMPTS[2], 10)
    assert text != greedy  # otherwise this test could not tell
    for _ in range(2):
        r = server.client().completions.create(model="m", prompt=PROMPTS[2], max_tokens=10, temperature=0.9,
                                               top_p=0.95, seed=11)
        assert r.choices[0].text == text


def test_logit_bias_reaches_the_last_stage(server: Server) -> None:
    greedy, _, _ = driver_text(PROMPTS[2], 6)
    first = greedy.split()[0]  # the stub's text is each token id after a space
    bias = ((int(first), -100.0), (7, 30.0))
    text, _, _ = driver_text(PROMPTS[2], 6, Sampling(logit_bias=bias))
    assert text != greedy and text.split()[0] != first  # otherwise this test could not tell
    for stream in (False, True):
        r = server.client().completions.create(model="m", prompt=PROMPTS[2], max_tokens=6, stream=stream,
                                               logit_bias={first: -100, "7": 30})
        assert ("".join(c.choices[0].text for c in r) if stream else r.choices[0].text) == text


def test_response_format_text_and_tool_choice_none_are_accepted_and_change_nothing(server: Server) -> None:
    client, messages = server.client(), [{"role": "user", "content": "hello there pipeline"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    same = client.chat.completions.create(model="m", messages=messages, max_tokens=5,
                                          response_format={"type": "text"}, tool_choice="none")
    assert same.choices[0].message.content == plain.choices[0].message.content
    for field, value in (("response_format", {"type": "json_object"}), ("tool_choice", "auto")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=messages, max_tokens=5, **{field: value})
        assert e.value.param == field


def test_models_retrieve_names_the_served_model(server: Server) -> None:
    client = server.client()
    model = client.models.retrieve("stub")
    assert (model.id, model.object, model.owned_by) == ("stub", "model", "pp_worker")
    assert model.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message


def _stream_text(server: Server, prompt: str) -> str:
    stream = server.client().completions.create(model="m", prompt=prompt, max_tokens=16, stream=True)
    return "".join(c.choices[0].text for c in stream)


def test_eight_concurrent_streaming_clients_equal_their_solo_runs(server: Server) -> None:
    solo = [_stream_text(server, p) for p in PROMPTS]
    results: dict[int, str] = {}
    peak = [0]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream_text(server, PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], server.get("/health")["running"])
        time.sleep(0.01)
    assert [results[i] for i in range(len(PROMPTS))] == solo
    assert peak[0] >= 2, "the requests never shared the pipeline"
    assert server.sessions() == [{}] * STAGES


def test_streaming_client_that_disconnects_releases_its_sessions(server: Server) -> None:
    stream = server.client().completions.create(model="m", prompt=PROMPTS[1], max_tokens=100000, stream=True)
    first = next(iter(stream))
    rid = request_id(first.id)
    assert all(rid in s for s in server.sessions()), "its session should be held on every stage meanwhile"
    stream.close()  # the client goes away mid-generation (100000 tokens would take minutes)
    server.wait_for("sessions released after the disconnect", lambda: server.sessions() == [{}] * STAGES)
    assert server.client().completions.create(model="m", prompt="still serving", max_tokens=2).choices[0].text


def test_waiting_client_that_disconnects_releases_its_sessions(server: Server) -> None:
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=1.0).completions.create(model="m", prompt=PROMPTS[4], max_tokens=100000)
    server.wait_for("sessions released after the disconnect", lambda: server.sessions() == [{}] * STAGES)


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"), ({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logprobs": 3}, "logprobs"), ({"seed": -1}, "seed"),
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x" * 70000}, "prompt"),
    ({"logit_bias": {"32": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_bad_values_get_400_in_the_api_error_shape(server: Server, fields: dict, param: str) -> None:
    body = {"model": "m", "prompt": "a b", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(**body)
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"
    assert e.value.body["message"]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "temperature": NaN}', 400),
    ("/v1/completions", b'{"model": "m"}', 422),
    ("/v1/completions", b'{"model": "m", "prompt": 3}', 422),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "max_tokens": "5"}', 422),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "logit_bias": {"1": "5"}}', 422),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "logit_bias": [1]}', 422),
    ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', 422),
    ("/v1/chat/completions", b'{"model": "m", "messages": []}', 400),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "tool", "content": "x"}]}', 400),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', 422),
])
def test_malformed_requests_get_the_error_shape(server: Server, path: str, body: bytes, status: int) -> None:
    got, reply = server.request(path, body)
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert server.get("/health")["status"] == "ok"  # and nothing broke


def test_dead_stage_gives_503_and_one_clear_log_line() -> None:
    s = Server(["--stub", "--stages", "2"], env={"PP_STUB_DELAY_MS": "5"})
    try:
        pids = s.stage_pids()
        stream = s.client().completions.create(model="m", prompt="a b c", max_tokens=100000, stream=True)
        next(iter(stream))
        os.kill(pids[1], signal.SIGKILL)  # the server stays up; only its stage dies
        with pytest.raises(openai.APIError, match="stage 1 was killed by SIGKILL"):
            list(stream)  # the stream in flight ends with the error
        for _ in range(2):  # and every request afterwards
            with pytest.raises(openai.InternalServerError) as e:
                s.client().completions.create(model="m", prompt="a", max_tokens=2)
            assert e.value.status_code == 503 and "stage 1 was killed by SIGKILL" in e.value.message
        status, health = s.request("/health")
        assert status == 503 and "stage 1 was killed by SIGKILL" in health["error"]
        down = [line for line in s.lines if "pipeline down" in line]
        assert len(down) == 1 and "stage 1 was killed by SIGKILL (exit code -9)" in down[0], s.stderr
    finally:
        assert s.stop() == 128 + signal.SIGTERM


def test_sigterm_shuts_the_stages_down() -> None:
    s = Server(["--stub", "--stages", "2"])
    pids = s.stage_pids()
    assert s.client().completions.create(model="m", prompt="a b", max_tokens=3).choices[0].text
    assert s.stop() == 128 + signal.SIGTERM
    for pid in pids:  # reaped by the server before it exited
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_get_a_session_for_every_generation_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PP_MAX_SESSIONS", raising=False)
    assert _launch(parse_args(["--stub", "--concurrency", "12"])).env["PP_MAX_SESSIONS"] == "12"
    assert _launch(parse_args(["--stub", "--env", "PP_MAX_SESSIONS=3"])).env["PP_MAX_SESSIONS"] == "3"


def test_a_port_in_use_fails_before_any_stage_starts() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pp_worker.serve", "--stub", "--port", str(port)],
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "stage 0 ready" not in proc.stderr  # it did not load the stages first
