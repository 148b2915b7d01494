"""stdout discipline and lifecycle events.

``Out`` is the only writer of protocol lines: one lock, one whole line per write, so the heartbeat thread and
the main loop never interleave. Events carry ``event`` and ``stage_index`` and never ``request_id`` (the
caller would mistake them for replies).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

from pp_worker.protocol import B64


class StdoutClosed(Exception):
    """The reader of our stdout went away; nobody can hear us any more."""


_ENCODER = json.JSONEncoder(allow_nan=False)  # built once: json.dumps with an argument builds one per call


def to_line(obj: dict[str, Any]) -> bytes:
    """One JSON line. A base64 payload (``protocol.B64``, megabytes on a prefill) is spliced in as is: it needs
    no escaping, and json.dumps would spend ~10 ms scanning a 5 MB one for characters to escape."""
    payloads = {k: v for k, v in obj.items() if isinstance(v, B64)}
    if not payloads:
        return (_ENCODER.encode(obj) + "\n").encode("ascii")
    text = _ENCODER.encode({k: "" if k in payloads else v for k, v in obj.items()})
    parts = []
    for key, value in payloads.items():
        head, sep, text = text.partition(_ENCODER.encode(key) + ': "')
        parts += [head.encode("ascii"), sep.encode("ascii"), value.data]
    return b"".join([*parts, text.encode("ascii"), b"\n"])


class Out:
    """Writes JSON objects as lines to a binary stream, whole and in order."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.closed = False

    def write(self, obj: dict[str, Any]) -> None:
        line = to_line(obj)
        with self._lock:
            self._write_locked(line)

    def write_if_free(self, obj: dict[str, Any]) -> None:
        """Write only if no other write is under way (a signal handler must never wait on the lock: the write
        it interrupted may be holding it). Best effort; never raises."""
        if self._lock.acquire(blocking=False):
            try:
                self._write_locked(to_line(obj))
            except StdoutClosed:
                pass
            finally:
                self._lock.release()

    def _write_locked(self, line: bytes) -> None:
        if self.closed:
            raise StdoutClosed()
        try:
            self._stream.write(line)
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError) as e:  # ValueError: stream already closed
            self.closed = True
            raise StdoutClosed() from e


class Clock:
    """Uptime and request counter shared by events, heartbeats and status."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests_served = 0

    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)


def rss_mb() -> int | None:
    """Resident set size in MB (Linux /proc); None where unavailable."""
    return _proc_status_mb("VmRSS:")


def peak_rss_mb() -> int | None:
    return _proc_status_mb("VmHWM:")


def _proc_status_mb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Events:
    """Emits lifecycle events; best effort: a closed stdout never raises from here."""

    def __init__(self, out: Out, stage_index: int, clock: Clock):
        self.out, self.stage_index, self.clock = out, stage_index, clock

    def emit(self, kind: str, **fields: Any) -> None:
        try:
            self.out.write(self._event(kind, fields))
        except StdoutClosed:
            pass

    def emit_if_free(self, kind: str, **fields: Any) -> None:
        """For a signal handler: written only if no other line is being written (``Out.write_if_free``)."""
        self.out.write_if_free(self._event(kind, fields))

    def _event(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        fields.pop("request_id", None)  # an event must never look like a reply
        return {"event": kind, "stage_index": self.stage_index, **fields}

    def heartbeat(self) -> None:
        self.emit("heartbeat", uptime_ms=self.clock.uptime_ms(), rss_mb=rss_mb(),
                  requests_served=self.clock.requests_served)


def start_heartbeat(events: Events, interval_s: float, on_closed: Callable[[], None]) -> threading.Event:
    """A daemon thread emitting ``heartbeat`` every ``interval_s``; set the returned Event to stop it.
    When stdout turns out closed, ``on_closed`` wakes the main loop so the process exits promptly."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            events.heartbeat()
            if events.out.closed:
                on_closed()
                return

    threading.Thread(target=run, name="pp-worker-heartbeat", daemon=True).start()
    return stop


def install_excepthook(events: Events) -> None:
    """Report any uncaught exception as an event before the usual traceback on stderr."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        events.emit("uncaught_exception", type=exc_type.__name__, value=str(exc), traceback=text,
                    uptime_ms=events.clock.uptime_ms())
        sys.__excepthook__(exc_type, exc, tb)

    sys.excepthook = hook


def widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Ask for a 1 MiB pipe buffer (default 64 KiB): a multi-MB prefill payload then crosses in a few wake-ups
    instead of ~90. Best effort: not a pipe, another OS, or above /proc/sys/fs/pipe-max-size is fine."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (OSError, ImportError, AttributeError, ValueError):  # AttributeError: not Linux
        pass


def protect_stdout() -> BinaryIO:
    """Keep a private handle on the real stdout for protocol lines and point fd 1 and ``sys.stdout`` at stderr,
    so nothing a library prints (Python or C) can corrupt the protocol stream."""
    sys.stdout.flush()
    for std in (0, 1):
        widen_pipe(std)
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "wb")
