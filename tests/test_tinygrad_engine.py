"""The tinygrad engine on CPU with small generated models: N chained stages == one process, token for token.

References:
- ``SameCastReference``: tinygrad's own whole-file loader (`Transformer.from_gguf`) and its blocks with their own
  KV caches, in one process over ALL blocks, casting the hidden state to fp16 and back at the same block
  boundaries as the chain. Prefill is eager with a concrete length; decode is a TinyJit with a symbolic position.
  The chain must give the same greedy tokens and logits within LOGIT_ATOL_SAME_CAST.
- ``pp_worker.testing.npref`` RefModel: an independent float64 numpy forward; logits within LOGIT_ATOL_FP64.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from samecast import SameCastReference
from tinygrad import dtypes

from pp_worker.testing import chain as chain_
from pp_worker.testing.modelgen import PRESETS, builtin_vocab, generate, random_weights, write_gguf
from pp_worker.testing.npref import RefModel
from pp_worker.worker.compiled.replay import Replay
from pp_worker.worker.engines.base import EngineError
from pp_worker.worker.engines.model import context_length
from pp_worker.worker.engines.tinygrad_engine import (
    CompiledStage,
    TinygradEngine,
    default_prefill_chunk,
    ladder,
    plan,
    split,
)
from pp_worker.worker.gguf.header import ModelLoadError, read_header
from pp_worker.worker.hostio import HostBuffer, InputBuffer, pinned_allocator

MAX_CONTEXT = 96  # room for prompts of 70 tokens: two full prefill chunks of 32 and a remainder
N_TOKENS = 16
# measured: <= 2.4e-4 (Q8_0) on logits of magnitude ~11; eager-concrete vs JIT-symbolic kernels differ. F16 on 4 stages
# (2026-12-07, an Intel Xeon): 1.1e-3 with the tiles, 1.9e-3 where a 32-row chunk takes F16's matrix product (an fp16
# rounding at a stage boundary that falls the other way moves a logit ~1e-3)
LOGIT_ATOL_SAME_CAST = 2e-3
# measured: <= 6.4e-3 (fp32 compute, fp16 weights and fp16 stage boundaries vs float64)
LOGIT_ATOL_FP64 = 3e-2
TEXTS = ("Beautiful is better than ugly.", "Now is better than never. Although never is often better")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    spec, n_merges = PRESETS["tiny"]
    vocab = builtin_vocab(n_merges)
    out = {dt: write_gguf(d / f"tiny-{dt}.gguf", spec, random_weights(spec, len(vocab.tokens), 0), vocab, dt,
                          name="pp-worker-tiny-s0") for dt in ("F16", "Q8_0")}
    tied = type(spec)(**{**spec.__dict__, "tie_embeddings": True})
    out["tied"] = write_gguf(d / "tiny-tied.gguf", tied, random_weights(tied, len(vocab.tokens), 1), vocab, "F16")
    return out


class Chain(chain_.Chain):
    def __init__(self, path: Path, num_stages: int, max_context: int = MAX_CONTEXT, **kw):
        super().__init__(path, num_stages, max_context, **kw)


@pytest.fixture(scope="module")
def chain(models):
    built: dict[tuple[str, int, bool], Chain] = {}

    def get(dtype: str, num_stages: int, keep_quantized: bool = True) -> Chain:
        if (dtype, num_stages, keep_quantized) not in built:
            # float32 KV pages: the same-cast reference's (float16 ones are checked against theirs in test_kvcache)
            built[dtype, num_stages, keep_quantized] = Chain(models[dtype], num_stages, keep_quantized=keep_quantized,
                                                             kv_dtype="float32")
        return built[dtype, num_stages, keep_quantized]

    return get


@pytest.fixture(scope="module")
def reference(models):
    built: dict[str, SameCastReference] = {}

    def get(dtype: str) -> SameCastReference:
        if dtype not in built:
            built[dtype] = SameCastReference(models[dtype], MAX_CONTEXT)
        return built[dtype]

    return get


@pytest.fixture(scope="module")
def prompts(chain) -> list[list[int]]:
    first = chain("F16", 2).engines[0]
    long = (first.tokenize(" ".join(TEXTS)) * 4)[:40]  # > the CPU's prefill chunk of 32: calls of 32 and 8
    return [first.tokenize(TEXTS[0]), first.tokenize(TEXTS[1]), long]


# ---------------------------------------------------------------- N stages == one process


@pytest.mark.parametrize("dtype, num_stages", [("F16", 2), ("F16", 3), ("F16", 4), ("Q8_0", 3)])
def test_chain_matches_same_cast_reference(chain, reference, prompts, dtype, num_stages):
    """tinygrad's loader dequantizes a quantized file to fp16 weights: the chain does the same here (its same cast
    points); kept packed, Q8_0 is checked against the float64 reference below and in tests/test_quantized.py."""
    c = chain(dtype, num_stages, keep_quantized=False)
    for rid, prompt in enumerate(prompts):
        got, got_logits = c.generate(rid, prompt, N_TOKENS)
        want, want_logits = reference(dtype).generate(prompt, N_TOKENS, c.boundaries)
        assert got == want, f"prompt {rid}"
        np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), rtol=0, atol=LOGIT_ATOL_SAME_CAST)
        c.release(rid)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_chain_logits_match_float64_reference(chain, models, prompts, dtype):
    c, ref = chain(dtype, 3 if dtype == "Q8_0" else 2), RefModel.from_gguf(models[dtype])
    prompt = prompts[0]
    tokens, logits = c.generate(100, prompt, 8)
    want = ref.logits(prompt + tokens[:-1])[len(prompt) - 1:]  # (8, V): the positions the chain predicted from
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=LOGIT_ATOL_FP64)
    assert tokens == ref.greedy(prompt, 8)


def test_tied_embeddings_head_uses_the_embedding_matrix(models):
    c = Chain(models["tied"], 2)
    last = c.engines[-1]
    assert "token_embd.weight" in last.loaded_tensors and "output.weight" not in read_header(models["tied"]).tensors
    prompt = c.engines[0].tokenize(TEXTS[0])
    want = RefModel.from_gguf(models["tied"]).logits(prompt)[-1]
    np.testing.assert_allclose(c.step(0, prompt, 0), want, rtol=0, atol=LOGIT_ATOL_FP64)


# ---------------------------------------------------------------- sessions under the JIT


def test_interleaved_generations_match_solo(chain, prompts):
    """The JIT trap: what changes per session must reach the JIT as arguments (the pool, bound pages and offsets, the
    page table's contents). A session's cache swapped in as a block attribute under the JIT fails this test."""
    c = chain("F16", 4)  # two middle stages
    solo = [c.generate(10 + i, p, N_TOKENS)[0] for i, p in enumerate(prompts)]
    rids = [20, 21, 22]
    outs: list[list[int]] = [[int(c.step(r, p, 0).argmax())] for r, p in zip(rids, prompts, strict=True)]
    for _ in range(N_TOKENS - 1):
        for r, p, out in zip(rids, prompts, outs, strict=True):
            out.append(int(c.step(r, [out[-1]], len(p) + len(out) - 1).argmax()))
    assert outs == solo
    assert all(e._stage.decode.ready for e in c.engines), "decode ran without the JIT"
    assert all(e._stage.decode.direct for e in c.engines), "decode replays went through tinygrad's preparation"
    held = c.engines[1].sessions()
    assert [held[r] for r in rids] == [len(p) + N_TOKENS - 1 for p in prompts]


def test_rewind_reuses_the_prefix_and_overwrites_the_rest(chain, prompts):
    c = chain("F16", 2)
    a, b = prompts[1], prompts[0]
    k = 4
    c.generate(30, a, 6)  # session 30 holds a + 5 generated positions
    fresh = c.generate(31, a[:k] + b, 8)[0]
    # rewind 30 to position k: a[:k] stays cached, b overwrites everything after it
    got = [int(c.step(30, b, k).argmax())]
    while len(got) < 8:
        got.append(int(c.step(30, [got[-1]], k + len(b) + len(got) - 1).argmax()))
    assert got == fresh
    assert c.engines[0].sessions()[30] == k + len(b) + 7


def test_a_check_runs_its_rows_as_one_call_each_with_its_one_token_steps_logits(chain, prompts, monkeypatch):
    """A check of drafted tokens (`forward_rows`): the last stage runs the rows as one call of the ladder (not one
    call a row), row i's logits those of the one-token step at position + i (up to a multi-row forward's rounding);
    a `rewind` then keeps the rows up to the last kept, and the session goes on from there."""
    c = chain("F16", 2)
    prompt, last = prompts[0], c.engines[-1]
    p = len(prompt)
    tokens, logits = c.generate(70, prompt, 6)  # logits[i + 1]: the one-token step fed tokens[i] at p + i
    c.step(71, prompt, 0)
    calls: list[int] = []
    run = last._stage.run
    monkeypatch.setattr(last._stage, "run", lambda values, *a: calls.append(len(values)) or run(values, *a))
    rows = c.rows(71, tokens[:4], p)
    assert calls == [4]
    np.testing.assert_allclose(rows, np.stack(logits[1:5]), rtol=0, atol=1e-4)
    assert [int(r.argmax()) for r in rows] == tokens[1:5]
    last.rewind(71, p + 2)  # the check kept one guess: rows p and p + 1 stay
    assert last.sessions()[71] == p + 2
    np.testing.assert_allclose(c.step(71, [tokens[2]], p + 2), logits[3], rtol=0, atol=1e-4)
    c.release(70)
    c.release(71)


def test_a_released_sessions_pages_are_reused_and_not_held_by_the_blocks(models, prompts):
    c = Chain(models["F16"], 2)
    first = c.engines[0]
    want = c.generate(1, prompts[1], N_TOKENS)[0]
    c.release(1)
    assert all(not hasattr(b, "kv") for e in c.engines for b in e._w.blocks), "a block keeps a session's pages"
    c.generate(2, prompts[2], 4)  # reuses session 1's page, leaving it full of its own keys and values
    c.release(2)
    assert c.generate(3, prompts[1], N_TOKENS)[0] == want  # stale contents of a reused page never leak in
    assert first.kv_pool.touched == 1, "a released session's page was not reused"


def test_context_overflow_is_refused_before_compute(chain):
    c = chain("F16", 2)
    first, last = c.engines
    with pytest.raises(EngineError, match=f"exceeds max_context {MAX_CONTEXT}"):
        first.embed_and_forward(40, [1] * (MAX_CONTEXT + 1), 0)
    assert 40 not in first.sessions()
    c.step(40, [1] * (MAX_CONTEXT - 1), 0)
    c.step(40, [2], MAX_CONTEXT - 1)  # the last position fits
    with pytest.raises(EngineError, match=f"position {MAX_CONTEXT} \\+ seq_len 1 = {MAX_CONTEXT + 1} exceeds"):
        first.embed_and_forward(40, [3], MAX_CONTEXT)
    with pytest.raises(EngineError, match="exceeds max_context"):
        last.forward_logits(40, bytes(2 * first.info.hidden_dim), MAX_CONTEXT, 1)
    assert first.sessions()[40] == last.sessions()[40] == MAX_CONTEXT


# ---------------------------------------------------------------- the prefill ladder and host copies


def test_ladder_and_split():
    assert ladder(32) == (32, 16, 8, 4, 2, 1) and ladder(48) == (48, 32, 16, 8, 4, 2, 1) and ladder(1) == (1,)
    assert split(37, ladder(32)) == [32, 4, 1] and split(70, ladder(32)) == [32, 32, 4, 2] and split(1, (1,)) == [1]
    assert all(sum(split(n, ladder(c))) == n for c in (1, 5, 32) for n in range(1, 100))


def test_a_mixed_calls_rows_go_as_one_larger_call_where_its_measured_time_is_less():
    rungs = ladder(64)
    times = {64: 0.06, 32: 0.04, 16: 0.025, 8: 0.015, 4: 0.01, 2: 0.009, 1: 0.008}
    assert plan(56, rungs, times) == [64]  # 64 rows in 60 ms against 32 + 16 + 8 in 80
    assert plan(36, rungs, times) == [32, 4]  # 50 ms against 64's 60
    assert plan(11, rungs, times) == [8, 4]  # the 3 rows after 8 as one call of 4: 25 ms against 8 + 2 + 1's 32
    assert plan(11, rungs, times | {16: 0.02}) == [16]
    assert plan(64, rungs, times) == [64] and plan(1, rungs, times) == [1] and plan(0, rungs, times) == []
    assert plan(72, rungs, times) == [64, 8]  # nothing above the ladder's top
    assert plan(56, rungs, times | {64: 0.09}) == [32, 16, 8]
    assert plan(56, rungs, {k: v for k, v in times.items() if k != 64}) == [32, 16, 8]  # 64 not timed yet
    assert plan(56, rungs, {}) == split(56, rungs)
    # every plan covers its rows, the padding (rows past n) in its last call only, less than that call's size
    for n in range(1, 130):
        calls = plan(n, rungs, times)
        assert sum(calls[:-1]) < n <= sum(calls) and sum(calls) - n < calls[-1]


def test_a_stage_times_its_calls_as_plan_weighs_them(chain, monkeypatch):
    # the fastest call of each size, a prefill's too: on the last stage only up to ROW_LOGITS rows (past them a
    # prefill call pays the head on its last row, a mixed call on every row); a call that compiled is not counted
    first, last = (e._stage for e in chain("F16", 2).engines)
    for stage in (first, last):
        monkeypatch.setattr(stage, "batch_s", {})
        for n, seconds in ((4, 0.02), (4, 0.01), (4, 0.03), (16, 0.05), (1, 0.004)):
            stage.timed(n, False, seconds)
        stage.timed(2, True, 9.0)
    assert first.batch_s == {4: 0.01, 16: 0.05, 1: 0.004} and last.batch_s == {4: 0.01, 1: 0.004}
    assert first.step_s == last.step_s == 0.004


def test_the_cpus_prefill_chunk_is_a_page_at_most_half_the_context():
    # 256 (a KV page) where the context holds it; a power of two at most half a small context, whose warm-up can
    # then run every size (a call of the whole context would leave no position to decode)
    assert [default_prefill_chunk("CPU", c) for c in (None, 8192, 512, 511, 96, 64, 3)] == [256, 256, 256, 128, 32,
                                                                                            32, 1]
    assert default_prefill_chunk("CUDA", 64) == default_prefill_chunk("CUDA") == 128


def test_every_prompt_length_in_flight_matches_the_float64_reference(chain, models):
    """Prompts of 1..70 tokens (every split over the ladder, up to two full chunks and any remainder), five sessions
    in flight, each prefill followed by a decode step of another open session: every JIT replayed many times, at
    many positions, between other sessions' calls, must read and write the right rows of the right cache."""
    c, ref = chain("F16", 2), RefModel.from_gguf(models["F16"])
    tokens = (c.engines[0].tokenize(" ".join(TEXTS)) * 4)[:70]
    held: dict[int, list[int]] = {}

    def check(rid: int, new: list[int], position: int) -> None:
        held[rid] = held.get(rid, [])[:position] + new
        want = ref.logits(held[rid])[-1]
        np.testing.assert_allclose(c.step(rid, new, position), want, rtol=0, atol=LOGIT_ATOL_FP64, err_msg=str(rid))

    for n in range(1, len(tokens) + 1):
        rid = 1000 + n
        check(rid, tokens[:n], 0)
        other = min(held)  # the oldest open session takes a decode step
        if other != rid:
            check(other, [tokens[(other + len(held[other])) % n]], len(held[other]))
        if len(held) == 5:
            oldest = min(held)
            c.release(oldest)
            del held[oldest]


def test_host_buffer_reuses_its_memory_and_frees_pinned_memory_when_it_grows():
    """Plain memory, CUDA's allocator (faked), and the CPU's real one as PP_PINNED_HOST=1 takes it (an HCQBuffer)."""
    class FakePinned:  # CUDA's allocator as HostBuffer uses it: alloc(size, host spec) -> a c_void_p
        def __init__(self):
            self.live: dict[int, ctypes.Array] = {}

        def alloc(self, size, options):
            assert options.host
            mem = (ctypes.c_uint8 * size)()
            self.live[ctypes.addressof(mem)] = mem
            return ctypes.c_void_p(ctypes.addressof(mem))

        def free(self, opaque, size, options):
            assert options.host and len(self.live.pop(opaque.value)) == size

    for pinned in (None, FakePinned(), pinned_allocator("CPU", pinned=True)):
        host = HostBuffer(8, pinned)
        assert host.pinned == (pinned is not None)
        a = host.view(8)
        a[:] = b"abcdefgh"
        assert host.view(4).obj is a.obj and bytes(host.view(4)) == b"abcd"  # the same memory, no allocation
        assert len(host.view(20)) == 20  # grown for a longer request
        if isinstance(pinned, FakePinned):
            assert len(pinned.live) == 1  # the smaller allocation was freed


def test_input_buffer_write():
    buf = InputBuffer((1, 3), dtypes.int32)
    buf.write(np.array([7, 8, 9], np.int32))
    buf.write(np.frombuffer(np.array([4, 5, 6], np.int32).tobytes(), np.int32))  # read-only values: staged first
    assert buf.tensor.numpy().tolist() == [[4, 5, 6]]


# ---------------------------------------------------------------- a single stage with max_sessions=2


@pytest.fixture(scope="module")
def small_table(models):
    events: list[tuple[str, dict]] = []
    engine = TinygradEngine(str(models["F16"]), 0, 2, max_context=MAX_CONTEXT, max_sessions=2,
                            emit=lambda kind, **f: events.append((kind, f)))
    return engine, events


def test_loading_progress_events(small_table):
    _, events = small_table
    loading = [f for kind, f in events if kind == "loading"]
    assert [f["blocks_done"] for f in loading] == [0, 1, 2] and all(f["blocks_total"] == 2 for f in loading)
    assert all(f["stage_index"] == 0 for f in loading)


def test_warmup_compiles_every_jit_and_leaves_no_session(small_table):
    engine, _ = small_table
    engine.warmup()
    assert engine.sessions() == {}
    jits = engine._stage.jits
    assert sorted(jits) == [1, 2, 4, 8, 16, 32] and all(j.ready for j in jits.values())


def test_a_cold_stage_compiles_a_prefill_size_only_when_it_pays(chain, models, prompts, monkeypatch):
    """The worker's start compiles only the decode JIT (``warmup(full=False)``). A prompt then runs in single-token
    calls while they cost less than compiling a size of the ladder (here, a small model: ~ms a call), with the
    logits of the every-size chain; once a single-token call costs as much as compiling (a big model's), the sizes
    the prompt fills compile."""
    lazy, eager = Chain(models["F16"], 2, every_size=False, kv_dtype="float32"), chain("F16", 2)  # eager's KV dtype
    for e in lazy.engines:
        e.warmup(full=False)
    stages = [e._stage for e in lazy.engines]
    assert [sorted(n for n, j in s.jits.items() if j.ready) for s in stages] == [[1], [1]]
    assert all(s.step_s > 0 and s.compile_s > 0 for s in stages)  # both measured by the warmup's calls
    for s in stages:  # what a small model's stage measures on a quiet machine (a load would move the measurements
        s.step_s, s.compile_s = 1e-3, 1.0  # and the choice: the plan is made from these before a prompt's calls)
    prompt = prompts[2]  # 40 tokens: 32 + 8 on the ladder
    want = eager.step(50, prompt, 0)
    np.testing.assert_allclose(lazy.step(50, prompt, 0), want, rtol=0, atol=1e-4)
    assert [s.compiled for s in stages] == [1, 1], "a prompt of a small model compiled a prefill size"
    for s in stages:
        s.step_s = s.compile_s  # as slow as a big model's single-token call
    assert stages[0].usable(len(prompt)) == (32, 8, 1)
    np.testing.assert_allclose(lazy.step(51, prompt, 0), want, rtol=0, atol=1e-4)
    assert [sorted(n for n, j in s.jits.items() if j.ready) for s in stages] == [[1, 8, 32], [1, 8, 32]]
    eager.release(50)
    asked: list[int] = []  # a decode call weighs no bigger size: it asks the disk about none (a stat each, per token)
    monkeypatch.setattr(Replay, "cached", property(lambda jit: asked.append(1) or False))
    assert stages[0].usable(1) == (1,) and not asked  # before: (32, 8, 1), and a stat for each of 16, 4 and 2


def test_a_size_whose_calls_recur_compiles_once_they_would_have_saved_its_compile():
    """The checks of drafted tokens (5 rows a round here) or a chat's short turns: no one call saves what compiling
    the size of 4 costs, the calls together do, and the size compiles then."""
    rungs = (8, 4, 2, 1)
    stage = SimpleNamespace(rungs=rungs, jits={r: SimpleNamespace(ready=False, cached=False) for r in rungs},
                            step_s=1e-3, compile_s=0.01, on_demand=True, every_size=False,
                            missed=dict.fromkeys(rungs, 0.0))
    plans = [CompiledStage.usable(stage, 5) for _ in range(4)]  # a call of 4 replaces 3 single-token calls: 3 ms
    assert plans == [(1,), (1,), (1,), (4, 1)]


def test_a_cpu_decode_call_copies_through_views_and_binds_nothing(chain, prompts, monkeypatch):
    """Once captured, a CPU stage's single-token call writes its input and reads its output through views of host
    memory, replays with the position as a value, and finds the device idle without tinygrad's synchronize:
    copyin/copyout, a bound variable and three synchronizes cost ~0.15 ms of Python a call (bench/NOTES.md). The
    results equal the full path's (the tinygrad calls, allowed)."""
    from tinygrad import Device, UOp
    from tinygrad.device import Buffer

    c = chain("F16", 2)
    prompt = prompts[0]
    want = [c.step(60, prompt, 0), c.step(60, [7], len(prompt)), c.step(60, [9], len(prompt) + 1)]
    c.release(60)
    assert all(e.native_graph for e in c.engines)
    c.step(61, prompt, 0)
    used: list[str] = []
    for name in ("copyin", "copyout"):
        real = getattr(Buffer, name)
        monkeypatch.setattr(Buffer, name, lambda self, *a, name=name, real=real: used.append(name) or real(self, *a))
    bind = UOp.bind
    monkeypatch.setattr(UOp, "bind", lambda self, v: used.append("bind") or bind(self, v))
    cpu = type(Device["CPU"])
    sync = cpu.synchronize
    monkeypatch.setattr(cpu, "synchronize", lambda self, timeout=None: used.append("sync") or sync(self, timeout))
    got = [c.step(61, [7], len(prompt)), c.step(61, [9], len(prompt) + 1)]
    assert used == []
    np.testing.assert_array_equal(np.stack(got), np.stack(want[1:]))
    c.release(61)


def test_eviction_then_evicted_and_unknown_sessions(small_table):
    engine, events = small_table
    for rid in (1, 2):
        engine.embed_and_forward(rid, [5, 6, 7], 0)
    engine.embed_and_forward(1, [8], 3)  # 2 is now the least recently used
    engine.embed_and_forward(3, [5], 0)
    assert engine.sessions() == {1: 4, 3: 1}
    evicted = [f for kind, f in events if kind == "session_evicted"]
    assert evicted == [{"session": 2, "positions": 3, "max_sessions": 2, "reason": "max_sessions", "cached": False}]
    with pytest.raises(EngineError, match="session 2 was evicted"):
        engine.embed_and_forward(2, [9], 3)
    with pytest.raises(EngineError, match="unknown session 99 at position 5"):
        engine.embed_and_forward(99, [9], 5)
    with pytest.raises(EngineError, match="position 9 is past the 4 positions session 1 holds"):
        engine.embed_and_forward(1, [9], 9)
    assert engine.release(1) and not engine.release(1)


def test_the_engine_trusts_what_the_protocol_layer_checked(small_table, chain):
    """Role, payload size and token ids are checked once, at the edge (test_protocol, test_loop); calling the engine
    past them is a programming error, caught by its assertions rather than computed with."""
    engine, _ = small_table
    held = engine.sessions()
    with pytest.raises(AssertionError, match="last stage"):
        engine.forward_logits(50, b"", 0, 1)
    with pytest.raises(AssertionError, match="last stage"):
        engine.detokenize([1])
    last = chain("F16", 2).engines[-1]
    with pytest.raises(AssertionError, match="payload size"):
        last.forward_logits(50, b"abc", 0, 2)
    middle = chain("F16", 3).engines[1]
    with pytest.raises(AssertionError, match="first stage"):
        middle.tokenize("hi")
    assert engine.sessions() == held and 50 not in last.sessions()  # a refused call started nothing
    assert last.detokenize(engine.tokenize(TEXTS[1])) == TEXTS[1]


def test_model_info(small_table):
    engine, _ = small_table
    info, vocab = engine.info, builtin_vocab(PRESETS["tiny"][1])
    assert (info.hidden_dim, info.vocab_size, info.total_blocks, info.max_context) == (64, 512, 4, MAX_CONTEXT)
    assert info.eos_token_ids == sorted({vocab.eos_id, vocab.tokens.index("<|eot_id|>")})
    assert info.name == "pp-worker-tiny-s0"
    assert (info.bos_token_id, info.add_bos, info.chat_template) == (vocab.bos_id, False, None)  # written so
    assert engine.max_sessions == 2


# ---------------------------------------------------------------- loading


def test_middle_stage_reads_only_its_blocks(chain, models):
    header = read_header(models["F16"])
    c = chain("F16", 4)
    for e in c.engines:
        prefixes = tuple(f"blk.{i}." for i in range(e.shard.start, e.shard.end))
        want = {n for n in header.tensors if n.startswith(prefixes)}
        if e.shard.is_first:
            want.add("token_embd.weight")
        if e.shard.is_last:
            want |= {"output_norm.weight", "output.weight"}
        assert set(e.loaded_tensors) == want, e.shard
        assert sum(e.loaded_tensors.values()) == sum(header.tensors[n].nbytes for n in want)
    middle = c.engines[1]
    assert sum(middle.loaded_tensors.values()) < models["F16"].stat().st_size / 4


def _copy(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    dst.write_bytes(edit(data))
    return dst


def test_load_errors(models, tmp_path):
    src = models["F16"]
    truncated = _copy(src, tmp_path / "truncated.gguf", lambda d: d[:-100])
    with pytest.raises(ModelLoadError, match="truncated file: tensor output.weight ends at byte"):
        TinygradEngine(str(truncated), 0, 2)
    header_cut = _copy(src, tmp_path / "header_cut.gguf", lambda d: d[:5000])
    with pytest.raises(ModelLoadError, match="truncated or malformed GGUF header"):
        TinygradEngine(str(header_cut), 0, 2)
    bad_magic = _copy(src, tmp_path / "bad_magic.gguf", lambda d: b"GGUX" + d[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        TinygradEngine(str(bad_magic), 0, 2)
    with pytest.raises(ModelLoadError, match="model file not found: /nonexistent/m.gguf"):
        TinygradEngine("/nonexistent/m.gguf", 0, 2)
    with pytest.raises(ModelLoadError, match="cannot split 4 blocks"):
        TinygradEngine(str(src), 0, 5)


def test_unknown_architecture_is_refused_by_name(models, tmp_path):
    key = b"general.architecture"

    def patch(d: bytearray) -> bytearray:
        at = d.index(key) + len(key) + 4 + 8  # key, value type (u32), string length (u64)
        assert d[at:at + 5] == b"llama"
        d[at:at + 5] = b"mamba"
        return d

    path = _copy(models["F16"], tmp_path / "mamba.gguf", patch)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        TinygradEngine(str(path), 1, 2)


def test_context_length_rule():
    kv = {"general.architecture": "llama", "llama.context_length": 512}
    assert context_length(kv, None) == 512
    assert context_length(kv, 100) == 100
    assert context_length(kv, 10_000) == 512  # never past what the model was trained for
    assert context_length({**kv, "llama.context_length": 131072}, None) == 131072  # no cap: the KV pool decides
    assert context_length({**kv, "llama.context_length": 131072}, 8192, cap=8192) == 8192
    with pytest.raises(ModelLoadError):
        context_length(kv, 0)


def test_tokenize_puts_the_bos_first_when_the_gguf_says_so(tmp_path):
    path = generate(tmp_path / "bos.gguf", "tiny", seed=3, add_bos=True)
    first, last = (TinygradEngine(str(path), s, 2, max_context=MAX_CONTEXT) for s in (0, 1))
    bos = builtin_vocab(PRESETS["tiny"][1]).bos_id
    assert (first.info.bos_token_id, first.info.add_bos) == (bos, True)
    plain = first.tokenize(TEXTS[0], add_special=False)
    assert plain and bos not in plain
    assert first.tokenize(TEXTS[0]) == [bos, *plain]
    assert last.detokenize(first.tokenize(TEXTS[0])) == TEXTS[0]  # the BOS is never shown


def test_missing_tensor(models, tmp_path):
    name = b"blk.3.ffn_up.weight"

    def rename(d: bytearray) -> bytearray:
        at = d.index(name)
        d[at:at + len(name)] = b"blk.3.ffn_XX.weight"
        return d

    path = _copy(models["F16"], tmp_path / "missing.gguf", rename)
    TinygradEngine(str(path), 0, 2)  # stage 0 never needs block 3
    with pytest.raises(ModelLoadError, match="tensor blk.3.ffn_up.weight is missing"):
        TinygradEngine(str(path), 1, 2)


def test_model_name_download_failure_names_the_url(monkeypatch):
    import urllib.request

    from tinygrad.llm.cli import models

    from pp_worker.worker.gguf import fetch

    def offline(request, *args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(fetch, "RETRY_S", 0.0)
    with pytest.raises(ModelLoadError, match=f"could not fetch the first bytes of {models['llama3.2:1b']}.*local"):
        TinygradEngine("llama3.2:1b", 0, 2)


def test_non_llama_architecture_is_loaded_like_tinygrad(models, tmp_path):
    """qwen3 keys, no Q/K un-permute (tinygrad only un-permutes llama): same tokens as tinygrad's own loader."""

    def to_qwen3(d: bytearray) -> bytearray:
        head = d[:4096]
        head = head.replace(b"llama.", b"qwen3.").replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                          b"\x05\x00\x00\x00\x00\x00\x00\x00qwen3")
        return head + d[4096:]

    path = _copy(models["F16"], tmp_path / "qwen3.gguf", to_qwen3)
    assert read_header(path).kv["general.architecture"] == "qwen3"
    c = Chain(path, 2, kv_dtype="float32")  # the same-cast reference's KV dtype
    prompt = c.engines[0].tokenize(TEXTS[0])
    got, got_logits = c.generate(0, prompt, 8)
    want, want_logits = SameCastReference(path, MAX_CONTEXT).generate(prompt, 8, c.boundaries)
    assert got == want
    np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), rtol=0, atol=LOGIT_ATOL_SAME_CAST)
