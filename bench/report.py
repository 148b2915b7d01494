"""The raw measurements of ``bench.run`` -> table rows, with the issue's targets next to them.

Targets (issue 10; issue 5 had 0.9 and 0.85, and 1.5x for K=4): 2 stages >= 0.95x the fastest one-process mode,
3 stages >= 0.9x (the median of decode rounds taken in turn with that mode, so both see the same load); ours >= 5x
the unjitted loop; K=4 in flight >= 2.5x K=1 (batched decode); 3-stage time to first token of a 512-token prompt
<= 0.6x the sum of the stages' prefill times (pipelined prefill), shown next to how busy the stages kept the cores
sent whole (3 stages on 2 cores must share them), and again with the stages pinned to a core each or by halves;
a stub decode hop
>= 20,000 round trips/s; the prefill payload path >= 500 MB/s; each stage's peak RSS <= (its weights + one
session's KV) x 1.3, on the bench model and again (``bench.rss``) on a model whose weights dwarf tinygrad's own
idle floor. Section 7 (issue 11, no target): pp-serve's requests/s and tokens/s. Section 8 (issue 10, no target):
what q8 on the wire costs in exactness (greedy agreement with f16) and gains in bytes. PP_BEAM (issue 10, no
target): decode with / without, and the search's cost.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

from bench import grammar, links
from bench.models import WEIGHT_BYTES, ModelFacts
from bench.rows import Row, number

MIB = 1 << 20
S1 = "1 single-stream decode, warm workers"
S2 = "2 ours vs the unjitted per-block loop, 2 stages"
S3 = "3 generations in flight through 2 stages (aggregate decode)"
S4 = "4 time to first token, warm workers"
S5 = "5 protocol overhead, no model"
S6 = "6 peak RSS (VmHWM)"
S7 = "7 pp-serve endpoint, embedded model"
S8 = "8 q8 hidden states on the wire (PP_WIRE_DTYPE=q8) against f16"
S9 = "9 quantized files kept quantized, 2 stages, and llama.cpp on the same files"
S10 = "10 peak RSS (VmHWM) of quantized stages"
S11 = "11 a cold start (empty caches) and a restart, the embedded model"
S13 = "13 pp-serve on a 30-block model (SmolLM2-135M's shape, Q8_0), 2 stages, 8 slots, cold"
S15 = "15 memwall: TinyLlama-1.1B's shape (2.2 GB F16), weights streamed from DRAM, 2 stages and llama.cpp"
S12 = "12 threads: one stage's decode call on every core / on one (PP_THREADS), timed inside the stage"
S19 = "19 prefill: a prompt's time to first token, 2 stages and llama.cpp on the same file, rounds in turn"
S14 = "14 mixture of experts (qwen3moe, Q8_0), 2 stages: against a dense twin and llama.cpp"
S17 = "17 prefix reuse across requests (cache_prompt), pp-serve, a 5-turn chat"
REUSE_TARGET = 0.25  # issue 52: the next turn's and an identical repeat's first token <= 0.25x the first turn's


def get(raw: dict[str, Any], *path: str) -> Any:
    """raw[a][b]...; None where any part is missing (a section that failed)."""
    node: Any = raw
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build(raw: dict[str, Any], facts: ModelFacts, shares: dict[int, list[tuple[int, int]]]) -> list[Row]:
    """Every section's rows. A section that raised before it measured anything (`run.attempt` left only its
    seconds) is one not run: its rows say "not measured". Rows that cannot be built from what a section left (it
    raised halfway) become one n/a row naming the error (its traceback on stderr): the rest of an hour's table
    stands."""
    raw = {k: v for k, v in raw.items() if not (isinstance(v, dict) and set(v) <= {"section_s"})}
    parts: list[tuple[str, Callable[[], list[Row]]]] = [
        (S1, lambda: single(raw)), (S2, lambda: unjitted(raw)), (S3, lambda: in_flight(raw)), (S4, lambda: ttft(raw)),
        (S5, lambda: protocol_rows(raw)), (S6, lambda: memory(raw, facts, shares)),
        (S7, lambda: endpoint(raw.get("serve"))), (S8, lambda: wire_q8(raw.get("q8"))),
        (S9, lambda: quantized(raw.get("quant"))), (S10, lambda: quant_memory(raw.get("qrss"))),
        (S11, lambda: cold_start(raw.get("cold"))), (S12, lambda: thread_rows(get(raw, "threads", "threads"))),
        (S13, lambda: serve_memory(raw.get("servemem"))), (S14, lambda: moe_rows(raw.get("moe"))),
        (S15, lambda: memwall_rows(raw.get("memwall"))), (grammar.S16, lambda: grammar.rows(raw.get("grammar"))),
        (S17, lambda: reuse_rows(raw.get("reuse"))), (links.SECTION, lambda: links.rows(raw.get("links"))),
        (S19, lambda: prefill_rows(raw.get("prefill")))]
    rows: list[Row] = []
    for section, part in parts:
        try:
            rows += part()
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(section, "its rows", None, "", note=f"not built from what it measured: "
                                                                 f"{type(e).__name__}: {e}"))
    return rows


def _decode_note(d: dict[str, Any] | None) -> str:
    return f"{d['decoded']} tokens, median {d['p50_ms']:.1f} ms/token" if d else "not measured"


SOLO_MODES = {"lazy": "lazy weights (tinygrad CLI's way)", "lazy-tuned": "lazy + rope table realized",
              "realize": "from_gguf(realize=True)", "tuned": "realize + rope table realized"}


def best_solo(raw: dict[str, Any]) -> float | None:
    """The one-process bar: the fastest of the one-process variants."""
    rates = [r for m in SOLO_MODES if (r := get(raw, "solo", m, "decode", "tps")) is not None]
    return max(rates, default=None)


def _fastest_mode(raw: dict[str, Any]) -> str:
    rates = {m: r for m in SOLO_MODES if (r := get(raw, "solo", m, "decode", "tps")) is not None}
    return max(rates, key=lambda m: rates[m]) if rates else "none measured"


def single(raw: dict[str, Any]) -> list[Row]:
    rows = []
    for mode, label in SOLO_MODES.items():
        d = get(raw, "solo", mode, "decode")
        rows.append(Row(S1, f"one process, {label}", get(d or {}, "tps"), "tok/s", note=_decode_note(d)))
    base, cli, fastest = best_solo(raw), get(raw, "solo", "lazy", "decode", "tps"), _fastest_mode(raw)
    for n, target in ((2, 0.95), (3, 0.9)):
        tps, side = get(raw, f"pp{n}", "decode", "tps"), get(raw, f"pp{n}", "side")
        rows.append(Row(S1, f"pp_worker {n} stages", tps, "tok/s", note=_decode_note(get(raw, f"pp{n}", "decode"))))
        apart = (f"measured apart: {number(ratio(tps, base))}x the fastest ({fastest}), "
                 f"{number(ratio(tps, cli))}x tinygrad as is (lazy)") if tps is not None else "not measured"
        if side:
            ratios = [r for r in side["ratios"] if r is not None]
            rows.append(Row(S1, f"  {n} stages / one process", statistics.median(ratios) if ratios else None, "x",
                            target, note=f"median of {len(ratios)} rounds in turn with one process ({side['mode']}, "
                                         f"{statistics.median(side['solo_tps']):.1f} tok/s): "
                                         f"{', '.join(number(r) for r in ratios)}; {apart}"))
        else:
            rows.append(Row(S1, f"  {n} stages / one process", ratio(tps, base), "x", target, note=apart))
    return rows + beam_rows(raw)


def beam_rows(raw: dict[str, Any]) -> list[Row]:
    """PP_BEAM on 2 stages: decode with / without, interleaved on two live pipelines; start-up with the search."""
    b = raw.get("beam")
    if not b or not b.get("ratio_rounds"):
        return []
    width, first, second = b.get("width"), get(b, "ready_s", "0"), get(b, "ready_s", "1")
    tps = {k: statistics.median(d["tps"] for d in b[k]) for k in ("beam", "plain")}
    rounds = [r for r in b["ratio_rounds"] if r is not None]
    return [Row(S1, f"pp_worker 2 stages, PP_BEAM={width}", tps["beam"], "tok/s",
                note=f"median of {len(b['beam'])} runs; without PP_BEAM, interleaved: {tps['plain']:.1f} tok/s"),
            Row(S1, f"  PP_BEAM={width} / without", statistics.median(rounds) if rounds else None, "x",
                note="median of the rounds' ratios; the decode JIT's kernels are searched, prefill's not"),
            Row(S1, f"  PP_BEAM={width}: start to ready", first, "s",
                note=("the search (new kernel cache)" if not b.get("cache_existed") else "kernel cache reused") +
                     f"; second start {number(second)} s; without PP_BEAM {number(get(raw, 'pp2', 'ready_s'))} s")]


def unjitted(raw: dict[str, Any]) -> list[Row]:
    d, ours = get(raw, "unjit", "decode"), get(raw, "pp2", "decode", "tps")
    note = "JIT=0: TinyJit calls the forward eagerly, each block each token; " + _decode_note(d)
    return [Row(S2, "2 stages, unjitted (JIT=0)", get(d or {}, "tps"), "tok/s", note=note),
            Row(S2, "  ours / unjitted", ratio(ours, get(d or {}, "tps")), "x", 5.0,
                note="the seed also re-traced per Python-int position: slower still than JIT=0")]


def in_flight(raw: dict[str, Any]) -> list[Row]:
    ks = get(raw, "pp2", "k") or {}
    one = get(ks, "1", "tps")
    rows = []
    for k, a in ks.items():
        note = f"{a['tokens_in_window']} tokens in {a['window_s']:.2f} s; prefills included: {a['overall_tps']:.1f}"
        rows.append(Row(S3, f"K={k}", a["tps"], "tok/s", note=note))
    for k in (k for k in ks if k != "1"):
        rows.append(Row(S3, f"  K={k} / K=1", ratio(get(ks, k, "tps"), one), "x", 2.5 if k == "4" else None,
                        note="each stage runs the steps that reach it together as one batched forward"))
    return rows


def ttft(raw: dict[str, Any]) -> list[Row]:
    rows = []
    for n, times in (get(raw, "pp2", "ttft_s") or {}).items():
        solo = [t for m in SOLO_MODES if (t := get(raw, "solo", m, "ttft_s", n)) is not None]
        base = min(solo, default=None)
        note = f"min {min(times):.3f} s of {len(times)}" + (f"; one process {base:.3f} s" if base else "")
        rows.append(Row(S4, f"{n}-token prompt", statistics.median(times), "s", note=note))
    rows += _prefill_rows(get(raw, "pp3", "prefill"), "3 stages", 0.6)
    rows += _prefill_rows(get(raw, "pinned", "pp3", "prefill"), "3 stages pinned, 2 CPUs by halves", 0.6)
    return rows + _prefill_rows(get(raw, "pinned", "pp2", "prefill"), "2 stages pinned, a CPU each", None)


def _prefill_rows(pre: dict[str, Any] | None, label: str, target: float | None) -> list[Row]:
    if not pre:
        return []
    n, stages = pre["prompt_tokens"], " + ".join(f"{t:.2f}" for t in pre["stage_s"])
    cpu = sum(pre["stage_cpu_s"])
    return [Row(S4, f"{label}, {n}-token prompt, pipelined prefill", pre["pipelined_ttft_s"], "s",
                note=f"sent whole: {pre['whole_ttft_s']:.2f} s; the stages' prefill times {stages} s"),
            Row(S4, "  pipelined / sum of the stages' prefill times", pre["ratio"], "x", target, at_most=True,
                note="chunks of the stages' prefill_chunk; stage s+1 works while stage s prefills on"),
            Row(S4, "  cores busy, the prompt sent whole", pre["cores_busy"], "",
                note=f"the stages' CPU time ({cpu:.2f} s) over {pre['cores']} cores x the sum: what is idle is the "
                     "room pipelining has, beside what the stages save by not competing for the cores")]


def protocol_rows(raw: dict[str, Any]) -> list[Row]:
    w = raw.get("wire") or {}
    rows = []
    for where, rate in (w.get("pipe_floor_rt_s") or {}).items():
        rows.append(Row(S5, f"bare pipe echo, 1 in flight, {where}", rate, "rt/s",
                        note="the floor: a Python child copying lines back, no JSON, client and child pinned"))
    for where, rate in (w.get("sequential_rt_s") or {}).items():
        rows.append(Row(S5, f"decode hop, 1 in flight, {where}", rate, "rt/s", 20000,
                        note="forward_range 1x16, stub middle stage; client encodes/parses lines as the driver"))
    return rows + [
        Row(S5, "decode hop, pipelined (stage capacity)", w.get("pipelined_rt_s"), "rt/s", 20000,
            note="requests written ahead by a thread, replies counted: what one stage process can serve"),
        Row(S5, "512-token prefill via the stub (16 KB)", get(w, "stub_prefill", "mb_per_s"), "MB/s",
            note="hidden 16: per-request cost and the stub's SHA-256 fake compute dominate"),
        Row(S5, "codec in-process, 512x4096 fp16", get(w, "codec", "mb_per_s"), "MB/s",
            note="encode_hidden + decode_hidden (validating) of 4.2 MB"),
        Row(S5, "prefill payload round trip, 512x4096", get(w, "echo", "mb_per_s"), "MB/s", 500,
            note="payload MB per round trip (out and back) through pp_worker's loop+codec, engine echoes"),
    ]


def _params(n: int) -> str:
    return f"{n / 1e6:.3g}M"


def memory(raw: dict[str, Any], facts: ModelFacts, shares: dict[int, list[tuple[int, int]]]) -> list[Row]:
    sec = f"{S6}, the {_params(facts.params)}-parameter bench model, MAX_CONTEXT {facts.context}"
    floor = get(raw, "solo", "idle", "peak_rss_mb")
    whole_kv = facts.kv_bytes(facts.n_blocks, facts.context) / MIB
    rows = [Row(sec, "tinygrad floor: import + one kernel", floor, "MiB", note="an idle process that ran one kernel"),
            Row(sec, "  floor + the model's tokenizer", get(raw, "solo", "idle", "with_tokenizer_peak_rss_mb"), "MiB",
                note="SimpleTokenizer.from_gguf_kv, which only the first stage builds (the last decodes from a table)"),
            Row(sec, "one process, whole model", get(raw, "solo", "lazy", "peak_rss_mb"), "MiB",
                note=f"file {facts.file_bytes / MIB:.0f} + KV {whole_kv:.0f} MiB + tokenizer, lazy weights; "
                     f"realized: {number(get(raw, 'solo', 'realize', 'peak_rss_mb'))}, tuned: "
                     f"{number(get(raw, 'solo', 'tuned', 'peak_rss_mb'))} MiB")]
    for n, share in sorted(shares.items()):
        peaks = get(raw, f"pp{n}", "peak_rss_mb") or [None] * n
        for i, ((w, kv), peak) in enumerate(zip(share, peaks, strict=True)):
            rows.append(_stage_rss(sec, f"{n} stages: stage {i}", w / MIB, kv / MIB, peak, floor))
    return rows + big_memory(raw.get("rss"))


def big_memory(rss: dict[str, Any] | None) -> list[Row]:
    """Section 6 on the "rss" model (``bench.rss``): weights far above tinygrad's floor, KV negligible."""
    m = get(rss or {}, "model")
    if m is None:
        return [Row(f"{S6}, a model whose weights dwarf the floor", "rss model", None, "MiB",
                    note="not measured (section rss not run, or it failed before generating the model)")]
    sec = f"{S6}, the {_params(m['params'])}-parameter \"{m['preset']}\" model, MAX_CONTEXT {m['max_context']}"
    floor = get(rss, "idle", "peak_rss_mb")
    label = f"{m['preset']} model"
    rows = [Row(sec, f"{label}: tinygrad floor", floor, "MiB", note="measured again: import + one kernel"),
            _big_solo(sec, label, rss, m, floor)]
    for n, share in sorted(m["shares"].items(), key=lambda kv: int(kv[0])):
        peaks = get(rss, f"pp{n}", "peak_rss_mb") or [None] * len(share)
        for i, ((w, kv), peak) in enumerate(zip(share, peaks, strict=True)):
            rows.append(_stage_rss(sec, f"{label}, {n} stages: stage {i}", w / MIB, kv / MIB, peak, floor))
    return rows


def _big_solo(sec: str, label: str, rss: dict[str, Any], m: dict[str, Any], floor: float | None) -> Row:
    weights, kv, peak = m["params"] * WEIGHT_BYTES / MIB, m["kv_whole"] / MIB, get(rss, "solo", "peak_rss_mb")
    note = f"from_gguf(realize=True) + 2 tokens; weights {number(weights)} + KV {number(kv)} MiB"
    if peak is not None and floor is not None:
        note += f"; (peak - floor) / (weights + KV) = {(peak - floor) / (weights + kv):.2f}"
    return Row(sec, f"{label}: one process, whole model", peak, "MiB", note=note)


def _stage_rss(sec: str, name: str, w: float, kv: float, peak: float | None, floor: float | None) -> Row:
    bound = (w + kv) * 1.3
    note = f"weights {number(w)} + KV {number(kv)} MiB"
    if peak is not None and floor is not None:
        net = peak - floor
        note += (f"; minus the floor {net:.0f} MiB ({'PASS' if net <= bound else 'MISS'} net), "
                 f"{net - w - kv:.0f} MiB above floor + share")
    return Row(sec, name, peak, "MiB", bound, at_most=True, note=note)


def machine_line(m: dict[str, Any]) -> str:
    text = f"machine: {m.get('cpus')} CPUs ({m.get('cpu_model') or 'unknown'}), bench wall {m.get('wall_s')} s"
    share = m.get("foreign_share")
    if share is not None:
        text += f"; other processes used {m['foreign_cpu_s']} CPU-s ({share:.0%} of the machine) meanwhile"
        if share > 0.05:
            text += " - timings are skewed, rerun on a quiet machine"
    return text


def endpoint(serve: dict[str, Any] | None) -> list[Row]:
    """Section 7: greedy non-streamed completions back to back from each of N client threads."""
    levels = get(serve or {}, "levels") or {}
    if not levels:
        return [Row(S7, "pp-serve", None, "req/s", note="not measured (section serve not run, or it failed)")]
    assert serve is not None
    sec = f"{S7} ({serve['model']}), {serve['stages']} stages, max_tokens {serve['max_tokens']}"
    rows = []
    for clients, m in levels.items():
        note = f"{m['requests']} requests, {m['tokens']} tokens in {m['wall_s']:.2f} s; median {m['p50_s']:.2f} s each"
        rows.append(Row(sec, f"{clients} concurrent client(s)", m["rps"], "req/s", note=note))
        rows.append(Row(sec, f"  {clients} client(s): generated tokens", m["tps"], "tok/s"))
    return rows


def wire_q8(q: dict[str, Any] | None) -> list[Row]:
    """Section 8: greedy agreement on 2 and 3 stages, then bytes per token and codec speed side by side."""
    if not q:
        return [Row(S8, "q8", None, "x", note="not measured (section q8 not run, or it failed)")]
    rows: list[Row] = []
    widths = {q["payload_hidden_dim"]: q["b64_chars_per_token"]} if "b64_chars_per_token" in q else {}
    for stages in (2, 3):
        a = q.get(f"pp{stages}")
        if a is None:
            rows.append(Row(S8, f"{stages} stages: greedy agreement", None, "", note="not measured"))
            continue
        widths[a["hidden_dim"]] = a["b64_chars_per_token"]
        rows += [
            Row(S8, f"{stages} stages: tokens identical before the first divergence", a["prefix_fraction"], "",
                note=f"{len(a['first_divergence'])} prompts x {a['n']} greedy tokens; first divergence at "
                     f"{a['first_divergence']} ({a['n']} = none)"),
            Row(S8, f"{stages} stages: tokens identical overall", a["overall_fraction"], "",
                note=f"per prompt {a['identical']} of {a['n']}; after a divergence the texts differ anyway"),
        ]
    for dim, chars in sorted(widths.items()):
        rows.append(Row(S8, f"bytes per token, hidden {dim}: q8 / f16", ratio(chars["q8"], chars["f16"]), "x",
                        note=f"base64 chars of a decode step's payload: {chars['q8']} vs {chars['f16']}"))
    for key, label in (("codec", "codec in-process, 512x4096"), ("echo", "prefill round trip via a worker, 512x4096")):
        f16, q8 = get(q, key, "f16", "mb_per_s"), get(q, key, "q8", "mb_per_s")
        rows += [Row(S8, f"{label}, q8", q8, "MB/s", note="MB of the fp16 hidden state; q8 encode + decode included"),
                 Row(S8, f"{label}, f16", f16, "MB/s", note="measured next to it"),
                 Row(S8, f"  {label}: q8 / f16", ratio(q8, f16), "x")]
    return rows


QUANT_TARGETS = {"Q8_0": 1.4, "Q4_K_M": 1.6}  # decode / the F16 file's (issue 17)
PEER_TARGETS = {"F16": 0.5, "Q8_0": 0.5}  # 2 stages / llama.cpp's one process on the same file (issue 19: these two)


def quantized(q: dict[str, Any] | None) -> list[Row]:
    """Section 9: decode in rounds in turn (pipelines and llama.cpp), prefill, load, on F16 and quantized files."""
    if not q:
        return [Row(S9, "quantized files", None, "tok/s", note="not measured (section quant not run, or it failed)")]
    from bench.quant import median_ratio

    rounds, rows = q["rounds"], []
    for dt, size in q["file_bytes"].items():
        rates = [r[f"pp2 {dt}"] for r in rounds]
        rows.append(Row(S9, f"{dt} file ({size / MIB:.0f} MiB): 2 stages decode", statistics.median(rates), "tok/s",
                        note=f"median of {len(rates)} rounds taken in turn with the other files' pipelines"))
        if dt != "F16":
            rows.append(Row(S9, f"  {dt} / F16 decode", median_ratio(rounds, f"pp2 {dt}", "pp2 F16"), "x",
                            QUANT_TARGETS.get(dt), note="median of the rounds' ratios"))
            if (peer := median_ratio(rounds, f"llama.cpp {dt}", "llama.cpp F16")) is not None:
                rows.append(Row(S9, f"  llama.cpp {dt} / F16 decode", peer, "x",
                                note="what llama.cpp gains from the same file here, in the same rounds (context)"))
    for dt in (d for d in q["file_bytes"] if any(f"llama.cpp {d}" in r for r in rounds)):
        rates = [r[f"llama.cpp {dt}"] for r in rounds]
        rows += [Row(S9, f"llama.cpp one process, {dt} file", statistics.median(rates), "tok/s",
                     note=f"{q['peer_info'].get(dt) or ''}"[:160]),
                 Row(S9, f"  2 stages / llama.cpp, {dt}", median_ratio(rounds, f"pp2 {dt}", f"llama.cpp {dt}"), "x",
                     PEER_TARGETS.get(dt),
                     note="median of the rounds' ratios, both decoding the same file in the same round")]
    if q.get("peers_skipped"):
        rows.append(Row(S9, "llama.cpp one process", None, "tok/s", note=q["peers_skipped"]))
    return rows + _quant_prefill_and_load(q)


def _quant_prefill_and_load(q: dict[str, Any]) -> list[Row]:
    rows = []
    f16_prefill, f16_load = statistics.median(q["prefill_s"]["F16"]), statistics.median(q["load_s"]["F16"])
    for dt, times in q["prefill_s"].items():
        t = statistics.median(times)
        rows.append(Row(S9, f"{dt}: {q['prefill_tokens']}-token prompt, time to first token", t, "s",
                        note=f"median of {len(times)}; each stage's peak RSS "
                             f"{', '.join(number(m) for m in q['peak_rss_mb'][dt])} MiB"))
        if dt != "F16":
            rows.append(Row(S9, f"  {dt} prefill speed / F16's", ratio(f16_prefill, t), "x", 0.8,
                            note="the F16 file's time over this file's"))
    for dt, times in q["load_s"].items():
        t = statistics.median(times)
        ready = q.get("ready_s", {}).get(dt)
        rows.append(Row(S9, f"{dt}: load, the slower of 2 stages", t, "s",
                        note=f"ready line load_ms (header, tokenizer, tensors); median of {len(times)} starts taken in "
                             "turn with the other files'"
                             + (f"; process start to ready {statistics.median(ready):.2f} s" if ready else "")))
        if dt != "F16":
            rows.append(Row(S9, f"  {dt} / F16 load time", ratio(t, f16_load), "x", 1.0, at_most=True))
    return rows


def quant_memory(r: dict[str, Any] | None) -> list[Row]:
    """Section 10: each quantized stage's peak against its share of the file + tinygrad's floor + 64 MiB."""
    if not r:
        return [Row(S10, "quantized stages", None, "MiB", note="not measured (section qrss not run, or it failed)")]
    rows = []
    for dt, entry in ((k, v) for k, v in r.items() if isinstance(v, dict)):
        floor = get(entry, "idle", "peak_rss_mb")
        for n in sorted(int(k[2:]) for k in entry if k.startswith("pp")):
            run = entry[f"pp{n}"]
            for i, (share, kv, peak) in enumerate(zip(run["file_share"], run["kv"], run["peak_rss_mb"], strict=True)):
                bound = share / MIB + floor + 64 if floor is not None else None
                note = f"its tensors in the file {share / MIB:.0f} MiB, KV {kv / MIB:.1f} MiB, " \
                       f"floor {number(floor)} MiB"
                if peak is not None and floor is not None:
                    note += f"; {peak - floor - share / MIB:.0f} MiB above floor + share"
                rows.append(Row(S10, f"{dt} ({entry['file_bytes'] / MIB:.0f} MiB file), {n} stages: stage {i}",
                                peak, "MiB", bound, at_most=True, note=note))
    return rows


def cold_start(c: dict[str, Any] | None) -> list[Row]:
    """Section 11 (issue 18): first token from before the processes start, pipeline and restart against tinygrad."""
    if not c:
        return [Row(S11, "cold start", None, "s", note="not measured (section cold not run, or it failed)")]
    tg, cold, restart, srv = c["tinygrad"], c["cold"], c["restart"], c["serve"]
    n = c["stages"]
    return [
        Row(S11, "tinygrad one process: first token, cold", tg["ttft_s"], "s",
            note=f"from before its process started; its first generation {tg['first_tps']:.0f} tok/s, "
                 f"steady {tg['steady_tps']:.0f} tok/s"),
        Row(S11, f"pp-pipeline {n} stages: first token, cold", cold["ttft_s"], "s",
            note=f"stages ready after {cold['ready_s']:.1f} s (no PP_WARMUP, as make demo)"),
        Row(S11, "  cold first token / tinygrad's", ratio(cold["ttft_s"], tg["ttft_s"]), "x", 1.0, at_most=True),
        Row(S11, f"pp-pipeline {n} stages: first token, restarted", restart["ttft_s"], "s",
            note=f"caches kept (compiled forwards, tinygrad's kernels); ready after {restart['ready_s']:.1f} s"),
        Row(S11, "  restart first token / tinygrad's cold one", ratio(restart["ttft_s"], tg["ttft_s"]), "x", 0.2,
            at_most=True),
        Row(S11, "  first generation's decode / tinygrad's steady", ratio(cold["first_tps"], tg["steady_tps"]), "x",
            0.5, note=f"{cold['first_tps']:.0f} tok/s over {c['decode']} tokens of the cold run"),
        Row(S11, "pp-serve: first burst of streams", srv["first_burst_s"], "s",
            note=f"listening after {srv['listening_s']:.1f} s; the same burst warm: {srv['warm_burst_s']:.2f} s"),
        Row(S11, "  first burst / warm burst", ratio(srv["first_burst_s"], srv["warm_burst_s"]), "x", 2.0,
            at_most=True),
    ]


def thread_rows(files: dict[str, dict[str, Any]] | None) -> list[Row]:
    """Section 12 (issue 32): what every core buys a stage whose weights stream from memory, a file at a time."""
    if not files:
        return [Row(S12, "decode call", None, "x", note="not measured (section threads not run, or it failed)")]
    rows = []
    for t in files.values():
        one, most = (min(t["call_ms"], key=int), max(t["call_ms"], key=int))
        rate = t["file_bytes"] / 2 / (statistics.median(t["call_ms"][most]) / 1000) / 1e9  # the stage reads ~half
        rate = t.get("gb_per_s", {}).get(most, rate)  # its held weights over the median call, where measured
        first = f"; {t['vs_first'][most]}x the first file's bytes/s in the same rounds" if "vs_first" in t else ""
        rows += [
            Row(S12, f"{t['model']}: stage 1 of 2, decode call on {one} thread",
                statistics.median(t["call_ms"][one]), "ms"),
            Row(S12, f"  the same on {most} threads", statistics.median(t["call_ms"][most]), "ms",
                note=f"~{rate:.1f} GB/s of its share{first}; {t['cpus']} CPUs here"),
            Row(S12, f"  {most} threads / {one}: call rate, median of rounds in turn", t["ratio"], "x",
                1.6 if int(most) == 2 else None, note=f"rounds {t['ratios']}"),
        ]
        if "read_ratio" in t:  # the memory's own ratio, in the same rounds: the most a streaming stage can gain
            rows.append(Row(S12, f"  a bare read of memory, {most} threads / {one}", t["read_ratio"], "x",
                            note=f"{t['read_gb_per_s'][most]} GB/s on {most}, {t['read_gb_per_s'][one]} on {one}"))
    return rows


def serve_memory(m: dict[str, Any] | None) -> list[Row]:
    """Section 13 (issue 35): each stage's memory after 8 concurrent completions, the context offered, the start."""
    if not m or "background" not in m:
        return [Row(S13, "pp-serve memory", None, "MiB", note="not measured (section servemem not run, or it failed)")]
    srv, floor, mib = m["background"], m["floor_mb"], 1 << 20
    rows = []
    for i, st in enumerate(srv["stages"]):
        w = st["weight_bytes"] / mib
        rows.append(Row(S13, f"stage {i} RSS after {m['slots']} x {m['tokens']}-token completions", st["rss_mb"],
                        "MiB", w + floor + 64, at_most=True,
                        note=f"weights {w:.0f} + floor {floor:.0f} + 64; peak {number(st['hwm_mb'])} MiB; KV "
                             f"{st['kv_pages_used']} pages used, {st['kv_pages_touched']} touched of "
                             f"{st['kv_pages_used'] + st['kv_pages_free']} ({st['kv_page_bytes'] / mib:.1f} MiB each, "
                             f"{st['kv_dtype']})"))
    offered = min(st["max_context"] for st in srv["stages"])
    rows.append(Row(S13, "max context offered / the model's own", ratio(offered, m["context"]), "x", 1.0,
                    note=f"{offered} of {m['context']}"))
    ttft = m["pipeline"]["ttft_s"]
    rows.append(Row(S13, "pp-serve cold start to /health ok", srv["ok_s"], "s", 2 * ttft, at_most=True,
                    note=f"2x pp-pipeline's cold first token ({ttft:.1f} s); /health said {srv['health']!r}"))
    rows.append(Row(S13, "  8 completions at once, compiling in the background", srv["burst_s"], "s",
                    note="right after /health said ok"))
    if od := m.get("on_demand"):
        rows.append(Row(S13, "  the same, compiling each size at its first use", od["burst_s"], "s",
                        note=f"PP_WARMUP=0; /health ok after {od['ok_s']:.1f} s"))
    return rows


def moe_rows(m: dict[str, Any] | None) -> list[Row]:
    """Section 14 (issue 34): decode of a qwen3moe file against a dense model of the same dims and parameters (only
    the routed experts read: target 2.5x) and against llama.cpp's one process on the same file (target 0.8x)."""
    if not m or "rounds" not in m:
        return [Row(S14, "MoE decode", None, "tok/s", note="not measured (section moe not run, or it failed)")]
    tps, b, n = m["tps"], m["bytes"], len(m["rounds"])
    key = f"pp{m['stages']}"
    read = {k: f"reads ~{v['read_per_token'] / MIB:.0f} of {v['file'] / MIB:.0f} MiB a token" for k, v in b.items()}
    rows = [Row(S14, f"{m['model']}, {m['stages']} stages", tps.get(f"{key} moe"), "tok/s",
                note=f"{_params(m['params']['moe'])} parameters; {read['moe']}"),
            Row(S14, f"  dense twin {m['dense_model']}", tps.get(f"{key} dense"), "tok/s",
                note=f"{_params(m['params']['dense'])} parameters; {read['dense']}"),
            Row(S14, "MoE / dense decode", m["moe_over_dense"], "x", 2.5,
                note=f"median of {n} rounds in turn; bytes read a token: dense / MoE "
                     f"{b['dense']['read_per_token'] / b['moe']['read_per_token']:.1f}x")]
    if calls := m.get("call_ms"):
        rows.append(Row(S14, "  last stage's decode call, dense / MoE, in one process", m["call_ratio"], "x",
                        note=f"median of {len(calls['moe'])} rounds in turn; MoE {statistics.median(calls['moe']):.2f}"
                             f" ms, dense {statistics.median(calls['dense']):.2f} ms"))
    if m.get("peers_skipped"):
        rows.append(Row(S14, "MoE 2 stages / llama.cpp", None, "x", 0.8, note=m["peers_skipped"]))
    else:
        rows += [Row(S14, "  llama.cpp one process, MoE file", tps.get("llama.cpp moe"), "tok/s",
                     note=m.get("peer_info") or ""),
                 Row(S14, f"MoE {m['stages']} stages / llama.cpp", m["moe_over_llama_cpp"], "x", 0.8,
                     note=f"median of {n} rounds in turn")]
        if check := m.get("peer_check"):
            rows.append(Row(S14, "  greedy tokens equal to llama.cpp's before the first divergence",
                            check["agree_before_divergence"] / check["tokens"], "x",
                            note=f"{check['agree_before_divergence']} of {check['tokens']}; the prompt's ids "
                                 f"{'equal' if check['prompt_ids_equal'] else 'DIFFERENT'} by both tokenizers"))
    for g in m.get("gemma3_peer", []):
        rows.append(Row(S14, f"gemma3 {g['file']}: llama.cpp's greedy tokens equal 2 stages'", float(g["greedy_equal"]),
                        "x", note=f"tokenizer {'equal' if g['tokenizer_equal'] else 'DIFFERENT'}; llama.cpp's logits "
                                  f"{g['max_abs_logit_diff_vs_float64']} from float64, argmax "
                                  f"{'equal' if g['argmax_equal'] else 'not always equal'} at every position"))
    return rows


# issue 33: 2 stages / llama.cpp (the AVX-512 build) on the same 1.1B file; AVX2 (our clang without AVX-512 against
# llama.cpp's AVX2 build): Q4_K_M only; Q4_K_M's bytes/s >= 0.8x the F16 file's (the memory wall)
MEMWALL_PEER_TARGETS = {"avx512": {"F16": 1.0, "Q8_0": 1.0, "Q4_K_M": 1.0, "Q5_K_M": 1.0, "Q6_K": 1.0},
                        "avx2": {"Q4_K_M": 1.0}}
MEMWALL_WALL_TARGETS = {"Q4_K_M": 0.8}
GB = 1e9


def memwall_rows(m: dict[str, Any] | None) -> list[Row]:
    """Section 15 (issue 33): each file's 2-stage decode against llama.cpp's, in rounds taken in turn, and the bytes
    a token streams times tokens/s against the F16 file's."""
    if not m or not m.get("rows"):
        note = (m or {}).get("peers_skipped") or "not measured (section memwall not run, or it failed)"
        return [Row(S15, "memwall", None, "tok/s", note=note)]
    rows: list[Row] = []
    for key, r in m["rows"].items():
        dt, build, label = r["dtype"], r["build"], r.get("label", "")
        f = m["files"][dt]
        ours, theirs = statistics.median(r["pp2_tps"]), statistics.median(r["peer_tps"])
        clang = " (our clang without AVX-512)" if r.get("clang") == "no-avx512" else ""
        tree = f" [{label}]" if label else ""
        rows.append(Row(S15, f"{key}: {dt} file ({f['file_bytes'] / MIB:.0f} MiB, {f['quantizer']}), 2 stages{clang}"
                             f"{tree}", ours, "tok/s", note=f"median of {len(r['pp2_tps'])} rounds"))
        rows.append(Row(S15, f"  llama.cpp one process, {r['build_name']} build", theirs, "tok/s",
                        note=(r.get("peer_info") or "")[:160]))
        ratios = [x for x in r["ratios"] if x]
        rows.append(Row(S15, f"  {key}: 2 stages / llama.cpp", statistics.median(ratios) if ratios else None, "x",
                        MEMWALL_PEER_TARGETS.get(build, {}).get(dt),
                        note="median of the rounds' ratios, both decoding the same file in turn"))
        rate = ours * f["streamed_bytes"]
        rows.append(Row(S15, f"  {key}: effective bytes/s (2 stages)", rate / GB, "GB/s",
                        note=f"{f['streamed_bytes'] / MIB:.0f} MiB a token (all but the token embedding) x tok/s; "
                             f"llama.cpp's {theirs * f['streamed_bytes'] / GB:.1f} GB/s"))
        ref = m["rows"].get(" ".join(x for x in ("F16", build) if x)) if dt != "F16" else None
        if ref is not None:
            f16 = statistics.median(ref["pp2_tps"]) * m["files"]["F16"]["streamed_bytes"]
            rows.append(Row(S15, f"  {key}: bytes/s / the F16 file's", rate / f16, "x",
                            MEMWALL_WALL_TARGETS.get(dt) if build != "avx2" else None,
                            note="against F16's 2 stages on the same build, its row measured before this one"))
    for what in ("avx2_skipped",):
        if m.get(what):
            rows.append(Row(S15, "AVX2 rows", None, "tok/s", note=m[what]))
    return rows


def reuse_rows(r: dict[str, Any] | None) -> list[Row]:
    """Section 17: each turn's time to first token with reuse and without, the turns after the first and the
    identical repeat against the first turn (the target), then 8 clients chatting at once."""
    if not r or "on" not in r:
        return [Row(S17, "prefix reuse", None, "s", note="not measured (section reuse not run, or it failed)")]
    sec = f"{S17} ({r['model']}, context {r['context']}), {r['stages']} stages, {r['max_tokens']}-token answers"
    on, off = r["on"], r["off"]
    first = on["turns"][0]["ttft_s"]
    rows = [Row(sec, f"turn 1 ({on['turns'][0]['prompt_tokens']} prompt tokens): first token, reuse on / off",
                first, "s", note=f"off: {off['turns'][0]['ttft_s']:.3f} s")]
    for i, (a, b) in enumerate(zip(on["turns"][1:], off["turns"][1:], strict=True), start=2):
        rows.append(Row(sec, f"  turn {i} / turn 1, reuse on", ratio(a["ttft_s"], first), "x", REUSE_TARGET,
                        at_most=True, note=f"{a['ttft_s']:.3f} s, {a['cached_tokens']} of {a['prompt_tokens']} "
                                           f"prompt tokens reused; off: {b['ttft_s']:.3f} s"))
    rows.append(Row(sec, "  identical repeat / turn 1, reuse on", ratio(on["repeat"]["ttft_s"], first), "x",
                    REUSE_TARGET, at_most=True, note=f"{on['repeat']['ttft_s']:.3f} s; off: "
                                                     f"{off['repeat']['ttft_s']:.3f} s"))
    for mode in ("on", "off"):
        c = r.get(f"clients_{mode}")
        if c:
            turns = ", ".join(f"{t:.2f}" for t in c["median_ttft_s"])
            rows.append(Row(sec, f"{r['clients']} chats at once, reuse {mode}: wall", c["wall_s"], "s",
                            note=f"median first token per turn: {turns} s"))
    return rows


PREFILL_PEER_TARGETS = {512: 1.0}  # issue 51: pp512 at llama.cpp's speed (its AVX-512 build)


def prefill_ratios(t: dict[str, list[float]]) -> list[float]:
    """Each round's prefill tokens/s of the pipeline over llama.cpp's (its time over ours)."""
    return [theirs / ours for ours, theirs in zip(t["ours_s"], t["peer_s"], strict=True) if ours > 0]


def tokens_per_s(n: int, seconds: list[float]) -> float | None:
    return n / statistics.median(seconds) if seconds else None


def _prefill_target(r: dict[str, Any]) -> bool:
    """Whether a prefill row has issue 51's target: against llama.cpp's AVX-512 build, or an AVX2 row (its kernels
    compiled without AVX-512, against llama.cpp's AVX2 build)."""
    return r["build"] == "avx512" or r.get("clang") == "no-avx512"


def prefill_rows(m: dict[str, Any] | None) -> list[Row]:
    """Section 19 (issue 51): each file's prompt lengths, the pipeline's tokens/s of prefill against llama.cpp's,
    the ratio the median of the rounds' ratios."""
    if not m or not m.get("rows"):
        note = (m or {}).get("peers_skipped") or "not measured (section prefill not run, or it failed)"
        return [Row(S19, "prefill", None, "tok/s", note=note)]
    rows: list[Row] = []
    for key, r in m["rows"].items():
        f = m["files"][key]
        for n, t in r["lengths"].items():
            ours, theirs = tokens_per_s(int(n), t["ours_s"]), tokens_per_s(int(n), t["peer_s"])
            rows.append(Row(S19, f"{key} pp{n}: 2 stages ({f['quantizer']}, {f['file_bytes'] / MIB:.0f} MiB)", ours,
                            "tok/s", note=f"median of {len(t['ours_s'])} rounds"))
            rows.append(Row(S19, f"  {key} pp{n}: llama.cpp one process, {r['build_name']} build", theirs, "tok/s"))
            rs = prefill_ratios(t)
            rows.append(Row(S19, f"  {key} pp{n}: 2 stages / llama.cpp", statistics.median(rs) if rs else None, "x",
                            PREFILL_PEER_TARGETS.get(int(n)) if _prefill_target(r) else None,
                            note="median of the rounds' ratios, the same prompt in turn"))
    return rows
