"""The engine as tinygrad's CUDA backend would run it, on a machine without a GPU (``testing.cudagraph``).

On the H200 the prefill JIT, traced with a symbolic token count, died in cuGraphAddKernelNode with "CUDA Error 1,
invalid argument": tinygrad 0.13.0's CUDAGraph builds kernel nodes with every variable at 0, so grids such as
(n_tokens, 1, 1) became zero. On DEV=NULL:CUDA the kernels get CUDA's real launch dims and an emulated CUDAGraph
checks them as the driver would; the old engine fails this test at its second prefill. The model is quantized
(Q4_1): its weights stay packed and tinygrad's dequantize expressions run inside the CUDA kernels.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import REPO, clean_env

from pp_worker.testing.modelgen import generate


def test_cuda_would_accept_every_launch_and_store_of_the_engine():
    env = {**clean_env(), "DEV": "NULL:CUDA:sm_90", "NULL_ALLOW_COPYOUT": "1"}
    proc = subprocess.run([sys.executable, "-m", "pp_worker.testing.cudagraph"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ok: a symbolic token count is refused" in proc.stdout  # the emulator itself is not a no-op
    assert proc.stdout.rstrip().splitlines()[-1].startswith("OK:"), proc.stdout
    assert "ok: packed weights: Q4_1" in proc.stdout


def tinygrads_own_count(model: Path, stages: int, *args: str) -> tuple[dict[str, Any], list[int]]:
    """``--count``'s report on ``model`` (DEV=NULL:CUDA:sm_90), and, independently of the code that counts, the
    kernels of each graph tinygrad itself says it built (its DEBUG=2 line "JIT GRAPHing batch with N kernels"): the
    decode JITs' graphs, one stage after the other (``--count`` compiles nothing else)."""
    env = {**clean_env(), "DEV": "NULL:CUDA:sm_90", "NULL_ALLOW_COPYOUT": "1", "DEBUG": "2"}
    proc = subprocess.run([sys.executable, "-m", "pp_worker.testing.cudagraph", "--count", str(stages), "--model",
                           str(model), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    report = json.loads(next(x for x in reversed(lines) if x.startswith("COUNT ")).removeprefix("COUNT "))
    return report, [int(m[1]) for x in lines if (m := re.match(r"JIT GRAPHing batch with (\d+) kernels", x))]


def test_a_decode_step_is_one_graph_launch_a_stage(tmp_path: Path):
    """4 blocks a stage (the bench shape): more kernels a stage than tinygrad's first graph batch (32), which split
    each stage's decode into 2 graphs before every capture was one batch. q/k/v and gate/up are one product each, and
    no kernel writes the softmax's weights (14 kernels a block before)."""
    model = generate(tmp_path / "bench.gguf", "bench")
    report, graphs = tinygrads_own_count(model, 2)
    stages = report["stages"]
    assert [s["blocks"] for s in stages] == [4, 4]
    assert all(s["kernels"] > 32 for s in stages), stages  # else tinygrad's default would also make one graph
    assert graphs == [s["kernels"] for s in stages]  # one graph a stage, holding every kernel tinygrad counted
    assert [(s["graphs"], s["launches"]) for s in stages] == [(1, 1), (1, 1)]
    assert report["kernels_per_token"] == sum(graphs) and report["launches_per_token"] == 2
    # a block: the norm's sum of squares twice, the q/k/v product, RoPE + KV store, scores, the scores' max, the
    # exponentials' sum, attention x values (exponentials inside), the output product (+ residual), the gate/up
    # product, down (silu * up inside, + residual)
    assert report["per_block"] <= 11
