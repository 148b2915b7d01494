"""Section 7: the HTTP endpoint's throughput (``pp-serve``), requests/s and tokens/s at 1, 4 and 8 concurrent clients.

The server runs as a user runs it (``python -m pp_worker.serve`` in its own process, the embedded model, warm
workers); each client thread sends non-streamed greedy completions back to back over HTTP on 127.0.0.1 with the
standard library (a light client: on 2 cores the client's own CPU time competes with the server's). Every level
sends the same requests, shared out among its clients; its rates are counted over its wall time, from the first
request sent to the last answer received.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from pp_worker import DEFAULT_MODEL

# prompts the embedded model knows: it was trained on the Zen of Python
PROMPTS = ["Beautiful is better than", "Explicit is better", "Simple is", "Complex is better than", "Flat is",
           "Sparse is better than", "Readability", "Special cases aren't special enough"]
QUIET = {"PP_WARMUP": "1", "PP_HEARTBEAT_S": "3600"}


@dataclass(frozen=True)
class ServePlan:
    stages: int = 2
    levels: tuple[int, ...] = (1, 4, 8)  # concurrent clients
    requests: int = 32  # per level, shared out among its clients: every level does the same work
    max_tokens: int = 32


class Endpoint:
    """A pp-serve process on a free port of 127.0.0.1; ``close`` stops it (SIGTERM) and its stages."""

    def __init__(self, stages: int, concurrency: int, env: dict[str, str] | None = None, warm: bool = True,
                 model: str | None = None):
        """``warm``: the stages compile every forward before the server listens (PP_WARMUP=1); ``env``: more;
        ``model``: a GGUF file (default: the embedded model)."""
        args = ["--stages", str(stages), "--port", "0", "--concurrency", str(concurrency), "--log-level", "warning",
                *(["--model", model] if model else [])]
        env = {**os.environ, **(QUIET if warm else {}), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "pp_worker.serve", *args], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # the stages' progress, then the address
            if m := re.search(r"listening on (http://\S+)", line):
                self.url = m.group(1)
                break
        else:
            raise RuntimeError(f"pp-serve exited with {self.proc.wait()} before listening")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # never let its stderr fill up

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = json.dumps({"model": "zen", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def stream(self, prompt: str, max_tokens: int) -> int:
        """A streamed greedy completion read to its end; the number of events."""
        body = json.dumps({"model": "zen", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        events = 0
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    return events
                events += line.startswith(b"data: ")
        raise RuntimeError("a stream ended without [DONE]")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(plan: ServePlan) -> dict[str, Any]:
    """{"levels": {clients: {requests, tokens, wall_s, rps, tps, p50_s}}, "model": ..., "stages": ...}."""
    t0 = time.monotonic()
    e = Endpoint(plan.stages, max(plan.levels))
    out: dict[str, Any] = {"model": DEFAULT_MODEL.name, "stages": plan.stages, "max_tokens": plan.max_tokens,
                           "ready_s": round(time.monotonic() - t0, 1), "levels": {}}
    try:
        for p in PROMPTS:  # every prompt once: whatever compiles on first use has compiled
            e.complete(p, plan.max_tokens)
        for clients in plan.levels:
            out["levels"][str(clients)] = _level(e, clients, plan)
    finally:
        e.close()
    return out


def _level(e: Endpoint, clients: int, plan: ServePlan) -> dict[str, Any]:
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(plan.requests // clients):
            t = time.monotonic()
            reply = e.complete(PROMPTS[(i + r) % len(PROMPTS)], plan.max_tokens)
            with lock:
                latencies.append(time.monotonic() - t)
                tokens[0] += reply["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"requests": len(latencies), "tokens": tokens[0], "wall_s": round(wall, 3), "rps": len(latencies) / wall,
            "tps": tokens[0] / wall, "p50_s": statistics.median(latencies)}
