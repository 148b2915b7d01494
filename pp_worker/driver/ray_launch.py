"""``--launcher ray``: Ray places the stages. Each stage's worker runs inside a Ray actor (one per stage, with the
stage's resource request) on the node Ray chose, and the same JSON lines are piped through the actor.

The driver's select loop wants file descriptors, so each stage is a ``RayProcess``: a stand-in for a Popen whose
stdin, stdout and stderr are local pipes, fed and drained by two threads that call the actor (``write``, ``read``).
Exit codes and stderr reach the driver as they would from a local process, so failure reports look the same.

Ray is an optional extra (``pip install 'pp_worker[ray]'``), imported only here and only when a stage is started
this way. ``ray.init()`` with no address starts a local cluster; with one (``ray start --head`` prints it), the
stages go wherever the cluster has room, and pp_worker must be installed on every node.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

RAY_LAUNCHER = "ray"
_READ_WAIT_S = 1.0  # a read call returns as soon as there is output, else after this long (then asks again)
_ACTOR_LOST = 1  # the exit code reported when the actor or its node died: the worker's own is unknowable


@dataclass(frozen=True)
class RayPlacement:
    """Which cluster, and what each stage's actor asks for (Ray's ``num_cpus`` / ``num_gpus``)."""

    address: str | None = None  # None: RAY_ADDRESS if set, else a new local cluster
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def resources(self) -> dict[str, float]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


class StageActor:
    """Lives in the Ray actor, on the node Ray chose: starts the worker there and buffers its output for ``read``."""

    def __init__(self, env: dict[str, str]):
        # The actor holds the only write end of the worker's stdin: if the actor dies, the worker reads EOF and exits.
        self.proc = subprocess.Popen([sys.executable, "-m", "pp_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env},
                                     start_new_session=True, bufsize=0)
        self._cond = threading.Condition()
        self._out, self._err = bytearray(), bytearray()
        self._open = 2  # streams not yet at EOF
        for stream, buf in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
            threading.Thread(target=self._drain, args=(stream, buf), daemon=True).start()

    def where(self) -> tuple[str, int]:
        return socket.gethostname(), self.proc.pid

    def write(self, data: bytes) -> bool:
        """Feed the worker's stdin (``b""`` closes it); False once the worker cannot take it (it is gone)."""
        stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        try:
            if not data:
                stdin.close()
                return True
            view = memoryview(data)
            while view:  # an unbuffered pipe may take part of it
                view = view[stdin.write(view) or 0:]
        except (OSError, ValueError):
            return False
        return True

    def read(self, wait_s: float) -> tuple[bytes, bytes, bool]:
        """(stdout, stderr) written since the last call, and whether both are closed; waits up to ``wait_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self._out or self._err or not self._open, wait_s)
            out, err = bytes(self._out), bytes(self._err)
            self._out.clear()
            self._err.clear()
            return out, err, not self._open

    def wait(self, wait_s: float) -> int | None:
        try:
            return self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:  # not reaped, so its pid (= its group) is still the worker's
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _drain(self, stream: IO[bytes], buf: bytearray) -> None:
        while chunk := stream.read(1 << 20):
            with self._cond:
                buf += chunk
                self._cond.notify_all()
        with self._cond:
            self._open -= 1
            self._cond.notify_all()


class RayProcess:
    """A worker in a Ray actor, seen by the driver's ``Stage`` as a Popen: ``stdin``/``stdout``/``stderr`` are local
    pipes; ``poll``, ``wait``, ``returncode`` and ``pid`` (the worker's on its node) mean what they do for a Popen."""

    def __init__(self, stage: int, num_stages: int, env: dict[str, str], placement: RayPlacement):
        ray = connect(placement, num_stages)
        self.stage, self.pid = stage, 0  # pid: known once the actor is placed; for messages only
        self.returncode: int | None = None
        self._exited = threading.Event()
        in_r, in_w = os.pipe()
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self.stdin, self.stdout = os.fdopen(in_w, "wb", buffering=0), os.fdopen(out_r, "rb", buffering=0)
        self.stderr = os.fdopen(err_r, "rb")
        self.actor = _actor_class(ray).options(**placement.resources(), scheduling_strategy="SPREAD").remote(env)
        self._note(f"waiting for Ray to place it on a node with {placement.resources()}")
        threading.Thread(target=self._feed, args=(ray, in_r), daemon=True, name=f"ray-stage{stage}-in").start()
        threading.Thread(target=self._drain, args=(ray,), daemon=True, name=f"ray-stage{stage}-out").start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"stage {self.stage} (Ray actor)", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signal the worker on its node. SIGKILL also kills the actor: it may never have been placed."""
        if self.returncode is not None:
            return
        import ray

        self.actor.signal.remote(sig)
        if sig == signal.SIGKILL:
            ray.kill(self.actor)

    def _feed(self, ray: Any, in_r: int) -> None:
        """The driver's request lines -> the worker's stdin; the driver closing stdin closes the worker's."""
        try:
            while chunk := os.read(in_r, 1 << 20):
                if not ray.get(self.actor.write.remote(chunk)):
                    return  # the worker is gone: closing our end makes the driver's next write fail, as for a Popen
            ray.get(self.actor.write.remote(b""))
        except ray.exceptions.RayError:
            pass
        finally:
            os.close(in_r)

    def _drain(self, ray: Any) -> None:
        """The worker's stdout and stderr -> our pipes, until both close; then its exit code."""
        code = _ACTOR_LOST
        try:
            node, self.pid = ray.get(self.actor.where.remote())
            self._note(f"placed on {node}, worker pid {self.pid}")
            closed = False
            while not closed:
                out, err, closed = ray.get(self.actor.read.remote(_READ_WAIT_S))
                _write_all(self._out_w, out)
                _write_all(self._err_w, err)
            self._close_pipes()  # the driver sees EOF as from a local process, exit code or not yet
            while (exit_code := ray.get(self.actor.wait.remote(_READ_WAIT_S))) is None:
                pass
            code = exit_code
        except ray.exceptions.RayError as e:  # the actor, or its node, died
            self._note(f"its Ray actor is lost: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        except OSError:  # the driver closed its end of our pipes
            pass
        finally:
            self.returncode = code
            self._exited.set()
            self._close_pipes()
            try:
                ray.kill(self.actor)  # its worker has exited; the actor would only hold its resources
            except Exception:  # Ray itself is shutting down
                pass

    def _note(self, text: str) -> None:
        """A line in the stage's stderr tail (what a failure report shows), marked as ours."""
        if self._err_w >= 0:
            try:
                _write_all(self._err_w, f"[ray] stage {self.stage}: {text}\n".encode())
            except OSError:
                pass

    def _close_pipes(self) -> None:
        """Once only: a second close could hit a descriptor number that another thread has since reused."""
        for fd in (self._out_w, self._err_w):
            if fd >= 0:
                os.close(fd)
        self._out_w = self._err_w = -1


def connect(placement: RayPlacement, num_stages: int) -> Any:
    """The ray module, connected: to ``placement.address`` (or RAY_ADDRESS), else to a new local cluster."""
    try:
        import ray
    except ImportError as e:
        raise OSError("--launcher ray needs Ray: pip install 'pp_worker[ray]'") from e
    if not ray.is_initialized():
        quiet = {"log_to_driver": False, "logging_level": "WARNING"}  # the workers' stderr comes through our pipes
        if placement.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=placement.address, **quiet)
        else:  # sized to hold every stage even on fewer cores than they ask for: they share them, as local processes do
            cpus = max(os.cpu_count() or 1, math.ceil(num_stages * placement.num_cpus))
            ray.init(num_cpus=cpus, include_dashboard=False, **quiet)
    return ray


@functools.cache
def _actor_class(ray: Any) -> Any:
    # threaded: a read waits for output while a write goes on; one caller per method keeps each in order
    return ray.remote(max_concurrency=4)(StageActor)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
