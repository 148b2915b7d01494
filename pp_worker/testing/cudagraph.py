"""What tinygrad 0.13.0's CUDA backend would refuse, checked on a machine without a GPU.

Run on tinygrad's NULL device with the CUDA renderer (``DEV=NULL:CUDA:sm_90``): every kernel is rendered as CUDA
C with real CUDA launch dims, nothing is compiled or executed (outputs are zeros). `install` replaces what a GPU
would check:

* the NULL device's graph runner by `StrictCUDAGraph`, which validates launch dims where tinygrad's CUDAGraph
  (runtime/graph/cuda.py) hands them to the driver: at construction (the JIT's capture call) every kernel node is
  built with ``launch_dims({v: 0 for v in vars})``, so a grid that depends on a variable that is 0 there gets a
  zero dim, and cuGraphAddKernelNode fails with "CUDA Error 1, invalid argument" (the H200's prefill failure);
  on every replay, the dims recomputed from the call's variables;
* NVRTC, which is not needed (no compile) except for one error class it reports that the NULL device would not:
  a store of a value whose dtype is not the buffer's (``half2 = float2`` does not compile);
* host memory semantics: copies in and out need writable host memory and nothing is zero-copy (`devmem`).

``python -m pp_worker.testing.cudagraph`` (with DEV and NULL_ALLOW_COPYOUT=1 set) first checks that a JIT with a
symbolic token count is refused, then runs the tinygrad engine, first and last stage, through prompts of many
lengths, decode steps, interleaved sessions, a release and warm-up; exit status 0 when CUDA would accept all of it.

``--count N`` instead counts what one decode token launches on CUDA with the model split over N stages
(`decode_launches`): each stage's kernels as its decode JIT captured them, the graphs they are batched into, and a
block's share; the last line is ``COUNT {json}`` (``make gpu-check`` reports it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

GRID_MAX = (2**31 - 1, 65535, 65535)  # CUDA's limits: tinygrad's CUDARenderer.global_max
BLOCK_MAX = (1024, 1024, 64)  # CUDARenderer.local_max
THREADS_MAX = 1024
PROBE_PROMPTS = ((1, 3), (2, 6), (3, 70), (4, 1), (5, 37), (6, 131))  # (session, prompt length)


class CUDALaunchError(RuntimeError):
    """What the CUDA driver or NVRTC would have answered."""


def check_dims(kernel: str, grid: tuple[int, ...], block: tuple[int, ...] | None, where: str) -> None:
    block = tuple(block) if block is not None else (1, 1, 1)
    bad = []
    if len(grid) != 3 or any(not isinstance(g, int) or not 1 <= g <= m for g, m in zip(grid, GRID_MAX, strict=True)):
        bad.append(f"gridDim={tuple(grid)}")
    if any(not 1 <= b <= m for b, m in zip(block, BLOCK_MAX, strict=True)) or math.prod(block) > THREADS_MAX:
        bad.append(f"blockDim={block}")
    if bad:
        raise CUDALaunchError(f"CUDA Error 1, invalid argument ({where}): kernel {kernel}: {', '.join(bad)}")


def check_stores(uops: list[Any]) -> None:
    """Every store must write a value of its buffer's scalar type: NVRTC has no ``half2 = float2``."""
    from tinygrad.uop.ops import Ops

    for u in uops:
        if u.op is Ops.STORE:
            target, value = u.src[0].dtype, u.src[1].dtype
            target = getattr(target, "base", target)  # a pointer: its element type
            if target.scalar() != value.scalar():
                raise CUDALaunchError(f"NVRTC: no operator \"=\" matches {target} = {value} "
                                      "(a value stored into a buffer of another dtype)")


def _strict_graph_class() -> type:
    from tinygrad.engine.jit import MultiGraphRunner
    from tinygrad.uop.ops import Ops

    class StrictCUDAGraph(MultiGraphRunner):
        """tinygrad's CUDAGraph's launch-dim handling, with CUDA's checks instead of the driver calls."""

        built = 0

        def __init__(self, linear: Any, input_uops: tuple = ()):
            super().__init__(linear, input_uops)
            StrictCUDAGraph.built += 1
            for _, ast, _, _ in self.calls:
                if ast.op is Ops.PROGRAM:  # exactly runtime/graph/cuda.py: every variable 0 at construction
                    grid, block = ast.arg.launch_dims({v: 0 for v in self.vars})
                    check_dims(ast.arg.function_name, grid, block, "cuGraphAddKernelNode, graph construction")

        def __call__(self, input_uops: tuple, var_vals: dict[str, int], wait: bool = False) -> float:
            missing = [v for v in self.vars if v not in var_vals]
            if missing:
                raise CUDALaunchError(f"a replay lacks the values of {missing}")
            for j, grid, block in self.updated_launch_dims(var_vals):
                check_dims(self.calls[j][1].arg.function_name, grid, block, "cuGraphExecKernelNodeSetParams, replay")
            return 1e-3

    return StrictCUDAGraph


def install() -> type:
    """Set up DEV=NULL:CUDA:* as described in the module docstring; returns the graph class (``.built`` counts)."""
    import tinygrad.runtime.support.compiler_cuda as cc
    from tinygrad import Device
    from tinygrad.device import Compiler
    from tinygrad.renderer.cstyle import CUDARenderer

    assert Device.DEFAULT == "NULL", f"run with DEV=NULL:CUDA:sm_90 (tinygrad chose {Device.DEFAULT})"

    def no_nvrtc(self: Any, arch: str, ptx: bool = True, cache_key: str = "cuda") -> None:
        Compiler.__init__(self, None)  # no cache key: a fake "binary" must never reach tinygrad's compile cache
        self.arch, self.ptx, self.compile_options = arch, ptx, []

    cc.NVRTCCompiler.__init__ = no_nvrtc
    cc.NVRTCCompiler.compile = lambda self, src: src.encode()
    render = CUDARenderer.render

    def checked_render(self: Any, uops: list[Any]) -> str:
        check_stores(uops)
        return render(self, uops)

    CUDARenderer.render = checked_render
    graph = _strict_graph_class()
    Device[Device.DEFAULT].graph = graph
    return graph


# ---------------------------------------------------------------- the probe


def symbolic_count_is_refused() -> bool:
    """A JIT whose token count is a variable (pp_worker's old prefill) must fail at its capture call."""
    from tinygrad import Tensor, TinyJit, UOp

    n_tokens = UOp.variable("n_tokens", 1, 8)
    x = Tensor.ones(1, 8, 16).contiguous().realize()
    jit = TinyJit(lambda t: ((t * 2).contiguous() + 1).sum(axis=2))
    try:
        for n in (3, 5, 6):
            jit(x[:, :n_tokens.bind(n)])
    except CUDALaunchError:
        return True
    return False


def run_engines(model: str, prefill_chunk: int) -> list[str]:
    """First and last stage of 2 through every kind of request; the steps done (raises at the first refusal)."""
    from pp_worker.testing.devmem import device_memory
    from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

    done = []
    with device_memory():
        first, last = (TinygradEngine(model, s, 2, max_context=160, prefill_chunk=prefill_chunk) for s in (0, 1))
        held = sorted({kind for e in (first, last) for kind in e.describe()["weights"] if kind not in ("F16", "F32")})
        done.append(f"packed weights: {', '.join(held) or 'none'}")
        first.warmup()
        last.warmup()
        done.append("warm-up")
        for rid, n in PROBE_PROMPTS:
            h = first.embed_and_forward(rid, list(range(10, 10 + n)), 0)
            last.forward_logits(rid, bytes(h), 0, n)
            done.append(f"prefill {n}")
        for step in range(3):  # sessions 1..5 interleaved, one decode step each
            for rid, n in PROBE_PROMPTS:
                h = first.embed_and_forward(rid, [7], n + step)
                last.forward_logits(rid, bytes(h), n + step, 1)
        done.append("decode, interleaved")
        assert first.release(2) and last.release(2)
        h = first.embed_and_forward(2, [5, 6, 7, 8, 9], 0)
        last.forward_logits(2, bytes(h), 0, 5)
        done.append("release, then a new session")
    return done


# ---------------------------------------------------------------- what a decode token launches


def launches(linear: Any) -> dict[str, Any]:
    """What a captured JIT (its ``linear``) launches per replay: its kernels' names in order, the graphs they are
    batched into, and the launches (a graph is one, a kernel outside a graph is one)."""
    from tinygrad.uop.ops import Ops

    names, graphs = [], 0
    for call in linear.src:
        fn = call.src[0]
        if fn.op is Ops.CUSTOM_FUNCTION and fn.arg == "graph":
            graphs += 1
            names += [c.src[0].arg.function_name for c in fn.src[0].src if c.src[0].op is Ops.PROGRAM]
        elif fn.op is Ops.PROGRAM:
            names.append(fn.arg.function_name)
    return {"kernels": len(names), "graphs": graphs, "launches": len(linear.src), "names": names}


def scheduled_kernels(stage: Any, blocks: int) -> int:
    """Kernels tinygrad's scheduler makes of the stage's one-token forward over its first ``blocks`` blocks, without
    the JIT: the difference between 2 blocks and 1 is what a block adds (its edges may fuse with what is around)."""
    from tinygrad.uop.ops import Ops

    w, saved = stage.w, stage.w.blocks
    w.blocks = saved[:blocks]
    try:
        out = stage._forward(stage.inputs[1].tensor, stage.pool.tensor, stage.start_pos.bind(1), stage.page.bind(0),
                             stage.off.bind(1))
        linear, _ = out.linear_with_vars()
    finally:
        w.blocks = saved
    return sum(call.src[0].op is Ops.SINK for call in linear.src)


def decode_launches(model: str, stages: int, max_context: int = 256) -> dict[str, Any]:
    """Per stage of ``stages``: its blocks, what its decode JIT launches (`launches`) and a block's kernels; per
    token: the sums over the stages."""
    from pp_worker.testing.devmem import device_memory
    from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

    per_stage = []
    with device_memory():
        for s in range(stages):
            engine = TinygradEngine(model, s, stages, max_context=max_context, kernels="tinygrad")
            engine.warmup(full=False)  # the decode JIT only: what a token replays
            stage = engine._stage
            n = len(stage.w.blocks)
            block = scheduled_kernels(stage, 2) - scheduled_kernels(stage, 1) if n >= 2 else None
            per_stage.append({"blocks": n, "per_block": block, **launches(stage.decode.captured.linear)})
            del engine, stage
    return {"stages": per_stage, "kernels_per_token": sum(s["kernels"] for s in per_stage),
            "launches_per_token": sum(s["launches"] for s in per_stage),
            "per_block": next((s["per_block"] for s in per_stage if s["per_block"] is not None), None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pp_worker.testing.cudagraph", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf (default: the generator's tiny preset as Q4_1: packed weights, expanded "
                                    "inside the kernels as on a GPU)")
    ap.add_argument("--prefill-chunk", type=int, default=32, help="PP_PREFILL_CHUNK (default 32; GPUs use 128)")
    ap.add_argument("--count", type=int, metavar="STAGES", help="count what a decode token launches on STAGES "
                                                                 "stages instead (needs --model)")
    args = ap.parse_args(argv)
    graph = install()
    if args.count:
        if not args.model:
            ap.error("--count needs --model")
        print("COUNT " + json.dumps(decode_launches(args.model, args.count)), flush=True)
        return 0
    if not symbolic_count_is_refused():
        print("FAIL: the emulator accepted a symbolic token count, which CUDA refuses")
        return 1
    print("ok: a symbolic token count is refused, as on CUDA")
    model = args.model
    if model is None:
        from pp_worker.testing.modelgen import generate

        model = str(generate(Path(tempfile.mkdtemp()) / "tiny-q4_1.gguf", "tiny", dtype="Q4_1"))
    try:
        for step in run_engines(model, args.prefill_chunk):
            print(f"ok: {step}")
    except CUDALaunchError as e:
        print(f"FAIL: {e}")
        return 1
    print(f"OK: {graph.built} CUDA graphs built; every launch and store valid for CUDA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
