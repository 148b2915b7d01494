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
