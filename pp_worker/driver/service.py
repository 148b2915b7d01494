"""A pipeline that takes generations at any time: its select loop runs in a thread of its own.

Other threads (the HTTP server's event loop) ``submit`` generations and ``cancel`` them; the pipeline thread starts
a generation when fewer than ``concurrency`` are in flight and runs it with the others, exactly as ``Pipeline.run``
does. Every ``ServedGeneration`` gets ``on_end`` called once, from the pipeline thread, whatever happens to it:
finished, failed alone (a prompt the context cannot hold), cancelled, or lost with the pipeline. A cancelled
generation that is running stops after its current step and, like any finished one, releases its KV session on
every stage.

When a stage dies the service is down for good: ``failure`` says why (one log line names the stage and its exit
code, its stderr tail follows), every generation ends with that error and ``submit`` refuses new ones.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TextIO

from pp_worker.driver.generation import Call, Generation, Reply
from pp_worker.driver.pipeline import Cancel, Pipeline, PipelineError
from pp_worker.driver.stage_proc import Launch


class Unavailable(Exception):
    """The pipeline is down (or shutting down): nothing can be generated any more."""


@dataclass
class ServedGeneration(Generation):
    """A generation with an end that is always reported: ``on_end(self)`` once, with ``error`` set if it failed."""

    on_end: Callable[[ServedGeneration], None] | None = None
    unavailable: bool = False  # the error is the pipeline's (503), not the request's (400)
    ended: bool = field(default=False, init=False)

    def steps(self, num_stages: int, eos: frozenset[int], max_context: int | None = None,
              prefill_chunk: int | None = None) -> Generator[Call, Reply | None, None]:
        """``Generation.steps``, then the end is reported (with ``error`` set when this generation alone could not
        run: an empty prompt, a prompt longer than the context)."""
        yield from super().steps(num_stages, eos, max_context, prefill_chunk)
        self.end()

    def end(self, error: str = "", unavailable: bool = False) -> None:
        """Report the end (only the first call counts)."""
        if self.ended:
            return
        self.ended = True
        if error:
            self.error, self.unavailable = error, unavailable
        if self.on_end:
            self.on_end(self)


class _Wake(Cancel):
    """What the select loop waits on besides the stages: a pipe other threads write to. A ``Cancel`` without its
    signal handlers, which belong to the main thread (the HTTP server's)."""

    def __init__(self) -> None:
        self.signum, self.count = None, 0
        self.wake_fd, self._write_fd = os.pipe()
        for fd in (self.wake_fd, self._write_fd):
            os.set_blocking(fd, False)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass


class PipelineService:
    """A running pipeline that generations can be submitted to from any thread."""

    def __init__(self, launch: Launch, *, concurrency: int, load_timeout: float = 600.0,
                 step_timeout: float = 120.0, echo_stderr: bool = False, log: TextIO | None = sys.stderr,
                 prefill_chunk: int | None = None, schedule: str = "auto"):
        self.log = log
        self._wake = _Wake()
        self.pipeline = Pipeline(launch, load_timeout=load_timeout, step_timeout=step_timeout, cancel=self._wake,
                                 echo_stderr=echo_stderr, log=log, prefill_chunk=prefill_chunk,
                                 schedule=schedule)  # loads every stage
        self.model = str((self.pipeline.stages[-1].ready or {}).get("model") or "")
        # every generation in flight holds a KV session on every stage: more than the workers keep would evict some
        self.concurrency = min(concurrency, self.pipeline.max_sessions or concurrency)
        self.failure = ""
        self._ids = itertools.count(1)  # 0 is the pipeline's own control id (shutdown)
        self._lock = threading.Lock()
        self._inbox: deque[Callable[[], None]] = deque()  # work for the pipeline thread, in order
        self._waiting: deque[ServedGeneration] = deque()
        self._running: dict[int, ServedGeneration] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="pipeline", daemon=True)
        self._thread.start()

    # --- any thread ---------------------------------------------------------------------------------------------
    def new_request_id(self) -> int:
        return next(self._ids)  # one C-level step: atomic under the GIL

    def submit(self, g: ServedGeneration) -> None:
        """Queue a generation (its ``on_end`` is called once, from the pipeline thread); raises ``Unavailable``."""
        self._post(lambda: self._waiting.append(g))

    def cancel(self, request_id: int) -> None:
        """Stop a generation (queued or running) and release its sessions; nothing if it is already over."""
        try:
            self._post(lambda: self._cancel(request_id))
        except Unavailable:  # everything has ended already
            pass

    def stage_status(self, on_reply: Callable[[list[Reply]], None]) -> None:
        """Every stage's ``status`` reply (its KV sessions, pid, ...), in stage order, to ``on_reply``."""
        self._post(lambda: self._ask_status(on_reply))

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) generations: a snapshot for /health (list() copies in one step under the GIL)."""
        return sum(not g.ended for g in list(self._running.values())), len(self._waiting)

    def close(self, timeout: float = 30.0) -> None:
        """End every generation, shut the stages down and wait for that (idempotent)."""
        with self._lock:
            self._closing = True
        self._wake.wake()
        self._thread.join(timeout)

    def _post(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self.failure or self._closing:
                raise Unavailable(self.failure or "the server is shutting down")
            self._inbox.append(work)
        self._wake.wake()

    # --- the pipeline thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._take_work():
                self.pipeline.pump()
            self._end_all("the server is shutting down")
        except PipelineError as e:
            self._fail(str(e))
        except Exception as e:  # a bug: the same treatment, with its traceback
            self._say(traceback.format_exc())
            self._fail(f"internal error: {type(e).__name__}: {e}")
        finally:
            self.pipeline.close(failed=bool(self.failure))

    def _take_work(self) -> bool:
        """Run what other threads posted, start waiting generations while there is room; False when closing."""
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
            closing = self._closing
        for work in inbox:
            work()
        for rid in [rid for rid, g in self._running.items() if g.ended]:
            del self._running[rid]
        while not closing and self._waiting and len(self._running) < self.concurrency:
            g = self._waiting.popleft()
            self._running[g.request_id] = g
            self.pipeline.start(g)
        return not closing

    def _cancel(self, request_id: int) -> None:
        if g := self._running.get(request_id):
            g.stop_requested = True  # it stops after its current step, then releases its sessions
        elif g := next((w for w in self._waiting if w.request_id == request_id), None):
            self._waiting.remove(g)
            g.end("cancelled before it started", unavailable=True)

    def _ask_status(self, on_reply: Callable[[list[Reply]], None]) -> None:
        replies: dict[int, Reply] = {}
        n = len(self.pipeline.stages)

        def collect(stage: int, reply: Reply) -> None:
            replies[stage] = reply
            if len(replies) == n:
                on_reply([replies[s] for s in range(n)])

        for s in range(n):
            self.pipeline.ask(s, "status", self.new_request_id(), lambda r, s=s: collect(s, r))

    def _fail(self, message: str) -> None:
        first, _, rest = message.partition("\n")
        self._say(f"pipeline down, every request now fails: {first}")
        if rest:
            self._say(rest)
        with self._lock:
            self.failure = first
        self._end_all(f"the pipeline is down: {first}")

    def _end_all(self, error: str) -> None:
        with self._lock:
            self._closing = True  # nothing more is taken in
            inbox, self._inbox = self._inbox, deque()
        for work in inbox:  # a generation submitted meanwhile is queued here, and so ends below with the rest
            work()
        for g in [*self._waiting, *self._running.values()]:
            g.end(error, unavailable=True)
        self._waiting.clear()
        self._running.clear()

    def _say(self, text: str) -> None:
        if self.log:
            print(text, file=self.log, flush=True)
