"""Smoke tests of the bench's pure parts: tiny counts, structure only, never a timing assertion."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_cuda_graph import tinygrads_own_count

from bench import gpu, links, memwall, models, pipe, report, reuse, run, solo, wire
from bench.pipe import Tokens
from bench.rows import Row, render, summary, to_json, write_results
from pp_worker.driver.generation import Generation
from pp_worker.driver.pipeline import Pipeline
from pp_worker.driver.stage_proc import Launch
from pp_worker.testing.modelgen import PRESETS, builtin_vocab, generate, tensor_types
from pp_worker.wire import to_line


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("bench") / "tiny.gguf", preset="tiny")


def test_codec_rate_round_trips_a_payload() -> None:
    p = wire.codec_rate(seq_len=8, hidden_dim=64, reps=2)
    assert p.mb == 8 * 64 * 2 / 1e6 and p.seconds > 0 and p.mb_per_s > 0


def test_q8_codec_and_echo_round_trip() -> None:
    p = wire.codec_rate(seq_len=8, hidden_dim=64, reps=2, dtype="q8")
    assert p.mb == 8 * 64 * 2 / 1e6 and p.mb_per_s > 0  # MB of the fp16 state it carries
    assert wire.payload_chars("q8", 64) < wire.payload_chars("f16", 64)
    e = wire.RawWorker.echo(64, "q8")
    try:
        reply = e.request(wire.hop(3, 64, dtype="q8"))
        assert reply["hidden_dtype"] == "q8" and len(reply["hidden_b64"]) == 4 * 3 * (64 + 4) // 3
        assert wire.round_trip_rate(e, 4, 64, 2, "q8").mb_per_s > 0
    finally:
        e.close()


def test_agreement_counts_the_prefix_and_every_position() -> None:
    a = pipe.agreement([[1, 2, 3, 4], [5, 6, 7], [1, 1, 1, 1]], [[1, 2, 9, 4], [5, 6, 7], [2, 1, 1, 1]], 4)
    assert a.first_divergence == [2, 4, 0]  # [5, 6, 7] stopped at an EOS in both runs: identical throughout
    assert a.identical == [3, 4, 3]
    assert a.prefix_fraction == pytest.approx(6 / 12) and a.overall_fraction == pytest.approx(10 / 12)
    assert pipe.agreement([[1, 2]], [[1]], 2).first_divergence == [1]  # one run ended early, the other did not


def test_stub_round_trips_one_at_a_time_and_pipelined() -> None:
    where = next(iter(wire.placements().values()), (None, None))
    with wire.client_on(where[0]):
        assert wire.pipe_floor_rate(20, where[1]) > 0
        w = wire.RawWorker.stub(1, 3, cpu=where[1])
    try:
        assert wire.sequential_rate(w, 20) > 0
        assert wire.pipelined_rate(w, 50) > 0
        assert wire.round_trip_rate(w, 4, wire.STUB_HIDDEN, 2).mb_per_s > 0
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_echo_worker_hands_the_payload_back() -> None:
    e = wire.RawWorker.echo(64)
    try:
        assert e.request(wire.hop(3, 64))["hidden_b64"] == wire.hop(3, 64)["hidden_b64"]
        assert "error" in json.loads(_raw_request(e, wire.hop(3, 32)))  # still validates the payload length
    finally:
        e.close()


def _raw_request(w: wire.RawWorker, obj: dict) -> bytes:
    w.stdin.write(to_line(obj))
    w.stdin.flush()
    return w.line()


def test_token_rates_from_arrival_times() -> None:
    t = Tokens([1.0, 1.1, 1.2, 1.3, 1.5])
    assert t.decoded == 4 and t.tps == pytest.approx(8.0) and t.p50_ms == pytest.approx(100.0)
    assert Tokens([]).tps == 0.0 and Tokens([2.0]).tps == 0.0


def test_stage_shares_add_up_to_the_model(tiny_model: Path) -> None:
    f = models.facts(tiny_model)
    for n in (2, 4):
        shares = models.stage_shares(tiny_model, n, f.context)
        assert sum(w for w, _ in shares) == f.params * models.WEIGHT_BYTES
        assert sum(kv for _, kv in shares) == f.kv_bytes(f.n_blocks, f.context)


def test_fixed_length_prompts(tiny_model: Path) -> None:
    prompts = models.fixed_length_prompts(tiny_model, 12, 3)
    tok = models.tokenizer(tiny_model)
    assert len(set(prompts)) == 3 and all(len(tok.encode(p)) == 12 for p in prompts)


def fake_raw() -> dict:
    decode = {"decoded": 4, "tps": 20.0, "p50_ms": 50.0, "times_s": [0, 0.05, 0.1, 0.15, 0.2]}
    agg = {"tps": 30.0, "overall_tps": 25.0, "window_s": 1.0, "tokens_in_window": 30}
    return {
        "solo": {"idle": {"peak_rss_mb": 100.0}, "lazy": {"decode": decode, "peak_rss_mb": 150.0, "ttft_s": {"8": 0.1}},
                 "realize": {"decode": decode | {"tps": 18.0}, "peak_rss_mb": 160.0, "ttft_s": {"8": 0.2}}},
        "pp2": {"decode": decode, "peak_rss_mb": [120.0, 121.0], "k": {"1": agg, "4": agg | {"tps": 60.0}},
                "ttft_s": {"8": [0.1, 0.12]},
                "side": {"mode": "lazy", "solo_tps": [20.0, 21.0, 19.0], "tps": [18.0, 20.37, 19.0],
                         "ratios": [0.9, 0.97, 1.0]}},
        "pp3": {"decode": decode | {"tps": 15.0},
                "prefill": {"prompt_tokens": 8, "stage_s": [1.0, 1.0, 2.0], "whole_ttft_s": 4.1,
                            "pipelined_ttft_s": 3.8, "stage_cpu_s": [1.9, 1.9, 3.8], "cores": 2, "ratio": 0.95,
                            "cores_busy": 0.95}},
        "pinned": {"pp3": {"prefill": {"prompt_tokens": 8, "stage_s": [1.0, 1.0, 2.0], "whole_ttft_s": 4.1,
                                       "pipelined_ttft_s": 2.2, "stage_cpu_s": [1.0, 1.0, 2.0], "cores": 2,
                                       "ratio": 0.55, "cores_busy": 0.5}}},
        "beam": {"width": 2, "ready_s": {"0": 90.0, "1": 20.0}, "beam": [decode | {"tps": 26.0}],
                 "plain": [decode], "ratio_rounds": [1.3]},
        "unjit": {"decode": decode | {"tps": 2.0}},
        "wire": {"pipe_floor_rt_s": {"one CPU": 9e4}, "sequential_rt_s": {"one CPU": 1e4, "two CPUs": 3e4},
                 "pipelined_rt_s": 30000.0, "codec": {"mb_per_s": 300.0},
                 "echo": {"mb_per_s": 600.0}},
        "q8": {"payload_hidden_dim": 4096, "b64_chars_per_token": {"f16": 10924, "q8": 5468},
               "codec": {"f16": {"mb_per_s": 2000.0}, "q8": {"mb_per_s": 100.0}},
               "echo": {"f16": {"mb_per_s": 160.0}},  # the q8 round trip failed: its rows say n/a
               "pp2": {"n": 4, "first_divergence": [4, 2], "identical": [4, 3], "prefix_fraction": 0.75,
                       "overall_fraction": 0.875, "hidden_dim": 64, "b64_chars_per_token": {"f16": 172, "q8": 92}}},
        "quant": {"file_bytes": {"F16": 2 << 20, "Q8_0": 1 << 20, "Q4_K_M": 1 << 19}, "prefill_tokens": 512,
                  "rounds": [{"pp2 F16": 100.0, "pp2 Q8_0": 150.0, "pp2 Q4_K_M": 160.0, "llama.cpp F16": 180.0,
                              "llama.cpp Q8_0": 270.0},
                             {"pp2 F16": 100.0, "pp2 Q8_0": 130.0, "pp2 Q4_K_M": 170.0, "llama.cpp F16": 220.0,
                              "llama.cpp Q8_0": 264.0}],
                  "prefill_s": {"F16": [1.0, 1.2], "Q8_0": [1.5, 1.4]}, "load_s": {"F16": [2.0], "Q8_0": [1.9]},
                  "ready_s": {"F16": [2.5, 2.7, 2.6], "Q8_0": [2.4]},
                  "peak_rss_mb": {"F16": [200.0, 201.0], "Q8_0": [150.0, 151.0]}, "peer_info": {"F16": "AVX2"}},
        "qrss": {"max_context": 64, "Q4_0": {"file_bytes": 100 << 20, "idle": {"peak_rss_mb": 140.0},
                                             "pp2": {"file_share": [50 << 20, 50 << 20], "kv": [1 << 20, 1 << 20],
                                                     "peak_rss_mb": [250.0, 260.0]}}},
        "cold": {"stages": 3, "decode": 48, "tinygrad": {"ttft_s": 10.0, "first_tps": 20.0, "steady_tps": 200.0},
                 "cold": {"ready_s": 2.0, "ttft_s": 8.0, "first_tps": 150.0},
                 "restart": {"ready_s": 1.0, "ttft_s": 3.0, "first_tps": 300.0},
                 "serve": {"listening_s": 5.0, "first_burst_s": 3.0, "warm_burst_s": 2.0}},
        "moe": {"model": "qwen3moe-bench-s0-Q8_0.gguf", "dense_model": "qwen3moe-bench-dense-s0-Q8_0.gguf",
                "stages": 2, "params": {"moe": 60_000_000, "dense": 60_000_000},
                "bytes": {"moe": {"file": 64 << 20, "read_per_token": 12 << 20},
                          "dense": {"file": 64 << 20, "read_per_token": 60 << 20}},
                "rounds": [{"pp2 moe": 90.0, "pp2 dense": 30.0}, {"pp2 moe": 80.0, "pp2 dense": 40.0}],
                "tps": {"pp2 moe": 85.0, "pp2 dense": 35.0}, "moe_over_dense": 2.5, "moe_over_llama_cpp": None,
                "call_ms": {"moe": [1.0, 0.9], "dense": [5.0, 4.8]}, "call_ratio": 5.1,
                "peers_skipped": "llama.cpp not built: run make peers"},
        "memwall": fake_memwall(),
        "prefill": fake_prefill(),
    }


def fake_prefill() -> dict:
    """Section 19: the small model's F16 file at two prompt lengths, and an AVX2 row, as bench.prefill writes them."""
    smol = {"name": "smol-s0-F16.gguf", "file_bytes": 260 << 20, "quantizer": "modelgen"}
    return {"rounds": 3, "threads": 2, "files": {"smol F16": smol, "smol F16 avx2": smol},
            "rows": {"smol F16": {"build": "avx512", "build_name": "AVX-512 + VNNI", "lengths": {
                "128": {"ours_s": [0.5, 0.4, 0.6], "peer_s": [0.4, 0.4, 0.3]},
                "512": {"ours_s": [2.0, 1.0, 1.6], "peer_s": [1.0, 1.5, 2.0]}}},
                "smol F16 avx2": {"build": "avx2", "build_name": "AVX2", "clang": "no-avx512", "lengths": {
                    "512": {"ours_s": [2.0, 2.0], "peer_s": [1.0, 3.0]}}}}}


def fake_memwall() -> dict:
    """Section 15: an F16 and a Q4_K_M row on the AVX-512 build, Q4_K_M on the AVX2 one, and Q4_K_M from another
    tree (labelled), as bench.memwall writes them."""
    mib = 1 << 20
    files = {"F16": {"file_bytes": 2100 * mib, "streamed_bytes": 2000 * mib, "quantizer": "modelgen"},
             "Q4_K_M": {"file_bytes": 640 * mib, "streamed_bytes": 600 * mib, "quantizer": "llama.cpp"}}

    def row(dt: str, build: str, ours: list[float], theirs: list[float], **extra: str) -> dict:
        return {"dtype": dt, "build": build, "build_name": {"avx512": "AVX-512 + VNNI", "avx2": "AVX2"}[build],
                "pp2_tps": ours, "peer_tps": theirs, "ratios": [a / b for a, b in zip(ours, theirs, strict=True)],
                "peer_info": f"llama.cpp {build}", "label": "", **extra}

    return {"model": "tinyllama-s0-F16.gguf", "files": files, "rows": {
        "F16 avx512": row("F16", "avx512", [12.0, 10.0, 11.0], [11.0, 10.0, 10.0]),
        "Q4_K_M avx512": row("Q4_K_M", "avx512", [22.0, 20.0, 30.0], [27.0, 25.0, 25.0]),
        "Q4_K_M avx2": row("Q4_K_M", "avx2", [8.0, 9.0], [23.0, 20.0], clang="no-avx512"),
        "Q4_K_M avx512 int8": row("Q4_K_M", "avx512", [33.0, 36.0, 30.0], [27.0, 30.0, 30.0], label="int8")}}


def test_report_table_and_json(tmp_path: Path, tiny_model: Path) -> None:
    f = models.facts(tiny_model)
    shares = {n: models.stage_shares(tiny_model, n, f.context) for n in (2, 4)}
    rows = report.build(fake_raw(), f, shares)
    by_name = {r.name.strip(): r for r in rows}
    two = by_name["2 stages / one process"]
    assert two.value == pytest.approx(0.97) and two.verdict == "PASS"  # the median of the interleaved rounds
    assert "measured apart: 1x the fastest (lazy)" in two.note
    three = by_name["3 stages / one process"]  # no interleaved rounds: the ratio measured apart, to the fastest mode
    assert three.value == pytest.approx(0.75) and three.verdict == "MISS"
    pipelined = [r for r in rows if r.name.strip() == "pipelined / sum of the stages' prefill times"]
    assert [(r.value, r.target_text, r.verdict) for r in pipelined] == [(0.95, "<= 0.6", "MISS"),
                                                                          (0.55, "<= 0.6", "PASS")]
    assert [r.value for r in rows if r.name.strip() == "cores busy, the prompt sent whole"] == [0.95, 0.5]
    assert by_name["PP_BEAM=2 / without"].value == pytest.approx(1.3)
    assert by_name["ours / unjitted"].value == pytest.approx(10.0)
    assert by_name["K=4 / K=1"].value == pytest.approx(2.0)
    assert by_name["decode hop, 1 in flight, one CPU"].verdict == "MISS"
    assert by_name["decode hop, 1 in flight, two CPUs"].verdict == "PASS"
    assert by_name["bare pipe echo, 1 in flight, one CPU"].verdict == ""  # context, no target
    assert by_name["4 stages: stage 0"].verdict == "n/a"  # no 4-stage data: not measured, not missed
    assert {r.section.split()[0] for r in rows} == {str(i) for i in range(1, 20)}
    assert by_name["MoE / dense decode"].verdict == "PASS" and "dense / MoE 5.0x" in by_name["MoE / dense decode"].note
    assert by_name["last stage's decode call, dense / MoE, in one process"].value == pytest.approx(5.1)
    no_peer = by_name["MoE 2 stages / llama.cpp"]  # no llama.cpp: n/a with the reason, not a miss
    assert no_peer.verdict == "n/a" and "make peers" in no_peer.note
    assert report.moe_rows(None)[0].value is None  # the section did not run: one n/a row, no crash
    with_peer = fake_raw()["moe"] | {"peers_skipped": None, "moe_over_llama_cpp": 0.9, "peer_info": "AVX2",
                                     "peer_check": {"prompt_ids_equal": True, "tokens": 32,
                                                    "agree_before_divergence": 24}}
    moe = {r.name.strip(): r for r in report.moe_rows(with_peer)}
    assert moe["MoE 2 stages / llama.cpp"].verdict == "PASS"
    agree = moe["greedy tokens equal to llama.cpp's before the first divergence"]
    assert agree.value == pytest.approx(0.75) and "ids equal" in agree.note
    gemma = {"file": "gemma3-Q8_0.gguf", "tokenizer_equal": True, "max_abs_logit_diff_vs_float64": 0.49,
             "argmax_equal": False, "greedy_equal": False}
    (row,) = [r for r in report.moe_rows(with_peer | {"gemma3_peer": [gemma]}) if "gemma3" in r.name]
    assert row.value == 0.0 and "tokenizer equal" in row.note and "not always equal" in row.note
    wall = {r.name.strip(): r for r in rows if r.section.startswith("15 ")}
    q4 = wall["Q4_K_M avx512: 2 stages / llama.cpp"]  # the median of the rounds' ratios, not of the rates
    assert q4.value == pytest.approx(22 / 27) and q4.target == 1.0 and q4.verdict == "MISS"
    assert wall["F16 avx512: 2 stages / llama.cpp"].value == pytest.approx(12 / 11) and \
        wall["F16 avx512: 2 stages / llama.cpp"].verdict == "PASS"
    # bytes a token streams x the median tok/s, against the F16 file's on the same build: (600 x 22) / (2000 x 11)
    assert wall["Q4_K_M avx512: effective bytes/s (2 stages)"].value == pytest.approx(600 * (1 << 20) * 22 / 1e9)
    wall_q4 = wall["Q4_K_M avx512: bytes/s / the F16 file's"]
    assert wall_q4.value == pytest.approx(0.6) and wall_q4.target == 0.8 and wall_q4.verdict == "MISS"
    avx2 = wall["Q4_K_M avx2: 2 stages / llama.cpp"]
    assert avx2.value == pytest.approx((8 / 23 + 9 / 20) / 2) and avx2.target == 1.0
    assert "Q4_K_M avx2: bytes/s / the F16 file's" not in wall  # no F16 row on the AVX2 build: no reference
    assert any("our clang without AVX-512" in n for n in wall) and "llama.cpp one process, AVX2 build" in wall
    int8 = wall["Q4_K_M avx512 int8: bytes/s / the F16 file's"]  # another tree's row against this tree's F16
    assert int8.value == pytest.approx(600 * 33 / (2000 * 11)) and int8.verdict == "PASS"
    assert report.memwall_rows(None)[0].value is None
    pp = {r.name.strip(): r for r in rows if r.section.startswith("19 ")}
    pp512 = pp["smol F16 pp512: 2 stages / llama.cpp"]  # the median of the rounds' ratios: 0.5, 1.5, 1.25
    assert pp512.value == pytest.approx(1.25) and pp512.target == 1.0 and pp512.verdict == "PASS"
    assert pp["smol F16 pp128: 2 stages / llama.cpp"].value == pytest.approx(0.8)  # 0.8, 1.0, 0.5: no target
    assert pp["smol F16 pp128: 2 stages / llama.cpp"].target is None
    assert pp["smol F16 pp512: 2 stages (modelgen, 260 MiB)"].value == pytest.approx(512 / 1.6)
    assert pp["smol F16 pp512: llama.cpp one process, AVX-512 + VNNI build"].value == pytest.approx(512 / 1.5)
    pp_avx2 = pp["smol F16 avx2 pp512: 2 stages / llama.cpp"]  # 0.5, 1.5: issue 51's target on the AVX2 build too
    assert pp_avx2.value == pytest.approx(1.0) and pp_avx2.target == 1.0
    assert pp["smol F16 avx2 pp512: llama.cpp one process, AVX2 build"].value == pytest.approx(512 / 2.0)
    assert "make peers" in report.prefill_rows({"peers_skipped": "llama.cpp not built: run make peers"})[0].note
    assert "make peers" in report.memwall_rows({"peers_skipped": "llama.cpp not built: run make peers"})[0].note
    assert by_name["cold first token / tinygrad's"].value == pytest.approx(0.8)
    assert by_name["restart first token / tinygrad's cold one"].verdict == "MISS"  # 0.3 > 0.2
    assert by_name["first generation's decode / tinygrad's steady"].value == pytest.approx(0.75)
    assert by_name["first burst / warm burst"].value == pytest.approx(1.5)
    assert by_name["Q8_0 / F16 decode"].value == pytest.approx(1.4) and by_name["Q8_0 / F16 decode"].verdict == "PASS"
    assert by_name["2 stages / llama.cpp, F16"].value == pytest.approx((100 / 180 + 100 / 220) / 2)  # two rounds
    assert by_name["Q8_0 prefill speed / F16's"].value == pytest.approx(1.1 / 1.45)  # medians: F16 1.1 s, Q8_0 1.45
    assert by_name["Q8_0 prefill speed / F16's"].verdict == "MISS"
    assert by_name["Q8_0 / F16 load time"].verdict == "PASS"
    peer = by_name["llama.cpp Q8_0 / F16 decode"]  # llama.cpp's own gain, same rounds: context, no target
    assert peer.value == pytest.approx((270 / 180 + 264 / 220) / 2) and peer.verdict == ""
    assert by_name["2 stages / llama.cpp, Q8_0"].value == pytest.approx((150 / 270 + 130 / 264) / 2)
    q4 = by_name["Q4_K_M / F16 decode"]
    assert q4.value == pytest.approx(1.65) and q4.verdict == "PASS"
    assert not {"llama.cpp one process, Q4_K_M file", "llama.cpp Q4_K_M / F16 decode"} & set(by_name)  # no rounds
    assert by_name["F16: load, the slower of 2 stages"].note.endswith("process start to ready 2.60 s")  # the median
    stages = [r for r in rows if r.name.startswith("Q4_0 (100 MiB file), 2 stages")]
    assert [(r.value, r.target, r.verdict) for r in stages] == [(250.0, 254.0, "PASS"), (260.0, 254.0, "MISS")]
    assert by_name["2 stages: tokens identical before the first divergence"].value == 0.75
    assert by_name["3 stages: greedy agreement"].value is None  # not measured: n/a, no crash
    assert by_name["bytes per token, hidden 64: q8 / f16"].value == pytest.approx(92 / 172)
    assert by_name["bytes per token, hidden 4096: q8 / f16"].value == pytest.approx(5468 / 10924)
    assert by_name["codec in-process, 512x4096: q8 / f16"].value == pytest.approx(0.05)
    assert by_name["prefill round trip via a worker, 512x4096: q8 / f16"].value is None
    assert report.wire_q8(None)[0].value is None  # section 8 not run
    assert report.endpoint(None)[0].value is None  # section 7 not run: one n/a row
    table = render(rows)
    assert all(r.name in table for r in rows) and "PASS" in table and "MISS" in table
    doc = to_json(rows, {"quick": True})
    paths = write_results(doc, tmp_path, "stamp")
    assert [p.name for p in paths] == ["stamp.json", "latest.json"]
    back = json.loads(paths[1].read_text())
    assert back["summary"] == summary(rows) and len(back["rows"]) == len(rows)
    assert set(back["rows"][0]) >= {"section", "name", "value", "unit", "target", "target_text", "verdict", "note"}


def test_the_report_takes_each_section_as_run_stores_it_and_survives_one_that_failed(tiny_model: Path) -> None:
    """`run.attempt` keeps a section's measure() result in raw[section] (with its seconds): the report must read the
    threads section's files from there (a file's row), and a section that raised (raw[section] holding only its
    seconds) must leave every row of the table built, its own rows "not measured", never a crash after an hour of
    measuring."""
    f = models.facts(tiny_model)
    shares = {n: models.stage_shares(tiny_model, n, f.context) for n in (2, 4)}
    one = {"model": "m-F16.gguf", "file_bytes": 2_000_000, "call_ms": {"1": [4.0, 4.2], "2": [2.5, 2.4]},
           "gb_per_s": {"1": 0.25, "2": 0.4}, "ratio": 1.6, "ratios": [1.6, 1.75], "cpus": 2,
           "read_gb_per_s": {"1": 30.0, "2": 33.0}, "read_ratio": 1.1}
    raw: dict = {}
    run.attempt(raw, "threads", lambda out: out.update({"threads": {"F16": one}}))  # as threads.measure returns
    rows = [r for r in report.build(raw, f, shares) if r.section == report.S12]
    assert [r.value for r in rows[:3]] == [4.1, 2.45, 1.6] and rows[0].name.startswith("m-F16.gguf")

    def failed(out: dict) -> None:
        raise RuntimeError("boom")

    for section in run.SECTIONS:
        raw = {}
        run.attempt(raw, section, failed)
        assert raw["errors"] == {section: "RuntimeError: boom"} and set(raw[section]) == {"section_s"}
        rows = report.build(raw, f, shares)  # every section's rows: its own "not measured", none failing to build
        assert rows and not [r for r in rows if r.name == "its rows"], section
    # one that raised halfway, leaving what its rows cannot be built from: one n/a row says so, the others stand
    rows = report.build({"quant": {"files": {}, "section_s": 9.0}, "threads": {"threads": {"F16": one}}}, f, shares)
    broken = [r for r in rows if r.section == report.S9]
    assert len(broken) == 1 and broken[0].value is None and "KeyError: 'rounds'" in broken[0].note
    assert [r.value for r in rows if r.section == report.S12][:3] == [4.1, 2.45, 1.6]


def test_grammar_rows_bound_the_masks_share_of_a_step() -> None:
    from bench import grammar

    m = {"vocab": 151_936, "step_s": [0.001, 0.002, 0.003], "first_s": [2.5, 0.004, 0.006], "head_s": 0.04}
    rows = {r.name.strip(): r for r in grammar.rows(m)}
    share = rows["mask / head"]  # the mean step against the head's read
    assert share.value == pytest.approx(0.05) and share.verdict == "PASS" and share.at_most
    assert rows["an answer's first step (a new matcher)"].value == pytest.approx(5.0)  # the tokenizer's build apart
    assert grammar.rows(None)[0].value is None


def test_grammar_bench_vocabulary_is_distinct_tokens_and_an_eos() -> None:
    from bench import grammar

    v = grammar.vocabulary(1000)
    assert len(v.tokens) == len(set(v.tokens)) == 1000 and v.eos == [999] and v.tokens[999].startswith(b"\xff")


def fake_rss(tiny_model: Path) -> dict:
    f = models.facts(tiny_model)
    mib = 1 << 20
    shares = {"2": [(100 * mib, 0), (100 * mib, 0)], "4": [(50 * mib, 0)] * 4}
    model = {"preset": "rss", "params": f.params, "max_context": 64, "kv_whole": 0, "shares": shares}
    return {"model": model, "idle": {"peak_rss_mb": 100.0}, "solo": {"peak_rss_mb": 500.0},
            "pp2": {"peak_rss_mb": [120.0, 300.0]}}


def test_report_rss_model_rows(tiny_model: Path) -> None:
    rows = {r.name: r for r in report.big_memory(fake_rss(tiny_model))}
    assert rows["rss model, 2 stages: stage 0"].verdict == "PASS"  # 120 <= 130
    stage1 = rows["rss model, 2 stages: stage 1"]
    assert stage1.verdict == "MISS" and stage1.target == pytest.approx(130.0) and "(MISS net)" in stage1.note
    assert rows["rss model, 4 stages: stage 3"].verdict == "n/a"  # no 4-stage data
    assert rows["rss model: one process, whole model"].value == 500.0
    assert report.big_memory(None)[0].value is None  # the section did not run: one n/a row, no crash


def test_report_endpoint_rows() -> None:
    level = {"requests": 8, "tokens": 200, "wall_s": 4.0, "rps": 2.0, "tps": 50.0, "p50_s": 1.5}
    serve = {"model": "zen.gguf", "stages": 2, "max_tokens": 32, "levels": {"1": level, "8": level | {"rps": 6.0}}}
    rows = {r.name.strip(): r for r in report.endpoint(serve)}
    assert rows["8 concurrent client(s)"].value == 6.0 and rows["1 client(s): generated tokens"].value == 50.0
    assert "8 requests, 200 tokens in 4.00 s" in rows["1 concurrent client(s)"].note


def test_report_serve_memory_rows() -> None:
    stage = {"rss_mb": 250.0, "hwm_mb": 260.0, "weight_bytes": 83 << 20, "max_context": 8192, "kv_dtype": "float16",
             "kv_page_bytes": 3 << 20, "kv_pages_used": 0, "kv_pages_free": 240, "kv_pages_touched": 8}
    srv = {"ok_s": 20.0, "health": "ok", "burst_s": 30.0, "stages": [stage, stage | {"rss_mb": 300.0}]}
    raw = {"context": 8192, "slots": 8, "tokens": 48, "floor_mb": 140.0, "pipeline": {"ttft_s": 15.0},
           "background": srv, "on_demand": srv | {"burst_s": 90.0}}
    rows = {r.name.strip(): r for r in report.serve_memory(raw)}
    first, second = (rows[f"stage {i} RSS after 8 x 48-token completions"] for i in (0, 1))
    assert first.target == 83 + 140 + 64 and (first.verdict, second.verdict) == ("PASS", "MISS")
    assert rows["max context offered / the model's own"].value == 1.0
    assert rows["pp-serve cold start to /health ok"].target == 30.0
    assert rows["pp-serve cold start to /health ok"].verdict == "PASS"
    assert rows["the same, compiling each size at its first use"].value == 90.0
    assert report.serve_memory(None)[0].value is None


def test_prefill_overlap_and_how_busy_the_stages_kept_the_cores() -> None:
    pre = pipe.Prefill([1.0, 1.0, 2.0], 4.1, 3.8, [1.9, 1.9, 3.8], cores=2)
    assert pre.ratio == pytest.approx(3.8 / 4) and pre.cores_busy == pytest.approx(7.6 / (2 * 4))
    assert pipe.Prefill([1.0, 1.0, 2.0], 4.1, 3.8, [1.9, 1.9, 3.8], cores=4).cores_busy == pytest.approx(7.6 / 16)
    assert pipe.cpu_seconds(os.getpid()) > 0


def test_solo_server_answers_one_generation_per_request(tiny_model: Path, tmp_path: Path) -> None:
    tok = models.tokenizer(tiny_model)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"warmup": [tok.encode("hello there")], "decode": [], "ttft": []}))
    s = solo.Solo(str(tiny_model), str(prompts), 64, "lazy-tuned")
    try:
        times = [s.decode_times(tok.encode("hello world"), n) for n in (3, 5)]
    finally:
        s.close()
    assert [len(t) for t in times] == [4, 6] and all(a < b for t in times for a, b in zip(t, t[1:], strict=False))
    assert s.proc.returncode == 0


def test_row_verdicts() -> None:
    assert Row("s", "n", 5.0, "x", target=5.0).verdict == "PASS"
    assert Row("s", "n", 6.0, "MiB", target=5.0, at_most=True).verdict == "MISS"
    assert Row("s", "n", None, "x", target=1.0).verdict == "n/a"
    assert Row("s", "n", 1.0, "x").verdict == ""


def test_run_arguments() -> None:
    args = run.parse_args(["--quick", "--sections", "wire,solo"])
    assert args.quick and args.sections == ("wire", "solo")
    with pytest.raises(SystemExit):
        run.parse_args(["--sections", "nope"])
    assert "beam" in run.SECTIONS and "beam" not in run.parse_args([]).sections  # opt-in: a long first search
    assert {run.QUICK.preset, run.FULL.preset, run.QUICK.rss.preset, run.FULL.rss.preset} <= set(PRESETS)
    assert run.SECTIONS[-3:] == ("reuse", "links", "prefill") and run.parse_args(["--sections", "moe"]).sections == (
        "moe",)  # sections 17 to 19, each runnable alone
    assert "prefill" in run.parse_args([]).sections and run.FULL.prefill.lengths == (128, 512)
    assert "memwall" in run.parse_args([]).sections and run.FULL.memwall.preset == "tinyllama"
    assert {run.FULL.moe.preset, run.FULL.moe.dense} <= set(PRESETS)
    assert "reuse" in run.parse_args([]).sections and run.FULL.reuse.preset in PRESETS
    assert run.QUICK.reuse.preset is None  # the embedded model


def test_moe_bench_twins_have_the_same_dims_and_parameters() -> None:
    """Section 14's dense model: the MoE's blocks with one feed-forward as wide as all its experts together."""
    from pp_worker.testing.modelgen import param_count

    moe_spec, moe_merges = PRESETS[run.FULL.moe.preset]
    dense_spec, dense_merges = PRESETS[run.FULL.moe.dense]
    assert moe_merges == dense_merges and moe_spec.n_experts > 0 and dense_spec.n_experts == 0
    assert (moe_spec.dim, moe_spec.n_layers, moe_spec.n_heads, moe_spec.n_kv_heads) == \
        (dense_spec.dim, dense_spec.n_layers, dense_spec.n_heads, dense_spec.n_kv_heads)
    vocab = 256 + moe_merges + 3
    router = moe_spec.n_layers * moe_spec.n_experts * moe_spec.dim
    qk_norms = moe_spec.n_layers * 2 * moe_spec.head_dim
    assert param_count(moe_spec, vocab) - router - qk_norms == param_count(dense_spec, vocab)


@pytest.mark.parametrize("plan", [run.QUICK, run.FULL], ids=["quick", "full"])
def test_quant_files_hold_their_types(plan: run.Plan) -> None:
    """Section 9's files are what they are named: no matrix of a quantized file falls back to F16 for want of
    whole blocks (the quick plan's "small" preset, 128 wide, once made its K-quant files all F16)."""
    spec, merges = PRESETS[plan.quant.preset]
    vocab = len(builtin_vocab(merges).tokens)
    for dtype in plan.quant.dtypes:
        types = tensor_types(spec, vocab, dtype)
        if dtype != "F16":
            assert "F16" not in types.values(), (dtype, sorted(n for n, t in types.items() if t == "F16"))


def test_the_device_run_runs_every_step_and_gpu_check_every_section(tmp_path: Path) -> None:
    """``bench/device_run.sh --quick``: the GPU run's script on this machine's device and the tiny model, each step a
    ``make gpu-check`` (its quick mode); neither must rot between GPU runs."""
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("DEV", None)
    proc = subprocess.run(["bash", "bench/device_run.sh", "--quick"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=280)
    log = (tmp_path / "device.log").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"machine.txt", "device.log", "gpu-f16.json", "gpu-q8_0.json",
                                                    "gpu-q4_k_m.json"}
    doc = json.loads((tmp_path / "gpu-f16.json").read_text())
    assert "errors" not in doc["raw"]
    values = {r["name"]: r["value"] for r in doc["rows"]}
    assert None not in values.values(), [k for k, v in values.items() if v is None]
    assert values["2 stages: greedy tokens equal"] == values["interleaved == solo, 3 generations"] == 1.0
    assert "2 stages speed / fastest one process" in log and "sum of the parts" in log
    # the kernel rows against tinygrad's own account of the graphs it built for the same model's decode steps
    _, graphs = tinygrads_own_count(models.ensure_model(gpu.QUICK.preset), 2)
    assert values["kernels a token"] == sum(graphs) and values["launches a token (graphs and lone kernels)"] == 2
    assert len(graphs) == 2 and doc["raw"]["kernels"]["stages"][1]["kernels"] == graphs[1]
    for dtype in ("q8_0", "q4_k_m"):
        doc = json.loads((tmp_path / f"gpu-{dtype}.json").read_text())
        assert "errors" not in doc["raw"] and doc["plan"]["dtype"] == dtype.upper()
        assert doc["raw"]["kernels"]["kernels_per_token"] > 0 and doc["raw"]["kernels"]["launches_per_token"] == 2


def test_gpu_check_table_targets() -> None:
    raw = {"exact": {"pp2": {"max_dlogit": 0.01, "greedy_agree": 1.0, "kv_dtype": "float16"},
                     "pp3": {"max_dlogit": 0.05, "greedy_agree": 0.75},
                     "interleaved": {"same_tokens": True, "max_dlogit": 0.0}},
           "speed": {"lazy": {"ms_per_token": 25.0}, "realize": {"ms_per_token": 8.5}, "pp2": {"ms_per_token": 9.0},
                     "chain2": {"ms_per_token": 8.8}},
           "hop": {"d2h_ms": 0.02, "encode_ms": 0.01, "loop_ms": 0.08, "decode_ms": 0.01, "h2d_ms": 0.02}}
    table = gpu.rows(raw, gpu.FULL)
    rows = {r.name: r for r in table if not r.section.startswith("4")}
    assert rows["2 stages speed / fastest one process"].value == pytest.approx(8.5 / 9.0)  # realized is the bar
    assert rows["2 stages speed / fastest one process"].verdict == "PASS"
    assert rows["3 stages: max |dlogit|"].verdict == rows["3 stages: greedy tokens equal"].verdict == "MISS"
    assert rows["end to end: (2 stages - one process) / 2 hops"].value == pytest.approx(0.25)
    assert rows["sum of the parts"].value == pytest.approx(0.14) and rows["sum of the parts"].verdict == "PASS"
    assert rows["pp_worker 2 stages"].value == 9.0
    ttft = [r for r in table if r.section.startswith("4")]
    assert [r.unit for r in ttft] == ["s"] * 3 and all(r.value is None for r in ttft)  # not measured: n/a, no crash


def test_a_pinned_stage_runs_on_its_share_of_the_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "STAGE": "2", "NUM_STAGES": "3", "PP_WORKER_STUB": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.pinned"], env=env, cwd=Path(run.__file__).parent.parent,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready = next(json.loads(line) for line in proc.stdout if b'"ready"' in line)  # type: ignore[union-attr]
        assert ready["pid"] == proc.pid and os.sched_getaffinity(proc.pid) == {cpus[2 * len(cpus) // 3]}
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_peer_builds_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench.peer picks llama.cpp's AVX-512 build only where /proc/cpuinfo has every set it is built with: AVX-512's
    own, and the extensions its build turned on (an Ice Lake Xeon's build has no BF16 and runs there)."""
    from bench import peer

    builds = {name: tmp_path / name for name in ("avx2", "avx512")}
    monkeypatch.setattr(peer, "BUILDS", builds)
    builds["avx512"].mkdir(parents=True)
    (builds["avx512"] / ".cmake-args").write_text(
        "-DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF\n")
    icelake = "flags\t\t: fpu avx2 avx512f avx512cd avx512dq avx512bw avx512vl avx512vbmi avx512_vnni\n"
    assert peer.cpu_has_avx512(icelake) and peer.build_name("avx512") == "AVX-512 (VBMI, VNNI)"
    assert not peer.cpu_has_avx512(icelake.replace(" avx512vbmi", ""))  # Cascade Lake: no VBMI
    assert not peer.cpu_has_avx512("flags\t\t: fpu avx2\n")
    (builds["avx512"] / ".cmake-args").write_text("-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON\n")
    assert not peer.cpu_has_avx512(icelake) and peer.cpu_has_avx512(icelake.replace("\n", " avx512_bf16\n"))
    (builds["avx512"] / ".cmake-args").unlink()
    assert peer.default_build() is None and not peer.available()
    builds["avx2"].mkdir(parents=True)
    (builds["avx2"] / ".installed-stamp").touch()
    assert peer.default_build() == "avx2" and peer.available("avx2") and not peer.available("avx512")
    (builds["avx512"] / ".installed-stamp").touch()
    monkeypatch.setattr(peer, "cpu_has_avx512", lambda cpuinfo=None: False)
    assert peer.default_build() == "avx2"  # built, but this CPU would die on it
    monkeypatch.setattr(peer, "cpu_has_avx512", lambda cpuinfo=None: True)
    assert peer.default_build() == "avx512"
    assert peer.command(Path("m.gguf"), 2, 256)[0] == str(builds["avx512"] / "bin" / "python")
    assert peer.command(Path("m.gguf"), 2, 256, "avx2")[0] == str(builds["avx2"] / "bin" / "python")


def test_memwall_streamed_bytes_leave_out_the_token_embedding(tiny_model: Path) -> None:
    from bench import memwall
    from pp_worker.worker.gguf.header import read_header

    tensors = read_header(tiny_model).tensors
    every = sum(t.nbytes or 0 for t in tensors.values())
    assert memwall.streamed_bytes(tiny_model) == every - (tensors["token_embd.weight"].nbytes or 0) > 0


def test_threads_section_times_each_count_in_its_own_stage() -> None:
    """Section 12 on the tiny model: a stage per thread count, each reporting the count it runs (PP_THREADS as the
    engine's threads), rounds timed in turn; the rows carry the ratio and name the target only for 1 vs 2."""
    from bench import threads

    files = threads.measure(threads.ThreadsPlan(preset="tiny", dtypes=("F16", "Q8_0"), rounds=2, calls=3))["threads"]
    out = files["F16"]
    # the files in the same rounds: the second's bytes/s against the first's, per count (the reads are the rounds')
    assert "vs_first" not in out and set(files["Q8_0"]["vs_first"]) == {"1", "2"}
    assert all(v > 0 for v in files["Q8_0"]["vs_first"].values())
    assert files["Q8_0"]["read_gb_per_s"] == out["read_gb_per_s"]
    assert files["Q8_0"]["weight_bytes"] < out["weight_bytes"]
    assert out["ready_threads"] == {1: 1, 2: 2} and out["model"].endswith("-F16.gguf")
    assert out["gains"]["1"] == 1.0 and out["gains"]["2"] > 0
    assert all(len(v) == 2 and all(ms > 0 for ms in v) for v in out["call_ms"].values())
    # the stage's held weights over each count's median call: the bandwidth a decode call reads them at
    assert out["weight_bytes"] > 0 and set(out["gb_per_s"]) == {"1", "2"}
    ms = statistics.median(out["call_ms"]["1"])  # rounded to 1 us: the rate within that rounding and its own
    rate = out["weight_bytes"] / ms / 1e6
    assert abs(out["gb_per_s"]["1"] - rate) <= rate * 0.0006 / ms + 0.005
    # a bare read of memory by each count in the same rounds: what the machine's memory gives more threads
    assert set(out["read_gb_per_s"]) == {"1", "2"} and all(v > 0 for v in out["read_gb_per_s"].values())
    assert out["read_ratio"] > 0
    rows = report.thread_rows({"F16": out, "Q4_K_M": {**out, "model": "q.gguf", "ratio": 1.7,
                                                      "vs_first": {"1": 0.9, "2": 0.8}}})  # a row set a file
    assert "0.8x the first file's bytes/s" in rows[5].note and "first file" not in rows[1].note
    assert len(rows) == 8 and rows[2].value == out["ratio"] > 0 and rows[6].value == 1.7
    assert rows[3].value == out["read_ratio"] and rows[3].target is None and "bare read" in rows[3].name
    assert rows[4].name.startswith("q.gguf") and rows[2].target == rows[6].target == 1.6
    assert report.thread_rows(None)[0].value is None


def test_memwall_refuses_an_unknown_file_type_before_it_builds_anything(capsys) -> None:
    from bench import memwall

    with pytest.raises(SystemExit) as e:
        memwall.main(["--dtypes", "F16,none", "--avx2-dtypes", "Q4_K_M"])
    assert e.value.code == 2 and "unknown file types: none" in capsys.readouterr().err


def test_manycore_row_takes_each_rounds_ratio_against_llama_bench(tmp_path: Path) -> None:
    """bench.manycore's rounds: a stub pipeline against a stand-in llama-bench that records its command line and
    answers a fixed rate in llama-bench's JSON: the rounds alternate, each ratio is the pipeline's rate over that
    round's."""
    from bench import manycore

    calls = tmp_path / "calls"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + "
                    "'\\n')\nprint(json.dumps([{'avg_ts': 25.0, 'n_gen': 4}]))\n")
    fake.chmod(0o755)
    with Pipeline(Launch(2, stub=True), load_timeout=60.0, step_timeout=60.0, log=None) as p:  # its tokens are real
        row = manycore.measure_row(p, tmp_path / "m.gguf", fake, 3, rounds=2, decode=4, prompt="one two three")
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all(f"-m {tmp_path / 'm.gguf'} -p 0 -n 4 -t 3 -r 1 -o json" == line for line in lines)
    assert row["peer_tps"] == [25.0, 25.0] and len(row["pp2_tps"]) == 2 and all(t > 0 for t in row["pp2_tps"])
    assert row["ratios"] == pytest.approx([t / 25.0 for t in row["pp2_tps"]], rel=1e-3)
    assert row["ratio"] == statistics.median(row["ratios"]) and len(row["ready_threads"]) == 2


def test_manycore_refuses_a_missing_llama_bench_before_it_builds_anything(tmp_path: Path, capsys) -> None:
    from bench import manycore

    with pytest.raises(SystemExit) as e:
        manycore.main(["--llama-bench", str(tmp_path / "llama-bench")])
    assert e.value.code == 2 and "no llama-bench to run at" in capsys.readouterr().err


def _turn(ttft: float, cached: int, prompt: int) -> dict[str, float]:
    return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": prompt}


def test_report_reuse_rows() -> None:
    on = {"turns": [_turn(2.0, 0, 1000), _turn(0.2, 1000, 1030)], "repeat": _turn(0.1, 1029, 1030)}
    off = {"turns": [_turn(2.0, 0, 1000), _turn(2.1, 0, 1030)], "repeat": _turn(2.1, 0, 1030)}
    clients = {"wall_s": 9.0, "median_ttft_s": [3.0, 0.5], "max_ttft_s": [4.0, 0.6]}
    raw = {"model": "smol.gguf", "context": 8192, "stages": 2, "max_tokens": 8, "clients": 8, "on": on, "off": off,
           "clients_on": clients, "clients_off": clients | {"wall_s": 20.0}}
    rows = {r.name.strip(): r for r in report.reuse_rows(raw)}
    nxt, repeat = rows["turn 2 / turn 1, reuse on"], rows["identical repeat / turn 1, reuse on"]
    assert (nxt.value, nxt.target, nxt.verdict) == (pytest.approx(0.1), 0.25, "PASS") and "1000 of 1030" in nxt.note
    assert repeat.value == pytest.approx(0.05) and "off: 2.100 s" in repeat.note
    assert rows["8 chats at once, reuse off: wall"].value == 20.0
    assert report.reuse_rows(None)[0].value is None


def test_reuse_bench_runs_a_chat_through_pp_serve() -> None:
    """The section end to end on the embedded model, small: a turn after the first reuses the conversation with
    reuse on and nothing with it off; no timing is judged here."""
    out = reuse.measure(reuse.ReusePlan(turns=2, clients=2, max_tokens=4, first_turn=60))
    on, off = out["on"]["turns"], out["off"]["turns"]
    assert on[0]["cached_tokens"] == 0 and on[1]["cached_tokens"] >= on[0]["prompt_tokens"] // 2
    assert out["on"]["repeat"]["cached_tokens"] == out["on"]["repeat"]["prompt_tokens"] - 1
    assert all(t["cached_tokens"] == 0 for t in [*off, out["off"]["repeat"]])
    assert [len(out[f"clients_{m}"]["median_ttft_s"]) for m in ("on", "off")] == [2, 2]
def test_the_relay_hands_bytes_through_both_ways_and_the_commands_exit_status() -> None:
    relay = [sys.executable, str(links.RELAY), "--delay-ms", "2", "--rate-mbit", "50", "--"]
    data = bytes(range(256)) * 1000  # several chunks, each held back by the link
    done = subprocess.run([*relay, "cat"], input=data, capture_output=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, data)  # in order, whole, and the end of input reached cat
    assert subprocess.run([*relay, "sh", "-c", "exit 3"], input=b"", timeout=60).returncode == 3


def test_links_rows_set_the_issues_targets() -> None:
    def runs(plain: float, ngram: float, model: float | None = None) -> dict:
        out = {"plain": {"tok_s": plain, "drafted": 0, "kept": 0}, "ngram": {"tok_s": ngram, "drafted": 9, "kept": 6}}
        return out | ({"model": {"tok_s": model, "drafted": 9, "kept": 9}} if model is not None else {})

    smol = {"plan": {"model": "/x/smol-s0-F16.gguf"}, "delays": {"0": {"repetitive": {"8": runs(100, 200)}},
                                                                 "25": {"repetitive": {"8": runs(40, 90)}}}}
    raw = {"delays": {"0": {"repetitive": {"1": runs(100, 160, 120)}, "free": {"8": runs(400, 300, 390)}},
                      "25": {"repetitive": {"1": runs(10, 30, 20)}, "free": {"8": runs(360, 380, 370)}}},
           "then": smol}
    by_name = {r.name: r for r in links.rows(raw)}
    assert (by_name["0 ms, repetitive, 1 stream(s): ngram / plain"].value, by_name[
        "0 ms, repetitive, 1 stream(s): ngram / plain"].verdict) == (1.6, "PASS")
    assert by_name["0 ms, repetitive, 1 stream(s): model / plain"].verdict == "MISS"  # 1.2 < 1.3
    assert by_name["0 ms, free, 8 stream(s): ngram / plain"].verdict == "MISS"  # 0.75 < 0.95
    assert by_name["0 ms, free, 8 stream(s): model / plain"].verdict == "PASS"  # 0.975 >= 0.95
    assert by_name["25 ms, repetitive, 1 stream(s): ngram / plain"].target is None
    assert by_name["25 ms, free, 8 streams, plain: against plain at 0 ms"].value == pytest.approx(0.9)
    assert by_name["25 ms, free, 8 streams, model: against plain at 0 ms"].value == pytest.approx(370 / 400)
    assert by_name["smol-s0-F16.gguf, 25 ms, repetitive, 8 streams, ngram: against plain at 0 ms"].value == 0.9
    assert "smol-s0-F16.gguf, 0 ms, repetitive, 8 stream(s): model / plain" not in by_name  # no draft model there
    assert links.rows(None)[0].value is None


def test_links_ratio_is_the_median_of_the_rounds_ratios() -> None:
    """Arms that ran in turn compare round by round: plain's rounds 100, 200, 100 and ngram's 150, 210, 160 give
    ratios 1.5, 1.05, 1.6, so 1.5 (the medians' ratio, 160 / 100, would be 1.6)."""
    plain = {"tok_s": 100, "rounds_tok_s": [100, 200, 100], "drafted": 0, "kept": 0}
    ngram = {"tok_s": 160, "rounds_tok_s": [150, 210, 160], "drafted": 9, "kept": 9}
    raw = {"delays": {"0": {"repetitive": {"8": {"plain": plain, "ngram": ngram}}}}}
    assert {r.name: r for r in links.rows(raw)}["0 ms, repetitive, 8 stream(s): ngram / plain"].value == 1.5


def test_links_steady_rate_counts_the_tokens_after_the_last_streams_first() -> None:
    """Two streams: b's prompt ends at 2.0 s, while a decodes; from then on 3 tokens (a's at 2.5, b's at 2.5 and 3.0)
    come in 1 s, where `rate` counts a's earlier tokens over the whole span from 1.0 s."""
    a, b = links.stamped([Generation(0, "a", 1), Generation(1, "b", 2)])
    for g, times in ((a, [1.0, 1.5, 1.8, 2.5]), (b, [2.0, 2.5, 3.0])):
        for t in times:
            g.t_first, g.t_end = g.t_first or t, t
            g.tokens.append(7)
            g.on_token(g)
    assert links.steady_rate([a, b]) == pytest.approx(3.0)
    assert links.rate([a, b]) == pytest.approx(5 / 2.0)
    plain = {"tok_s": 100, "drafted": 0, "kept": 0, "steady_tok_s": 200}
    raw = {"delays": {"0": {"free": {"8": {"plain": plain, "ngram": plain | {"tok_s": 110, "steady_tok_s": 300}}}}}}
    assert "once every stream decodes: 1.50x" in {r.name: r for r in links.rows(raw)}[
        "0 ms, free, 8 stream(s): ngram / plain"].note


def test_links_local_rate_is_local_stages_without_the_relay() -> None:
    """What "against plain at 0 ms" compares with: the stages as a user runs them on one machine (no launcher, so
    auto's lock-step on the CPU), not the relay with nothing to delay (a launcher: the schedule of remote stages)."""
    assert links.launcher(0, 0) is None
    assert str(links.RELAY) in (links.launcher(25, 0) or "") and "--rate-mbit 10" in (links.launcher(0, 10) or "")
    assert "no relay" in links._far_rows({"0": {"free": {"8": {"plain": {"tok_s": 100}}}},
                                          "25": {"free": {"8": {"plain": {"tok_s": 50}}}}}, "", 2)[0].note


def test_links_far_rows_say_what_the_links_alone_allow() -> None:
    """8 streams of 1 token a trip behind 25 ms links to 2 stages: a trip crosses 4 x 25 ms, so at most 80 tok/s,
    0.4x of a local 200; with 5 tokens a trip, 2x."""
    far = {"plain": {"tok_s": 50, "tokens_per_trip": 1.0}, "ngram": {"tok_s": 180, "tokens_per_trip": 5.0}}
    notes = [r.note for r in links._far_rows({"0": {"free": {"8": {"plain": {"tok_s": 200}}}},
                                             "25": {"free": {"8": far}}}, "", 2)]
    assert "at most 0.40x (8 streams x 1.0 tokens a trip per 4 x 25 ms)" in notes[0]
    assert "at most 2.00x (8 streams x 5.0 tokens a trip" in notes[1]


def test_links_counters_count_trips_and_the_stages_compute_from_the_trace() -> None:
    """Two generations behind 10 ms links. Stage 0 serves in order: A's check arrives with B's step and computes
    after it. A's prompt (before its first token) is no trip and its compute falls before the span."""
    a, b = Generation(0, "a", 1), Generation(1, "b", 2)
    for g, first, tokens in ((a, 1.0, 5), (b, 1.5, 3)):
        g.session, g.t_first, g.t_end, g.tokens = g.request_id, first, 2.0, [7] * tokens
    calls = [(0, 1, "embed_and_forward", 0.5, 0.9), (0, 1, "decode_step", 1.0, 1.2),
             (1, 1, "forward_and_sample", 1.2, 1.4), (0, 2, "decode_step", 1.5, 1.7),
             (0, 1, "embed_and_forward", 1.5, 1.9)]
    trace = sorted([(sent, s, rid, op, "send") for s, rid, op, sent, _ in calls]
                   + [(reply, s, rid, op, "reply") for s, rid, op, _, reply in calls], key=lambda e: e[0])
    counted = links.counters(trace, [a, b], 0.010)
    assert counted["trips"] == 1.5 and counted["tokens_per_trip"] == 2.0  # 3 trips, 4 + 2 tokens after the first
    assert counted["first_spread_s"] == 0.5
    # computing: 1.01-1.19 (A's step), 1.21-1.39 (stage 1), 1.51-1.69 (B's), 1.69-1.89 (A's check): 0.74 of 1 s
    assert counted["busy_share"] == 0.74
    assert "1.5 trips a stream, 2.0 tokens a trip, stages busy 74% of the span" in links._counted(counted)


def test_links_bench_runs_and_counts_each_runs_trips() -> None:
    """The section end to end on the embedded model, small (the relay at 5 ms): plain decoding makes one trip a
    token after the first, ngram fewer on the repeated passage; no timing is judged here."""
    plan = links.LinksPlan(delays_ms=(5.0,), streams=(2,), tokens=12, rounds=1, tasks=("repetitive",),
                           draft_model=None)
    runs = links.measure(plan)["delays"]["5"]["repetitive"]["2"]
    plain, ngram = runs["plain"], runs["ngram"]
    assert (plain["trips"], plain["tokens_per_trip"]) == (11, 1.0)
    assert ngram["kept"] > 0 and ngram["trips"] < 11 and ngram["tokens_per_trip"] > 1
    assert 0 < plain["busy_share"] <= 1 and plain["first_spread_s"] >= 0


def test_prefill_refuses_an_unknown_file_before_it_builds_anything(capsys) -> None:
    from bench import prefill

    for args in (["--files", "smol:F16,smol:none"], ["--files", "", "--avx2-files", "smol"]):
        with pytest.raises(SystemExit) as e:
            prefill.main(args)
        assert e.value.code == 2 and "unknown files" in capsys.readouterr().err


def test_prefills_avx2_rows_compile_without_avx512_against_llamacpps_avx2_build(monkeypatch, tmp_path) -> None:
    from bench import prefill

    runs = []
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    monkeypatch.setattr(prefill.memwall, "ensure_file", lambda preset, dt: (model, "llama.cpp"))
    monkeypatch.setattr(prefill, "measure_file", lambda path, build, plan, env=None: runs.append((build, env)) or {
        "build": build})
    monkeypatch.setattr(prefill.peer, "default_build", lambda: "avx512")
    monkeypatch.setattr(prefill.peer, "available", lambda build=None: True)
    monkeypatch.setattr(prefill.memwall, "NO_AVX512_CC", model)  # a file that is there
    plan = prefill.PrefillPlan(files=(("smol", "F16"),), avx2_files=(("tinyllama", "Q4_K_M"),))
    out = prefill.measure(plan)
    assert list(out["rows"]) == ["smol F16", "tinyllama Q4_K_M avx2"] and set(out["files"]) == set(out["rows"])
    (build, env), (build2, env2) = runs
    assert build == "avx512" and not env
    assert build2 == "avx2" and env2["CC"] == str(model) and out["rows"]["tinyllama Q4_K_M avx2"][
        "clang"] == "no-avx512"
    assert env2["XDG_CACHE_HOME"] and env2["PP_CACHE_DIR"].startswith(env2["XDG_CACHE_HOME"])  # fresh caches
    runs.clear()
    assert list(prefill.measure(plan, avx2=False)["rows"]) == ["smol F16"]  # --no-avx2
    monkeypatch.setattr(prefill.peer, "available", lambda build=None: build != "avx2")
    assert "make peers" in prefill.measure(plan)["avx2_skipped"]
    monkeypatch.setattr(prefill.peer, "available", lambda build=None: True)
    monkeypatch.setattr(prefill.memwall, "NO_AVX512_CC", tmp_path / "none")
    runs.clear()
    assert "PP_NO_AVX512_CC" in prefill.measure(plan)["avx2_skipped"] and [b for b, _ in runs] == ["avx512"]


def test_a_memwall_tree_is_the_package_its_workers_import(tmp_path: Path) -> None:
    """``--tree``: a worker started as the pipelines start theirs (``python -m pp_worker``, in this checkout) runs
    the other tree's package, not this checkout's, which ``-m`` would otherwise put first on the path."""
    (tmp_path / "pp_worker").mkdir()
    (tmp_path / "pp_worker" / "__init__.py").write_text("")
    (tmp_path / "pp_worker" / "__main__.py").write_text("import pp_worker; print(pp_worker.__file__)\n")
    env = {**os.environ, **memwall._tree_env(memwall.MemwallPlan(tree=str(tmp_path)))}
    proc = subprocess.run([sys.executable, "-m", "pp_worker"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.strip() == str(tmp_path / "pp_worker" / "__init__.py"), proc.stdout + proc.stderr[-500:]
