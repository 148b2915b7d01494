"""A link between machines, in user space: a one-way delay and a bandwidth cap in front of a stage (as tc netem would
add on a real interface, without root).

    python bench/relay.py --delay-ms 5 --rate-mbit 100 -- python -m pp_worker

starts the command with pipes and relays its stdin and stdout through a link each way: every chunk is sent after
the ones before it (at ``rate`` bytes a second) and arrives ``delay`` later. stderr is the command's own. The relay
waits for the command and exits with its status; the end of its stdin reaches the command's stdin the same way (so
the worker's PP_EXIT_ON_EOF sees its driver gone). As a ``--launcher`` (bench.links) it stands where ssh would.
"""

from __future__ import annotations

import argparse
import heapq
import os
import subprocess
import sys
import threading
import time
from typing import BinaryIO


class Link:
    """One direction: chunks in, the same chunks out, each ``delay_s`` after it was serialized at ``rate``."""

    def __init__(self, delay_s: float, rate: float | None, out: BinaryIO):
        self.delay_s, self.rate, self.out = delay_s, rate, out
        self._queue: list[tuple[float, int, bytes | None]] = []  # (due, order, chunk; None: close)
        self._wire_free = 0.0  # when the link has sent everything before
        self._order = 0
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._deliver, daemon=True)
        self.thread.start()

    def put(self, chunk: bytes | None) -> None:
        now = time.monotonic()
        with self._cond:
            if chunk and self.rate:
                self._wire_free = max(self._wire_free, now) + len(chunk) / self.rate
            due = max(self._wire_free, now) + self.delay_s
            heapq.heappush(self._queue, (due, self._order, chunk))
            self._order += 1
            self._cond.notify()

    def _deliver(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._queue[0][0] > time.monotonic():
                    self._cond.wait(self._queue[0][0] - time.monotonic() if self._queue else None)
                _, _, chunk = heapq.heappop(self._queue)
            try:
                if chunk is None:
                    self.out.close()
                    return
                self.out.write(chunk)
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                return


def pump(src: BinaryIO, link: Link) -> None:
    while chunk := os.read(src.fileno(), 1 << 16):
        link.put(chunk)
    link.put(None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/relay.py", description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth cap each way, Mbit/s (0: none)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rate = args.rate_mbit * 1e6 / 8 if args.rate_mbit > 0 else None
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    down = Link(args.delay_ms / 1000, rate, proc.stdin)  # type: ignore[arg-type]
    up = Link(args.delay_ms / 1000, rate, sys.stdout.buffer)
    threading.Thread(target=pump, args=(sys.stdin.buffer, down), daemon=True).start()
    pump(proc.stdout, up)  # type: ignore[arg-type]
    up.thread.join()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
