"""One stage worker seen from the driver: how it is started, how bytes go in and lines come out, how it stops.

The driver is single-threaded around ``select``: stdin is non-blocking and fed from a buffer, because a stage
blocked writing a large reply while we block writing it a large request would deadlock both. stderr is drained
by a thread into a ring buffer, so a chatty worker can never block on it and a failure report has its tail.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pp_worker.driver.ray_launch import RAY_LAUNCHER, RayPlacement, RayProcess
from pp_worker.wire import to_line, widen_pipe

STDERR_TAIL = 50
# Forwarded to workers started through a launcher (a local child inherits the whole environment anyway).
PASS_THROUGH = ("MAX_CONTEXT", "PP_MAX_SESSIONS", "PP_WARMUP", "PP_HEARTBEAT_S", "PP_MAX_LINE_BYTES",
                "PP_STUB_DELAY_MS", "PP_PREFILL_CHUNK", "PP_KV_DTYPE", "PP_KV_BYTES", "PP_WIRE_DTYPE", "PP_MAX_BATCH",
                "PP_BEAM",
                "PP_KERNELS", "PP_PINNED_HOST", "PP_CACHE", "PP_CACHE_DIR", "PP_THREADS", "PP_HOST_STAGES",
                "DEV", "CPU", "CUDA", "GPU", "METAL", "AMD", "NV", "JIT", "DEBUG", "BEAM", "HALF", "CACHEDB")
_SSH_OPTS_WITH_ARG = set("BbcDEeFIiJLlmOopQRSWw")  # ssh(1): the options that take an argument


@dataclass(frozen=True)
class Launch:
    """How to start the workers: locally with ``sys.executable -m pp_worker``, through a launcher template, or in
    Ray actors (launcher ``"ray"``)."""

    num_stages: int
    model: str | None = None
    stub: bool = False
    launcher: str | None = None  # placeholders: {stage} {num_stages} {python} {env}
    env: dict[str, str] = field(default_factory=dict)  # extra variables for every worker; "{stage}" in a value
    # becomes the stage's index, so one setting can give each stage its own GPU: CUDA_VISIBLE_DEVICES={stage}
    ray: RayPlacement | None = None  # with launcher "ray": where the actors go (None: RayPlacement's defaults)
    split: str | tuple[int, ...] | None = None  # --split: "auto" or blocks per stage, planned before the load (split)
    layers: tuple[tuple[int, int], ...] = ()  # each stage's block range (PP_LAYERS), once a split is planned

    def worker_env(self, stage: int) -> dict[str, str]:
        """The variables a worker needs, beyond what it inherits. ``PP_EXIT_ON_EOF``: the driver closes a worker's
        stdin only to stop it, and through ssh or a Ray actor the end of stdin is all that reaches a worker whose
        driver died, so it must end an op or a load in progress (worker.watchdog). ``PP_HOST_STAGES``: started here,
        every stage shares this host's memory with the others (each sizes its KV pool to its share).
        ``PP_WIRE_DTYPE=auto``: the driver hands each reply's ``hidden_dtype`` on, so a stage may send a hidden state
        past float16's range as float32 (unless told otherwise, here or in the driver's environment)."""
        env = {"STAGE": str(stage), "NUM_STAGES": str(self.num_stages), "PP_EXIT_ON_EOF": "1"}
        if "PP_WIRE_DTYPE" not in os.environ:
            env["PP_WIRE_DTYPE"] = "auto"
        if not self.launcher and "PP_HOST_STAGES" not in os.environ:
            env["PP_HOST_STAGES"] = str(self.num_stages)
        if self.model:
            env["MODEL"] = self.model
        if self.stub:
            env["PP_WORKER_STUB"] = "1"
        if self.layers:
            start, end = self.layers[stage]
            env["PP_LAYERS"] = f"{start}:{end}"
        return {**env, **{k: v.replace("{stage}", str(stage)) for k, v in self.env.items()}}

    def remote_env(self, stage: int) -> dict[str, str]:
        """What a worker started elsewhere (ssh, a Ray node) needs: it inherits nothing of ours."""
        env = self.worker_env(stage)
        env.update({k: os.environ[k] for k in PASS_THROUGH if k in os.environ and k not in env})
        return env

    def argv(self, stage: int) -> list[str]:
        if not self.launcher:
            return [sys.executable, "-m", "pp_worker"]
        return launcher_argv(self.launcher, stage, self.num_stages, self.remote_env(stage))


def launcher_argv(template: str, stage: int, num_stages: int, env: dict[str, str]) -> list[str]:
    """The launcher command for one stage. The variables must survive ssh, so they travel as ``env K=V`` words:
    where ``{env}`` stands, else right after ssh's destination, else in front of the whole command."""
    words = shlex.split(template.format(stage=stage, num_stages=num_stages, python=sys.executable, env="\0"))
    quoted = ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items())]  # parsed again by the remote shell
    if "\0" in words:
        i = words.index("\0")
        return words[:i] + quoted + words[i + 1:]
    if words and os.path.basename(words[0]) == "ssh":
        i = _ssh_command_start(words)
        return words[:i] + quoted + words[i:]
    return ["env", *(f"{k}={v}" for k, v in env.items()), *words]


def _ssh_command_start(words: list[str]) -> int:
    """Index of the first word of ssh's remote command (the word after the destination)."""
    i = 1
    while i < len(words) and words[i].startswith("-") and words[i] != "--":
        flags = words[i][1:]
        takes = next((j for j, c in enumerate(flags) if c in _SSH_OPTS_WITH_ARG), None)
        i += 2 if takes == len(flags) - 1 else 1  # "-p 22" and "-vp 22": the value is the next word
    return min(i + (1 if i < len(words) and words[i] == "--" else 0) + 1, len(words))


class Stage:
    """A running worker process: buffered non-blocking writes, line-split reads, stderr tail, busy-time clock."""

    def __init__(self, index: int, launch: Launch, echo_stderr: bool = False):
        self.index = index
        self.proc: subprocess.Popen[bytes] | RayProcess
        if launch.launcher == RAY_LAUNCHER:
            self.proc = RayProcess(index, launch.num_stages, launch.remote_env(index), launch.ray or RayPlacement())
        else:
            env = {**os.environ, **launch.worker_env(index)}
            # Own session: the terminal's Ctrl-C reaches only the driver, which then stops the stages in order.
            self.proc = subprocess.Popen(launch.argv(index), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True, bufsize=0)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.in_fd, self.out_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.in_fd, False)
        for fd in (self.in_fd, self.out_fd):
            widen_pipe(fd)
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._stderr_thread = threading.Thread(target=self._read_stderr, args=(echo_stderr,), daemon=True,
                                               name=f"stage{index}-stderr")
        self._stderr_thread.start()
        self._outbuf, self._inbuf = bytearray(), bytearray()
        self.ready: dict[str, Any] | None = None
        self.eof = self.stdin_closed = False
        self._close_after_flush = False
        self.outstanding = self.requests = 0
        self.busy_s, self._busy_since = 0.0, 0.0
        self.last_progress = time.monotonic()  # a send to the idle stage, or its last reply: the step timeout's clock

    # --- writing --------------------------------------------------------------------------------------------
    def send(self, obj: dict[str, Any]) -> None:
        """Queue one request line and write what the pipe takes now; the rest goes out as ``flush`` is called."""
        if self.outstanding == 0:
            self._busy_since = self.last_progress = time.monotonic()
        self.outstanding += 1
        self.requests += 1
        self._outbuf += to_line(obj)
        self.flush()

    def flush(self) -> None:
        while self._outbuf and not self.stdin_closed:
            try:
                n = os.write(self.in_fd, self._outbuf)
            except BlockingIOError:
                return
            except (BrokenPipeError, OSError):  # it died; the stdout EOF tells the loop
                self._outbuf.clear()
                break
            del self._outbuf[:n]
        if self._close_after_flush and not self._outbuf:
            self.close_stdin()

    def wants_write(self) -> bool:
        return bool(self._outbuf) and not self.stdin_closed

    def close_stdin(self) -> None:
        if not self.stdin_closed:
            self.stdin_closed = True
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass

    def request_stop(self) -> None:
        """Ask for a clean exit: a shutdown op after whatever is queued, then end of input."""
        if not self.stdin_closed and not self.eof:
            self._outbuf += b'{"op":"shutdown","request_id":0}\n'
            self._close_after_flush = True
            self.flush()

    # --- reading --------------------------------------------------------------------------------------------
    def read_lines(self) -> list[bytes]:
        """Complete stdout lines available now (call when select says readable); sets ``eof`` at the end."""
        try:
            chunk = os.read(self.out_fd, 1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return [bytes(self._inbuf)] if self._inbuf else []
        if b"\n" not in chunk:  # only the new chunk is scanned: a multi-MB reply arrives in 64 KiB pieces
            self._inbuf += chunk
            return []
        *lines, rest = chunk.split(b"\n")
        lines[0] = bytes(self._inbuf) + lines[0]
        self._inbuf = bytearray(rest)
        return lines

    def busy_now(self) -> float:
        """Seconds with at least one request outstanding, the current stretch included (``busy_s`` counts a stretch
        once it ends)."""
        return self.busy_s + (time.monotonic() - self._busy_since if self.outstanding else 0.0)

    def replied(self) -> None:
        self.last_progress = time.monotonic()
        self.outstanding -= 1
        if self.outstanding == 0:
            self.busy_s += self.last_progress - self._busy_since

    def _read_stderr(self, echo: bool) -> None:
        for raw in self.proc.stderr:  # type: ignore[union-attr]
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if echo:
                print(f"[stage {self.index}] {line}", file=sys.stderr, flush=True)

    # --- reporting --------------------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Signal the worker and whatever its launcher started (its process group), unless it is reaped."""
        if isinstance(self.proc, RayProcess):
            self.proc.send_signal(sig)  # signalled on its node, by its actor
            return
        if self.proc.poll() is None:  # not reaped, so its pid (= group id) is still ours to signal
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def exit_description(self, wait_s: float = 2.0) -> str:
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return "closed its stdout but is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        return f"exited with code {code}"

    def stderr_lines(self) -> list[str]:
        self._stderr_thread.join(1.0)  # the last lines may still be in flight after the process ended
        return list(self.tail)

    def stderr_tail(self) -> str:
        return "\n".join(f"  | {line}" for line in self.stderr_lines()) or "  | (no stderr output)"


def stop_all(stages: list[Stage], grace_s: float = 5.0, term_s: float = 2.0,
             hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop every stage and reap it: shutdown op + end of input, then SIGTERM, then SIGKILL. Their stdout is
    drained meanwhile, since a stage blocked writing a reply nobody reads could never exit."""
    for st in stages:
        st.request_stop()
    _wait_exit(stages, grace_s, hurry)
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 5.0)):
        for st in stages:
            if st.proc.poll() is None:
                st.signal(sig)
        _wait_exit(stages, 0.0 if sig == signal.SIGTERM and hurry() else wait_s, lambda: False)
    for st in stages:
        st.close_stdin()


def _wait_exit(stages: list[Stage], timeout_s: float, hurry: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while not hurry():
        alive = [st for st in stages if st.proc.poll() is None]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return
        r = wait_io(alive, min(left, 0.05))
        for st in alive:
            if st.out_fd in r:
                st.read_lines()


def wait_io(stages: list[Stage], timeout_s: float, extra_fds: list[int] | None = None) -> list[int]:
    """Wait until a stage's stdout (or an extra fd) is readable or a stage can take queued input; write what it
    takes now and return the readable fds."""
    reading = [st.out_fd for st in stages if not st.eof] + (extra_fds or [])
    writing = [st.in_fd for st in stages if st.wants_write()]
    r, w, _ = select.select(reading, writing, [], timeout_s)
    for st in stages:
        if st.in_fd in w:
            st.flush()
    return r
