"""Mixture-of-experts models (qwen3moe; Mixtral-style experts in llama files) on chained engines, against the
independent float64 reference (`npref.RefModel._moe`, written from llama.cpp's formulas), and the CPU's expert kernel
(`cpu.moe`) against numpy with the experts no token routes to poisoned, so that reading one would show.

Every model is generated once per module (8 experts, top-2). Expected values come from the reference or from runs
without the feature under test (a session alone, a prompt sent whole)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_cpu_kernels import TYPES, random_rows
from tinygrad import Tensor

from pp_worker.testing.chain import Chain, step_batch, wire_rows
from pp_worker.testing.modelgen import generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cpu import moe as cpu_moe
from pp_worker.worker.engines.model import check_architecture
from pp_worker.worker.engines.moe import MoEBlock
from pp_worker.worker.gguf.header import ModelLoadError, read_header
from pp_worker.worker.gguf.types import type_name

MAX_CONTEXT = 64
LOGIT_ATOL_FP64 = 3e-2  # as test_tinygrad_engine: fp16 activations and stage boundaries vs float64
LOGIT_ATOL_SAME = 2e-3  # the same engine, batched or chunked against alone or whole (fp16 KV pages)
N_TOKENS = 8
TEXT = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."
MODELS = {  # name -> (preset, dtype)
    "qwen3moe-F16": ("qwen3moe", "F16"),
    "qwen3moe-Q8_0": ("qwen3moe", "Q8_0"),
    "qwen3moe-Q4_K": ("qwen3moe-kq", "Q4_K"),
    "llama-moe-F16": ("moe-llama", "F16"),
    "llama-moe-Q8_0": ("moe-llama", "Q8_0"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: generate(root / f"{name}.gguf", preset, seed=5, dtype=dtype)
            for name, (preset, dtype) in MODELS.items()}


@pytest.fixture(scope="module")
def chain(models: dict[str, Path]):
    built: dict[tuple[str, int], Chain] = {}

    def get(name: str, num_stages: int) -> Chain:
        if (name, num_stages) not in built:
            built[name, num_stages] = Chain(models[name], num_stages, MAX_CONTEXT, max_sessions=4, max_batch=4)
        return built[name, num_stages]

    return get


def prompt_of(c: Chain, n: int = 40) -> list[int]:
    """``n`` tokens of text: over 32, so the prefill runs in two chunks (32 and the rest)."""
    return (c.engines[0].tokenize(TEXT) * 4)[:n]


def assert_picks_are_the_references(ref: RefModel, prompt: list[int], got: list[int],
                                    logits: list[np.ndarray]) -> None:
    """Each step's logits within LOGIT_ATOL_FP64 of the reference's on the same tokens, and each pick the
    reference's argmax wherever its best two are further apart than the tolerance allows to swap."""
    want = ref.logits(prompt + got[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), want, rtol=0, atol=LOGIT_ATOL_FP64)
    for step, (token, row) in enumerate(zip(got, want, strict=True)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 2 * LOGIT_ATOL_FP64:
            assert token == int(row.argmax()), f"step {step}"


# ---------------------------------------------------------------- the families against the reference


@pytest.mark.parametrize("name, num_stages", [("qwen3moe-F16", 2), ("qwen3moe-Q8_0", 3), ("qwen3moe-Q4_K", 2),
                                              ("llama-moe-F16", 3), ("llama-moe-Q8_0", 2)])
def test_greedy_picks_are_the_float64_references(models, chain, name, num_stages):
    c = chain(name, num_stages)
    assert all(isinstance(b, MoEBlock) for e in c.engines for b in e._w.blocks)
    prompt = prompt_of(c)
    got, logits = c.generate(1, prompt, N_TOKENS)
    assert_picks_are_the_references(RefModel.from_gguf(models[name]), prompt, got, logits)
    c.release(1)


def test_experts_stay_packed_one_buffer_per_tensor_read_only_by_their_stage(models, chain):
    c = chain("qwen3moe-Q8_0", 3)
    header = read_header(models["qwen3moe-Q8_0"])
    for e in c.engines:
        held = e._w.held
        mine = {f"blk.{i}.{t}.weight" for i in range(e.shard.start, e.shard.end)
                for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        assert {n for n in held if "_exps" in n} == mine
        for n in mine:
            assert held[n] == ("Q8_0", header.tensors[n].nbytes)  # the file's bytes, whole, in its own buffer
        assert all(held[f"blk.{i}.ffn_gate_inp.weight"][0] == "F32" for i in range(e.shard.start, e.shard.end))


def test_the_tinygrad_kernels_route_as_the_c_ones(models):
    """Off the C kernels (a GPU's path, here on the CPU), the routed experts' matrices are gathered by tinygrad."""
    c = Chain(models["llama-moe-Q8_0"], 2, MAX_CONTEXT, kernels="tinygrad", every_size=False)
    prompt = prompt_of(c, 12)
    got, logits = c.generate(1, prompt, 4)
    assert_picks_are_the_references(RefModel.from_gguf(models["llama-moe-Q8_0"]), prompt, got, logits)


# ---------------------------------------------------------------- sessions, batches and chunks


def test_interleaved_sessions_give_their_solo_tokens(chain):
    c = chain("qwen3moe-Q8_0", 2)
    first = c.engines[0]
    prompts = [first.tokenize("Errors should never pass silently."), prompt_of(c, 36), first.tokenize("Now is")]
    solo = [c.generate(10 + i, p, N_TOKENS)[0] for i, p in enumerate(prompts)]
    rids = [20, 21, 22]
    outs = [[int(c.step(r, p, 0).argmax())] for r, p in zip(rids, prompts, strict=True)]
    for _ in range(N_TOKENS - 1):
        for r, p, out in zip(rids, prompts, outs, strict=True):
            out.append(int(c.step(r, [out[-1]], len(p) + len(out) - 1).argmax()))
    assert outs == solo
    for r in (10, 11, 12, *rids):
        c.release(r)


def test_a_batched_decode_across_sessions_is_each_sessions_own(chain):
    """Four sessions' tokens in one forward: 8 (token, expert) slots over 8 experts, so some experts serve several
    sessions at once (the kernel's grouped path) and some none."""
    c = chain("llama-moe-Q8_0", 3)
    first, middle, last = c.engines
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]
    alone = [c.generate(100 + i, p, 5) for i, p in enumerate(prompts)]
    got = [[int(c.step(i, p, 0).argmax())] for i, p in enumerate(prompts)]
    for ids in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 1], [0, 1, 2, 3]):
        at = [len(prompts[i]) + len(got[i]) - 1 for i in ids]
        hidden = step_batch(first, ids, at, [got[i][-1] for i in ids])
        hidden = step_batch(middle, ids, at, wire_rows(first, hidden))
        logits = step_batch(last, ids, at, wire_rows(middle, hidden)).copy()
        for b, i in enumerate(ids):
            np.testing.assert_allclose(logits[b], alone[i][1][len(got[i])], rtol=0, atol=LOGIT_ATOL_SAME)
            got[i].append(int(logits[b].argmax()))
    assert got == [tokens[:len(g)] for g, (tokens, _) in zip(got, alone, strict=True)]
    for r in (0, 1, 2, 3, 100, 101, 102, 103):
        c.release(r)


def test_a_prompt_in_chunks_is_the_prompt_whole(models, chain):
    c = chain("qwen3moe-F16", 2)
    prompt = prompt_of(c, 45)
    whole = c.step(30, prompt, 0)
    at = 0
    for n in (7, 13, 25):  # chunks of several tokens: experts shared by tokens of a chunk, at three offsets
        chunked = c.step(31, prompt[at:at + n], at)
        at += n
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=LOGIT_ATOL_SAME)
    want = RefModel.from_gguf(models["qwen3moe-F16"]).logits(prompt)[-1]
    np.testing.assert_allclose(chunked, want, rtol=0, atol=LOGIT_ATOL_FP64)
    c.release(30)
    c.release(31)


# ---------------------------------------------------------------- the expert kernel


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("ids, xdiv", [([3], 1), ([3, 0], 2), ([3, 0, 3, 5, 0, 3], 2), ([5, 5, 1, 5], 1)])
def test_the_expert_kernel_reads_only_the_routed_experts(ggml_type, ids, xdiv):
    """Slots routed to experts ``ids`` (several slots of one expert: decoded once for all), ``xdiv`` slots per input
    row; every expert no slot names is all 0xFF bytes (NaN scales, NaN fp16 values), which any read of it would
    carry into the products."""
    e, n, k = 6, 20, 256
    raw, w = random_rows(ggml_type, e * n, k, seed=3)
    raw, w = raw.reshape(e, n, -1).copy(), w.reshape(e, n, k)
    raw[[x for x in range(e) if x not in ids]] = 0xFF
    x = np.random.default_rng(4).standard_normal((len(ids) // xdiv, k)).astype(np.float32)
    got = cpu_moe.matmul(Tensor(x), Tensor(np.array(ids, np.int32)), Tensor(raw.reshape(e * n, -1)), ggml_type, e,
                         n, k, xdiv).numpy()
    want = np.stack([w[j].astype(np.float64) @ x[m // xdiv] for m, j in enumerate(ids)])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("target", ["avx512"])
def test_the_expert_kernel_compiles_for(target, tmp_path):
    """Every type's expert kernel for an AVX-512 CPU (this one may lack it): compiled and loaded by tinygrad's loader
    (`cross.compile_units`). The builds for aarch64, AVX2 and a baseline x86-64 CPU run against float64 in
    tests/test_kernel_arches.py."""
    from pp_worker.testing import cross
    from pp_worker.worker.cpu.kernels import source

    units = {f"{type_name(t).lower()}_moe": source("moe", t, 256, f"{type_name(t).lower()}_moe") for t in TYPES}
    assert len(cross.compile_units(units, cross.TARGETS[target], tmp_path)) == len(units)


# ---------------------------------------------------------------- what is refused


BASE = {"general.architecture": "llama", "llama.expert_count": 8, "llama.expert_used_count": 2}


@pytest.mark.parametrize("kv, message", [
    ({"general.architecture": "qwen2", "qwen2.expert_count": 4}, "unsupported qwen2 variant: mixture of experts"),
    ({**BASE, "llama.expert_shared_count": 1}, "shared experts"),
    ({**BASE, "llama.expert_used_count": 9}, "expert_used_count must be in 1..8"),
    ({**BASE, "llama.expert_weights_norm": False}, "unnormalized expert weights"),
    ({**BASE, "llama.expert_gating_func": 2}, "gating function 2"),
    ({"general.architecture": "qwen3moe"}, "without qwen3moe.expert_count"),
])
def test_other_mixtures_of_experts_are_refused_by_name(kv, message):
    with pytest.raises(ModelLoadError, match=message):
        check_architecture(kv)


def test_supported_mixtures_of_experts_are_accepted():
    assert check_architecture(BASE) == "llama"
    assert check_architecture({"general.architecture": "qwen3moe", "qwen3moe.expert_count": 128,
                               "qwen3moe.expert_used_count": 8, "qwen3moe.expert_weights_norm": True}) == "qwen3moe"


# ---------------------------------------------------------------- compiled forwards


def test_compiled_forwards_are_kept_and_replayed_by_a_restart(models, tmp_path, monkeypatch):
    """The routing changes per token, the graph does not: a restart replays the compiled forwards from disk (ids
    computed inside them), with the first start's tokens and logits."""
    from pp_worker.worker.cpu import graph as cpu_graph

    if not cpu_graph.supported():
        pytest.skip("the cache keeps native tables (Linux)")
    monkeypatch.setenv("PP_CACHE", "1")
    monkeypatch.setenv("PP_CACHE_DIR", str(tmp_path))

    def run() -> tuple[Chain, list[int], list[np.ndarray]]:
        c = Chain(models["llama-moe-Q8_0"], 2, MAX_CONTEXT, prefill_chunk=8)
        tokens, logits = c.generate(0, [5, 9, 11, 3, 7, 2, 40, 41, 42, 43, 44], 5)
        return c, tokens, logits

    c, want_tokens, want_logits = run()
    jits = [j for e in c.engines for j in e._stage.all_jits if j.ready]
    assert jits and not any(j.restored for j in jits)
    c, tokens, logits = run()
    again = [j for e in c.engines for j in e._stage.all_jits if j.ready]
    assert len(again) == len(jits) and all(j.restored and j.captured is None for j in again)
    assert tokens == want_tokens and all(np.array_equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def test_an_early_mixtral_file_with_one_tensor_per_expert_is_refused_with_what_to_do():
    from types import SimpleNamespace

    from pp_worker.worker.engines.moe import load_experts

    header = SimpleNamespace(path="mixtral.gguf", tensors={"blk.0.ffn_gate.0.weight": None})
    config = SimpleNamespace(num_experts=8, dim=64, hidden_dim=64)
    with pytest.raises(ModelLoadError, match="experts stored one tensor each .* convert the model again"):
        load_experts(None, SimpleNamespace(header=header), config, 0)  # type: ignore[arg-type]
