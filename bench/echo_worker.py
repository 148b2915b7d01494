"""A worker process whose engine hands the hidden state straight back, at a realistic hidden size.

It runs pp_worker's real loop, validation and codec (``LineReader`` -> ``Worker.handle_line`` -> ``Out``), so a
round trip through it measures the protocol path of a prefill payload and nothing else. The stub worker cannot:
its hidden size is fixed at 16 and its fake compute (a SHA-256 stream per value) would dominate.

    python -m bench.echo_worker 4096 [q8]     # hidden_dim [wire dtype]; a middle stage: answers forward_range
"""

from __future__ import annotations

import dataclasses
import os
import sys

from pp_worker.worker.dispatch import Worker
from pp_worker.worker.engines.stub import StubEngine
from pp_worker.worker.events import Clock
from pp_worker.worker.loop import LineReader, LoopState, serve
from pp_worker.worker.stdout import Out

LINE_CAP = 256 << 20


class EchoEngine(StubEngine):
    """The stub as a middle stage, with ``hidden_dim`` wide hidden states that pass through unchanged."""

    def __init__(self, hidden_dim: int):
        super().__init__(1, 3)
        self.info = dataclasses.replace(self.info, hidden_dim=hidden_dim)

    def forward_range(self, session: int, hidden: bytes, position: int, seq_len: int) -> bytes:
        return hidden


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    hidden_dim = int(args[0]) if args else 4096
    out = Out(sys.stdout.buffer)
    worker = Worker(EchoEngine(hidden_dim), Clock(), "echo", args[1] if len(args) > 1 else "f16")
    wake_r, _wake_w = os.pipe()  # never written: the reader then waits with select + os.read, as the worker does
    out.write({"status": "ready", "hidden_dim": hidden_dim, "pid": os.getpid()})
    serve(LineReader(sys.stdin.buffer, LINE_CAP, wake_fd=wake_r), out, worker, LoopState())
    return 0


if __name__ == "__main__":
    sys.exit(main())
