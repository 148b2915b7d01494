"""The serving loop: read a line, get its reply, write it. It owns I/O only and never raises on input.

Lines are read by ``LineReader`` straight from the file descriptor when there is one, so the loop can also
wait on a wake-up pipe: a signal (through ``signal.set_wakeup_fd``) or the heartbeat thread seeing stdout
closed interrupts the wait without an exception in the middle of a request.
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass
from typing import BinaryIO

from pp_worker.worker.dispatch import Worker
from pp_worker.worker.stdout import Out, StdoutClosed

CHUNK = 1 << 20


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


OVERLONG = _Marker("OVERLONG")  # a line longer than the cap (its bytes were dropped as they came)
WOKEN = _Marker("WOKEN")  # the wake-up pipe fired


class LineReader:
    """Lines of at most ``cap`` bytes from a binary stream. Longer lines are discarded chunk by chunk and
    reported as OVERLONG, so a line of hundreds of MB never sits in memory."""

    def __init__(self, stream: BinaryIO, cap: int, wake_fd: int | None = None):
        self.stream, self.cap, self.wake_fd = stream, cap, wake_fd
        self._fd = _fileno(stream) if wake_fd is not None else None
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self._discarding = False

    def next_line(self) -> bytes | _Marker | None:
        """The next line without its newline, OVERLONG, WOKEN, or None at end of input."""
        while True:
            nl = self._buf.find(b"\n", self._scanned)
            if nl >= 0:
                with memoryview(self._buf) as view:  # one copy of a multi-MB line, not two
                    line = bytes(view[:nl])
                del self._buf[: nl + 1]
                self._scanned = 0
                if self._discarding or nl > self.cap:
                    self._discarding = False
                    return OVERLONG
                return line
            if self._discarding or len(self._buf) > self.cap:
                self._discarding = True
                self._buf.clear()
            self._scanned = len(self._buf)
            chunk = self._read()
            if chunk is WOKEN:
                return WOKEN
            if not chunk:
                return self._at_eof()
            self._buf += chunk

    def ready_lines(self, limit: int) -> list[bytes]:
        """Up to ``limit`` more complete, non-blank lines that are here already (buffered, or readable without
        waiting), for the worker to batch. Never blocks; a partial or overlong line is left to `next_line`."""
        if self._discarding:
            return []
        if self._fd is not None and select.select([self._fd], [], [], 0)[0]:
            self._buf += os.read(self._fd, CHUNK)  # b"" at end of input: next_line sees it again
        lines: list[bytes] = []
        while len(lines) < limit:
            nl = self._buf.find(b"\n")
            if nl < 0 or nl > self.cap:
                break
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            self._scanned = 0
            if not is_blank(line):
                lines.append(line)
        return lines

    def _at_eof(self) -> bytes | _Marker | None:
        if self._discarding:
            self._discarding = False
            return OVERLONG
        if self._buf:  # a last line without its newline still gets a reply
            line = bytes(self._buf)
            self._buf.clear()
            self._scanned = 0
            return line
        return None

    def _read(self) -> bytes | _Marker:
        if self._fd is None:
            read1 = getattr(self.stream, "read1", None)
            return read1(CHUNK) if read1 else self.stream.read(CHUNK)
        ready, _, _ = select.select([self._fd, self.wake_fd], [], [])
        if self.wake_fd in ready:
            _drain(self.wake_fd)
            return WOKEN
        return os.read(self._fd, CHUNK)


def _fileno(stream: BinaryIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


@dataclass
class LoopState:
    """Shared with the signal handler: which signal asked us to stop, whether a request is in flight, and
    whether we are still loading (nothing to finish: a signal then stops the process at once)."""

    signum: int | None = None
    busy: bool = False
    loading: bool = True


def serve(reader: LineReader, out: Out, worker: Worker, state: LoopState) -> str:
    """Serve until end of input, a signal, a shutdown request or a closed stdout; return which (the reason)."""
    try:
        while state.signum is None:
            line = reader.next_line()
            if line is None:
                return "eof"
            if line is WOKEN:  # a signal (the loop condition sees it) or the heartbeat found stdout closed
                if out.closed:
                    return "stdout_closed"
                continue
            if isinstance(line, bytes) and is_blank(line):
                continue  # as the seed did: a reply without a request id would desynchronise a caller matching by order
            state.busy = True
            if isinstance(line, bytes):  # with the requests already queued behind it, which may share a forward
                replies = worker.serve(worker.prepare_lines([line, *reader.ready_lines(worker.engine.max_batch - 1)]))
            else:
                replies = iter([_overlong(reader.cap)])
            for reply in replies:
                out.write(reply)
                worker.clock.requests_served += 1
                if state.signum is not None:  # finish the request in flight, not the ones read ahead
                    break
            state.busy = False
            if worker.shutdown_requested:
                return "shutdown"
        return "signal"
    except StdoutClosed:
        return "stdout_closed"


def is_blank(line: bytes) -> bool:
    """Whitespace only, as Python's ``str.strip`` sees it (the seed's test), without decoding a request line: one
    that starts with a printable ASCII character after its ASCII whitespace cannot be blank."""
    stripped = line.strip()
    if not stripped or 0x21 <= stripped[0] <= 0x7E:
        return not stripped
    try:
        return not line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def _overlong(cap: int) -> dict[str, str]:
    return {"error": f"line longer than the {cap}-byte limit (PP_MAX_LINE_BYTES); it was discarded"}
