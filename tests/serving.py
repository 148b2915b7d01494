"""A real ``pp-serve`` for tests: ``python -m pp_worker.serve`` in its own process on 127.0.0.1 (a free port it
picks itself), its stderr collected by a thread, and the official ``openai`` client pointed at it.

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

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class Server:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout: float = 180.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "pp_worker.serve", "--port", "0", *args], cwd=REPO,
                                     env={**clean_env(), **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()  # type: ignore
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
        return "".join(self.lines)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kw)

    def request(self, path: str, body: bytes | None = None) -> tuple[int, Any]:
        """A plain HTTP request (GET, or POST with a JSON ``body``): (status, parsed JSON body)."""
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> Any:
        status, body = self.request(path)
        assert status == 200, (path, status, body)
        return body

    def stage_pids(self) -> list[int]:
        return [s["pid"] for s in self.get("/stages")["stages"]]

    def sessions(self) -> list[dict[str, int]]:
        """Each stage's KV sessions (request id -> positions), from the workers' own status replies."""
        return [s["sessions"] for s in self.get("/stages")["stages"]]

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
    """The pipeline request id in a response id (``cmpl-<id>-<run>``): the key of its KV sessions."""
    return response_id.split("-")[1]
