"""``make bench``: every measurement side by side in one run; a table on stdout, JSON under ``bench/results/``.

    python -m bench.run            # the 27M-parameter bench model (decode in rounds in turn with one warm tinygrad
                                   # process, 2 and 3 stages, then pinned to CPUs), then section 6 again on the
                                   # 0.73B "rss" model (its first run generates it), pp-serve, and section 8, q8
                                   # against f16 on the wire: ~15 minutes on 2 idle cores
    python -m bench.run --sections memwall   # section 15: the 1.1B shape's files against llama.cpp (bench.memwall;
                                             # its first run generates and quantizes ~5 GB into bench/models/)
    python -m bench.run --sections prefill   # section 16: pp128 / pp512, 2 stages against llama.cpp (bench.prefill)
    python -m bench.run --quick    # the 0.9M "small" model and few tokens: a smoke test of the whole bench
    python -m bench.run --sections beam   # PP_BEAM=2 vs without (not in the default run: the first search takes
                                          # minutes, 20+ on a loaded machine; the kernel cache is kept in bench/models/)

Measurements fill a ``raw`` dict (kept whole in the JSON); ``bench.report`` turns it into table rows. A section
that fails is reported (traceback on stderr, an error in the JSON, n/a in the table) and the rest still run.
Progress goes to stderr; stdout gets the table only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import (
    cold,
    grammar,
    links,
    memwall,
    models,
    moe,
    pipe,
    prefill,
    quant,
    report,
    reuse,
    rss,
    serve,
    servemem,
    solo,
    threads,
    wire,
)
from bench.machine import CpuMeter, describe
from bench.quant import say
from bench.rows import render, summary, to_json, write_results

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("solo", "pp2", "pp3", "pinned", "beam", "pp4", "unjit", "wire", "rss", "serve", "q8", "quant", "qrss",
            "cold", "threads", "servemem", "grammar", "moe", "memwall", "reuse", "links", "prefill")
DEFAULT = tuple(s for s in SECTIONS if s != "beam")  # beam: its first run searches for 20+ minutes


@dataclass(frozen=True)
class Plan:
    preset: str
    prompt_tokens: int = 16  # prompt length of the decode rows
    warm: int = 8  # tokens of the warm-up generation on every pipeline
    decode: int = 64  # row 1: decode tokens timed after the first
    side_rounds: int = 5  # row 1: rounds of one-process decode, then the pipeline's, interleaved
    unjit_decode: int = 8  # row 2 (~0.4 s a token)
    k_values: tuple[int, ...] = (1, 2, 4)
    k_decode: int = 48  # row 3: decode tokens per generation
    ttft_lengths: tuple[int, ...] = (128, 512)
    ttft_reps: int = 3
    beam: int = 2  # PP_BEAM width of the beam section
    beam_rounds: int = 3  # decode runs with and without PP_BEAM, interleaved
    stub_sequential: int = 5000
    stub_pipelined: int = 40000
    payload_reps: int = 9
    payload_shape: tuple[int, int] = (512, 4096)  # a 512-token prefill of a 4096-wide model: 4 MiB of fp16
    q8_tokens: int = 64  # section 8: greedy tokens per prompt compared, q8 against f16 on the wire
    rss: rss.RssPlan = rss.RssPlan()  # section 6 on a model whose weights dwarf tinygrad's floor
    serve: serve.ServePlan = serve.ServePlan()  # section 7: pp-serve on the embedded model
    quant: quant.QuantPlan = quant.QuantPlan()  # sections 9 and 10: quantized files, llama.cpp on the same files
    cold: cold.ColdPlan = cold.ColdPlan()  # section 11: a cold start and a restart, against tinygrad's cold start
    threads: threads.ThreadsPlan = threads.ThreadsPlan()  # section 12: a stage's decode call on 1 thread and on all
    servemem: servemem.ServeMemPlan = servemem.ServeMemPlan()  # section 13: pp-serve's memory and start, 30 blocks
    moe: moe.MoePlan = moe.MoePlan()  # section 14: a qwen3moe against its dense twin and llama.cpp
    memwall: memwall.MemwallPlan = memwall.MemwallPlan()  # section 15: the 1.1B shape from DRAM, against llama.cpp
    grammar: grammar.GrammarPlan = grammar.GrammarPlan()  # section 16: a grammar's mask at a 150K vocabulary
    # section 17: prefix reuse in pp-serve, a 5-turn chat with a ~1,000-token first turn on SmolLM2-135M's shape
    reuse: reuse.ReusePlan = reuse.ReusePlan(preset="smol", dtype="Q8_0")
    links: links.LinksPlan = links.FULL  # section 18: stages behind a delayed link, with and without drafts; smol
    prefill: prefill.PrefillPlan = prefill.PrefillPlan()  # section 19: pp128 / pp512 against llama.cpp


FULL = Plan("bench")
QUICK = Plan("small", warm=3, decode=12, side_rounds=2, unjit_decode=2, k_decode=8, ttft_lengths=(32, 128), ttft_reps=1,
             stub_sequential=300, stub_pipelined=2000, payload_reps=3, q8_tokens=12, rss=rss.RssPlan(preset="bench"),
             serve=serve.ServePlan(requests=8, max_tokens=8),
             # "kq": the smallest preset whose every width is whole K-quant blocks ("small" stores K types as F16)
             quant=quant.QuantPlan(preset="kq", decode=12, rounds=2, load_rounds=1, prefill_reps=1,
                                   rss_preset="bench", rss_stages=(2,)),
             cold=cold.ColdPlan(decode=12, streams=8, stream_tokens=8),
             threads=threads.ThreadsPlan(preset="bench", dtypes=("F16", "Q4_K_M"), rounds=2, calls=6),
             servemem=servemem.ServeMemPlan(preset="bench", dtype="Q8_0", tokens=8, on_demand=False),
             moe=moe.MoePlan(decode=8, rounds=2),
             memwall=memwall.MemwallPlan(preset="kq", dtypes=("F16", "Q4_K_M"), avx2_dtypes=("Q4_K_M",), rounds=2,
                                         decode=8),
             reuse=reuse.ReusePlan(),  # the embedded model: its context (256) holds a ~100-token first turn
             links=links.QUICK,
             prefill=prefill.PrefillPlan(files=(("kq", "F16"), ("kq", "Q4_K_M")), lengths=(32, 128), rounds=1,
                                         avx2_files=(("kq", "Q4_K_M"),)))




def attempt(raw: dict[str, Any], key: str, fn: Callable[[dict[str, Any]], None]) -> None:
    """Run one section, which fills ``raw[key]`` as it goes; a failure is recorded and the bench goes on."""
    section = raw.setdefault(key, {})
    t0 = time.monotonic()
    try:
        fn(section)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        raw.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
    section["section_s"] = round(time.monotonic() - t0, 1)


@dataclass
class Bench:
    plan: Plan
    model: Path
    facts: models.ModelFacts
    prompts: dict[str, list[str]]
    fastest: str = "lazy-tuned"  # the fastest one-process mode (the solo section's, when it ran)
    baseline: solo.Solo | None = None  # that mode, warm, for decode measured in turn with a pipeline's

    @classmethod
    def prepare(cls, plan: Plan) -> Bench:
        model = models.ensure_model(plan.preset)
        facts = models.facts(model)
        say(f"model {model.name}: {facts.params / 1e6:.1f}M parameters; building prompts")
        short = models.fixed_length_prompts(model, plan.prompt_tokens, 3 + max(plan.k_values))
        prompts = {"warm": short[:2], "decode": short[2:3], "k": short[3:]}
        for length in plan.ttft_lengths:
            prompts[f"ttft{length}"] = models.fixed_length_prompts(model, length, 1)
        return cls(plan, model, facts, prompts)

    # --- the one-process baseline --------------------------------------------------------------------------
    def one_process(self, out: dict[str, Any]) -> None:
        say("tinygrad's RSS floor (import + one tiny kernel)")
        out["idle"] = solo.run_json(["--idle", str(self.model)])
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(self.prompt_ids, f)
            f.flush()
            args = [str(self.model), "--prompt-file", f.name, "--decode", str(self.plan.decode),
                    "--max-context", str(self.facts.context)]
            for mode in solo.MODES:  # the fastest one-process variant is the bar
                say(f"one process: Transformer.generate ({mode}), {self.plan.decode} decode tokens")
                res = solo.run_json([*args, "--mode", mode])
                out[mode] = res | {"decode": _tokens_dict(pipe.Tokens(res.pop("decode_token_times")))}
        self.fastest = max(solo.MODES, key=lambda m: out[m]["decode"]["tps"])

    def _solo(self) -> solo.Solo:
        """The fastest one-process mode, started once and kept warm for the interleaved rounds."""
        if self.baseline is None:
            say(f"one process ({self.fastest}), kept warm for decode rounds interleaved with the pipelines'")
            with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
                json.dump(self.prompt_ids, f)
                f.flush()
                self.baseline = solo.Solo(str(self.model), f.name, self.facts.context, self.fastest)  # read by ready
        return self.baseline

    def close(self) -> None:
        if self.baseline is not None:
            self.baseline.close()

    def _side_by_side(self, p: pipe.Pipeline, out: dict[str, Any], decode: int) -> None:
        """Decode rounds in turn: one process, then the pipeline; the pipeline's median round and each ratio."""
        ids = self.prompt_ids["decode"][0]
        base = self._solo()
        side: dict[str, Any] = {"mode": base.mode, "solo_tps": [], "tps": [], "ratios": []}
        runs = []
        for r in range(self.plan.side_rounds):
            say(f"{len(p.stages)} stages: decode round {r + 1} of {self.plan.side_rounds}, one process then pipeline")
            one = pipe.Tokens(base.decode_times(ids, decode))
            runs.append(pipe.decode_rate(p, self.prompts["decode"][0], decode))
            side["solo_tps"].append(one.tps)
            side["tps"].append(runs[-1].tps)
            side["ratios"].append(runs[-1].tps / one.tps if one.tps else None)
        out["decode"] = _tokens_dict(sorted(runs, key=lambda t: t.tps)[len(runs) // 2])
        out["side"] = side

    @functools.cached_property
    def prompt_ids(self) -> dict[str, list[list[int]]]:
        """The pipeline's prompts as token ids, for the one-process runs (same tokenizer, same ids)."""
        tok = models.tokenizer(self.model)
        return {"warmup": [tok.encode(p) for p in self.prompts["warm"]],
                "decode": [tok.encode(self.prompts["decode"][0])],
                "ttft": [tok.encode(self.prompts[f"ttft{n}"][0]) for n in self.plan.ttft_lengths]}

    # --- pipelines ------------------------------------------------------------------------------------------
    def pipeline(self, stages: int, out: dict[str, Any], *, decode: int, warm: int, full: bool = False,
                 prefill: bool = False, side: bool = False, env: dict[str, str] | None = None,
                 launcher: str | None = None) -> None:
        """Start ``stages`` workers, warm them with a ``warm``-token generation, time ``decode`` tokens (``side``:
        in rounds interleaved with one process's), read each stage's peak RSS; ``full``: then the in-flight and
        time-to-first-token rows on the same workers; ``prefill``: the longest prompt sent whole, then pipelined."""
        env = {"PP_MAX_SESSIONS": str(max(8, *self.plan.k_values)), **(env or {})}
        say(f"{stages} stages starting{' with ' + str(env) if len(env) > 1 else ''}")
        t0 = time.monotonic()
        with pipe.start(self.model, stages, env, launcher) as p:
            out["ready_s"] = round(time.monotonic() - t0, 1)
            pipe.run_traced(p, self.prompts["warm"][:1], warm)
            if side:
                self._side_by_side(p, out, decode)
            else:
                say(f"{stages} stages: single stream, {decode} decode tokens")
                out["decode"] = _tokens_dict(pipe.decode_rate(p, self.prompts["decode"][0], decode))
            out["peak_rss_mb"] = pipe.peak_rss(p)
            if full:
                self._concurrency(p, out)
                self._ttft(p, out)
            if prefill:
                n = max(self.plan.ttft_lengths)
                say(f"{stages} stages: a {n}-token prompt sent whole, then pipelined")
                pre = pipe.prefill_overlap(p, self.prompts[f"ttft{n}"][0])
                out["prefill"] = {"prompt_tokens": n, **dataclasses.asdict(pre), "ratio": pre.ratio,
                                  "cores_busy": pre.cores_busy}

    def _concurrency(self, p: pipe.Pipeline, out: dict[str, Any]) -> None:
        out["k"] = {}
        for k in self.plan.k_values:
            say(f"{len(p.stages)} stages: {k} generations in flight, {self.plan.k_decode} decode tokens each")
            out["k"][str(k)] = dataclasses.asdict(pipe.aggregate_rate(p, self.prompts["k"][:k], self.plan.k_decode))

    def _ttft(self, p: pipe.Pipeline, out: dict[str, Any]) -> None:
        out["ttft_s"] = {}
        for n in self.plan.ttft_lengths:
            say(f"{len(p.stages)} stages: time to first token, {n}-token prompt x {self.plan.ttft_reps}")
            out["ttft_s"][str(n)] = pipe.time_to_first_token(p, self.prompts[f"ttft{n}"][0], self.plan.ttft_reps)

    def pinned(self, out: dict[str, Any]) -> None:
        """Pipelined prefill with every stage pinned to one CPU (bench.pinned): 2 stages on a CPU each, 3 stages on
        2 CPUs by halves of the work. Unpinned, each stage's kernels already keep every core busy, so the stages
        have nothing to overlap into; pinned they do (and each runs on one core: the sum they are compared with
        is of single-core prefills)."""
        if len(os.sched_getaffinity(0)) < 2:
            out["skipped"] = "needs 2 CPUs"
            return
        for n in (2, 3):
            self.pipeline(n, out.setdefault(f"pp{n}", {}), decode=self.plan.warm, warm=self.plan.warm, prefill=True,
                          launcher=pipe.PINNED)

    # --- PP_BEAM ---------------------------------------------------------------------------------------------
    def beam(self, out: dict[str, Any]) -> None:
        """2 stages with PP_BEAM, started twice on one kernel cache kept under bench/models/ (a missing one: the
        first start pays the search, ~20+ minutes on 2 shared cores; the second reads it); then decode with and
        without PP_BEAM, interleaved on two live pipelines."""
        plan = self.plan
        cache = models.CACHE / f"beam{plan.beam}-cache.db"
        out["width"], out["ready_s"], out["cache_existed"] = plan.beam, {}, cache.exists()
        env = {"PP_MAX_SESSIONS": "8", "PP_BEAM": str(plan.beam), "CACHEDB": str(cache)}
        for i in range(2):
            say(f"2 stages with PP_BEAM={plan.beam}, start {i + 1} of 2 (kernel cache {cache})")
            t0 = time.monotonic()
            beamed = pipe.start(self.model, 2, env)
            out["ready_s"][str(i)] = round(time.monotonic() - t0, 1)
            if i == 0:
                beamed.close()
        with beamed, pipe.start(self.model, 2, {"PP_MAX_SESSIONS": "8"}) as plain:
            runs: dict[str, list[pipe.Tokens]] = {"beam": [], "plain": []}
            for p in (beamed, plain):
                pipe.run_traced(p, self.prompts["warm"][:1], plan.warm)
            for r in range(plan.beam_rounds):
                say(f"decode with / without PP_BEAM, round {r + 1} of {plan.beam_rounds}")
                for key, p in (("beam", beamed), ("plain", plain)):
                    runs[key].append(pipe.decode_rate(p, self.prompts["decode"][0], plan.decode))
        for key, tokens in runs.items():
            out[key] = [_tokens_dict(t) for t in tokens]
        out["decode"] = max(out["beam"], key=lambda d: d["tps"])
        out["ratio_rounds"] = [b.tps / p.tps if p.tps else None for b, p in zip(runs["beam"], runs["plain"],
                                                                                strict=True)]

    # --- section 6 again, on a model whose weights dwarf tinygrad's floor ----------------------------------------
    def big_rss(self, out: dict[str, Any]) -> None:
        plan = self.plan.rss
        say(f'peak RSS on the "{plan.preset}" model (generated once into bench/models/ if missing)')
        model, out["model"] = rss.prepare(plan)
        say(f"{plan.preset} model: {out['model']['params'] / 1e6:.0f}M parameters; tinygrad's floor again")
        out["idle"] = solo.run_json(["--idle", str(model)])
        text = rss.prompt(model, plan)
        for n in plan.stages:
            say(f"{plan.preset} model: {n} stages, MAX_CONTEXT {plan.max_context}, one {plan.tokens}-token generation")
            out[f"pp{n}"] = rss.stage_peaks(model, n, text, plan)
        say(f"{plan.preset} model: one process, from_gguf(realize=True) + 2 tokens")
        out["solo"] = rss.one_process(model, text, plan)

    # --- protocol, no model ---------------------------------------------------------------------------------
    def wire(self, out: dict[str, Any]) -> None:
        self._hops(out)
        self._payloads(out)

    def _hops(self, out: dict[str, Any]) -> None:
        n = self.plan.stub_sequential
        out["pipe_floor_rt_s"], out["sequential_rt_s"] = {}, {}
        for where, (mine, theirs) in wire.placements().items():
            say(f"decode hops, one in flight, {where}: bare pipe echo, then a stub middle stage (forward_range 1x16)")
            with wire.client_on(mine):
                out["pipe_floor_rt_s"][where] = wire.pipe_floor_rate(n, theirs)
                w = wire.RawWorker.stub(1, 3, cpu=theirs)
                try:
                    out["sequential_rt_s"][where] = wire.sequential_rate(w, n)
                finally:
                    w.close()
        say(f"decode hops, {self.plan.stub_pipelined} pipelined; a 512-token prefill through the stub")
        w = wire.RawWorker.stub(1, 3)
        try:
            out["pipelined_rt_s"] = wire.pipelined_rate(w, self.plan.stub_pipelined)
            out["stub_prefill"] = _payload(wire.round_trip_rate(w, 512, wire.STUB_HIDDEN, self.plan.payload_reps))
        finally:
            w.close()

    def _payloads(self, out: dict[str, Any]) -> None:
        plan = self.plan
        seq, hidden = plan.payload_shape
        say(f"payload path: {seq} x {hidden} fp16 in-process codec and echo-worker round trip")
        out["codec"] = _payload(wire.codec_rate(seq, hidden, plan.payload_reps))
        e = wire.RawWorker.echo(hidden)
        try:
            out["echo"] = _payload(wire.round_trip_rate(e, seq, hidden, plan.payload_reps))
        finally:
            e.close()

    # --- Q8 hidden states on the wire (PP_WIRE_DTYPE=q8) against f16, side by side ---------------------------
    def q8(self, out: dict[str, Any]) -> None:
        seq, hidden = self.plan.payload_shape
        say(f"q8 vs f16: bytes per token, {seq} x {hidden} codec in-process and echo-worker round trip")
        out["payload_hidden_dim"] = hidden
        out["b64_chars_per_token"] = {dtype: wire.payload_chars(dtype, hidden) for dtype in ("f16", "q8")}
        for dtype in ("f16", "q8"):  # interleaved, so that both see the same machine load
            out.setdefault("codec", {})[dtype] = _payload(wire.codec_rate(seq, hidden, self.plan.payload_reps, dtype))
            e = wire.RawWorker.echo(hidden, dtype)
            try:
                out.setdefault("echo", {})[dtype] = _payload(wire.round_trip_rate(e, seq, hidden,
                                                                                   self.plan.payload_reps, dtype))
            finally:
                e.close()
        for stages in (2, 3):
            out[f"pp{stages}"] = self._q8_agreement(stages, self.prompts["k"], self.plan.q8_tokens)

    def _q8_agreement(self, stages: int, prompts: list[str], n: int) -> dict[str, Any]:
        """The same greedy generations on f16 and on q8 pipelines (PP_WARMUP off: only two sizes are used)."""
        tokens: dict[str, list[list[int]]] = {}
        for dtype in ("f16", "q8"):
            say(f"{stages} stages, PP_WIRE_DTYPE={dtype}: {len(prompts)} prompts x {n} greedy tokens")
            with pipe.start(self.model, stages, {"PP_WARMUP": "0", "PP_WIRE_DTYPE": dtype}) as p:
                tokens[dtype] = pipe.greedy_tokens(p, prompts, n)
                ready = p.stages[0].ready
                assert ready is not None  # the pipeline started: every stage is ready
                hidden = ready["hidden_dim"]
        a = pipe.agreement(tokens["f16"], tokens["q8"], n)
        return {**dataclasses.asdict(a), "prefix_fraction": a.prefix_fraction, "overall_fraction": a.overall_fraction,
                "hidden_dim": hidden, "b64_chars_per_token": {d: wire.payload_chars(d, hidden) for d in tokens},
                "tokens": tokens}


def _payload(p: wire.Payload) -> dict[str, float]:
    return {**dataclasses.asdict(p), "mb_per_s": p.mb_per_s}


def _tokens_dict(t: pipe.Tokens) -> dict[str, Any]:
    t0 = t.times[0] if t.times else 0.0
    return {"decoded": t.decoded, "tps": t.tps, "p50_ms": t.p50_ms, "times_s": [round(x - t0, 5) for x in t.times]}


def measure(b: Bench, sections: tuple[str, ...]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    plan = b.plan
    steps: dict[str, Callable[[dict[str, Any]], None]] = {
        "solo": b.one_process,
        "pp2": lambda out: b.pipeline(2, out, decode=plan.decode, warm=plan.warm, full=True, side=True),
        "pp3": lambda out: b.pipeline(3, out, decode=plan.decode, warm=plan.warm, prefill=True, side=True),
        "pinned": b.pinned,
        "beam": b.beam,
        "pp4": lambda out: b.pipeline(4, out, decode=plan.warm, warm=plan.warm),  # for its peak RSS
        "unjit": lambda out: b.pipeline(2, out, decode=plan.unjit_decode, warm=2, env={"JIT": "0"}),
        "wire": b.wire,
        "rss": b.big_rss,
        "serve": lambda out: out.update(serve.measure(plan.serve)),
        "q8": b.q8,
        "quant": lambda out: out.update(quant.measure(plan.quant, b.prompts, b.prompt_ids["decode"][0], (
            n := max(plan.ttft_lengths), b.prompts[f"ttft{n}"][0]), b.facts.context)),
        "qrss": lambda out: out.update(quant.big_rss(plan.quant, lambda m: rss.prompt(m, rss.RssPlan()))),
        "cold": lambda out: out.update(cold.measure(plan.cold)),
        "threads": lambda out: out.update(threads.measure(plan.threads)),
        "servemem": lambda out: out.update(servemem.measure(plan.servemem)),
        "moe": lambda out: out.update(moe.measure(plan.moe)),
        "memwall": lambda out: out.update(memwall.measure(plan.memwall)),
        "grammar": lambda out: out.update(grammar.measure(plan.grammar)),
        "reuse": lambda out: out.update(reuse.measure(plan.reuse)),
        "links": lambda out: out.update(links.measure(plan.links)),
        "prefill": lambda out: out.update(prefill.measure(plan.prefill)),
    }
    try:
        for key in sections:
            attempt(raw, key, steps[key])
    finally:
        b.close()
    return raw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help='the "small" model and few tokens (a smoke test)')
    ap.add_argument("--sections", default=",".join(DEFAULT),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but beam)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    args = ap.parse_args(argv)
    args.sections = tuple(s for s in args.sections.split(",") if s)
    if unknown := set(args.sections) - set(SECTIONS):
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "machine": describe(),
            "plan": dataclasses.asdict(plan)}
    meter = CpuMeter()
    b = Bench.prepare(plan)
    meta["model"] = {"path": str(b.model), **dataclasses.asdict(b.facts)}
    raw = measure(b, args.sections)
    meta["machine"] |= meter.read()
    shares = {n: models.stage_shares(b.model, n, b.facts.context) for n in (2, 4)}
    rows = report.build(raw, b.facts, shares)
    doc = to_json(rows, meta | {"raw": raw})
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    paths = write_results(doc, args.out, stamp, latest="latest-quick.json" if args.quick else "latest.json")
    print(render(rows))
    print(summary(rows))
    print(report.machine_line(meta["machine"]), flush=True)
    say(f"results: {paths[0]}")
    return 1 if raw.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
