"""pp-serve end to end in real mode: tinygrad stages on the embedded model, the official ``openai`` client.

Where real mode differs from the stub: real KV sessions (released on disconnect, counted against the context),
a real tokenizer (usage counts, multi-byte text), EOS ids, and compiled forwards shared by concurrent requests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest
from conftest import REPO
from serving import Server, request_id

from pp_worker.driver.pipeline import run_pipeline

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"
CONTEXT = 48  # small, so that the context limit is reached in a few tokens
PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Flat is better than", "Sparse",
           "Readability counts", "Errors should never", "Now is better"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--stages", "2", "--model", str(ZEN), "--max-context", str(CONTEXT)], ready_timeout=300)
    yield s
    s.stop()


def _complete(server: Server, prompt: str, **kw: object) -> openai.types.Completion:
    return server.client().completions.create(model="zen", prompt=prompt, temperature=0, **kw)


def test_greedy_completion_equals_the_driver(server: Server) -> None:
    g = run_pipeline([PROMPTS[0]], stages=2, model=str(ZEN), max_tokens=10, env={"MAX_CONTEXT": str(CONTEXT)},
                     load_timeout=300).generations[0]
    r = _complete(server, PROMPTS[0], max_tokens=10)
    assert r.choices[0].text == g.text and g.text.strip()
    assert r.usage.prompt_tokens == len(g.prompt_tokens) and r.usage.completion_tokens == len(g.tokens)
    assert r.choices[0].finish_reason == ("stop" if g.stop_reason == "eos" else "length")


def _stream(server: Server, prompt: str, out: dict[int, str] | None = None, i: int = 0) -> str:
    stream = server.client().completions.create(model="zen", prompt=prompt, max_tokens=6, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    if out is not None:
        out[i] = text
    return text


def test_eight_concurrent_streaming_clients_equal_their_solo_runs(server: Server) -> None:
    solo = [_stream(server, p) for p in PROMPTS]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=_stream, args=(server, p, together, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together.get(i) for i in range(len(PROMPTS))] == solo
    assert all(solo), solo
    assert server.sessions() == [{}, {}]


def test_output_is_cut_to_the_context_and_a_longer_prompt_refused(server: Server) -> None:
    r = _complete(server, PROMPTS[0], max_tokens=1000)
    # the session then holds prompt + completion - 1 positions: exactly the context, and no stage saw a step past it
    assert r.usage.prompt_tokens + r.usage.completion_tokens - 1 == CONTEXT
    assert r.choices[0].finish_reason == "length"
    for stream in (False, True):  # a prompt under the API's 65,536 characters but over the context
        with pytest.raises(openai.BadRequestError, match=f"exceeds max_context {CONTEXT}") as e:
            _complete(server, " ".join(["Beautiful"] * (CONTEXT + 5)), max_tokens=2, stream=stream)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")
    assert server.get("/health")["status"] == "ok"


def test_chat_completion_streamed_equals_not_streamed(server: Server) -> None:
    messages = [{"role": "user", "content": "Beautiful is better than"}]
    client = server.client()
    whole = client.chat.completions.create(model="zen", messages=messages, max_tokens=8, temperature=0)
    parts = client.chat.completions.create(model="zen", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1


def test_disconnect_releases_the_kv_sessions(server: Server) -> None:
    # without prefix reuse its session is its request id, and it is released rather than left as cache
    stream = server.client().completions.create(model="zen", prompt=PROMPTS[1], max_tokens=1000, stream=True,
                                                extra_body={"cache_prompt": False})
    rid = request_id(next(iter(stream)).id)
    assert all(rid in s for s in server.sessions())
    stream.close()
    server.wait_for("sessions released after the disconnect", lambda: server.sessions() == [{}, {}])
    assert all(int(rid) not in c for c in server.cached())


def test_logprobs_of_the_real_model_add_up_to_its_text(server: Server) -> None:
    """Each token's text, as the last stage gives it with its log-probability, adds up to the answer, streamed or
    not; greedy, so each token is its own most probable alternative."""
    messages = [{"role": "user", "content": "Beautiful is better than"}]
    client = server.client()
    r = client.chat.completions.create(model="zen", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content and content
    assert all(c.token == c.top_logprobs[0].token and c.logprob == c.top_logprobs[0].logprob <= 0 for c in content)
    stream = client.chat.completions.create(model="zen", messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert [(e.token, e.logprob) for c in chunks if c.logprobs for e in c.logprobs.content] == \
        [(e.token, e.logprob) for e in content]
    assert "".join(c.delta.content or "" for c in chunks) == r.choices[0].message.content
