"""A real ``pp-serve`` for tests: ``python -m pp_worker.serve`` in its own process on 127.0.0.1 (a free port it
picks itself), its output (stderr, and stdout where uvicorn writes its access log) collected by a thread, and the
official ``openai`` client pointed at it; with ``key``, every request carries that API key.

Nothing here may hang a test: every wait has a deadline, and ``stop`` kills what SIGTERM did not stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from conftest import REPO, clean_env
from prometheus_client.parser import text_string_to_metric_families

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class Server:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout: float = 180.0,
                 key: str | None = None):
        self.key = key
        self.proc = subprocess.Popen([sys.executable, "-m", "pp_worker.serve", "--port", "0", *args], cwd=REPO,
                                     env={**clean_env(), **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()  # type: ignore
        self.url = self._wait_listening(ready_timeout)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if m := next((LISTENING.search(line) for line in list(self.lines) if LISTENING.search(line)), None):
                return m.group(1)
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"pp-serve did not start listening: {self.stderr}")

    @property
    def stderr(self) -> str:
        """Everything the server wrote (its access log on stdout too)."""
        return "".join(self.lines)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, **kw)

    def request(self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                method: str | None = None) -> tuple[int, Any]:
        """A plain HTTP request (GET, or POST with a JSON ``body``): (status, parsed JSON body)."""
        status, _, raw = self.fetch(path, body, headers, method)
        return status, json.loads(raw)

    def fetch(self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
              method: str | None = None) -> tuple[int, dict[str, str], bytes]:
        """A plain HTTP request with the server's key unless ``headers`` say otherwise: (status, headers, body)."""
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {}),
                **(headers or {})}
        req = urllib.request.Request(self.url + path, data=body, headers={k: v for k, v in sent.items() if v},
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` as parsed by prometheus_client: (sample name, sorted labels) -> value."""
        status, headers, raw = self.fetch("/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4"), (status, headers)
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(raw.decode()) for sample in family.samples}

    def get(self, path: str) -> Any:
        status, body = self.request(path)
        assert status == 200, (path, status, body)
        return body

    def stage_pids(self) -> list[int]:
        return [s["pid"] for s in self.get("/stages")["stages"]]

    def sessions(self) -> list[dict[str, int]]:
        """Each stage's live KV sessions (request id -> positions), from the workers' own status replies: those of
        generations running, not the ones finished requests left as cache for prefix reuse (``cached``)."""
        return [{k: n for k, n in s["sessions"].items() if int(k) not in s["cached_sessions"]}
                for s in self.get("/stages")["stages"]]

    def cached(self) -> list[list[int]]:
        """Each stage's sessions held as cache (prefix reuse), least recently used first."""
        return [s["cached_sessions"] for s in self.get("/stages")["stages"]]

    def wait_for(self, what: str, check: Any, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout} s; server stderr:\n{self.stderr[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the server (as a service manager would) and reap it; its exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            pytest.fail(f"pp-serve still running {timeout} s after {signal.Signals(sig).name}: {self.stderr[-3000:]}")


def request_id(response_id: str) -> str:
    """The pipeline request id in a response id (``cmpl-<id>-<run>``): the key of its KV sessions, unless it took
    a cached one (prefix reuse: ``cache_prompt``)."""
    return response_id.split("-")[1]
