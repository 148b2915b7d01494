"""The protocol stream: a private handle on the real stdout, and the one writer of protocol lines.

``Out`` writes one whole line per call under one lock, so the heartbeat thread and the main loop never
interleave. ``protect_stdout`` points fd 1 and ``sys.stdout`` at stderr, so nothing a library prints (Python or
C; tinygrad with ``DEBUG`` set) can reach the protocol stream.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, BinaryIO

from pp_worker.wire import to_line, widen_pipe


class StdoutClosed(Exception):
    """The reader of our stdout went away; nobody can hear us any more."""


class Out:
    """Writes JSON objects as lines to a binary stream, whole and in order."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.closed = False
        self._exit: tuple[int, list[bytes]] | None = None  # set by exit_between_lines: (status, last lines)

    def write(self, obj: dict[str, Any]) -> None:
        line = to_line(obj)
        try:
            with self._lock:
                self._write_locked(line)
        finally:
            if self._exit is not None:  # a signal asked for an exit while this line was being written
                self._lock.acquire()  # held until the exit: no other thread starts a line that would be cut
                self._exit_now()

    def exit_between_lines(self, status: int, last: list[dict[str, Any]]) -> None:
        """For a signal handler: write ``last`` and exit the process with ``status``, never cutting a line in two.
        With no line being written this happens now; otherwise the writer does it as soon as its line is complete.
        The handler must not wait for the lock: the write it interrupted may be the one holding it."""
        self._exit = (status, [to_line(obj) for obj in last])  # set before trying the lock: see write's finally
        if self._lock.acquire(blocking=False):
            self._exit_now()

    def _exit_now(self) -> None:
        """With the lock held: the last lines, then the exit (no unwinding, no atexit: nothing is left to finish)."""
        assert self._exit is not None
        status, lines = self._exit
        try:
            for line in lines:
                self._write_locked(line)
        except StdoutClosed:
            pass
        os._exit(status)

    def _write_locked(self, line: bytes) -> None:
        if self.closed:
            raise StdoutClosed()
        try:
            self._stream.write(line)
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError) as e:  # ValueError: stream already closed
            self.closed = True
            raise StdoutClosed() from e


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
