"""A pipeline that takes generations at any time: its select loop runs in a thread of its own.

Other threads (the HTTP server's event loop) ``submit`` generations and ``cancel`` them; the pipeline thread starts
a generation when fewer than ``concurrency`` are in flight and runs it with the others, exactly as ``Pipeline.run``
does. Every ``ServedGeneration`` gets ``on_end`` called once, from the pipeline thread, whatever happens to it:
finished, failed alone (a prompt the context cannot hold), cancelled, or lost with the pipeline. A cancelled
generation that is running stops after its current step and, like any finished one, releases its KV session on
every stage.

When a stage dies, freezes (no reply within the step timeout) or answers an error (one log line names the stage
and its exit code, its stderr tail follows), the stages are stopped (a frozen one killed) and a new pipeline is
started, after 1, 2, 4, ... s, at most ``restarts`` times; meanwhile ``recovering`` says why and ``submit`` refuses
new generations. Nothing accepted is lost with them: what was queued waits for the new stages, and what was running
goes on there in the order it came (``again``): from its start while it had no token, else from its last token (its
prompt and tokens prefilled again), so a stream only pauses; one asked to stop (a stop string found) ends with the
text streamed so far. Only a generation under a grammar that has tokens (the new stages' matcher would start over)
ends with the failure's error, and so does one that fails again after going on (it may be what brings the stages
down: it must not take every restart with it). Once the attempts are spent the service is down for good:
``failure`` says why, ``on_down`` is called, every call refuses, and what waited ends too.

``drain`` (SIGTERM) makes ``submit`` refuse while what was accepted runs on; ``expire`` ends what is left. ``ask``
sends one op outside any generation (``status``, ``tokenize``, ``detokenize``) to one stage. What ``/metrics`` reports
of the stages outlives a restart: ``restarted``, ``failures`` (by stage) and ``stage_busy_s``.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import threading
import traceback
from collections import Counter, deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TextIO

from pp_worker.driver.draft import Draft
from pp_worker.driver.generation import Call, Generation, Reply
from pp_worker.driver.pipeline import Cancel, Interrupted, Pipeline, PipelineError
from pp_worker.driver.prefix import PrefixCache
from pp_worker.driver.stage_proc import Launch, Stage

MAX_BACKOFF_S = 30.0  # the longest wait before a restart attempt


class Unavailable(Exception):
    """The pipeline is down, restarting or shutting down: nothing can be generated now."""


@dataclass
class ServedGeneration(Generation):
    """A generation with an end that is always reported: ``on_end(self)`` once, with ``error`` set if it failed."""

    on_end: Callable[[ServedGeneration], None] | None = None
    unavailable: bool = False  # the error is the pipeline's (503), not the request's (400)
    ended: bool = field(default=False, init=False)
    again_of: int = field(default=0, init=False)  # how many tries came before this one (`again`)

    def steps(self, num_stages: int, eos: frozenset[int], max_context: int | None = None,
              prefill_chunk: int | None = None,
              prefixes: PrefixCache | None = None) -> Generator[Call, Reply | None, None]:
        """``Generation.steps``, then the end is reported (with ``error`` set when this generation alone could not
        run: an empty prompt, a prompt longer than the context)."""
        yield from super().steps(num_stages, eos, max_context, prefill_chunk, prefixes)
        self.end()

    def again(self) -> ServedGeneration:
        """This request for new stages after a failure: from its start, or with its tokens (and the text streamed
        of them) to go on from the last; the pipeline gives it its draft."""
        g = ServedGeneration(self.index, self.prompt, self.request_id, self.max_tokens, self.sampling,
                             on_text=self.on_text, on_token=self.on_token, keep_session=self.keep_session,
                             grammar=self.grammar, cache_prompt=self.cache_prompt, on_end=self.on_end,
                             t_start=self.t_start)
        g.again_of = self.again_of + 1
        if self.tokens:
            g.prompt_tokens, g.tokens, g.logprobs = self.prompt_tokens, self.tokens, self.logprobs
            g.t_first, g.t_end, g._streamed, g._covered = self.t_first, self.t_end, self._streamed, self._covered
        return g

    @property
    def can_go_on(self) -> bool:
        """Whether ``again`` keeps this generation whole: not over, not tried again before, and no grammar whose
        state went with the stages."""
        return not (self.ended or self.stop_requested or self.again_of or (self.tokens and self.grammar is not None))

    def end_stopped(self) -> None:
        """End as asked (a stop string found in the streamed text, or the reader gone) though the stages failed
        before the last text came: with the text streamed so far, which holds the stop string, not the failure."""
        self.stop_reason = "stop"
        self._finish(self._streamed)
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

    def interrupt(self) -> None:
        """Make the pipeline's next round raise ``Interrupted``, even while it waits for its stages to load."""
        self.signum = signal.SIGTERM
        self.wake()


class PipelineService:
    """A running pipeline that generations can be submitted to from any thread."""

    def __init__(self, launch: Launch, *, concurrency: int, load_timeout: float = 600.0,
                 step_timeout: float = 120.0, echo_stderr: bool = False, log: TextIO | None = sys.stderr,
                 prefill_chunk: int | None = None, schedule: str = "auto", restarts: int = 0,
                 backoff_s: float = 1.0, reuse: bool | None = None,
                 draft: Draft | None = None):
        self.log = log
        self._wake = _Wake()
        self._start = functools.partial(Pipeline, launch, load_timeout=load_timeout, step_timeout=step_timeout,
                                        cancel=self._wake, echo_stderr=echo_stderr, log=log,
                                        prefill_chunk=prefill_chunk, schedule=schedule, reuse=reuse,
                                        draft=draft)
        self.pipeline = self._start()  # loads every stage
        ready = self.pipeline.stages[-1].ready or {}
        self.model = str(ready.get("model_name") or ready.get("model") or "")  # the GGUF's name; model: its path
        # every generation in flight holds a KV session on every stage: more than the workers keep would evict some
        self.concurrency = min(concurrency, self.pipeline.max_sessions or concurrency)
        self.restarts, self.backoff_s = restarts, backoff_s
        self.failure = ""  # down for good: why
        self.recovering = ""  # restarting the stages: why
        self.draining = False  # taking nothing new (SIGTERM): what was accepted runs on
        self.on_down: Callable[[], None] | None = None  # called (pipeline thread) once the service is down for good
        self._closed = threading.Event()  # close() was called: a restart's waits and loads stop
        self._ids = itertools.count(1)  # 0 is the pipeline's own control id (shutdown)
        self._lock = threading.Lock()
        self._inbox: deque[Callable[[], None]] = deque()  # work for the pipeline thread, in order
        self._waiting: deque[ServedGeneration] = deque()
        self._running: dict[int, ServedGeneration] = {}
        self._asks: dict[int, Callable[[Reply | None], None]] = {}  # ops sent by ``ask``, by request id
        self._closing = False
        self.restarted = 0  # times a new set of stages took over
        self.failures: Counter[int] = Counter()  # by stage: the failures that brought the pipeline down
        # the busy seconds of the stages replaced so far, and the stages running now (none while restarting): one
        # attribute, so that a restart replaces both at once for a reader in another thread
        self._busy: tuple[list[float], list[Stage]] = ([0.0] * len(self.pipeline.stages), self.pipeline.stages)
        self._thread = threading.Thread(target=self._loop, name="pipeline", daemon=True)
        self._thread.start()

    # --- any thread ---------------------------------------------------------------------------------------------
    def new_request_id(self) -> int:
        return next(self._ids)  # one C-level step: atomic under the GIL

    def submit(self, g: ServedGeneration) -> None:
        """Queue a generation (its ``on_end`` is called once, from the pipeline thread); raises ``Unavailable``."""
        if self.draining:  # one that slips in as the drain begins is accepted: the drain waits for it too
            raise Unavailable("the server is shutting down")
        self._post(lambda: self._waiting.append(g), new=True)

    def cancel(self, request_id: int) -> None:
        """Stop a generation (queued or running) and release its sessions; nothing if it is already over. While the
        stages restart, a queued one is taken off the queue as the new ones start, before anything runs."""
        if self.recovering and all(g.request_id != request_id for g in list(self._waiting)):
            return  # it ended with the failure; a posted no-op would hold a drain until the new stages run
        try:
            self._post(lambda: self._cancel(request_id))
        except Unavailable:  # everything has ended already
            pass

    def ask(self, stage: int, op: str, fields: dict[str, Any], on_reply: Callable[[Reply | None], None]) -> None:
        """Send one op to one stage (-1: the last); ``on_reply`` gets its reply from the pipeline thread, or None if
        the pipeline fails or closes first. The op must be valid: a stage's error reply fails the pipeline."""
        self._post(lambda: self._ask(stage, op, fields, on_reply), new=True)

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has had a request outstanding since the server started, across restarts."""
        done, live = self._busy
        return [d + st.busy_now() for d, st in zip(done, live, strict=True)] if live else list(done)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) generations: a snapshot for /health (list() copies in one step under the GIL)."""
        return sum(not g.ended for g in list(self._running.values())), len(self._waiting)

    def running(self) -> list[ServedGeneration]:
        """The generations running now, by request id (a snapshot for /slots: list() copies in one step)."""
        return sorted((g for g in list(self._running.values()) if not g.ended), key=lambda g: g.request_id)

    @property
    def status(self) -> str:
        """``ok``, ``draining``, ``recovering`` or ``down``."""
        return "down" if self.failure else "recovering" if self.recovering else "draining" if self.draining else "ok"

    def idle(self) -> bool:
        """Nothing accepted is left to run: no generation running or waiting, nothing posted."""
        with self._lock:
            posted = bool(self._inbox)
        return not posted and self.load == (0, 0)

    def drain(self) -> None:
        """Take no new generation (``submit`` raises ``Unavailable``); those accepted run on."""
        with self._lock:
            self.draining = True

    def expire(self, error: str) -> None:
        """End every generation still running or waiting with ``error`` (a 503: the server's, not the request's);
        while the stages restart, at once (what waits for them is the pipeline thread's only once it runs again,
        and it takes the lock to say so)."""
        with self._lock:
            if self.failure or self._closing:
                return
            if self.recovering:
                waiting, self._waiting = self._waiting, deque()
                for g in waiting:
                    g.end(error, unavailable=True)
                return
            self._inbox.append(lambda: self._end_all(error, closing=False))
        self._wake.wake()

    def close(self, timeout: float = 30.0) -> None:
        """End every generation, shut the stages down (a restart in progress too) and wait for that (idempotent)."""
        with self._lock:
            self._closing = True
        self._closed.set()
        self._wake.interrupt()
        self._thread.join(timeout)

    def _post(self, work: Callable[[], None], new: bool = False) -> None:
        """Queue work for the pipeline thread; ``new`` work (a generation, a status request) is refused while the
        stages restart."""
        with self._lock:
            if self.failure or self._closing:
                raise Unavailable(self.failure or "the server is shutting down")
            if new and self.recovering:
                raise Unavailable(f"the pipeline is restarting after a failure: {self.recovering}")
            self._inbox.append(work)
        self._wake.wake()

    # --- the pipeline thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._run():
                pass
        finally:
            self.pipeline.close(failed=bool(self.failure))

    def _run(self) -> bool:
        """Serve until closed (False) or until the pipeline fails; then recover (True: a new pipeline runs)."""
        try:
            while self._take_work():
                self.pipeline.pump()
        except PipelineError as e:
            return self._recover(str(e), getattr(e, "stage", None))
        except Exception as e:  # a bug: the same treatment, with its traceback
            self._say(traceback.format_exc())
            return self._recover(f"internal error: {type(e).__name__}: {e}")
        self._end_all("the server is shutting down")
        return False

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

    def _ask(self, stage: int, op: str, fields: dict[str, Any], on_reply: Callable[[Reply | None], None]) -> None:
        rid = self.new_request_id()
        self._asks[rid] = on_reply
        self.pipeline.ask(stage % len(self.pipeline.stages), op, rid, lambda reply: self._answer(rid, reply), fields)

    def _answer(self, rid: int, reply: Reply) -> None:
        if on_reply := self._asks.pop(rid, None):  # None: already answered with None (``expire``)
            on_reply(reply)

    def _recover(self, error: str, stage: int | None = None) -> bool:
        """The pipeline failed: end every generation with its error, stop its stages (a frozen one gets SIGTERM,
        then SIGKILL) and start new ones. True once a new pipeline runs; False when closing or given up."""
        if not self._closed.is_set():  # else the close interrupted it: not a failure
            first, _, rest = error.partition("\n")
            self._say(f"pipeline down: {first}" + (f"\n{rest}" if rest else ""))
            if stage is not None:
                self.failures[stage] += 1
            self._busy = (self.stage_busy_s(), [])  # a dead stage's unanswered request is not busy time
            for g in self._running.values():
                if g.stop_requested and g.tokens and not g.ended:
                    g.end_stopped()  # its text is whole: the failure costs it nothing
            kept = [g for g in self._running.values() if g.can_go_on]
            for g in kept:
                del self._running[g.request_id]
            self._end_all(f"the pipeline failed: {first}", closing=False, keep_waiting=True)
            self._waiting.extendleft([g.again() for g in reversed(kept)])  # first in the queue: they came first
            with self._lock:  # from here `expire` may end what waits (see there); new work is refused
                self.recovering = first
            if self._waiting:
                self._say(f"{len(self._waiting)} request(s) wait for the new stages ({len(kept)} of them were "
                          f"running: {sum(not g.tokens for g in kept)} start again, the rest go on from their last "
                          f"token)")
            self.pipeline.close(failed=True)
            if self._restart():
                return True
            if not self._closed.is_set():
                tried = f" (not recovered after {self.restarts} restart attempts)" if self.restarts else ""
                self._fail(first + tried)
                return False
        self._end_all("the server is shutting down")
        return False

    def _restart(self) -> bool:
        """Start a new pipeline after 1, 2, 4, ... x ``backoff_s``, at most ``restarts`` times; True once one runs."""
        for attempt in range(1, self.restarts + 1):
            delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            self._say(f"restarting the stages in {delay:g} s (attempt {attempt} of {self.restarts})")
            if self._closed.wait(delay):
                return False
            try:
                self.pipeline = self._start()
            except Interrupted:  # closed while the new stages loaded
                return False
            except Exception as e:  # the stages' report, or a bug (with its traceback): the next attempt may do
                self._say(f"restart attempt {attempt} failed: {e}" if isinstance(e, PipelineError)
                          else traceback.format_exc())
                continue
            with self._lock:
                self.recovering = ""
            self.restarted += 1
            self._busy = (self._busy[0], self.pipeline.stages)
            self._say(f"pipeline restarted (attempt {attempt} of {self.restarts}): serving again")
            return True
        return False

    def _fail(self, message: str) -> None:
        self._say(f"pipeline down for good, every request now fails: {message}")
        with self._lock:
            self.failure = message
            self.recovering = ""
        self._end_all(f"the pipeline is down: {message}")
        if self.on_down:
            self.on_down()

    def _end_all(self, error: str, closing: bool = True, keep_waiting: bool = False) -> None:
        """End every generation, queued or running, with ``error`` (a 503); ``closing``: and take nothing more;
        ``keep_waiting``: the queued ones stay queued (they run on the stages started next)."""
        with self._lock:
            self._closing = self._closing or closing
            inbox, self._inbox = self._inbox, deque()
        for work in inbox:  # a generation submitted meanwhile is queued here, and so ends below with the rest
            work()
        for g in [*([] if keep_waiting else self._waiting), *self._running.values()]:
            g.stop_requested = True  # a running one stops after its current step (and releases its sessions)
            g.end(error, unavailable=True)
        if not keep_waiting:
            self._waiting.clear()
        self._running.clear()
        asks, self._asks = self._asks, {}
        for on_reply in asks.values():  # their replies went with the pipeline
            on_reply(None)

    def _say(self, text: str) -> None:
        if self.log:
            print(text, file=self.log, flush=True)
