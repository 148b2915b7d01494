"""Real-mode workers as subprocesses over the protocol (tinygrad on CPU, a small generated model).

The invariant test: a 4-stage pipeline of real processes (two middle stages), several generations in flight,
gives exactly the greedy tokens of one process holding all blocks with the same fp16 cast points.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, WorkerProcess, clean_env
from documented import ready_fields, status_fields
from samecast import SameCastReference
from tinygrad.llm.cli import SimpleTokenizer

from pp_worker.driver.pipeline import run_pipeline
from pp_worker.testing.modelgen import generate
from pp_worker.worker.gguf.header import read_header
from pp_worker.worker.shard import compute_layer_range

MAX_CONTEXT = 64
PROMPTS = ["Beautiful is better than", "Errors should never pass silently.", "Now is better than never"]
N_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("real") / "tiny.gguf", preset="tiny", seed=7, dtype="F16")


def real_env(stage: int, num_stages: int, model: Path | str, **extra: str) -> dict[str, str]:
    return {**clean_env(), "STAGE": str(stage), "NUM_STAGES": str(num_stages), "MODEL": str(model),
            "MAX_CONTEXT": str(MAX_CONTEXT), **extra}


def spawn_real(stage: int, num_stages: int, model: Path | str, **extra: str) -> WorkerProcess:
    return WorkerProcess([sys.executable, "-m", "pp_worker"], real_env(stage, num_stages, model, **extra), REPO)


def test_four_real_stages_in_flight_equal_one_process_with_the_same_casts(model: Path) -> None:
    stats = run_pipeline(PROMPTS, stages=4, model=str(model), max_tokens=N_TOKENS, concurrency=3,
                         env={"MAX_CONTEXT": str(MAX_CONTEXT)})
    kv = read_header(model).kv
    tokenizer = SimpleTokenizer.from_gguf_kv(kv)
    boundaries = {compute_layer_range(s, 4, kv["llama.block_count"])[0] for s in range(1, 4)}
    reference = SameCastReference(model, MAX_CONTEXT)
    for g, prompt in zip(stats.generations, PROMPTS, strict=True):
        want, _ = reference.generate(tokenizer.encode(prompt), N_TOKENS, boundaries)
        assert g.prompt_tokens == tokenizer.encode(prompt)
        assert g.tokens == want[: len(g.tokens)] and len(g.tokens) == N_TOKENS, (prompt, g.tokens, want)


def _bad_models(model: Path, tmp: Path) -> dict[str, Path]:
    data = model.read_bytes()
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    arch = bytearray(data)
    key = b"general.architecture"
    at = arch.index(key) + len(key) + 4 + 8  # key, value type (u32), string length (u64)
    arch[at:at + 5] = b"mamba"
    unknown = tmp / "mamba.gguf"
    unknown.write_bytes(bytes(arch))
    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(b"not a model at all\n" * 10)
    return {"missing": tmp / "nope.gguf", "truncated": truncated, "unknown arch": unknown, "garbage": garbage}


@pytest.mark.parametrize("case", ["missing", "truncated", "unknown arch", "garbage"])
def test_a_bad_model_fails_cleanly(model: Path, tmp_path: Path, case: str) -> None:
    bad = _bad_models(model, tmp_path)[case]
    # the last stage of 2 reads the tail of the file, where the truncation is
    result = subprocess.run([sys.executable, "-m", "pp_worker"], env=real_env(1, 2, bad), cwd=REPO,
                            stdin=subprocess.PIPE, capture_output=True, timeout=60)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 2
    assert not [o for o in lines if o.get("status") == "ready"]
    failed = [o for o in lines if o.get("event") == "model_load_failed"]
    assert len(failed) == 1 and failed[0]["model"] == str(bad) and failed[0]["value"]
    stderr = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert len(stderr) == 1 and "cannot load model" in stderr[0] and str(bad) in stderr[0], stderr


def test_real_stages_report_ready_fields_and_answer_control_ops(model: Path) -> None:
    header = read_header(model)
    kv = header.kv
    first = spawn_real(0, 2, model, PP_MAX_SESSIONS="3")
    last = spawn_real(1, 2, model, PP_MAX_SESSIONS="3", PP_KV_DTYPE="float32", PP_PREFILL_CHUNK="16",
                      PP_THREADS="3", PP_EXACT="0")  # more threads than this machine's cores; the default numerics
    try:
        ready = [first.wait_ready(60), last.wait_ready(60)]
        blocks = kv["llama.block_count"]
        assert [r["layer_range"] for r in ready] == [list(compute_layer_range(s, 2, blocks)) for s in (0, 1)]
        for r in ready:
            assert r["hidden_dim"] == kv["llama.embedding_length"] and r["total_blocks"] == blocks
            assert r["vocab_size"] == len(kv["tokenizer.ggml.tokens"]) and r["max_context"] == MAX_CONTEXT
            assert kv["tokenizer.ggml.eos_token_id"] in r["eos_token_ids"]
            assert (r["chat_template"], r["bos_token_id"], r["add_bos"], r["max_sessions"]) == \
                (None, kv["tokenizer.ggml.bos_token_id"], False, 3)  # the generated model: no template, no BOS
            assert (r["bos_token"], r["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
            assert (r["model"], r["model_name"]) == (str(model), kv["general.name"])  # as given; the file's name
        starting = [next(o for o in w.lines if o.get("event") == "starting") for w in (first, last)]
        assert [o["model"] for o in starting] == [str(model)] * 2
        # how each stage runs: the CPU's defaults on stage 0, the environment's choices on stage 1
        head_dim = kv["llama.embedding_length"] // kv["llama.attention.head_count"]
        page = 256  # a session's KV is whole pages (kvcache.PAGE) of every block of the stage
        kv_bytes = 2 * kv["llama.attention.head_count_kv"] * page * head_dim * (blocks // 2)  # per element byte
        assert [(r["device"], r["prefill_chunk"], r["kv_dtype"], r["kv_session_bytes"], r["kernels"])
                for r in ready] == [("CPU", 32, "float16", kv_bytes * 2, "c"),
                                    ("CPU", 16, "float32", kv_bytes * 4, "c")]
        assert [(r["threads"], r["graph"]) for r in ready] == [(len(os.sched_getaffinity(0)), "native"), (3, "native")]
        # the suite's PP_EXACT=1; PP_EXACT=0 on an F16 file: no product of it has an integer path
        assert [r["numerics"] for r in ready] == ["float", "float"]
        # what each stage holds: its share of the file (an F16 file: F16 matrices and F32 gains, each as it is)
        for r, (start, end) in zip(ready, [compute_layer_range(s, 2, blocks) for s in (0, 1)], strict=True):
            names = [n for n in header.tensors if n.startswith(tuple(f"blk.{i}." for i in range(start, end)))]
            names += ["token_embd.weight"] if start == 0 else ["output_norm.weight", "output.weight"]
            infos = [header.tensors[n] for n in names]
            gains = sum(len(i.shape) == 1 for i in infos)
            assert gains and all(i.ggml_type == 0 for i in infos if len(i.shape) == 1)  # the file's are F32
            assert r["weights"] == {"F16": len(names) - gains, "F32": gains} and r["weights_converted"] == {}
            assert r["weight_bytes"] == sum(i.nbytes for i in infos)
        assert [r["jits_compiled"] for r in ready] == [1, 1]  # no PP_WARMUP: decode only, before the ready line
        tokens = first.request({"op": "tokenize", "request_id": 5, "prompt": "Flat is better than nested."})["tokens"]
        hidden = first.request({"op": "embed_and_forward", "request_id": 5, "tokens": tokens, "position": 0})
        token = last.request({"op": "forward_and_sample", "request_id": 5, "hidden_b64": hidden["hidden_b64"],
                              "position": 0, "seq_len": len(tokens)})
        assert 0 <= token["token_id"] < ready[1]["vocab_size"]
        for w, r in ((first, ready[0]), (last, ready[1])):
            status = w.request({"op": "status", "request_id": 6})
            assert status["sessions"] == {"5": len(tokens)} and status["requests_served"] >= 1
            assert (status["bos_token_id"], status["add_bos"], status["max_sessions"]) == \
                (kv["tokenizer.ggml.bos_token_id"], False, 3)
            assert status["kv_dtype"] == r["kv_dtype"]
            assert (status["kv_pages_used"], status["kv_pages_touched"]) == (1, 1)
            assert status["kv_pages_used"] + status["kv_pages_free"] == status["kv_bytes"] // status["kv_page_bytes"]
            assert (status["threads"], status["numerics"]) == (r["threads"], r["numerics"])
            assert (status["model"], status["model_name"]) == (r["model"], r["model_name"])
            common, real = status_fields()
            assert set(status) == common | real and set(r) == ready_fields() | real  # as docs/protocol.md lists
            assert status["jits_compiled"] == 1  # a short prompt on a small model: single-token calls, no new size
            assert w.request({"op": "release", "request_id": 5})["released"] is True
            assert w.request({"op": "status", "request_id": 7})["sessions"] == {}
            assert w.request({"op": "ping", "request_id": 8})["pong"] is True
        # the released session is gone: a step past position 0 is refused, by name
        again = first.request({"op": "decode_step", "request_id": 5, "token_id": token["token_id"],
                               "position": len(tokens)})
        assert "unknown session 5" in again["error"]
        overflow = first.request({"op": "embed_and_forward", "request_id": 9, "tokens": [1] * (MAX_CONTEXT + 1)})
        assert str(MAX_CONTEXT) in overflow["error"]
        for rid in (11, 12):
            first.request({"op": "embed_and_forward", "request_id": rid, "tokens": tokens, "position": 0})
        assert first.request({"op": "reset", "request_id": 13}) == {"request_id": 13, "released": 2}
        assert first.request({"op": "status", "request_id": 14})["sessions"] == {}
        for w in (first, last):
            assert w.request({"op": "shutdown", "request_id": 10}) == {"request_id": 10, "ok": True}
            assert w.rest_of_stdout()[-1]["reason"] == "shutdown" and w.wait() == 0
    finally:
        first.kill()
        last.kill()


def _greedy_steps(first: WorkerProcess, last: WorkerProcess, tokens: list[int], n: int,
                  ids: Iterator[int]) -> list[int]:
    """n greedy tokens, each request under the id ``ids`` gives (the seed's callers: a new id at every step)."""
    hidden = first.request({"op": "embed_and_forward", "request_id": next(ids), "tokens": tokens, "position": 0})
    out = [last.request({"op": "forward_and_sample", "request_id": next(ids), "hidden_b64": hidden["hidden_b64"],
                         "position": 0, "seq_len": len(tokens)})["token_id"]]
    while len(out) < n:
        position = len(tokens) + len(out) - 1
        hidden = first.request({"op": "decode_step", "request_id": next(ids), "token_id": out[-1],
                                "position": position})
        out.append(last.request({"op": "forward_and_sample", "request_id": next(ids), "position": position,
                                 "hidden_b64": hidden["hidden_b64"], "seq_len": 1})["token_id"])
    return out


def test_a_new_request_id_per_step_continues_the_one_generation(model: Path) -> None:
    """The caller's own real-mode test (written for the seed's one cache per stage): prefill id 2, sample id 3,
    decode id 4, sample id 5, ... It gives the tokens of the same generation under one id."""
    first, last = spawn_real(0, 2, model), spawn_real(1, 2, model)
    try:
        first.wait_ready(60)
        last.wait_ready(60)
        tokens = first.request({"op": "tokenize", "request_id": 1, "prompt": PROMPTS[0]})["tokens"]
        caller = _greedy_steps(first, last, tokens, 6, itertools.count(2))
        adopted = [(o["session"], o["from_session"], o["positions"]) for w in (first, last) for o in w.lines
                   if o.get("event") == "session_adopted"]
        p = len(tokens)
        assert adopted == [(4, 2, p), (6, 4, p + 1), (8, 6, p + 2), (10, 8, p + 3), (12, 10, p + 4),
                           (5, 3, p), (7, 5, p + 1), (9, 7, p + 2), (11, 9, p + 3), (13, 11, p + 4)]
        for w, rid in ((first, 12), (last, 13)):
            assert w.request({"op": "release", "request_id": rid})["released"] is True
        assert _greedy_steps(first, last, tokens, 6, itertools.repeat(50)) == caller  # one id all along
        # where it would be a guess, it stays an error: two sessions held now (50 and 60)
        first.request({"op": "embed_and_forward", "request_id": 60, "tokens": tokens, "position": 0})
        refused = first.request({"op": "decode_step", "request_id": 61, "token_id": caller[0], "position": p})
        assert "unknown session 61 at position" in refused["error"]
    finally:
        first.kill()
        last.kill()


def test_tokenize_and_detokenize_round_trip_non_ascii_and_special_tokens(model: Path) -> None:
    text = "héllo wörld — 日本語 🙂<|eot_id|> done"
    first, last = spawn_real(0, 2, model), spawn_real(1, 2, model)
    try:
        first.wait_ready(60)
        last.wait_ready(60)
        tokens = first.request({"op": "tokenize", "request_id": 1, "prompt": text})["tokens"]
        eot = read_header(model).kv["tokenizer.ggml.tokens"].index("<|eot_id|>")
        assert eot in tokens  # a special token is one token, not its characters
        assert last.request({"op": "detokenize", "request_id": 2, "tokens": tokens})["text"] == text
        vocab = len(read_header(model).kv["tokenizer.ggml.tokens"])
        bad = last.request({"op": "detokenize", "request_id": 3, "tokens": [vocab]})
        assert bad["request_id"] == 3 and "'tokens'" in bad["error"] and str(vocab - 1) in bad["error"]
    finally:
        first.kill()
        last.kill()


def test_sigterm_while_loading_exits_at_once(model: Path) -> None:
    w = spawn_real(0, 2, model)
    try:
        assert w.read_line(30)["event"] == "starting"  # the model load begins right after this line
        w.proc.send_signal(signal.SIGTERM)
        assert w.wait(10) == 0, w.stderr_text()
        rest = w.rest_of_stdout()
        assert [o["event"] for o in rest[-2:]] == ["signal_received", "exiting"] and rest[-1]["reason"] == "signal"
        assert not [o for o in rest if o.get("status") == "ready"]
        assert "Traceback" not in w.stderr_text()
    finally:
        w.kill()


def test_warmup_compiles_every_forward_before_ready_and_leaves_no_session_behind(model: Path) -> None:
    w = spawn_real(1, 2, model, PP_WARMUP="1")
    try:
        ready = w.wait_ready(120)
        # one JIT per prefill size (32 on the CPU and the powers of two below it, 1 for decode) and per mixed call's
        # row count (64, 32, 16, 8, 4, 2: MIX_ROWS and below): all compiled before the ready line
        assert (ready["jits"], ready["jits_compiled"]) == (6 + 6, 6 + 6)
        assert w.request({"op": "status", "request_id": 1})["sessions"] == {}  # the scratch session is gone
        hidden = base64.b64encode(bytes(read_header(model).kv["llama.embedding_length"] * 2)).decode()  # zeros
        reply = w.request({"op": "forward_and_sample", "request_id": 2, "hidden_b64": hidden, "position": 0,
                           "seq_len": 1})
        assert isinstance(reply["token_id"], int)
        assert w.request({"op": "status", "request_id": 3})["jits_compiled"] == 6 + 6
    finally:
        w.kill()
