"""The driver against real stage workers (tinygrad on CPU): what a user hits in the first hour.

One pipeline on a generated model that wants a BOS and carries a Llama 3 chat template serves most tests; the
command line runs on the embedded model. Expected values come from tinygrad's own tokenizer and from runs that
do not use the feature under test (a fresh session instead of a kept one, one generation instead of several).
"""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_env
from tinygrad.llm.cli import SimpleTokenizer

from pp_worker.driver.chat import Conversation, TemplateFormat, pipeline_chat_format
from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.service import PipelineService, ServedGeneration
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.modelgen import PRESETS, builtin_vocab, generate
from pp_worker.worker.gguf.header import read_header

ZEN = REPO / "pp_worker" / "data" / "zen.gguf"

MAX_CONTEXT = 320  # a conversation of three turns fits (its headers are spelled out byte by byte)
MAX_SESSIONS = 2
# Llama 3's template, shortened: it writes the BOS itself, as the real one does
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
BOS = builtin_vocab(PRESETS["tiny"][1]).bos_id
PROMPTS = ["Beautiful is better than", "Flat is better", "Errors should never", "Now is better than never"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("driver") / "bos.gguf", "tiny", seed=5, add_bos=True,
                    chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def pipeline(model):
    launch = Launch(2, model=str(model), env={"MAX_CONTEXT": str(MAX_CONTEXT), "PP_MAX_SESSIONS": str(MAX_SESSIONS)})
    with Pipeline(launch, log=io.StringIO()) as p:  # p.log: what it would have said on stderr
        yield p


@pytest.fixture(scope="module")
def tokenizer(model) -> SimpleTokenizer:
    return SimpleTokenizer.from_gguf_kv(read_header(model).kv)


def solo(p: Pipeline, prompt: str, max_tokens: int, sampling: Sampling | None = None) -> Generation:
    return p.run(make_generations(p, [prompt], max_tokens, sampling or Sampling())).generations[0]


def test_the_ready_lines_carry_what_the_driver_needs(pipeline):
    ready = pipeline.stages[0].ready
    assert (ready["bos_token_id"], ready["add_bos"], ready["max_sessions"]) == (BOS, True, MAX_SESSIONS)
    assert (ready["bos_token"], ready["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert pipeline.chat_template == TEMPLATE and isinstance(pipeline_chat_format(pipeline), TemplateFormat)
    assert (pipeline.max_context, pipeline.max_sessions) == (MAX_CONTEXT, MAX_SESSIONS)


def test_prompts_start_with_the_bos(pipeline, tokenizer):
    g = solo(pipeline, PROMPTS[0], 2)
    assert g.prompt_tokens == [BOS, *tokenizer.encode(PROMPTS[0])]


def test_concurrency_above_max_sessions_is_capped_instead_of_evicting(pipeline):
    alone = [solo(pipeline, prompt, 6).tokens for prompt in PROMPTS]
    pipeline.trace = []
    together = pipeline.run(make_generations(pipeline, PROMPTS, 6, Sampling()), concurrency=4)
    trace, pipeline.trace = pipeline.trace, None
    assert [g.tokens for g in together.generations] == alone  # nobody's KV cache was evicted
    assert _most_in_flight(trace) == MAX_SESSIONS
    assert f"running {MAX_SESSIONS} at a time" in pipeline.log.getvalue()


def test_prompts_sent_together_compute_their_common_beginning_once(pipeline):
    """Two generations of one prompt in flight at once: the second forks the first's session on each stage (its
    forks queued behind the first's prefill, which each stage serves first) and computes only the last prompt token;
    both give the tokens of a generation that computes the whole prompt alone, without reuse."""
    prompt = " ".join(PROMPTS)
    pipeline.drop_cache()
    alone = Generation(0, prompt, pipeline.new_request_id(), 8, cache_prompt=False)
    pipeline.run([alone])
    assert alone.reused == 0 and pipeline.cached_sessions() == {}
    pipeline.trace = []
    a, b = pipeline.run(make_generations(pipeline, [prompt, prompt], 8, Sampling()), concurrency=2).generations
    trace, pipeline.trace = pipeline.trace, None
    assert (a.reused, b.reused) == (0, len(b.prompt_tokens) - 1)
    assert sorted(stage for _, stage, rid, op, way in trace if op == "fork" and way == "send" and rid == b.session) \
        == [0, 1]
    assert a.tokens == b.tokens == alone.tokens
    assert sorted(pipeline.cached_sessions()) == sorted([a.session, b.session])  # each left its own as cache


def _most_in_flight(trace) -> int:
    """The most generations that had been prefilled and not yet released, at any moment."""
    live, most = set(), 0
    for _, _, rid, op, direction in trace:
        if op == "embed_and_forward" and direction == "send":
            live.add(rid)
        elif op == "release" and direction == "send":
            live.discard(rid)
        most = max(most, len(live))
    return most


def test_a_generation_stops_at_max_context_with_reason_length(pipeline, tokenizer):
    prompt = tokenizer.decode(tokenizer.encode(" ".join(PROMPTS * 40))[: MAX_CONTEXT - 8])  # close to the end
    g = solo(pipeline, prompt, 1000)
    assert g.stop_reason == "length", g.stop_reason
    # every position of the session is used: the prompt and each fed token; the last token is sampled, not fed
    assert len(g.prompt_tokens) + len(g.tokens) - 1 == MAX_CONTEXT
    assert g.text == solo(pipeline, prompt, len(g.tokens)).text  # the same text a max_tokens stop gives


def test_a_prompt_longer_than_max_context_fails_alone(pipeline):
    long = " ".join(PROMPTS * 40)
    gens = make_generations(pipeline, [PROMPTS[0], long, PROMPTS[1]], 4, Sampling())
    stats = pipeline.run(gens, concurrency=2)
    ok1, refused, ok2 = stats.generations
    assert refused.stop_reason == "error" and refused.tokens == []
    assert refused.error == f"prompt of {len(refused.prompt_tokens)} tokens exceeds max_context {MAX_CONTEXT}"
    assert (ok1.tokens, ok2.tokens) == (solo(pipeline, PROMPTS[0], 4).tokens, solo(pipeline, PROMPTS[1], 4).tokens)


def test_streaming_sends_each_id_about_once_and_adds_up_to_the_final_text(pipeline, tokenizer, monkeypatch):
    sent: list[dict] = []
    last = pipeline.stages[-1]
    send = last.send
    monkeypatch.setattr(last, "send", lambda obj: (sent.append(obj) if obj["op"] == "detokenize" else None,
                                                   send(obj)))
    streamed: list[str] = []
    g = Generation(0, PROMPTS[0], pipeline.new_request_id(), 40, Sampling(temperature=1.0, seed=3),
                   on_text=lambda gen, text, finished: streamed.append(text))
    pipeline.run([g])
    n = len(g.tokens)
    assert n == 40 and any("\ufffd" in tokenizer.decode([t]) for t in g.tokens), "no character split across tokens"
    partial = [c for c in sent if c.get("partial")]
    assert len(partial) >= 5  # it did stream
    ids_sent = sum(len(c["tokens"]) for c in partial)
    assert ids_sent <= n + 3 * len(partial)  # new ids, plus the few held back at a split character (not ~n*n/2)
    assert [c["tokens"] for c in sent if not c.get("partial")] == [g.tokens]  # the final text, once
    assert streamed[-1] == g.text == tokenizer.decode(g.tokens)
    assert all(g.text.startswith(text) for text in streamed)  # never a wrong character on the way


def test_a_conversation_keeps_its_session_between_turns(pipeline, monkeypatch):
    prefills: list[tuple[int, int, int]] = []  # (request id, position, tokens) of each prefill call
    first = pipeline.stages[0]
    send = first.send
    monkeypatch.setattr(first, "send", lambda obj: (prefills.append((obj["request_id"], obj["position"],
                                                                     len(obj["tokens"])))
                                                    if obj["op"] == "embed_and_forward" else None, send(obj)))
    conversation = Conversation(pipeline, pipeline_chat_format(pipeline), 6, Sampling())
    pipeline.trace = []
    turns = [conversation.ask(text) for text in ("Beautiful is", "Flat is", "Sparse is")]
    released_early = [t for t in pipeline.trace if t[3] == "release"]
    conversation.close()
    trace, pipeline.trace = pipeline.trace, None
    assert all(t.stop_reason != "error" for t in turns)
    rid = conversation.request_id
    assert not released_early and {t[1] for t in trace if t[2] == rid and t[3] == "release"} == {0, 1}
    # turns 2 and 3 prefill from where they part from what the session holds: its earlier turns are kept
    starts = [_common(t.cached, t.prompt_tokens) for t in turns]
    # a long prompt goes in chunks (pipelined prefill): a turn's prefill starts where no chunk ends
    turn_starts = [(r, p) for i, (r, p, _) in enumerate(prefills) if i == 0 or p != sum(prefills[i - 1][1:])]
    assert turn_starts == [(rid, 0), (rid, starts[1]), (rid, starts[2])] and 0 < starts[1] < starts[2]
    assert sum(n for _, _, n in prefills) == sum(len(t.prompt_tokens) - s for t, s in zip(turns, starts, strict=True))
    for t in turns:  # one BOS, at the start of the whole conversation, although the template writes one too
        assert t.prompt_tokens[0] == BOS and t.prompt_tokens.count(BOS) == 1
        assert t.prompt.startswith("<|start_header_id|>user")
    # the third answer is what a fresh session gives for the same conversation
    fresh = solo(pipeline, conversation.fmt.render(conversation.turns[:-1]), 6)
    assert fresh.prompt_tokens == turns[2].prompt_tokens and fresh.tokens == turns[2].tokens


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- the command line, on the embedded model -------------------------------------------------------------------

def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pp_worker.driver", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=clean_env())


def test_chat_goes_on_past_the_first_turn():
    result = cli("--chat", "--max-tokens", "4", stdin="Beautiful is better than\nFlat is\nReadability\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp-pipeline:" not in result.stderr
    assert result.stderr.count(">>> ") == 4  # three turns answered, then end of input
    assert result.stdout.count("\n") >= 3


def test_the_summary_says_why_each_generation_stopped():
    prompts = ["Beautiful is better than", "Beautiful is better than ugly. " * 12, "Flat is"]
    result = cli("--max-context", "24", "--max-tokens", "100", "--concurrency", "3", "--env", "PP_MAX_SESSIONS=2",
                 *prompts)
    assert result.returncode == 1, result.stderr[-3000:]  # one prompt could not run; the others did
    err = result.stderr
    assert "running 2 at a time" in err
    n = [len(SimpleTokenizer.from_gguf_kv(read_header(ZEN).kv).encode(p)) for p in prompts]  # no BOS: add_bos false
    # the Zen model does not end its text within 24 positions: both stop at max_context, having used all of it
    assert f"[1] prompt {n[0]} tokens, generated {24 - n[0] + 1} (stopped: length)" in err, err[-2000:]
    assert f"[2] error: prompt of {n[1]} tokens exceeds max_context 24" in err
    assert f"[3] prompt {n[2]} tokens, generated {24 - n[2] + 1} (stopped: length)" in err


def test_logprobs_of_a_real_model_describe_its_choices_alone_or_batched(pipeline):
    """The real last stage's log-probabilities: asking changes no token, the greedy token is the most probable one,
    the alternatives come most probable first with at most all the mass, and two generations side by side (their
    steps batched where the stage can) report what each does alone (up to the batched matmuls' rounding)."""
    greedy = solo(pipeline, PROMPTS[0], 6)
    g = solo(pipeline, PROMPTS[0], 6, Sampling(logprobs=5))
    assert g.tokens == greedy.tokens and len(g.logprobs) == len(g.tokens)
    for token, e in zip(g.tokens, g.logprobs, strict=True):
        top = [t["logprob"] for t in e["top"]]
        assert e["token_id"] == token == e["top"][0]["token_id"] and e["logprob"] == top[0] <= 0
        assert top == sorted(top, reverse=True) and len(top) == 5 and sum(math.exp(lp) for lp in top) <= 1 + 1e-9
    both = pipeline.run(make_generations(pipeline, PROMPTS[:2], 6, Sampling(logprobs=5)), concurrency=2).generations
    alone = [g, solo(pipeline, PROMPTS[1], 6, Sampling(logprobs=5))]
    for b, a in zip(both, alone, strict=True):
        assert b.tokens == a.tokens
        assert [e["logprob"] for e in b.logprobs] == pytest.approx([e["logprob"] for e in a.logprobs], abs=1e-3)


def test_a_generation_goes_on_after_its_stage_dies_with_the_tokens_it_would_have_had():
    """pp-serve's service on the embedded model: one greedy generation runs whole; the same again, its stage 1
    stopped (nothing more can come) then killed a few tokens in, goes on on the restarted stages from its last
    token (its prompt and tokens prefilled again): the same tokens and text as the one that never failed, ended
    once, without an error."""
    ended: list[ServedGeneration] = []
    done = threading.Event()

    def on_end(g: ServedGeneration) -> None:
        ended.append(g)
        done.set()

    service = PipelineService(Launch(2, model=str(ZEN)), concurrency=1, log=None, restarts=1, backoff_s=0)
    try:
        whole = ServedGeneration(0, PROMPTS[0], service.new_request_id(), 96, on_end=on_end)
        service.submit(whole)
        assert done.wait(120) and not whole.error and len(whole.tokens) > 20, whole.error
        done.clear()
        failed = ServedGeneration(1, PROMPTS[0], service.new_request_id(), 96, on_end=on_end)
        service.submit(failed)
        deadline = time.monotonic() + 60
        while len(failed.tokens) < 5:
            assert time.monotonic() < deadline and not failed.ended, "no tokens"
            time.sleep(0.002)
        stage1 = service.pipeline.stages[1].proc.pid
        os.kill(stage1, signal.SIGSTOP)  # from here no token comes
        cut = len(failed.tokens)
        os.kill(stage1, signal.SIGKILL)
        assert done.wait(180)
    finally:
        service.close()
    went_on = ended[1]
    assert went_on is not failed and went_on.again_of == 1 and not went_on.error and not failed.ended
    assert cut < len(whole.tokens) and went_on.tokens[:cut] == failed.tokens[:cut]
    assert (went_on.tokens, went_on.text, went_on.stop_reason) == (whole.tokens, whole.text, whole.stop_reason)
