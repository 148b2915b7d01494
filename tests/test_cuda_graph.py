"""The engine as tinygrad's CUDA backend would run it, on a machine without a GPU (``testing.cudagraph``).

On the H200 the prefill JIT, traced with a symbolic token count, died in cuGraphAddKernelNode with "CUDA Error 1,
invalid argument": tinygrad 0.13.0's CUDAGraph builds kernel nodes with every variable at 0, so grids such as
(n_tokens, 1, 1) became zero. On DEV=NULL:CUDA the kernels get CUDA's real launch dims and an emulated CUDAGraph
checks them as the driver would; the old engine fails this test at its second prefill. The model is quantized
(Q4_1): its weights stay packed and tinygrad's dequantize expressions run inside the CUDA kernels.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, clean_env


def test_cuda_would_accept_every_launch_and_store_of_the_engine():
    env = {**clean_env(), "DEV": "NULL:CUDA:sm_90", "NULL_ALLOW_COPYOUT": "1"}
    proc = subprocess.run([sys.executable, "-m", "pp_worker.testing.cudagraph"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ok: a symbolic token count is refused" in proc.stdout  # the emulator itself is not a no-op
    assert proc.stdout.rstrip().splitlines()[-1].startswith("OK:"), proc.stdout
    assert "ok: packed weights: Q4_1" in proc.stdout
