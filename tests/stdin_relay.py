"""A stage launcher for tests that must know when a stage has taken a request, without timing it:

    python stdin_relay.py LOG -- CMD ARGS...

execs CMD (the worker keeps this process's pid and process group, as the contract wants) with its stdin fed through
a pipe by a forked child. The child passes each line on, waits until the worker has read it out of the pipe, then
appends the line's op to LOG: a test that sees ``embed_and_forward`` there knows the worker is in that op (its
reply, with PP_STUB_DELAY_MS long, comes much later). The child ends at the end of its stdin (the driver gone) or
when the worker is.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import sys
import termios


def _unread(fd: int) -> int:
    """Bytes written to the pipe that the worker has not read yet."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def _read_by_worker(fd: int) -> bool:
    """Wait until the worker has read everything written; False when it is gone (no reader: POLLERR)."""
    poller = select.poll()
    poller.register(fd, select.POLLERR)
    while _unread(fd):
        if poller.poll(10):
            return False
    return True


def _op(line: bytes) -> str:
    try:
        return str(json.loads(line).get("op"))
    except (ValueError, AttributeError):
        return "?"


def relay(log_path: str, out: int) -> None:
    buf = b""
    with open(log_path, "a", encoding="utf-8") as log:
        while chunk := os.read(0, 1 << 16):
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                data = memoryview(line + b"\n")
                while data:
                    data = data[os.write(out, data):]
                if not _read_by_worker(out):
                    return
                log.write(_op(line) + "\n")
                log.flush()


def main() -> None:
    log_path, cmd = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the worker's stdout is the worker's alone: its end is its EOF
        try:
            relay(log_path, w)
        finally:
            os._exit(0)  # closing the pipe: the worker's end of input
    os.close(w)
    os.dup2(r, 0)
    os.close(r)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
