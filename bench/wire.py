"""Protocol overhead without a model: round trips through a stub worker, and the hidden-state payload path.

Three honest variants, each labelled in the table:
- one request in flight: the client encodes each request and parses each reply as the driver does, so this is
  the latency of a hop (two pipe wake-ups and both sides' JSON work). Client and worker are pinned, on one CPU
  or on two: on two, every wake-up of an idle (virtual) CPU costs tens of microseconds on this kind of machine,
  and unpinned the scheduler picks either placement from run to run. A bare line echo gives the floor of each;
- many in flight: requests pre-encoded and written by a thread, replies only counted, so this is what one
  stage can serve per second (its capacity) when the pipe never runs dry;
- the payload path: the codec in-process, and the pipe round trip of a 512 x 4096 fp16 payload through
  ``bench.echo_worker`` (pp_worker's loop and codec around an engine that hands the input back); both also with
  the payload in q8 (``PP_WIRE_DTYPE=q8``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pp_worker.wire import encode_payload, to_line, widen_pipe
from pp_worker.worker import q8
from pp_worker.worker.protocol import decode_hidden

REPO = Path(__file__).resolve().parent.parent  # workers run from here, so ``-m bench...`` resolves anywhere
STUB_HIDDEN = 16
PLACEMENTS = {"one CPU": (0, 0), "two CPUs": (0, 1)}  # (client CPU, worker CPU)


def placements() -> dict[str, tuple[int, int]]:
    """The placements this machine can pin (none without sched_setaffinity, one CPU only on a 1-CPU machine)."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    cpus = os.sched_getaffinity(0)
    return {name: p for name, p in PLACEMENTS.items() if set(p) <= cpus}


@contextmanager
def client_on(cpu: int | None) -> Iterator[None]:
    """Pin this process to ``cpu`` for the block (no-op for None)."""
    if cpu is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _pin(pid: int, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(pid, {cpu})


class RawWorker:
    """A worker process driven line by line, with no driver in between; optionally pinned to one CPU."""

    def __init__(self, argv: list[str], env: dict[str, str], cpu: int | None = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PP_HEARTBEAT_S": "3600", **env}, cwd=REPO)
        assert self.proc.stdin and self.proc.stdout
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        for pipe in (self.stdin, self.stdout):
            widen_pipe(pipe.fileno())  # as the driver does
        _pin(self.proc.pid, cpu)
        while json.loads(self.line()).get("status") != "ready":
            pass

    @classmethod
    def stub(cls, stage: int, num_stages: int, cpu: int | None = None) -> RawWorker:
        return cls([sys.executable, "-m", "pp_worker"],
                   {"STAGE": str(stage), "NUM_STAGES": str(num_stages), "PP_WORKER_STUB": "1"}, cpu)

    @classmethod
    def echo(cls, hidden_dim: int, wire_dtype: str = "f16") -> RawWorker:
        return cls([sys.executable, "-m", "bench.echo_worker", str(hidden_dim), wire_dtype], {})

    def line(self) -> bytes:
        """The next stdout line that is not an event."""
        while True:
            raw = self.stdout.readline()
            if not raw:
                raise RuntimeError("the worker closed its stdout")
            if not raw.startswith(b'{"event"'):
                return raw

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.stdin.write(to_line(obj))  # as the driver writes a hop: the base64 payload spliced in, not escaped
        self.stdin.flush()
        reply = json.loads(self.line())
        if "error" in reply:
            raise RuntimeError(f"worker error: {reply['error']}")
        return reply

    def close(self) -> None:
        self.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def hop(seq_len: int, hidden_dim: int, position: int = 0, dtype: str = "f16") -> dict[str, Any]:
    """A forward_range request carrying a (1, seq_len, hidden_dim) payload: fp16 zeros, or (q8) an activation-like
    state in q8."""
    if dtype == "f16":
        b64 = encode_payload(bytes(seq_len * hidden_dim * 2))
        return {"op": "forward_range", "request_id": 1, "hidden_b64": b64, "position": position, "seq_len": seq_len}
    b64 = encode_payload(q8.encode(hidden_state(seq_len, hidden_dim), hidden_dim))
    return {"op": "forward_range", "request_id": 1, "hidden_b64": b64, "position": position, "seq_len": seq_len,
            "hidden_dtype": dtype}


def hidden_state(seq_len: int, hidden_dim: int) -> bytes:
    """fp16 (1, seq_len, hidden_dim) that looks like activations: normal values with a few large channels (random
    bytes would hold inf and NaN, which q8 refuses)."""
    x = np.random.default_rng(0).standard_normal((seq_len, hidden_dim), dtype=np.float32)
    x[:, ::97] *= 20
    return x.astype("<f2").tobytes()


def payload_chars(dtype: str, hidden_dim: int) -> int:
    """base64 characters of one token's hidden state on the wire (a decode step's payload)."""
    row = hidden_state(1, hidden_dim)
    return len(encode_payload(row if dtype == "f16" else q8.encode(row, hidden_dim)).data)


def sequential_rate(w: RawWorker, n: int, seq_len: int = 1, hidden_dim: int = STUB_HIDDEN) -> float:
    """Round trips per second with one request in flight; each request encoded, each reply parsed."""
    req = hop(seq_len, hidden_dim)
    w.request(req)  # first-use costs out of the way
    t0 = time.perf_counter()
    for i in range(n):
        w.request(req | {"position": i % 4000})
    return n / (time.perf_counter() - t0)


ECHO_LINES = "import sys\nfor line in sys.stdin.buffer:\n    sys.stdout.buffer.write(line)\n    sys.stdout.flush()\n"


def pipe_floor_rate(n: int, cpu: int | None = None, hidden_dim: int = STUB_HIDDEN) -> float:
    """Round trips per second of a bare line echo (a Python child copying stdin lines to stdout, no JSON; on
    ``cpu`` if given) of a one-token hop's line: the floor that pipe wake-ups alone put under a one-in-flight
    round trip."""
    proc = subprocess.Popen([sys.executable, "-c", ECHO_LINES], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin and proc.stdout
    _pin(proc.pid, cpu)
    line = to_line(hop(1, hidden_dim))
    try:
        t0 = 0.0
        for i in range(n + 1):
            if i == 1:
                t0 = time.perf_counter()  # the first trip waits for the child to start
            proc.stdin.write(line)
            proc.stdin.flush()
            proc.stdout.readline()
        return n / (time.perf_counter() - t0)
    finally:
        proc.stdin.close()
        proc.wait(10)


def pipelined_rate(w: RawWorker, n: int) -> float:
    """Round trips per second with up to ``n`` requests in flight (a writer thread keeps the pipe full)."""
    blob = b"".join(to_line(hop(1, STUB_HIDDEN, i % 4000))
                    for i in range(n))

    def write() -> None:
        w.stdin.write(blob)
        w.stdin.flush()

    writer = threading.Thread(target=write, daemon=True)
    t0 = time.perf_counter()
    writer.start()
    errors = sum(b'"error"' in w.line() for _ in range(n))
    elapsed = time.perf_counter() - t0
    writer.join()
    if errors:
        raise RuntimeError(f"{errors} of {n} pipelined requests failed")
    return n / elapsed


@dataclass
class Payload:
    mb: float  # payload size in MB (10^6 bytes), one direction
    seconds: float  # per round trip (or per encode + decode, in-process)

    @property
    def mb_per_s(self) -> float:
        return self.mb / self.seconds if self.seconds > 0 else 0.0


def codec_rate(seq_len: int, hidden_dim: int, reps: int, dtype: str = "f16") -> Payload:
    """In-process, per rep: what a stage does to send a hidden state (q8: quantize, then base64) and what the next
    does to read it (``decode_hidden``: validate, base64, q8: back to fp16). MB are those of the fp16 state."""
    data = hidden_state(seq_len, hidden_dim)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        text = str(encode_payload(data if dtype == "f16" else q8.encode(data, hidden_dim)))
        back = decode_hidden({"hidden_b64": text, "hidden_dtype": dtype}, seq_len, hidden_dim)
        best = min(best, time.perf_counter() - t0)
    assert len(back) == len(data) and (dtype != "f16" or back == data)
    return Payload(len(data) / 1e6, best)


def round_trip_rate(w: RawWorker, seq_len: int, hidden_dim: int, reps: int, dtype: str = "f16") -> Payload:
    """Median round trip of one forward_range carrying the payload out and back; the client builds the request
    and parses the reply with json as the driver does, but never base64-decodes (neither does the driver). MB are
    those of the fp16 state, whatever ``dtype`` carries it."""
    req = hop(seq_len, hidden_dim, dtype=dtype)
    w.request(req)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        reply = w.request(req)
        times.append(time.perf_counter() - t0)
    assert len(reply["hidden_b64"]) == len(str(req["hidden_b64"]))
    times.sort()
    return Payload(seq_len * hidden_dim * 2 / 1e6, times[len(times) // 2])
