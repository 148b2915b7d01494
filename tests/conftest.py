"""Shared helpers: drive the serving loop in-process, and spawn real stub workers with deadline-bounded reads.

Nothing here may hang a test: every read from a worker's stdout goes through ``select`` with a deadline.
"""

from __future__ import annotations

import io
import json
import os
import select
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock
from pp_worker.worker.loop import LineReader, LoopState, serve
from pp_worker.worker.stdout import Out

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
LAUNCHER = REPO / "pp_tinygrad_worker.py"
MODULE_CMD = [sys.executable, "-m", "pp_worker"]

# --- in-process -------------------------------------------------------------------------------------------


def make_worker(stage: int, num_stages: int) -> Worker:
    return Worker(StubEngine(stage, num_stages), Clock(), "stub")


def serve_bytes(worker: Worker, data: bytes, cap: int = 1 << 20) -> tuple[list[dict[str, Any]], str]:
    """Serve ``data`` (raw stdin bytes) through the real loop; return the parsed reply lines and the stop reason."""
    sink = io.BytesIO()
    reason = serve(LineReader(io.BytesIO(data), cap), Out(sink), worker, LoopState())
    raw = sink.getvalue()
    assert raw == b"" or raw.endswith(b"\n"), "every reply line must end in a newline"
    return [json.loads(line) for line in raw.split(b"\n")[:-1]], reason


def request_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def run_requests(stage: int, num_stages: int, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One fresh stub worker serving ``requests`` in order; its replies."""
    replies, _ = serve_bytes(make_worker(stage, num_stages), b"".join(request_line(r) for r in requests))
    return replies


# --- subprocess -------------------------------------------------------------------------------------------


# Compiled forwards are not kept on disk during the suite (compiled.jitcache): a test sees what a first start does,
# whatever ran before it; tests/test_jitcache.py turns the cache on in directories of its own.
os.environ["PP_CACHE"] = "0"
# The C products on their float path (cpu.kernels.numerics): the suite's float64-reference tolerances are the float
# path's; the integer path (the workers' default) has its own tests (tests/test_int8*.py), which unset this.
os.environ["PP_EXACT"] = "1"


def clean_env() -> dict[str, str]:
    """The inherited environment minus anything of ours that could leak into a worker under test (but the suite's
    PP_CACHE=0 and PP_EXACT=1)."""
    return {k: v for k, v in os.environ.items()
            if (not k.startswith("PP_") or k in ("PP_CACHE", "PP_EXACT"))
            and k not in ("STAGE", "NUM_STAGES", "MODEL", "DEBUG")}


def stub_env(stage: int | None, num_stages: int | None, **extra: str) -> dict[str, str]:
    """The caller's environment for a stub stage."""
    env = clean_env()
    if stage is not None:
        env["STAGE"] = str(stage)
    if num_stages is not None:
        env["NUM_STAGES"] = str(num_stages)
    env["PP_WORKER_STUB"] = "1"
    env.update(extra)
    return env


class WorkerProcess:
    """A spawned worker with pipes on stdin/stdout; stderr goes to a temporary file (it can never fill up)."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path):
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)
        self.pid = self.proc.pid
        self._buf = b""
        self.lines: list[dict[str, Any]] = []  # every stdout line read so far, parsed

    def send(self, obj: dict[str, Any] | bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(obj if isinstance(obj, bytes) else request_line(obj))
        self.proc.stdin.flush()

    def read_line(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next stdout line as a JSON object; fails the test (never hangs) after ``timeout`` seconds."""
        raw = self.read_raw_line(timeout)
        assert raw is not None, f"worker closed stdout; stderr: {self.stderr_text()}"
        obj = json.loads(raw)
        assert isinstance(obj, dict), f"stdout line is not a JSON object: {raw!r}"
        if "event" in obj:  # checked on every event any process test sees
            assert "request_id" not in obj and "stage_index" in obj, obj
        self.lines.append(obj)
        return obj

    def read_raw_line(self, timeout: float = 10.0) -> bytes | None:
        """The next raw stdout line without its newline, or None at end of stdout."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                pytest.fail(f"no stdout line within {timeout}s; partial {self._buf[:200]!r}; "
                            f"stderr: {self.stderr_text()[-2000:]}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def wait_for_bytes(self, marker: bytes, timeout: float = 10.0) -> None:
        """Read stdout until ``marker`` has arrived (it stays buffered for the line readers); e.g. to know that the
        worker has begun writing a line it cannot finish while we read no more."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while marker not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                pytest.fail(f"no {marker!r} on stdout within {timeout}s; stderr: {self.stderr_text()[-2000:]}")
            self._buf += chunk

    def read_until(self, match: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> list[dict[str, Any]]:
        """Lines up to and including the first that ``match`` accepts."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while True:
            seen.append(self.read_line(max(deadline - time.monotonic(), 0.01)))
            if match(seen[-1]):
                return seen

    def wait_ready(self, timeout: float = 20.0) -> dict[str, Any]:
        """Read through the start-up lines and the ready events; return the ready line."""
        lines = self.read_until(lambda o: o.get("event") == "pp_worker_ready", timeout)
        ready = [o for o in lines if o.get("status") == "ready"]
        assert len(ready) == 1, lines
        return ready[0]

    def request(self, obj: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Send one request; return its reply, skipping events (e.g. heartbeats)."""
        self.send(obj)
        return self.read_until(lambda o: "event" not in o, timeout)[-1]

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def rest_of_stdout(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every remaining stdout line up to EOF."""
        rest: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while (raw := self.read_raw_line(max(deadline - time.monotonic(), 0.01))) is not None:
            obj = json.loads(raw)
            self.lines.append(obj)
            rest.append(obj)
        return rest

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {self.pid} still running after {timeout}s; stderr: {self.stderr_text()[-2000:]}")

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
        self._stderr.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., WorkerProcess]]:
    """``spawn(stage, num_stages, env=..., cmd=..., cwd=...)`` starts a stub worker; all are killed at teardown."""
    started: list[WorkerProcess] = []

    def start(stage: int | None, num_stages: int | None, *, env: dict[str, str] | None = None,
              cmd: list[str] | None = None, cwd: Path = REPO, args: list[str] | None = None) -> WorkerProcess:
        full_env = stub_env(stage, num_stages, **(env or {}))
        w = WorkerProcess([*(cmd or MODULE_CMD), *(args or [])], full_env, cwd)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a process from /proc, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[2])


def until(check: Callable[[], Any], timeout: float) -> bool:
    """Whether ``check()`` turns true within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def gone(pid: int, timeout: float = 3.0) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie waiting for its parent) within ``timeout`` seconds."""
    return until(lambda: (_state(pid) or ("Z", 0))[0] == "Z", timeout)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``: a worker and whatever its launcher started."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    return [pid for pid in pids if (st := _state(pid)) is not None and st[1] == pgid and st[0] != "Z"]


def group_gone(pgid: int, timeout: float = 3.0) -> bool:
    """Whether every process of group ``pgid`` has ended within ``timeout`` seconds."""
    return until(lambda: not group_members(pgid), timeout)


def assert_event(obj: dict[str, Any], stage: int) -> None:
    """What the contract requires of every event line."""
    assert isinstance(obj.get("event"), str), obj
    assert obj.get("stage_index") == stage, obj
    assert "request_id" not in obj, obj


@pytest.fixture
def started_processes(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """Every process the driver starts from now on (stage_proc's Popen, recorded), to check each is reaped."""
    from pp_worker.driver import stage_proc

    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(stage_proc.subprocess, "Popen", recording_popen)
    return started


def held_restart(tmp_path: Path) -> tuple[str, Path]:
    """A launcher whose stages start at once the first time, and the second time (the restart) only once the test
    creates the gate file it returns: until then the server is restarting, however loaded the machine is."""
    gate = tmp_path / "gate"
    mark = f"{tmp_path}/started{{stage}}"
    return (f"sh -c 'test -e {mark} && until test -e {gate}; do sleep 0.05; done; touch {mark}; "
            f"exec {shlex.quote(sys.executable)} -m pp_worker'"), gate
