"""pp-serve as a browser and a llama-server user meet it: API keys, CORS and the metrics of a queue.

One stub server for the module, with three keys (a flag, and two in PP_API_KEY), one CORS origin and room for one
generation at a time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import openai
import pytest
from serving import Server

STAGES = 2
FLAG_KEY, ENV_KEYS = "flag-key-0c9f2d71", ["env-key-5be04a13", "env-key-e7716c88"]
ORIGIN = "http://page.test"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--stub", "--stages", str(STAGES), "--concurrency", "1", "--api-key", FLAG_KEY,
                "--cors-origin", ORIGIN, "--log-level", "debug"],
               env={"PP_STUB_DELAY_MS": "5", "PP_API_KEY": ",".join(ENV_KEYS)}, key=FLAG_KEY)
    yield s
    s.stop()
    assert not [k for k in (FLAG_KEY, *ENV_KEYS) if k in s.stderr], "an API key is in the server's log"


KEYED = [("GET", "/v1/models", None), ("GET", "/v1/models/stub", None), ("GET", "/stages", None),
         ("GET", "/metrics", None), ("GET", "/nowhere", None),
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


def test_health_needs_no_key(server: Server) -> None:
    for path in ("/health",):
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
