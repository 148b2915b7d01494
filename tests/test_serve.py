"""pp-serve end to end in stub mode: the official ``openai`` client against a real server on 127.0.0.1.

Expected text never comes from the server's code: it comes from the driver (``run_pipeline``) running the same
prompt through its own stub stages, or from the same server serving one request at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import REPO, gone, group_gone, group_members, held_restart
from serving import Server, request_id

from pp_worker.driver.chat import chat_format
from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import run_pipeline
from pp_worker.serve import app as serve_app
from pp_worker.serve.api import Defaults
from pp_worker.serve.app import build_app
from pp_worker.serve.cli import _launch, parse_args
from pp_worker.serve.metrics import Metrics
from pp_worker.worker.engines.stub import STUB_MAX_CONTEXT

PY = shlex.quote(sys.executable)
PROMPTS = [f"prompt {i} " + " ".join(f"w{i * j}" for j in range(i + 1)) for i in range(8)]
STAGES = 3
RELAY = REPO / "tests" / "stdin_relay.py"  # a launcher that tells which ops a stage has read


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


def test_n_choices_are_generations_of_their_own_streamed_or_not(server: Server) -> None:
    """Choice i samples with the seed plus i (each its own draw, the request repeatable), each text as the driver
    gives it; the usage counts the prompt once and every choice's tokens; a stream's chunks name their choice."""
    texts = [driver_text(PROMPTS[2], 10, Sampling(temperature=0.9, seed=11 + i))[0] for i in range(3)]
    assert len(set(texts)) == 3  # otherwise this test could not tell the choices apart
    _, n_prompt, _ = driver_text(PROMPTS[2], 10)
    client = server.client()
    r = client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=11, n=3)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, t, "length") for i, t in enumerate(texts)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 30, n_prompt + 30)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=11,
                                            n=3, stream=True, stream_options={"include_usage": True}))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)] \
        == texts
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [30] and chunks[-1].choices == []
    assert len({c.id for c in chunks}) == 1
    messages = [{"role": "user", "content": "hello there pipeline"}]
    chat = list(client.chat.completions.create(model="m", messages=messages, max_tokens=4, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant") == [0, 1]
    assert sorted(c.choices[0].index for c in chat if c.choices[0].finish_reason == "length") == [0, 1]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=4, n=2)
    assert [c.message.content for c in whole.choices] == \
        ["".join(c.choices[0].delta.content or "" for c in chat if c.choices[0].index == i) for i in range(2)]


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
    for field, value in (("response_format", {"type": "jsonl"}), ("tool_choice", "required")):  # no tools
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


def test_tokenize_and_detokenize_take_llama_server_shapes(server: Server) -> None:
    """Stage 0's tokens for a text, the last stage's text for tokens: the same the driver's own pipeline uses."""
    g = run_pipeline([PROMPTS[4]], stages=STAGES, stub=True, max_tokens=6).generations[0]
    assert server.request("/tokenize", json.dumps({"content": PROMPTS[4]}).encode()) == (200, {"tokens":
                                                                                               g.prompt_tokens})
    assert server.request("/detokenize", json.dumps({"tokens": g.tokens}).encode()) == (200, {"content": g.text})
    status, pieces = server.request("/tokenize", json.dumps({"content": PROMPTS[4], "with_pieces": True}).encode())
    assert status == 200 and [p["id"] for p in pieces["tokens"]] == g.prompt_tokens
    whole = server.request("/detokenize", json.dumps({"tokens": g.prompt_tokens}).encode())[1]["content"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == whole  # the stub's pieces add up to the text
    assert server.request("/tokenize", b'{"content": ""}') == (200, {"tokens": []})


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", b"{}", 422, "content"),
    ("/tokenize", b'{"content": 5}', 422, "content"),
    ("/tokenize", b'{"content": "a", "parse_special": false}', 400, "parse_special"),
    ("/tokenize", b'{"content": "a", "add_special": "yes"}', 422, "add_special"),
    ("/tokenize", rb'{"content": "\ud800"}', 400, "content"),  # a lone surrogate
    ("/detokenize", b'{"tokens": "1 2"}', 422, "tokens"),
    ("/detokenize", b'{"tokens": [1, true]}', 422, "tokens"),
    ("/detokenize", b'{"tokens": [1, 32]}', 400, "tokens"),  # the stub's vocabulary is 32 ids
    ("/detokenize", b'{"tokens": [-1]}', 400, "tokens"),
])
def test_bad_tokenize_requests_are_refused_before_any_stage(server: Server, path: str, body: bytes, status: int,
                                                            param: str) -> None:
    got, reply = server.request(path, body)
    assert (got, reply["error"]["param"]) == (status, param), reply
    assert server.get("/health")["status"] == "ok"  # a stage's error reply would have failed the pipeline


def test_metrics_count_the_requests_and_tokens_served(server: Server) -> None:
    before = server.metrics()
    client = server.client()
    plain = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=7)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[6], max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="a", n=0)
    assert server.request("/nowhere")[0] == 404
    server.request("/tokenize", b'{"content": "a b"}')
    after = server.metrics()
    usages = [plain.usage, chunks[-1].usage]

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "pp_serve_requests_total"
    assert grew(requests, endpoint="/v1/completions", method="POST", status="200") == 2
    assert grew(requests, endpoint="/v1/completions", method="POST", status="400") == 1
    assert grew(requests, endpoint="other", method="GET", status="404") == 1
    assert grew(requests, endpoint="/tokenize", method="POST", status="200") == 1
    assert grew(requests, endpoint="/metrics", method="GET", status="200") == 1  # the first scrape
    assert grew("pp_serve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("pp_serve_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 12
    assert grew("pp_serve_time_to_first_token_seconds_count") == 2  # one first token per generation
    assert grew("pp_serve_inter_token_latency_seconds_count") == 12 - 2  # every later token
    for h in ("pp_serve_time_to_first_token_seconds", "pp_serve_inter_token_latency_seconds"):
        assert grew(f"{h}_bucket", le="+Inf") == grew(f"{h}_count") and grew(f"{h}_sum") > 0
    assert after[("pp_serve_queue_depth", ())] == after[("pp_serve_generations_in_flight", ())] == 0
    for stage in map(str, range(STAGES)):
        assert grew("pp_serve_stage_busy_seconds_total", stage=stage) > 0  # every stage worked for these
        assert after[("pp_serve_stage_kv_sessions", (("stage", stage),))] == 0  # and released their sessions
        assert after[("pp_serve_stage_restarts_total", (("stage", stage),))] == 0


def test_the_chat_page_and_props_are_served(server: Server) -> None:
    status, headers, html = server.fetch("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert headers["content-security-policy"].startswith("default-src 'self'")
    scripts = re.findall(rb'(?:src|href)="([^"]+)"', html)
    assert sorted(scripts) == [b"/static/chat.css", b"/static/chat.js", b"/static/marked.umd.js",
                               b"/static/purify.min.js", b"data:,"], scripts
    for name in ("chat.js", "chat.css"):
        status, _, text = server.fetch(f"/static/{name}")
        assert status == 200 and b"://" not in text, name  # nothing fetched from anywhere else
    props = server.get("/props")
    assert (props["model"], props["n_ctx"], props["total_slots"]) == ("stub", STUB_MAX_CONTEXT,
                                                                       server.get("/health")["concurrency"])
    assert props["default_generation_settings"]["params"]["n_predict"] == 64  # pp-serve's --max-tokens default


def test_without_cors_origins_no_page_elsewhere_may_call(server: Server) -> None:
    status, headers, _ = server.fetch("/v1/models", headers={"Origin": "http://elsewhere.test"})
    assert status == 200 and "access-control-allow-origin" not in headers
    preflight = {"Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST"}
    status, headers, _ = server.fetch("/v1/completions", headers=preflight, method="OPTIONS")
    assert status == 405 and "access-control-allow-origin" not in headers


CHAT = [{"role": "user", "content": "hello there pipeline"}]


def driver_generation(prompt: str, max_tokens: int, sampling: Sampling) -> Generation:
    return run_pipeline([prompt], stages=STAGES, stub=True, max_tokens=max_tokens, sampling=sampling).generations[0]


def test_chat_logprobs_streamed_or_not_are_the_last_stages(server: Server) -> None:
    g = driver_generation(chat_format(None).render([("user", CHAT[0]["content"])]), 6, Sampling(logprobs=3))
    want = [(e["text"], e["logprob"], [(t["text"], t["logprob"]) for t in e["top"]]) for e in g.logprobs]
    assert len(want) == 6 and all(len(top) == 3 for _, _, top in want)
    client = server.client()
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content] == want
    assert "".join(c.token for c in content) == r.choices[0].message.content == g.text
    assert all(c.bytes == list(c.token.encode()) and c.token == c.top_logprobs[0].token for c in content)  # argmax
    stream = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in streamed] == want
    plain = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, logprobs=True)
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[]] * 6
    assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_take_the_legacy_shape(server: Server) -> None:
    g = driver_generation(PROMPTS[3], 8, Sampling(logprobs=2))
    client = server.client()
    for stream in (False, True):
        r = client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=8, logprobs=2, stream=stream)
        parts = [c.choices[0].logprobs for c in r if c.choices and c.choices[0].logprobs] if stream \
            else [r.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        assert tokens == [e["text"] for e in g.logprobs] and "".join(tokens) == g.text
        assert [x for p in parts for x in p.token_logprobs] == [e["logprob"] for e in g.logprobs]
        assert [x for p in parts for x in p.top_logprobs] == [{t["text"]: t["logprob"] for t in e["top"]}
                                                            for e in g.logprobs]
        offsets = [x for p in parts for x in p.text_offset]
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_presence_and_frequency_penalties_reach_the_last_stage(server: Server) -> None:
    greedy, _, _ = driver_text(PROMPTS[2], 24)
    penalised, _, _ = driver_text(PROMPTS[2], 24, Sampling(presence_penalty=1.5, frequency_penalty=2.0))
    assert penalised != greedy  # otherwise this test could not tell
    r = server.client().completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, presence_penalty=1.5,
                                           frequency_penalty=2)
    assert r.choices[0].text == penalised


def test_seed_minus_one_draws_a_random_seed(server: Server) -> None:
    texts = {server.client().completions.create(model="m", prompt=PROMPTS[2], max_tokens=24, temperature=2.0,
                                                seed=-1).choices[0].text for _ in range(3)}
    assert len(texts) > 1  # three equal draws of 24 tokens at temperature 2 would be a one-in-billions chance


def test_chat_stream_chunks_end_on_token_boundaries(server: Server) -> None:
    """The chat format's stop string ("\nUser:") holds back only text that could begin it: the stub's text never
    can, so every chunk is whole tokens (" 3 14"), never a word cut where the hold-back happened to end."""
    stream = server.client().chat.completions.create(model="m", messages=CHAT, max_tokens=24, stream=True)
    chunks = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) > 1 and all(re.fullmatch(r"( \d+)+", c) for c in chunks), chunks


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"n": 0}, "n"), ({"n": 129}, "n"),
])
def test_bad_chat_values_get_400_naming_the_field(server: Server, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="m", messages=CHAT, max_tokens=2, **fields)
    assert e.value.status_code == 400 and e.value.param == param
    assert server.client().chat.completions.create(model="m", messages=CHAT, max_tokens=2).choices[0].message


# --- llama-server's own endpoints ---------------------------------------------------------------------------------


def post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    return server.request(path, json.dumps(body).encode())


def test_completion_endpoint_takes_llama_server_fields_and_shape(server: Server) -> None:
    g = driver_generation(PROMPTS[3], 8, Sampling(logprobs=2))
    status, r = post(server, "/completion", {"prompt": PROMPTS[3], "n_predict": 8, "return_tokens": True,
                                             "n_probs": 2, "cache_prompt": True})
    assert status == 200 and r["content"] == g.text and r["tokens"] == g.tokens and r["stop"] is True
    assert (r["tokens_predicted"], r["tokens_evaluated"], r["stop_type"], r["stopping_word"]) == \
        (8, len(g.prompt_tokens), "limit", "")
    assert (r["model"], r["prompt"], r["generation_settings"]["n_predict"]) == ("stub", PROMPTS[3], 8)
    t = r["timings"]
    assert (t["prompt_n"], t["predicted_n"]) == (len(g.prompt_tokens), 8) and t["prompt_ms"] > 0 < t["predicted_ms"]
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == g.tokens and [p["logprob"] for p in probs] == [e["logprob"] for e in g.logprobs]
    assert [[t["id"] for t in p["top_logprobs"]] for p in probs] == [[t["token_id"] for t in e["top"]]
                                                                     for e in g.logprobs]
    assert post(server, "/completions", {"prompt": PROMPTS[3], "n_predict": 8})[1]["content"] == g.text  # its alias


def test_completion_endpoint_sampling_fields_and_stop_words(server: Server) -> None:
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=11, repetition_penalty=1.3, presence_penalty=0.5)
    text, _, _ = driver_text(PROMPTS[2], 10, sampling)
    body = {"prompt": PROMPTS[2], "n_predict": 10, "temperature": 0.9, "top_p": 0.95, "seed": 11,
            "repeat_penalty": 1.3, "presence_penalty": 0.5}
    assert post(server, "/completion", body)[1]["content"] == text
    full, _, _ = driver_text(PROMPTS[5], 40)
    word = full.split()[6]
    status, r = post(server, "/completion", {"prompt": PROMPTS[5], "n_predict": 40, "stop": [word]})
    assert (r["content"], r["stop_type"], r["stopping_word"]) == (full[:full.find(word)], "word", word)
    greedy, _, _ = driver_text(PROMPTS[2], 6)
    first = int(greedy.split()[0])
    banned = post(server, "/completion", {"prompt": PROMPTS[2], "n_predict": 6, "logit_bias": [[first, False]]})
    assert banned[1]["content"] == driver_text(PROMPTS[2], 6, Sampling(logit_bias=((first, -100.0),)))[0]


def test_completion_endpoint_streams_as_llama_server(server: Server) -> None:
    g = driver_generation(PROMPTS[4], 12, Sampling())
    status, headers, raw = server.fetch("/completion", json.dumps({"prompt": PROMPTS[4], "n_predict": 12,
                                                                    "stream": True}).encode())
    lines = [line for line in raw.decode().split("\n\n") if line]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: {") for line in lines), lines[-1]  # no [DONE], as llama-server
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert len(events) > 2 and all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == g.text
    assert [t for e in events[:-1] for t in e["tokens"]] == g.tokens
    assert (events[-1]["stop_type"], events[-1]["tokens_predicted"]) == ("limit", 12)


def test_apply_template_and_the_unprefixed_aliases(server: Server) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, r = post(server, "/apply-template", {"messages": messages})
    assert (status, r) == (200, {"prompt": chat_format(None).render([("system", "be brief"), ("user", "hi")])})
    assert server.request("/models") == server.request("/v1/models")
    bare = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)  # no /v1, as llama-server allows
    answer = bare.chat.completions.create(model="m", messages=CHAT, max_tokens=5).choices[0].message.content
    assert answer == server.client().chat.completions.create(model="m", messages=CHAT,
                                                             max_tokens=5).choices[0].message.content


def test_embeddings_are_a_501_that_says_why(server: Server) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        server.client().embeddings.create(model="m", input="hello")
    assert e.value.status_code == 501 and "last stage" in e.value.message
    assert server.get("/health")["status"] == "ok"


def test_props_report_llama_servers_fields_and_metrics_its_names(server: Server) -> None:
    props = server.get("/props")
    params = props["default_generation_settings"]["params"]
    assert (params["repeat_penalty"], params["presence_penalty"], params["n_probs"], params["stop"]) == \
        (1.0, 0.0, 0, [])
    assert props["build_info"].startswith("pp_worker") and props["model_alias"] == "stub"
    server.client().completions.create(model="m", prompt=PROMPTS[1], max_tokens=3)
    m = server.metrics()
    assert m[("llamacpp:prompt_tokens_total", ())] == m[("pp_serve_prompt_tokens_total", ())] > 0
    assert m[("llamacpp:tokens_predicted_total", ())] == m[("pp_serve_generation_tokens_total", ())] > 0
    assert m[("llamacpp:requests_processing", ())] == m[("llamacpp:requests_deferred", ())] == 0


@pytest.mark.parametrize("fields, param", [
    ({"n_predict": 0}, "n_predict"), ({"n_predict": -2}, "n_predict"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"n_probs": 21}, "n_probs"), ({"logit_bias": [["hello", 1]]}, "logit_bias"), ({"prompt": [1, 2]}, "prompt"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"seed": -7}, "seed"),
])
def test_bad_completion_endpoint_values_get_400_naming_the_field(server: Server, fields: dict, param: str) -> None:
    status, r = post(server, "/completion", {"prompt": "a b", "n_predict": 2, **fields})
    assert (status, r["error"]["param"]) == (400, param), r
    assert post(server, "/completion", {"prompt": "a b", "n_predict": 2})[0] == 200


def test_alias_names_the_model_everywhere() -> None:
    s = Server(["--stub", "--stages", "2", "--alias", "my-model"])
    try:
        client = s.client()
        assert [m.id for m in client.models.list().data] == ["my-model"] and client.models.retrieve("my-model")
        assert client.completions.create(model="x", prompt="a b", max_tokens=2).model == "my-model"
        assert s.get("/props")["model"] == "my-model"
    finally:
        s.stop()


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
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    body = json.dumps({"model": "m", "prompt": PROMPTS[4], "max_tokens": 100000})  # minutes of generation
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})  # not streamed
    held: list[list[dict[str, int]]] = []
    server.wait_for("a session on every stage for the request",
                    lambda: held.append(server.sessions()) or all(len(s) == 1 for s in held[-1]))
    assert len({key for s in held[-1] for key in s}) == 1, held[-1]  # the same generation on every stage
    conn.close()  # the client goes away without its answer
    server.wait_for("sessions released after the disconnect", lambda: server.sessions() == [{}] * STAGES)


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logprobs": 21}, "logprobs"), ({"seed": -2}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
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
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', 400),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', 422),
])
def test_malformed_requests_get_the_error_shape(server: Server, path: str, body: bytes, status: int) -> None:
    got, reply = server.request(path, body)
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert server.get("/health")["status"] == "ok"  # and nothing broke


def _asgi_post(app: Any, path: str, messages: list[dict], sent: list[dict], length: int | None = None) -> None:
    """``app`` run on one POST to ``path`` (JSON; ``length``: the Content-Length it promises) whose receive() gives
    ``messages`` in turn; what it sends goes to ``sent``."""
    headers = [(b"content-type", b"application/json")] + ([(b"content-length", str(length).encode())] if length
                                                         is not None else [])
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "root_path": "", "headers": headers,
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1)}
    feed = iter(messages)

    async def receive() -> dict:
        return next(feed)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))


def _reply(sent: list[dict]) -> tuple[int, dict]:
    """The status and JSON body of what an ASGI app sent."""
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_an_internal_error_is_a_500_in_the_api_error_shape() -> None:
    """A bug in a handler (here a service that raises) still gets OpenAI's shape, not a plain-text 500."""

    class Broken:
        def new_request_id(self) -> int:
            raise RuntimeError("boom")

    app = build_app(Broken(), chat_format(None), Defaults(4, Sampling()))  # type: ignore[arg-type]
    sent: list[dict] = []
    with pytest.raises(RuntimeError, match="boom"):  # raised again after the reply, for the server's log
        _asgi_post(app, "/v1/completions", [{"type": "http.request", "body": b'{"model": "m", "prompt": "a"}',
                                             "more_body": False}], sent)
    status, body = _reply(sent)
    assert status == 500 and body["error"]["type"] == "server_error", body
    assert body["error"]["message"] == "internal error: RuntimeError: boom"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/apply-template"])
def test_a_client_gone_before_its_body_is_a_499_not_a_server_error(path: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that closes its connection halfway through its body: the reply (which nobody reads) says so, the log
    gets no traceback, and the metrics count a 499, not a 500 of the server's."""

    class Idle:
        def new_request_id(self) -> int:
            raise AssertionError("no request may start without its body")

    made: list[Metrics] = []
    monkeypatch.setattr(serve_app, "Metrics", lambda: made.append(Metrics()) or made[-1])
    app = build_app(Idle(), chat_format(None), Defaults(4, Sampling()))  # type: ignore[arg-type]
    sent: list[dict] = []
    _asgi_post(app, path, [{"type": "http.request", "body": b'{"prompt": "half a bo', "more_body": True},
                           {"type": "http.disconnect"}], sent, length=500)  # nothing raised: no traceback logged
    status, body = _reply(sent)
    assert status == 499 and body["error"]["code"] == "client_closed_request", body
    assert "after 21 bytes" in body["error"]["message"]
    assert {status for (_, _, status) in made[0].requests} == {"499"}


def _health(s: Server) -> tuple[int, dict]:
    return s.request("/health")


def _completes(s: Server) -> bool:
    """Whether a completion is answered now (a 503 while the stages restart is not)."""
    try:
        return bool(s.client().completions.create(model="m", prompt="a", max_tokens=2).choices[0].text)
    except openai.InternalServerError as e:
        assert e.status_code == 503 and e.body["type"] == "service_unavailable", e.body
        return False


def _restart_held_503(s: Server, waiting: int) -> None:
    """While the new stages wait at the gate, every new request, and /health, gets a 503 that says why."""
    with pytest.raises(openai.InternalServerError) as e:
        s.client().completions.create(model="m", prompt="a", max_tokens=2)
    assert e.value.status_code == 503 and "restarting" in e.value.message, e.value.body
    assert "stage 1 was killed by SIGKILL" in e.value.message
    status, health = _health(s)
    assert status == 503 and health["status"] == "recovering" and "stage 1 was killed" in health["error"]
    assert health["waiting"] == waiting  # what was accepted, kept for the new stages


def test_a_dead_stage_is_replaced_and_serving_resumes(tmp_path: Path) -> None:
    """Stage 1 is stopped (the stream holds), a second request queues, stage 1 is killed: the restart is held at a
    gate while new requests get a 503; then the stream goes on to its end on the new stages (a pause, no error),
    and the queued request is answered there."""
    launcher, gate = held_restart(tmp_path)
    s = Server(["--stub", "--stages", "2", "--restart-backoff", "0.5", "--launcher", launcher, "--concurrency", "1"],
               env={"PP_STUB_DELAY_MS": "5"})
    try:
        pids = s.stage_pids()
        stream = s.client().completions.create(model="m", prompt="a b c", max_tokens=300, stream=True,
                                               stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        os.kill(pids[1], signal.SIGSTOP)  # the stream holds here: stage 1 answers nothing more
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rest = pool.submit(list, chunks)  # the stream, read on
            queued = pool.submit(lambda: s.client().completions.create(model="m", prompt="d e", max_tokens=5))
            try:
                s.wait_for("the second request queued", lambda: s.get("/health")["waiting"] == 1, timeout=30)
                os.kill(pids[1], signal.SIGKILL)
                s.wait_for("both kept", lambda: "2 request(s) wait for the new stages (1 of them were running: 0 "
                           "start again, the rest go on from their last token)" in s.stderr, timeout=30)
                _restart_held_503(s, waiting=2)
            finally:
                gate.touch()  # (a failure above must not leave the requests waiting for ever)
            answer = queued.result(timeout=90)  # it never reached the dead stages: it runs on the new ones
            chunks_after = rest.result(timeout=90)
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
        assert first.choices[0].text and chunks_after[-2].choices[0].finish_reason == "length"
        assert chunks_after[-1].usage.completion_tokens == 300  # every token, those before the failure included
        s.wait_for("completions answered again", lambda: _completes(s), timeout=90)
        assert _health(s) == (200, s.get("/health")) and s.get("/health")["status"] == "ok"
        new_pids = s.stage_pids()
        assert not set(new_pids) & set(pids) and all(gone(pid) for pid in pids), (pids, new_pids)
        down = [line for line in s.lines if line.startswith("pipeline down")]
        assert down == ["pipeline down: stage 1 was killed by SIGKILL (exit code -9)\n"], s.stderr
        assert "restarting the stages in 0.5 s (attempt 1 of 5)" in s.stderr
        assert "pipeline restarted (attempt 1 of 5): serving again" in s.stderr
        metrics = s.metrics()  # /metrics counts the restart and names the stage that failed
        assert [metrics[("pp_serve_stage_restarts_total", (("stage", st),))] for st in "01"] == [1, 1]
        assert [metrics[("pp_serve_stage_failures_total", (("stage", st),))] for st in "01"] == [0, 1]
    finally:
        assert s.stop() == 128 + signal.SIGTERM


def test_sigterm_while_the_stages_restart_does_not_wait_for_them() -> None:
    """What waits for restarted stages when a SIGTERM comes ends at once with a 503: a stopping server starts none."""
    s = Server(["--stub", "--stages", "2", "--restart-backoff", "20"], env={"PP_STUB_DELAY_MS": "5"})
    stream = s.client().completions.create(model="m", prompt="a b c", max_tokens=100000, stream=True)
    next(iter(stream))
    os.kill(s.stage_pids()[1], signal.SIGKILL)
    s.wait_for("recovering", lambda: s.request("/health")[1]["status"] == "recovering")
    assert s.stop(timeout=10) == 128 + signal.SIGTERM  # no drain waits for the 20 s backoff
    with pytest.raises(openai.APIError, match="the server is shutting down"):
        list(stream)  # the stream kept for the new stages got its error event before the exit
    assert "1 requests waiting for the restarted stages end with 503" in s.stderr
    assert "Traceback" not in s.stderr


def test_a_frozen_stage_is_killed_and_replaced() -> None:
    s = Server(["--stub", "--stages", "2", "--step-timeout", "1", "--restart-backoff", "0"],
               env={"PP_STUB_DELAY_MS": "5"})
    try:
        pids = s.stage_pids()
        os.kill(pids[1], signal.SIGSTOP)
        # it waits --step-timeout for the frozen stage; the request, still in its prompt, runs on the new stages
        answer = s.client().completions.create(model="m", prompt="a b", max_tokens=4)
        assert answer.usage.completion_tokens == 4 and answer.choices[0].finish_reason == "length"
        assert "stage 1 gave no reply" in s.stderr and "(1 of them were running: 1 start again" in s.stderr
        assert gone(pids[1], timeout=30), "the frozen stage was left behind"
        assert not set(s.stage_pids()) & set(pids)
    finally:
        assert s.stop() == 128 + signal.SIGTERM


def test_while_the_stages_load_the_port_answers_503_warming(tmp_path: Path) -> None:
    """A supervisor polling /health sees the server on its way (503 warming), never a connection that hangs; then ok.
    The stages' launcher waits for a gate file (loading, and PP_WARMUP's compiles, for a stub), which this test
    creates once it has seen the 503s."""
    gate = tmp_path / "gate"
    slow = f"sh -c 'until test -e {gate}; do sleep 0.05; done; exec {PY} -m pp_worker'"
    proc = subprocess.Popen([sys.executable, "-m", "pp_worker.serve", "--port", "0", "--stub", "--stages", "2",
                             "--launcher", slow], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        url = re.search(r"warming up on (http://\S+)", proc.stderr.readline()).group(1)  # type: ignore[union-attr]
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(st == 200 and path == "/health" for st, path, _ in seen):
            if len([st for st, _, _ in seen if st == 503]) >= 2:
                gate.touch()  # both paths answered while warming: now the stages may start
            for path in ("/v1/models", "/health"):
                try:
                    with urllib.request.urlopen(url + path, timeout=5) as r:
                        seen.append((r.status, path, json.loads(r.read())))
                except urllib.error.HTTPError as e:
                    seen.append((e.code, path, json.loads(e.read())))
            time.sleep(0.1)
        warming = [(path, body) for status, path, body in seen if status == 503]
        assert ("/health", {"status": "warming"}) in warming, seen[:4]
        assert any(path == "/v1/models" and body["error"]["code"] == "warming_up" for path, body in warming)
        last = [(status, body) for status, path, body in seen if path == "/health"][-1]
        assert last == (200, {**last[1], "status": "ok"})  # then the API, on the same port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_pp_serve_compiles_in_the_background_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PP_WARMUP", raising=False)
    assert _launch(parse_args(["--stub"])).env["PP_WARMUP"] == "background"
    assert _launch(parse_args(["--stub", "--env", "PP_WARMUP=0"])).env["PP_WARMUP"] == "0"
    monkeypatch.setenv("PP_WARMUP", "0")  # the operator's environment, which the stages inherit
    assert "PP_WARMUP" not in _launch(parse_args(["--stub"])).env


def test_a_server_that_cannot_restart_its_stages_exits_1(tmp_path: Path) -> None:
    once = f"sh -c 'test -e {tmp_path}/{{stage}} && exit 3; touch {tmp_path}/{{stage}}; exec {PY} -m pp_worker'"
    s = Server(["--stub", "--stages", "2", "--restarts", "2", "--restart-backoff", "0.1", "--launcher", once])
    pids = s.stage_pids()
    os.kill(pids[0], signal.SIGKILL)
    try:
        assert s.proc.wait(60) == 1, s.stderr  # so that a supervisor starts a fresh one
    finally:
        s.stop()
    assert re.search(r"restart attempt 2 failed: stage \d exited with code 3", s.stderr), s.stderr
    assert "pipeline down for good, every request now fails: stage 0 was killed by SIGKILL (exit code -9) " \
           "(not recovered after 2 restart attempts)" in s.stderr
    assert "Traceback" not in s.stderr


def test_sigterm_drains_the_requests_in_flight_and_refuses_new_ones() -> None:
    s = Server(["--stub", "--stages", str(STAGES)], env={"PP_STUB_DELAY_MS": "5"})
    expected, _, _ = driver_text(PROMPTS[2], 40)
    frozen = s.stage_pids()[1]
    os.kill(frozen, signal.SIGSTOP)  # the request cannot end before the checks below are done, however slow they are
    chunks: list = []
    try:
        reader = threading.Thread(target=lambda: chunks.extend(s.client().completions.create(
            model="m", prompt=PROMPTS[2], max_tokens=40, stream=True)))
        reader.start()
        s.wait_for("the request to be running", lambda: s.get("/health")["running"] == 1)
        os.kill(s.proc.pid, signal.SIGTERM)
        s.wait_for("the drain to begin", lambda: "SIGTERM: draining 1 running" in s.stderr)
        with pytest.raises(openai.InternalServerError) as e:
            s.client().completions.create(model="m", prompt="a", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable", e.value.body
        assert "shutting down" in e.value.message
        status, health = s.request("/health")
        assert status == 503 and health["status"] == "draining" and health["running"] == 1
    finally:
        os.kill(frozen, signal.SIGCONT)
    reader.join(60)
    assert "".join(c.choices[0].text for c in chunks) == expected  # the drain let it finish
    assert chunks[-1].choices[0].finish_reason == "length"
    assert s.stop(timeout=30) == 128 + signal.SIGTERM
    assert "Traceback" not in s.stderr, s.stderr


def test_requests_still_running_at_the_drain_timeout_end_in_openai_errors() -> None:
    s = Server(["--stub", "--stages", "2", "--drain-timeout", "1"], env={"PP_STUB_DELAY_MS": "5"})
    endless = {"model": "m", "prompt": "a b", "max_tokens": 100000}
    conn = http.client.HTTPConnection(s.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**endless, "stream": True}),
                 {"Content-Type": "application/json"})
    streamed = conn.getresponse()
    assert streamed.status == 200 and streamed.readline().startswith(b"data: {")
    plain: list[tuple[int, dict]] = []
    waiter = threading.Thread(target=lambda: plain.append(s.request("/v1/completions", json.dumps(endless).encode())))
    waiter.start()
    s.wait_for("both requests running", lambda: s.get("/health")["running"] == 2)
    os.kill(s.proc.pid, signal.SIGTERM)
    events = [line.decode().strip() for line in streamed if line.startswith(b"data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]  # the stream ends as streams do, after an error event
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
    waiter.join(30)
    status, body = plain[0]
    assert status == 503 and body["error"]["type"] == "service_unavailable", (status, body)
    assert "shutting down" in body["error"]["message"]
    assert s.stop(timeout=30) == 128 + signal.SIGTERM
    assert "Traceback" not in s.stderr and "still in flight end with 503" in s.stderr, s.stderr


def test_sigterm_shuts_the_stages_down() -> None:
    s = Server(["--stub", "--stages", "2"])
    pids = s.stage_pids()
    assert s.client().completions.create(model="m", prompt="a b", max_tokens=3).choices[0].text
    assert s.stop() == 128 + signal.SIGTERM
    for pid in pids:  # reaped by the server before it exited
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_killed_server_leaves_no_worker_running(tmp_path: Path) -> None:
    relay = f"{PY} {shlex.quote(str(RELAY))} {tmp_path}/ops{{stage}} -- {PY} -m pp_worker"  # logs the ops read
    s = Server(["--stub", "--stages", "2", "--launcher", relay], env={"PP_STUB_DELAY_MS": "60000"})  # an op: 1 min
    pids = s.stage_pids()
    conn = http.client.HTTPConnection(s.url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "a b", "max_tokens": 4}),
                 {"Content-Type": "application/json"})
    ops = tmp_path / "ops0"
    s.wait_for("stage 0 to be in the prefill", lambda: "embed_and_forward" in ops.read_text().split())
    s.proc.kill()
    s.proc.wait(5)
    conn.close()
    assert all(group_gone(pid, timeout=10) for pid in pids), {pid: group_members(pid) for pid in pids}


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
