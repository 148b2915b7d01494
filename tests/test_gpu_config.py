"""The GPU configuration forced on the CPU, through real worker processes on 2 and 3 stages.

What a stage does by default on CUDA (fp16 KV caches; tinygrad's own kernels over native fp16 weights and
tinygrad's own JIT graph, instead of the CPU's C kernels over the file's bytes and native replays; prefill calls of
up to 128 tokens; outputs copied into host memory from the device's allocator) is set here through the switches a
user would set (PP_KV_DTYPE, PP_KERNELS, PP_PREFILL_CHUNK, PP_PINNED_HOST), with the values the device defaults give
for CUDA. Every
stage's ready line must show each one in force, and the tokens must agree with the float64 reference
(pp_worker.testing.npref) for prompts on both sides of the 128-token chunk, none of a ladder size, and a long decode.

Only tokens come out of a pipeline, so each is checked against the reference's logits at its position, computed on
the pipeline's own sequence: the token must be float64's argmax or within LOGIT_ATOL_FP64 of it (two logits that
close may come out either way under the fp16 casts). On the CPU the pinned host memory is an ordinary mapping from
tinygrad's CPU allocator: the code path is CUDA's (allocate, view, grow and free through the device's allocator),
the page-locking is not.
"""

from __future__ import annotations

import contextlib
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pp_worker.driver.generation import Generation, Sampling
from pp_worker.driver.pipeline import Pipeline, make_generations
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.modelgen import builtin_text, generate
from pp_worker.testing.npref import RefModel
from pp_worker.worker.cli import ConfigError, parse_config
from pp_worker.worker.engines.kvcache import default_kv_dtype
from pp_worker.worker.engines.tinygrad_engine import default_prefill_chunk
from pp_worker.worker.engines.weights import default_kernels
from pp_worker.worker.gguf.header import read_header
from pp_worker.worker.hostio import default_pinned_host
from pp_worker.worker.shard import compute_layer_range
from pp_worker.worker.text.detokenizer import Detokenizer
from pp_worker.worker.text.tokenizer import Tokenizer

LOGIT_ATOL_FP64 = 3e-2  # as test_tinygrad_engine and bench.gpu: fp16 weights, boundaries and KV caches vs float64
N_DECODE = 96
STAGES = (2, 3)


def device_defaults(device: str) -> dict[str, Any]:
    """What a stage on ``device`` chooses when nothing is set, by the ready line's field names."""
    kernels = default_kernels(device)
    return {"kv_dtype": default_kv_dtype(device), "kernels": kernels,
            "graph": "native" if kernels == "c" else "tinygrad", "prefill_chunk": default_prefill_chunk(device),
            "pinned_host": default_pinned_host(device)}


GPU = device_defaults("CUDA")
CHUNK = GPU["prefill_chunk"]
# none a ladder size; 2+1, then prompts the driver sends in chunks of CHUNK (replayed at positions 0 and CHUNK) and
# a remainder. Every size below CHUNK the stages compile costs seconds each, so only 2 and 1 (decode's) are used.
PROMPT_LENGTHS = (3, CHUNK + 1, CHUNK + 3, 2 * CHUNK + 1)
MAX_CONTEXT = PROMPT_LENGTHS[-1] + N_DECODE + 3
ENV = {"MAX_CONTEXT": str(MAX_CONTEXT), "PP_KV_DTYPE": GPU["kv_dtype"], "PP_PREFILL_CHUNK": str(CHUNK),
       "PP_KERNELS": GPU["kernels"], "PP_PINNED_HOST": str(int(GPU["pinned_host"]))}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("gpu_config") / "tiny.gguf", "tiny", seed=3)


@dataclass
class Run:
    ready: list[dict[str, Any]]  # each stage's ready line
    generations: list[Generation]  # one per prompt of PROMPT_LENGTHS, in order


@pytest.fixture(scope="module")
def runs(model: Path) -> dict[int, Run]:
    """The 2- and 3-stage pipelines, each fed every prompt once, one after the other; the two pipelines at the same
    time, in threads of their own: compiling a forward (most of this module's time) keeps one stage process busy and
    the others of its pipeline idle, so on two cores the two pipelines compile side by side."""
    prompts = [prompt_of(model, n) for n in PROMPT_LENGTHS]
    with contextlib.ExitStack() as stack:
        pipelines = {n: stack.enter_context(Pipeline(Launch(n, model=str(model), env=ENV), log=io.StringIO()))
                     for n in STAGES}
        with ThreadPoolExecutor(len(STAGES)) as pool:
            ran = {n: pool.submit(p.run, make_generations(p, prompts, N_DECODE, Sampling()))
                   for n, p in pipelines.items()}
            return {n: Run([st.ready or {} for st in pipelines[n].stages], f.result().generations)
                    for n, f in ran.items()}


def test_the_switches_parse_and_default_to_the_device():
    env = {"STAGE": "0", "NUM_STAGES": "2"}
    cfg = parse_config([], env)
    assert (cfg.kernels, cfg.pinned_host) == (None, None)  # the device decides
    cfg = parse_config([], env | {"PP_KERNELS": "c", "PP_PINNED_HOST": "0"})
    assert (cfg.kernels, cfg.pinned_host) == ("c", False)
    cfg = parse_config([], env | {"PP_KERNELS": "tinygrad", "PP_PINNED_HOST": "1"})
    assert (cfg.kernels, cfg.pinned_host) == ("tinygrad", True)
    for name, bad in (("PP_KERNELS", "cuda"), ("PP_KERNELS", "C"), ("PP_PINNED_HOST", "2"), ("PP_PINNED_HOST", "yes")):
        with pytest.raises(ConfigError, match=f"{name}='{bad}' is invalid"):
            parse_config([], env | {name: bad})


@pytest.mark.parametrize("stages", STAGES)
def test_every_stage_runs_the_gpu_configuration(runs: dict[int, Run], model: Path, stages: int):
    cpu = device_defaults("CPU")
    # else this module would force nothing on the CPU (fp16 KV pages are the CPU's default too now)
    assert all(cpu[k] != GPU[k] for k in GPU if k != "kv_dtype"), (cpu, GPU)
    kv = read_header(model).kv
    head_dim = kv["llama.embedding_length"] // kv["llama.attention.head_count"]
    for stage, ready in enumerate(runs[stages].ready):
        assert ready["device"] == "CPU"
        assert {k: ready.get(k) for k in GPU} == GPU, f"stage {stage}: {ready}"
        start, end = compute_layer_range(stage, stages, kv["llama.block_count"])
        # fp16 caches in fact: the pool's bytes, 2 per element
        assert ready["kv_session_bytes"] == (end - start) * 2 * kv["llama.attention.head_count_kv"] * MAX_CONTEXT \
            * head_dim * 2


@pytest.mark.parametrize("stages", STAGES)
def test_tokens_agree_with_the_float64_reference(runs: dict[int, Run], model: Path, stages: int):
    ref = RefModel.from_gguf(model)
    for g, n in zip(runs[stages].generations, PROMPT_LENGTHS, strict=True):
        assert len(g.prompt_tokens) == n and g.stop_reason == "max_tokens" and len(g.tokens) == N_DECODE, \
            (n, g.stop_reason, g.error)
        short = _short_of_argmax(ref, g)
        bad = np.flatnonzero(short > LOGIT_ATOL_FP64)
        assert not len(bad), f"{n}-token prompt: generated tokens {bad} are {short[bad]} below float64's argmax"


def _short_of_argmax(ref: RefModel, g: Generation) -> np.ndarray:
    """(n,) how far below float64's largest logit each generated token's logit is (0: the argmax), on the
    generation's own sequence: token t was picked from the logits after prompt + tokens[:t]."""
    want = ref.logits(g.prompt_tokens + g.tokens[:-1])[len(g.prompt_tokens) - 1:]  # (n, V)
    return want.max(-1) - want[np.arange(len(g.tokens)), g.tokens]


def prompt_of(model: Path, n: int) -> str:
    """A window of the built-in text that stage 0 tokenizes to exactly ``n`` tokens (with the worker's own tokenizer;
    a window's edges can tokenize differently once decoded, so it slides until they do not)."""
    kv = read_header(model).kv
    tokenizer, detokenizer = Tokenizer.from_gguf_kv(kv), Detokenizer.from_gguf_kv(kv)
    ids = tokenizer.encode(builtin_text())
    for start in range(len(ids) - n):
        text = detokenizer.decode(ids[start:start + n])
        if len(tokenizer.encode(text)) == n:
            return text
    raise ValueError(f"no window of the built-in text is {n} tokens")
