"""The real entry points as the caller runs them: start-up, events, bad configuration, EOF, signals, a closed
stdout, a 3-stage chain, and a line of hundreds of MB."""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    LAUNCHER,
    MODULE_CMD,
    REPO,
    VENV_BIN,
    WorkerProcess,
    assert_event,
    gone,
    make_worker,
    run_requests,
    serve_bytes,
    stub_env,
)
from documented import ready_fields

pytestmark = pytest.mark.timeout(60)

Spawn = Callable[..., WorkerProcess]
HIDDEN_DIM, VOCAB = 16, 32  # the stub's sizes, fixed by the contract


def system_python3() -> str | None:
    """The ``python3`` a caller would find on PATH, outside this virtual environment (the launcher must cope)."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != VENV_BIN.resolve())
    return shutil.which("python3", path=path)


def entry_point(name: str) -> list[str]:
    if name == "module":
        return MODULE_CMD
    if name == "console-script":
        script = VENV_BIN / "pp-worker"
        assert script.exists(), f"{script} is missing: run `make install` (pip install -e '.[dev]')"
        return [str(script)]
    if name == "launcher":
        return [sys.executable, str(LAUNCHER)]
    python3 = system_python3()
    if python3 is None:
        pytest.skip("no python3 on PATH outside the venv")
    return [python3, str(LAUNCHER)]


def layer_range(stage: int, num_stages: int, total: int) -> list[int]:
    k = total // num_stages
    return [stage * k, total if stage == num_stages - 1 else (stage + 1) * k]


# --- start-up ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["module", "console-script", "launcher", "launcher-system-python3"])
def test_entry_points_start_and_report_ready(spawn: Spawn, tmp_path: Path, name: str) -> None:
    cwd = REPO if name == "module" else tmp_path  # the path forms must work from any directory
    w = spawn(1, 3, cmd=entry_point(name), cwd=cwd)
    ready = w.wait_ready()
    starting, ready_event, pp_ready = (next(o for o in w.lines if o.get("event") == kind)
                                       for kind in ("starting", "ready", "pp_worker_ready"))
    assert w.lines[0] is starting
    assert starting["pid"] == w.pid and ready["pid"] == w.pid and pp_ready["pid"] == w.pid  # no forking wrapper
    assert (starting["stage"], starting["num_stages"], starting["stub"]) == (1, 3, True)
    assert starting["model"] == ready["model"] == ready["model_name"] == "stub"  # given, and its own name
    assert starting["python_version"] == platform.python_version()  # the launcher execs into the venv's Python
    assert isinstance(pp_ready["uptime_ms"], int)
    for event in (starting, ready_event, pp_ready):
        assert_event(event, stage=1)
    assert "request_id" not in ready
    assert (ready["hidden_dim"], ready["vocab_size"]) == (HIDDEN_DIM, VOCAB)
    assert ready["layer_range"] == layer_range(1, 3, ready["total_blocks"])
    assert isinstance(ready["eos_token_ids"], list)
    # what a remote driver needs (no GGUF in the stub): no template, no BOS, PP_MAX_SESSIONS' default
    model_fields = {"chat_template": None, "bos_token_id": None, "add_bos": False, "bos_token": None,
                    "eos_token": None, "max_sessions": 8, "wire_dtype": "auto", "model": "stub",
                    "model_name": "stub"}
    assert {k: ready.get(k, "absent") for k in model_fields} == model_fields
    assert set(ready) == ready_fields()  # what docs/protocol.md lists, no more
    status = w.request({"op": "status", "request_id": 3})
    assert {k: status.get(k, "absent") for k in model_fields} == model_fields
    assert w.request({"op": "ping", "request_id": 4})["pong"] is True
    w.close_stdin()
    rest = w.rest_of_stdout()
    assert rest[-1]["event"] == "exiting" and rest[-1]["reason"] == "eof"
    assert w.wait() == 0


BAD_CONFIGS: list[tuple[dict[str, str | None], str, str | None]] = [
    ({"STAGE": None}, "STAGE", None),
    ({"NUM_STAGES": None}, "NUM_STAGES", None),
    ({"NUM_STAGES": "1", "STAGE": "0"}, "NUM_STAGES", "1"),
    ({"NUM_STAGES": "0", "STAGE": "0"}, "NUM_STAGES", "0"),
    ({"STAGE": "3"}, "STAGE", "3"),  # STAGE == NUM_STAGES
    ({"STAGE": "\u0663", "NUM_STAGES": "5"}, "STAGE", "\u0663"),  # Arabic-Indic three: int() would accept it
    ({"NUM_STAGES": "\uff13"}, "NUM_STAGES", "\uff13"),  # fullwidth three
    ({"STAGE": "-1"}, "STAGE", "-1"),
    ({"STAGE": "abc"}, "STAGE", "abc"),
    ({"STAGE": "1.0"}, "STAGE", "1.0"),
    ({"PP_WORKER_STUB": "yes"}, "PP_WORKER_STUB", "yes"),
    ({"PP_HEARTBEAT_S": "0"}, "PP_HEARTBEAT_S", "0"),
    ({"PP_HEARTBEAT_S": "nan"}, "PP_HEARTBEAT_S", "nan"),
    ({"PP_MAX_LINE_BYTES": "ten"}, "PP_MAX_LINE_BYTES", "ten"),
    ({"PP_PREFILL_CHUNK": "0"}, "PP_PREFILL_CHUNK", "0"),
    ({"PP_KV_DTYPE": "bfloat16"}, "PP_KV_DTYPE", "bfloat16"),
    ({"PP_WIRE_DTYPE": "int8"}, "PP_WIRE_DTYPE", "int8"),
    ({"PP_BEAM": "-1"}, "PP_BEAM", "-1"),
    ({"PP_BEAM": "two"}, "PP_BEAM", "two"),
    ({"PP_KERNELS": "cuda"}, "PP_KERNELS", "cuda"),
    ({"PP_EXACT": "yes"}, "PP_EXACT", "yes"),
    ({"PP_STRICT_FINITE": "on"}, "PP_STRICT_FINITE", "on"),
    ({"PP_PINNED_HOST": "true"}, "PP_PINNED_HOST", "true"),
    ({"PP_THREADS": "0"}, "PP_THREADS", "0"),
    ({"PP_THREADS": "two"}, "PP_THREADS", "two"),
    ({"PP_THREADS": "1.5"}, "PP_THREADS", "1.5"),
    ({"PP_HOST_STAGES": "0"}, "PP_HOST_STAGES", "0"),
]


@pytest.mark.parametrize(("env", "variable", "value"),
                         [pytest.param(*c, id=f"{c[1]}={ascii(c[2])}" if c[2] else f"no-{c[1]}") for c in BAD_CONFIGS])
def test_bad_configuration_exits_2_without_waiting_on_stdin(spawn: Spawn, env: dict[str, str | None],
                                                            variable: str, value: str | None) -> None:
    full = stub_env(1, 3)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    started = time.monotonic()
    w = WorkerProcess(MODULE_CMD, full, REPO)  # stdin stays an open pipe: the worker must not wait on it
    try:
        rc = w.wait(timeout=5)
        elapsed = time.monotonic() - started
        stdout = w.proc.stdout.read() if w.proc.stdout else b""
        stderr = w.stderr_text()
    finally:
        w.kill()
    assert rc == 2
    assert elapsed < 5
    assert b"ready" not in stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert variable in lines[0]
    if value is not None:
        assert value in lines[0] or ascii(value).strip("'") in lines[0]


# --- events --------------------------------------------------------------------------------------------------

def test_heartbeat(spawn: Spawn) -> None:
    w = spawn(0, 2, env={"PP_HEARTBEAT_S": "0.2"})
    w.wait_ready()
    beats = [o for o in w.read_until(lambda o: o.get("event") == "heartbeat", 5) if o.get("event") == "heartbeat"]
    assert w.request({"op": "ping", "request_id": 1})["pong"] is True
    # the first heartbeat after the reply may still race the counter's update; the next one cannot
    beats += [o for o in w.read_until(lambda o: o.get("requests_served") == 1, 5) if o.get("event") == "heartbeat"]
    for beat in beats:
        assert_event(beat, stage=0)
        assert isinstance(beat["uptime_ms"], int) and isinstance(beat["requests_served"], int)
        assert isinstance(beat["rss_mb"], int) and beat["rss_mb"] > 0
    assert beats[-1]["uptime_ms"] - beats[0]["uptime_ms"] >= 150
    assert beats[0]["requests_served"] == 0 and beats[-1]["requests_served"] == 1
    w.close_stdin()
    assert w.wait() == 0


def test_eof_exits_cleanly(spawn: Spawn) -> None:
    w = spawn(1, 2)
    w.wait_ready()
    w.request({"op": "ping", "request_id": 1})
    w.request({"op": "bogus", "request_id": 2})
    w.close_stdin()
    rest = w.rest_of_stdout()
    assert [o["event"] for o in rest] == ["exiting"]
    assert_event(rest[0], stage=1)
    assert rest[0]["reason"] == "eof" and rest[0]["requests_served"] == 2 and isinstance(rest[0]["uptime_ms"], int)
    assert w.wait() == 0


def test_shutdown_op_exits_cleanly(spawn: Spawn) -> None:
    w = spawn(0, 2)
    w.wait_ready()
    assert w.request({"op": "shutdown", "request_id": 3})["request_id"] == 3
    rest = w.rest_of_stdout()
    assert rest[-1]["event"] == "exiting" and rest[-1]["reason"] == "shutdown"
    assert w.wait() == 0


def test_sigterm_while_idle(spawn: Spawn) -> None:
    w = spawn(0, 2)
    w.wait_ready()
    w.proc.send_signal(signal.SIGTERM)
    rest = w.rest_of_stdout()
    assert [o["event"] for o in rest] == ["signal_received", "exiting"]
    for event in rest:
        assert_event(event, stage=0)
    assert rest[0]["signum"] == signal.SIGTERM
    assert rest[1]["reason"] == "signal"
    assert w.wait() == 0


def test_sigint_while_idle(spawn: Spawn) -> None:
    w = spawn(1, 2)
    w.wait_ready()
    w.proc.send_signal(signal.SIGINT)
    rest = w.rest_of_stdout()
    assert rest[-1]["event"] == "exiting" and rest[-1]["reason"] == "signal"
    assert w.wait() == 0
    assert "Traceback" not in w.stderr_text()


DELAY_ENV = {"PP_STUB_DELAY_MS": "1500"}
PREFILL = {"op": "embed_and_forward", "request_id": 21, "tokens": [1, 2, 3], "position": 0}


def in_flight(busy: Path, timeout: float = 30.0) -> None:
    """Until the stub has started a forward op (PP_STUB_BUSY_FILE): from then on it is in its PP_STUB_DELAY_MS."""
    deadline = time.monotonic() + timeout
    while not (busy.exists() and busy.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy.exists() and busy.read_text(), "no op started"


def test_sigterm_mid_op_finishes_the_op_first(spawn: Spawn, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    w = spawn(0, 2, env=DELAY_ENV | {"PP_STUB_BUSY_FILE": str(busy)})
    w.wait_ready()
    sent = time.monotonic()
    w.send(PREFILL)
    in_flight(busy)
    w.proc.send_signal(signal.SIGTERM)
    rest = w.rest_of_stdout(timeout=10)
    assert [o.get("event") for o in rest] == [None, "signal_received", "exiting"]
    assert rest[0]["request_id"] == 21 and rest[0]["seq_len"] == 3  # the reply, whole, before the exit
    assert rest[2]["reason"] == "signal"
    assert w.wait() == 0
    assert time.monotonic() - sent >= 1.4  # it really waited for the op


def test_second_sigterm_while_draining_exits_at_once(spawn: Spawn, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    w = spawn(0, 2, env={"PP_STUB_DELAY_MS": "60000", "PP_STUB_BUSY_FILE": str(busy)})  # an op far longer than all
    w.wait_ready()
    w.send(PREFILL)
    in_flight(busy)
    first = time.monotonic()
    while w.proc.poll() is None and time.monotonic() - first < 30:  # the first signal handled asks to drain, any
        w.proc.send_signal(signal.SIGTERM)  # later one to exit (two sent together may merge into one)
        time.sleep(0.1)
    assert w.wait(timeout=5) == 128 + signal.SIGTERM  # long before the op's 60 s would have ended
    rest = w.rest_of_stdout()
    assert all("request_id" not in o for o in rest)  # the op's reply never came


SIGNAL_DURING_WRITE = """
import io, os, signal
from pp_worker.worker.cli import _install_signals
from pp_worker.worker.events import Clock, Events
from pp_worker.worker.stdout import Out
from pp_worker.worker.loop import LoopState

class Stream(io.RawIOBase):  # stands for stdout; the second SIGTERM lands while a reply is being written
    def writable(self):
        return True

    def write(self, b):
        os.kill(os.getpid(), signal.SIGTERM)
        return len(b)

out = Out(Stream())
state = LoopState(signum=signal.SIGTERM, busy=True, loading=False)  # draining: the first signal came, an op runs
_install_signals(state, Events(out, 0, Clock()))
out.write({"request_id": 1})
"""


def test_second_signal_during_a_long_reply_exits_after_the_line(spawn: Spawn) -> None:
    n = 150_000  # a 6.4 MB reply line: far more than the 1 MiB pipe holds while we read no more of it
    w = spawn(0, 2, env={"MAX_CONTEXT": str(n)})  # the stub's context (4096) as large as the prompt
    w.wait_ready()
    w.send({"op": "embed_and_forward", "request_id": 8, "tokens": [1] * n, "position": 0})
    w.wait_for_bytes(b'{"request_id": 8, "hidden_b64": "', timeout=30)  # the worker is now blocked mid-line
    for _ in range(4):  # the first signal asks to drain; any later one (two sent together may merge) asks to exit
        w.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    rest = w.rest_of_stdout(timeout=30)  # json-parses every line: a cut line would fail here
    assert w.wait() == 128 + signal.SIGTERM
    assert rest[0]["request_id"] == 8 and rest[0]["seq_len"] == n
    assert len(base64.b64decode(rest[0]["hidden_b64"])) == n * HIDDEN_DIM * 2  # the whole reply
    assert [o["event"] for o in rest[1:]] == ["signal_received"] and rest[1]["draining"] is True
    assert w.read_raw_line(1) is None and w._buf == b""  # nothing after it, not even half a line


EARLY_SIGNAL = """
import os, signal, sys
real_signal = signal.signal
def install_then_signal(signum, handler):  # the signal lands the moment the worker's handler is in place
    old = real_signal(signum, handler)
    if signum == signal.SIGTERM and callable(handler):
        os.kill(os.getpid(), signal.SIGTERM)
    return old
signal.signal = install_then_signal
from pp_worker.worker.cli import main
sys.exit(main([]))
"""


def test_signal_before_the_loop_is_a_clean_shutdown() -> None:
    result = subprocess.run([sys.executable, "-c", EARLY_SIGNAL], capture_output=True, timeout=30, cwd=REPO,
                            env=stub_env(0, 2), stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 0, result.stderr.decode()
    assert [e["event"] for e in events] == ["signal_received", "exiting"], events
    assert events[0]["signum"] == signal.SIGTERM and events[1]["reason"] == "signal"
    for event in events:
        assert_event(event, stage=0)
    assert b"Traceback" not in result.stderr


def test_second_signal_during_a_write_exits_at_once() -> None:
    try:
        result = subprocess.run([sys.executable, "-c", SIGNAL_DURING_WRITE], capture_output=True, timeout=3,
                                cwd=REPO, env=stub_env(0, 2))
    except subprocess.TimeoutExpired:  # run() has killed it (SIGKILL)
        pytest.fail("hung on the second signal")
    assert result.returncode == 128 + signal.SIGTERM


@pytest.mark.parametrize("trigger", ["request", "heartbeat"])
def test_reader_closing_stdout_makes_the_worker_exit(spawn: Spawn, trigger: str) -> None:
    w = spawn(0, 2, env={"PP_HEARTBEAT_S": "0.2"} if trigger == "heartbeat" else {})
    w.wait_ready()
    assert w.proc.stdout is not None
    w.proc.stdout.close()
    closed = time.monotonic()
    if trigger == "request":
        w.send({"op": "ping", "request_id": 1})
    w.wait(timeout=5)
    assert time.monotonic() - closed < 5
    stderr = w.stderr_text()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


# --- the caller gone mid-op (worker.watchdog) -----------------------------------------------------------------------

LONG_OP_ENV = {"PP_STUB_DELAY_MS": "60000"}  # one op outlasts every deadline below many times over
# A parent that hands its own stdin and stdout to the worker, so the test keeps both pipes when the parent dies
PARENT = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def test_a_worker_whose_parent_dies_mid_op_exits(spawn: Spawn, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    w = spawn(0, 2, cmd=[sys.executable, "-c", PARENT, *MODULE_CMD], env=LONG_OP_ENV | {"PP_STUB_BUSY_FILE": str(busy)})
    worker_pid = w.wait_ready()["pid"]
    assert worker_pid != w.pid  # the worker is the parent's child, not the process we started
    w.send(PREFILL)
    in_flight(busy)
    w.proc.kill()  # the parent dies; the pipes stay open (we hold them), so only the parent's death tells
    assert gone(worker_pid, timeout=10), "the worker outlived its parent by 10 s"
    rest = w.rest_of_stdout()
    assert [o.get("event") for o in rest] == ["exiting"] and rest[0]["reason"] == "parent_exited", rest
    assert "the parent process exited in the middle of an op; exiting" in w.stderr_text()


def test_a_worker_whose_stdout_reader_leaves_mid_op_exits(spawn: Spawn, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    w = spawn(1, 3, env=LONG_OP_ENV | {"PP_STUB_BUSY_FILE": str(busy)})
    w.wait_ready()
    w.send({"op": "forward_range", "request_id": 4, "position": 0, "seq_len": 1,
            "hidden_b64": base64.b64encode(bytes(HIDDEN_DIM * 2)).decode()})
    in_flight(busy)
    assert w.proc.stdout is not None
    w.proc.stdout.close()  # no reply can be delivered any more
    assert w.wait(timeout=10) == 0
    assert "stdout has no reader in the middle of an op; exiting" in w.stderr_text()


@pytest.mark.parametrize("exit_on_eof", [True, False])
def test_end_of_stdin_mid_op(spawn: Spawn, exit_on_eof: bool, tmp_path: Path) -> None:
    """With PP_EXIT_ON_EOF=1 (what pp-pipeline and pp-serve set) the end of stdin ends the op in progress at once;
    without it the op finishes and its reply is written first (the contract's end of stdin)."""
    env = LONG_OP_ENV if exit_on_eof else {"PP_STUB_DELAY_MS": "800"}
    busy = tmp_path / "busy"
    w = spawn(0, 2, env={**env, "PP_EXIT_ON_EOF": "1" if exit_on_eof else "0", "PP_STUB_BUSY_FILE": str(busy)})
    w.wait_ready()
    w.send(PREFILL)
    in_flight(busy)
    w.close_stdin()
    rest = w.rest_of_stdout(timeout=10)
    assert w.wait() == 0
    assert rest[-1]["event"] == "exiting" and rest[-1]["reason"] == "eof"
    assert [o.get("request_id") for o in rest[:-1]] == ([] if exit_on_eof else [21])


def test_stdout_carries_only_json_even_with_debug(spawn: Spawn) -> None:
    w = spawn(2, 3, env={"DEBUG": "2", "PP_HEARTBEAT_S": "0.2"})
    w.wait_ready()
    for line in [b"not json", b"", b"[[[[", b'{"op": "status", "request_id": 5}']:
        w.send(line + b"\n")
    w.send({"op": "forward_and_sample", "request_id": 9, "position": 0, "seq_len": 1,
            "hidden_b64": base64.b64encode(bytes(HIDDEN_DIM * 2)).decode()})
    time.sleep(0.5)  # let a heartbeat or two interleave
    w.close_stdin()
    assert w.wait() == 0
    raw_lines = []
    while (raw := w.read_raw_line(5)) is not None:
        raw_lines.append(raw)
    assert raw_lines, "expected the replies and events on stdout"
    objs = [json.loads(raw) for raw in raw_lines]  # fails on any non-JSON line
    assert all(isinstance(o, dict) for o in objs)
    replies = [o for o in objs if "event" not in o]
    assert len(replies) == 4  # the blank line got none
    assert replies[-1]["request_id"] == 9 and 0 <= replies[-1]["token_id"] < VOCAB


def test_import_prints_nothing_and_the_excepthook_reports() -> None:
    code = ("import io, sys\n"
            "import pp_worker, pp_worker.worker.cli, pp_worker.worker.loop, pp_worker.worker.dispatch\n"
            "import pp_worker.worker.events as ev\n"
            "from pp_worker.worker.stdout import Out\n"
            "sys.stdout.flush()\n"
            "ev.install_excepthook(ev.Events(Out(sys.stdout.buffer), 4, ev.Clock()))\n"
            "raise ValueError('boom')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30, cwd=REPO,
                            env=stub_env(None, None))
    assert result.returncode == 1
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 1  # importing printed nothing; the hook printed one line
    event = json.loads(lines[0])
    assert_event(event, stage=4)
    assert (event["event"], event["type"], event["value"]) == ("uncaught_exception", "ValueError", "boom")
    assert event["traceback"].startswith("Traceback") and "line 7" in event["traceback"]  # where it was raised
    assert "ValueError: boom" in result.stderr.decode()  # the usual traceback still goes to stderr


# --- a 3-stage chain -----------------------------------------------------------------------------------------

def b64_chars(seq_len: int) -> int:
    return 4 * math.ceil(seq_len * HIDDEN_DIM * 2 / 3)


def generate(call: Callable[[int, dict[str, Any]], dict[str, Any]], rid: int, prompt: str, steps: int
             ) -> tuple[list[int], str]:
    """Drive one generation through stages 0, 1, 2 as the caller does; ``call(stage, request) -> reply``."""
    tokens = call(0, {"op": "tokenize", "request_id": rid, "prompt": prompt})["tokens"]
    length = len(tokens)
    h0 = call(0, {"op": "embed_and_forward", "request_id": rid, "tokens": tokens, "position": 0})
    assert h0["seq_len"] == length and len(h0["hidden_b64"]) == b64_chars(length)
    h1 = call(1, {"op": "forward_range", "request_id": rid, "hidden_b64": h0["hidden_b64"], "position": 0,
                  "seq_len": length})
    assert h1["seq_len"] == length and len(h1["hidden_b64"]) == b64_chars(length)
    token = call(2, {"op": "forward_and_sample", "request_id": rid, "hidden_b64": h1["hidden_b64"], "position": 0,
                     "seq_len": length})["token_id"]
    out = [token]
    for position in range(length, length + steps):
        h0 = call(0, {"op": "decode_step", "request_id": rid, "token_id": token, "position": position})
        assert h0["seq_len"] == 1 and len(h0["hidden_b64"]) == b64_chars(1)
        h1 = call(1, {"op": "forward_range", "request_id": rid, "hidden_b64": h0["hidden_b64"], "position": position,
                      "seq_len": 1})
        token = call(2, {"op": "forward_and_sample", "request_id": rid, "hidden_b64": h1["hidden_b64"],
                         "position": position, "seq_len": 1})["token_id"]
        out.append(token)
    text = call(2, {"op": "detokenize", "request_id": rid, "tokens": out})["text"]
    return out, text


def test_three_stage_chain(spawn: Spawn) -> None:
    stages = [spawn(s, 3) for s in range(3)]
    for s, w in enumerate(stages):
        ready = w.wait_ready()
        assert ready["layer_range"] == layer_range(s, 3, ready["total_blocks"])

    def call(stage: int, request: dict[str, Any]) -> dict[str, Any]:
        reply = stages[stage].request(request)
        assert "error" not in reply and reply["request_id"] == request["request_id"], reply
        return reply

    tokens, text = generate(call, 1, "Beautiful is better than ugly", steps=5)
    assert len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens)
    assert isinstance(text, str) and text
    assert generate(call, 2, "Beautiful is better than ugly", steps=5) == (tokens, text)  # same across requests

    local = [make_worker(s, 3) for s in range(3)]  # and the same as in this process: no per-process state

    def call_local(stage: int, request: dict[str, Any]) -> dict[str, Any]:
        replies, _ = serve_bytes(local[stage], json.dumps(request).encode() + b"\n")
        return replies[0]

    assert generate(call_local, 1, "Beautiful is better than ugly", steps=5) == (tokens, text)
    for w in stages:
        w.close_stdin()
    assert [w.wait() for w in stages] == [0, 0, 0]


def test_outputs_are_identical_across_processes(spawn: Spawn) -> None:
    request = {"op": "embed_and_forward", "request_id": 1, "tokens": [3, 1, 4, 1, 5], "position": 2}
    replies = []
    for _ in range(2):
        w = spawn(0, 2)
        w.wait_ready()
        replies.append(w.request(request))
        w.close_stdin()
        w.wait()
    assert replies[0] == replies[1] == run_requests(0, 2, [request])[0]


# --- a line of hundreds of MB ----------------------------------------------------------------------------------

def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_huge_line_is_refused_in_bounded_memory(spawn: Spawn) -> None:
    line_mb, cap = 200, 1 << 20
    w = spawn(0, 2, env={"PP_MAX_LINE_BYTES": str(cap)})
    w.wait_ready()
    w.send({"op": "ping", "request_id": 1})
    assert w.read_line()["request_id"] == 1
    chunk = b"A" * (1 << 20)
    w.send(b'{"op": "ping", "request_id": 2, "pad": "')
    for _ in range(line_mb):
        w.send(chunk)
    w.send(b'"}\n')
    error = w.read_line(timeout=30)
    assert "error" in error and str(cap) in error["error"] and "request_id" not in error
    assert w.request({"op": "ping", "request_id": 3})["pong"] is True  # still serving
    peak_mb = peak_rss_kb(w.pid) / 1024
    assert peak_mb < line_mb / 4, f"peak RSS {peak_mb:.0f} MB for a {line_mb} MB line"
    w.close_stdin()
    assert w.rest_of_stdout()[-1]["reason"] == "eof"
    assert w.wait() == 0


def test_threads_default_to_every_cpu_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """PP_THREADS wins; without it a stage takes every CPU it may use, also where a local pp-pipeline or pp-serve
    started the host's other stages (PP_HOST_STAGES sizes their memory share, not their threads)."""
    from pp_worker.driver.stage_proc import Launch
    from pp_worker.worker.cli import parse_config

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("PP_HOST_STAGES", raising=False)
    env = {"STAGE": "0", "NUM_STAGES": "4"}
    assert parse_config([], env).threads == 16
    assert parse_config([], env | Launch(4).worker_env(0)).threads == 16
    assert parse_config([], env | {"PP_THREADS": "7"}).threads == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})  # a taskset: only the CPUs it may use
    assert parse_config([], env | Launch(4).worker_env(0)).threads == 2
    assert "PP_HOST_STAGES" not in Launch(4, launcher="ssh host{stage} {python} -m pp_worker").worker_env(0)
