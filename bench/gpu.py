"""``make gpu-check``: pp_worker on whatever device DEV selects (CUDA, CPU...), one table: exactness against a
float64 reference, decode speed against one tinygrad process, the per-hop overhead by part, time to first token.

    python -m bench.gpu            # 0.74B "rss" model (dim 2048, 16 blocks, ffn 5632); under 5 minutes on one GPU
    python -m bench.gpu --quick    # the tiny model and few tokens: a smoke test (tests/test_bench.py runs it)
    python -m bench.gpu --dtype Q4_K_M --sections speed,kernels --beam 2 --tag q4-beam   # one part, another file

Exactness runs on a smaller model (a float64 forward of 0.74B parameters in numpy would take minutes): 2 and 3
stages in this process, the device's default KV dtype. Speed: one tinygrad process (``bench.solo``, weights lazy
and realized) and a real 2-stage pipeline of worker processes, both stages on the one device. The per-hop parts
are timed in this process on the same device. Kernels: what one decode token launches on CUDA, counted on
tinygrad's CUDA renderer without running anything (``DEV=NULL:CUDA:sm_90`` in a child, `testing.cudagraph`), so
the count is the same on a machine without a GPU. Progress goes to stderr, the table to stdout, JSON to ``--out``.
bench/device_run.sh runs the issue's whole set on a borrowed GPU (docs/gpus.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import models, pipe, solo, wire
from bench.rows import Row, render, summary, to_json, write_results
from bench.run import RESULTS, attempt, say

EXACT_ATOL = 3e-2  # fp16 weights, fp16 stage boundaries (and fp16 KV caches on a GPU) vs float64: tests measure <1e-2


@dataclass(frozen=True)
class Plan:
    preset: str = "rss"  # the speed rows
    exact_preset: str = "bench"  # the exactness rows
    prompt_tokens: int = 16
    exact_tokens: int = 8  # greedy tokens compared with the float64 reference
    decode: int = 64  # decode tokens timed after the first
    ttft_tokens: int = 512
    ttft_reps: int = 2
    max_context: int = 1024
    hop_reps: int = 2000
    prefill_chunk: int | None = None  # None: the device's default (PP_PREFILL_CHUNK)
    dtype: str = "F16"  # the speed and kernel rows' model file type (F16, Q8_0, Q4_K_M...)
    beam: int = 0  # PP_BEAM of the 2 stages (their decode kernels searched at compile); 0: none
    solo_modes: tuple[str, ...] = ("lazy", "realize")  # one tinygrad process, weights lazy and realized


SECTIONS = ("exact", "hop", "speed", "kernels")
FULL = Plan()
QUICK = Plan(preset="tiny", exact_preset="tiny", exact_tokens=4, decode=8, ttft_tokens=48, ttft_reps=1,
             max_context=96, hop_reps=200, prefill_chunk=8)  # 4 JITs a stage to compile instead of 6


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _ms(times)


# ---------------------------------------------------------------- 1 exactness


def exactness(plan: Plan, out: dict[str, Any]) -> None:
    from pp_worker.testing.chain import Chain
    from pp_worker.testing.npref import RefModel

    model = models.ensure_model(plan.exact_preset)
    tok = models.tokenizer(model)
    prompts = [tok.encode(p) for p in models.fixed_length_prompts(model, plan.prompt_tokens, 3)]
    ref = RefModel.from_gguf(model)
    n = plan.exact_tokens
    for stages in (2, 3):
        say(f"exactness: {stages} stages vs float64 ({plan.exact_preset} model)")
        chain = Chain(model, stages, plan.max_context, prefill_chunk=plan.prefill_chunk)
        got, logits = chain.generate(0, prompts[0], n)
        want = ref.logits(prompts[0] + got[:-1])[len(prompts[0]) - 1:]  # (n, V): the positions the chain predicted
        greedy = ref.greedy(prompts[0], n)
        out[f"pp{stages}"] = {"max_dlogit": float(np.abs(np.stack(logits) - want).max()),
                              "greedy_agree": sum(a == b for a, b in zip(got, greedy, strict=True)) / n,
                              "kv_dtype": chain.engines[0].kv_dtype}
        if stages == 2:
            out["interleaved"] = _interleaved_vs_solo(chain, prompts, n)


def _interleaved_vs_solo(chain: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Generations alone, then the same ones taking turns step by step: identical tokens and logits expected."""
    say("exactness: 3 generations interleaved vs each alone")
    solo_runs = [chain.generate(10 + i, p, n) for i, p in enumerate(prompts)]
    rids = [20 + i for i in range(len(prompts))]
    steps = [[chain.step(r, p, 0)] for r, p in zip(rids, prompts, strict=True)]
    for k in range(1, n):
        for r, p, s in zip(rids, prompts, steps, strict=True):
            s.append(chain.step(r, [int(s[-1].argmax())], len(p) + k - 1))
    same = all([int(x.argmax()) for x in s] == t for s, (t, _) in zip(steps, solo_runs, strict=True))
    diff = max(float(np.abs(np.stack(s) - np.stack(lg)).max()) for s, (_, lg) in zip(steps, solo_runs, strict=True))
    return {"same_tokens": same, "max_dlogit": diff}


# ---------------------------------------------------------------- 2 per-hop parts


def hop_parts(plan: Plan, out: dict[str, Any]) -> None:
    """The parts of one decode hop, timed in this process on this device: the hidden row's copies and codec at
    the model's width, and a stub stage's round trip (pipes, both ends' line handling, no compute)."""
    from tinygrad import Device, Tensor, dtypes

    from pp_worker.wire import encode_payload, parse_json, to_line
    from pp_worker.worker import q8
    from pp_worker.worker.hostio import HostBuffer, InputBuffer, pinned_allocator
    from pp_worker.worker.protocol import decode_hidden

    kv = models.read_header(models.ensure_model(plan.preset, isolated=True)).kv
    dim = kv[f"{kv['general.architecture']}.embedding_length"]
    say(f"per-hop parts on {Device.DEFAULT}, one {dim}-wide row (float32 in the stage, float16 on the wire)")
    row = np.random.default_rng(0).standard_normal(dim).astype(np.float16)
    host = HostBuffer(dim * 4, pinned_allocator(Device.DEFAULT))
    output = Tensor(row.astype(np.float32).reshape(1, 1, dim)).contiguous().realize()  # a stage's output
    out_buf = output.uop.base.realized
    inp = InputBuffer((1, 1, dim), dtypes.float32)  # a stage's input
    request_line = to_line(wire.hop(1, dim) | {"position": 7})
    n = plan.hop_reps
    out["hidden_dim"] = dim
    out["d2h_ms"] = timed(lambda: out_buf.copyout(host.view(dim * 4)), n)
    out["encode_ms"] = timed(lambda: to_line({"request_id": 1, "hidden_b64": encode_payload(
        q8.emit(host.view(dim * 4), "f32", "f16", dim)[0]), "seq_len": 1}), n)
    stub = wire.RawWorker.stub(1, 3)
    try:
        out["loop_ms"] = 1000 / wire.sequential_rate(stub, n)
    finally:
        stub.close()
    out["pipe_floor_ms"] = 1000 / wire.pipe_floor_rate(n, hidden_dim=dim)
    out["decode_ms"] = timed(lambda: decode_hidden(parse_json(request_line), 1, dim), n)
    out["h2d_ms"] = timed(lambda: inp.write(row), n)


# ---------------------------------------------------------------- 3 decode speed and time to first token


def speed(plan: Plan, out: dict[str, Any]) -> None:
    model = models.ensure_model(plan.preset, dtype=plan.dtype, isolated=True)
    tok = models.tokenizer(model)
    short = models.fixed_length_prompts(model, plan.prompt_tokens, 3)
    long = models.fixed_length_prompts(model, plan.ttft_tokens, 1)[0]
    ids = {"warmup": [tok.encode(p) for p in short[:2]], "decode": [tok.encode(short[2])], "ttft": [tok.encode(long)]}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(ids, f)
        f.flush()
        for mode in plan.solo_modes:
            say(f"one process ({mode}): {plan.decode} decode tokens, a {plan.ttft_tokens}-token prompt")
            res = solo.run_json([str(model), "--prompt-file", f.name, "--decode", str(plan.decode),
                                 "--max-context", str(plan.max_context), "--mode", mode])
            out[mode] = {"ms_per_token": 1000 / pipe.Tokens(res["decode_token_times"]).tps,
                         "ttft_s": res["ttft_s"][str(plan.ttft_tokens)]}
    out["chain2"] = {"ms_per_token": _in_process_decode(model, short, plan)}
    say("2 stages (warm-up compiles every prefill size first)")
    env = {"MAX_CONTEXT": str(plan.max_context), "PP_BEAM": str(plan.beam)}
    if plan.prefill_chunk:
        env["PP_PREFILL_CHUNK"] = str(plan.prefill_chunk)
    with pipe.start(model, 2, env) as p:
        out["pp2_ready"] = {str(s.index): s.ready for s in p.stages}
        pipe.run_traced(p, short[:1], 4)
        say(f"2 stages: {plan.decode} decode tokens, a {plan.ttft_tokens}-token prompt x {plan.ttft_reps}")
        out["pp2"] = {"ms_per_token": 1000 / pipe.decode_rate(p, short[2], plan.decode).tps,
                      "ttft_s": min(pipe.time_to_first_token(p, long, plan.ttft_reps))}


def _in_process_decode(model: Path, prompts: list[str], plan: Plan) -> float:
    """ms/token of 2 stages chained in this process: the pipeline's tinygrad work without processes or pipes."""
    from pp_worker.testing.chain import Chain

    say(f"2 stages in this process: {plan.decode} decode tokens")
    chain = Chain(model, 2, plan.max_context, prefill_chunk=plan.prefill_chunk)
    tok = models.tokenizer(model)
    chain.generate(0, tok.encode(prompts[0]), 4)  # compiles the prompt's prefill sizes and decode
    prompt = tok.encode(prompts[2])
    t0 = time.perf_counter()
    chain.generate(1, prompt, 1)
    t1 = time.perf_counter()
    chain.generate(2, prompt, plan.decode + 1)  # the prefill, then decode tokens
    return ((time.perf_counter() - t1) - (t1 - t0)) / plan.decode * 1000


# ---------------------------------------------------------------- 5 kernels a decode token launches


def kernels(plan: Plan, out: dict[str, Any]) -> None:
    """`testing.cudagraph.decode_launches` of the speed rows' model on 2 stages, on the emulated CUDA device."""
    model = models.ensure_model(plan.preset, dtype=plan.dtype, isolated=True)
    say(f"kernels a decode token launches on CUDA, 2 stages ({plan.preset} {plan.dtype}, tinygrad's CUDA renderer)")
    out |= count_kernels(model, 2)


def count_kernels(model: Path, stages: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m pp_worker.testing.cudagraph --count`` on ``DEV=NULL:CUDA:sm_90`` (``env`` added): its JSON."""
    env = {**os.environ, "DEV": "NULL:CUDA:sm_90", "NULL_ALLOW_COPYOUT": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pp_worker.testing.cudagraph", "--count", str(stages), "--model",
                           str(model)], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parent.parent)
    counts = [line for line in proc.stdout.splitlines() if line.startswith("COUNT ")]
    if proc.returncode != 0 or not counts:
        raise RuntimeError(f"counting kernels exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(counts[-1].removeprefix("COUNT "))


# ---------------------------------------------------------------- the table


def rows(raw: dict[str, Any], plan: Plan) -> list[Row]:
    return [*exact_rows(raw.get("exact", {}), plan), *speed_rows(raw.get("speed", {}), raw.get("hop", {}), plan),
            *kernel_rows(raw.get("kernels", {}), plan)]


def _get(d: dict[str, Any], *path: str) -> Any:
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def exact_rows(ex: dict[str, Any], plan: Plan) -> list[Row]:
    sec = f"1 exactness vs float64, {plan.exact_preset} model, KV {_get(ex, 'pp2', 'kv_dtype') or '?'}"
    out = []
    for s in (2, 3):
        out.append(Row(sec, f"{s} stages: max |dlogit|", _get(ex, f"pp{s}", "max_dlogit"), "", EXACT_ATOL, True))
        out.append(Row(sec, f"{s} stages: greedy tokens equal", _get(ex, f"pp{s}", "greedy_agree"), "share", 1.0,
                       note=f"{plan.exact_tokens} tokens"))
    same = _get(ex, "interleaved", "same_tokens")
    out.append(Row(sec, "interleaved == solo, 3 generations", None if same is None else float(same), "1 = yes", 1.0,
                   note=f"max |dlogit| {_get(ex, 'interleaved', 'max_dlogit')}"))
    return out


def speed_rows(sp: dict[str, Any], hop: dict[str, Any], plan: Plan) -> list[Row]:
    sec = f"2 decode, {plan.preset} model {plan.dtype}, one device{f', PP_BEAM={plan.beam}' if plan.beam else ''}"
    lazy, real, pp2, chain = (_get(sp, k, "ms_per_token") for k in ("lazy", "realize", "pp2", "chain2"))
    best = min((x for x in (lazy, real) if x), default=None)
    out = [Row(sec, "one process, weights lazy (tinygrad CLI)", lazy, "ms/token"),
           Row(sec, "one process, weights realized", real, "ms/token"),
           Row(sec, "pp_worker 2 stages", pp2, "ms/token"),
           Row(sec, "2 stages speed / fastest one process", best / pp2 if best and pp2 else None, "x", 0.9),
           Row(sec, "pp_worker 2 stages in one process (no pipes)", chain, "ms/token")]
    sec = "3 per-hop overhead (one request/reply between the driver and a stage)"
    e2e = (pp2 - best) / 2 if best and pp2 else None
    out.append(Row(sec, "end to end: (2 stages - one process) / 2 hops", e2e, "ms", 0.2, True,
                   note="includes each stage's own tinygrad call"))
    out.append(Row(sec, "processes and pipes: (2 stages - in one process) / 2", (pp2 - chain) / 2 if pp2 and chain
                   else None, "ms"))
    parts = {"d2h_ms": "device -> host copy, 1 row", "encode_ms": "encode: base64 + reply line",
             "loop_ms": "pipe + both ends' line handling", "decode_ms": "decode: parse request + base64",
             "h2d_ms": "host -> device copy, 1 row"}
    notes = {"loop_ms": f"a stub stage's round trip; bare pipe echo {_fmt(hop.get('pipe_floor_ms'))} ms"}
    out += [Row(sec, name, hop.get(key), "ms", note=notes.get(key, "")) for key, name in parts.items()]
    total = sum(hop[k] for k in parts) if all(k in hop for k in parts) else None
    out.append(Row(sec, "sum of the parts", total, "ms", 0.2, True, note=f"hidden_dim {hop.get('hidden_dim')}"))
    sec = f"4 time to first token, {plan.ttft_tokens}-token prompt"
    out += [Row(sec, "one process, weights lazy", _get(sp, "lazy", "ttft_s"), "s"),
            Row(sec, "one process, weights realized", _get(sp, "realize", "ttft_s"), "s"),
            Row(sec, "pp_worker 2 stages", _get(sp, "pp2", "ttft_s"), "s")]
    return out


def kernel_rows(k: dict[str, Any], plan: Plan) -> list[Row]:
    """Kernels and launches a decode token costs over 2 stages; the target: one graph launch a stage."""
    sec = f"5 kernels a decode token launches, {plan.preset} model {plan.dtype}, 2 stages (CUDA's, counted on the CPU)"
    stages = k.get("stages") or []
    each = ", ".join(f"{s['kernels']} in {s['blocks']} blocks" for s in stages)
    return [Row(sec, "kernels a token", k.get("kernels_per_token"), "kernels", note=f"stages: {each}"),
            Row(sec, "kernels a block", k.get("per_block"), "kernels"),
            Row(sec, "launches a token (graphs and lone kernels)", k.get("launches_per_token"), "launches",
                float(len(stages) or 2), True, note="one graph a stage")]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model and few tokens (a smoke test)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"which to run, of {','.join(SECTIONS)} (all)")
    ap.add_argument("--dtype", default="F16", help="the speed and kernel rows' model type: F16, Q8_0, Q4_K_M... (F16)")
    ap.add_argument("--beam", type=int, default=0, help="PP_BEAM for the 2 stages (their decode kernels searched)")
    ap.add_argument("--solo", default="lazy,realize", help="the one-process modes timed: lazy,realize (both), one, "
                                                            "or none (with --beam: none)")
    ap.add_argument("--tag", help="name the JSON gpu-TAG.json (one file) instead of a time stamp and gpu-latest.json")
    args = ap.parse_args(argv)
    if unknown := set(args.sections.split(",")) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if args.solo != "none" and (unknown := set(args.solo.split(",")) - {"lazy", "realize"}):
        ap.error(f"unknown one-process modes {sorted(unknown)}; choose from lazy,realize or none")
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    # with BEAM only the 2 stages are searched: one-process rows would be those of a run without
    modes = () if args.beam or args.solo == "none" else tuple(args.solo.split(","))
    return dataclasses.replace(QUICK if args.quick else FULL, dtype=args.dtype, beam=args.beam, solo_modes=modes)


def main(argv: list[str] | None = None) -> int:
    from tinygrad import Device

    args = parse_args(argv)
    plan = plan_of(args)
    t0 = time.monotonic()
    raw: dict[str, Any] = {}
    runs = {"exact": exactness, "hop": hop_parts, "speed": speed, "kernels": kernels}
    name = f"gpu-{args.tag}" if args.tag else f"gpu-{time.strftime('%Y%m%d-%H%M%S')}"
    for section in args.sections.split(","):  # the JSON after each: a run stopped half-way keeps what it measured
        attempt(raw, section, lambda out, fn=runs[section]: fn(plan, out))
        table = rows(raw, plan)
        meta = {"device": Device.DEFAULT, "plan": dataclasses.asdict(plan),
                "wall_s": round(time.monotonic() - t0, 1)}
        write_results(to_json(table, meta | {"raw": raw}), args.out, name,
                      latest=f"{name}.json" if args.tag else "gpu-latest.json")
    print(f"device {Device.DEFAULT}, {meta['wall_s']} s")
    print(render(table))
    print(summary(table), flush=True)
    return 1 if raw.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
