"""``--draft-model PATH``: a small GGUF with the pipeline's vocabulary guesses the next tokens (speculative decoding).

The draft model runs on the driver's host as a two-stage pipeline (a worker is a stage of at least two), driven by a
thread of its own: a generation's guesses are a job queued to that thread, whose result the pipeline's loop gets back
through its mailbox (pipeline.Mailbox), so while one generation waits for its guesses the others' steps go on. Its two
stages are, by default, in the driver's process (``_Local``: a worker's ``Worker`` over its engine, called directly
by that thread, the only one here that touches tinygrad; the forwards of sessions they hold go straight to the
engines, `DraftWorker._direct`), or two local worker processes
(``processes``, ``--draft-processes``: ``_Process``, a JSON line over a pipe each call; isolation at ~0.5 ms a call
here, bench/NOTES.md).
Either way the guesses are the same. The thread takes every generation's guesses queued
at that moment together: each round of their forwards is one forward of each stage's engine (with worker processes one
``batch`` request per stage, where the one-token ones share a forward), so 8 streams cost the draft model little more
than one. Each generation keeps a KV session there, fed its
prompt while the pipeline prefills it (``begin``); to guess, it feeds what the session does not hold yet (the tokens
kept since, the model's own token) and takes k argmax tokens, one forward each; a guess the pipeline did not keep is
rewound over by the next feed (a forward at a smaller position rewinds, docs/protocol.md). When the generation ends
its session is released there (``end``).

Guesses are an optimisation: nothing the draft model does fails a generation. A request's error (an engine's, in
either mode) costs that generation its guesses at that step. A failure of the draft model (a call that raises out of
its stages in-process; a worker process that dies or gives no reply within the step timeout) gives the generations
waiting no guesses, and the draft model is started again a few times (``DraftWorker._failed``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

from pp_worker.driver.draft import Adaptive
from pp_worker.driver.stage_proc import Launch, Stage, wait_io


class DraftModelError(RuntimeError):
    pass


RESTARTS = 3  # times a failed draft model is started again (after 1, 2, 4 s) before drafting stays off
# A draft model file smaller than this runs on one thread unless PP_THREADS says otherwise: its forwards are mostly
# fixed costs, which a helper thread's wake-ups (between small forwards, on cores the stages share) only add to: the
# Zen draft (0.35 MB) beside the embedded model's local stages, 8 streams 1.32-1.36x -> 1.36-1.43x plain, one stream
# 2.21-2.25x -> 2.39-2.51x (bench/NOTES.md); a bigger draft streams its weights, where every core helps
ONE_THREAD_BYTES = 4 << 20


class _Process:
    """One of the draft model's worker processes (a driver ``Stage``: its pipes and stderr tail), and a blocking
    request -> reply over it, within ``timeout`` seconds a reply (None: no limit)."""

    def __init__(self, launch: Launch, stage: int, path: str, timeout: float | None):
        self.path, self.timeout = path, timeout
        self.stage = Stage(stage, launch)
        self.proc = self.stage.proc
        self._lines: deque[bytes] = deque()

    def ready(self, timeout: float | None) -> dict[str, Any]:
        """The ready line, within ``timeout`` seconds of loading (None: no limit; past it the worker is killed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        line = self._line(deadline, "--load-timeout", timeout)
        while line.get("status") != "ready":  # load progress events may come before it
            line = self._line(deadline, "--load-timeout", timeout)
        return line

    def call(self, obj: dict[str, Any]) -> dict[str, Any]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.stage.send(obj)  # what the pipe takes now; the rest as it drains, while the reply is awaited
        reply = self._line(deadline, "--step-timeout", self.timeout)
        while "event" in reply:  # pp_worker_ready after the ready line, progress...: not the reply
            reply = self._line(deadline, "--step-timeout", self.timeout)
        self.stage.replied()
        if "error" in reply:
            raise DraftModelError(f"draft model {self.path}: {reply['error']}")
        return reply

    def batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several requests in one ``batch`` line -> their replies, in order (each may be an error of its own)."""
        return self.call({"op": "batch", "request_id": 0, "requests": requests})["replies"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stage.close_stdin()  # PP_EXIT_ON_EOF: the worker ends
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL: a frozen worker (SIGSTOP) would answer neither EOF nor SIGTERM."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _line(self, deadline: float | None, flag: str, seconds: float | None) -> dict[str, Any]:
        """The next stdout line; both pipes waited on with select (``wait_io``), so that a frozen worker fails a call
        at its deadline (it would block a write as well as a read): past it the worker is killed."""
        while not self._lines:
            if self.stage.eof:  # ended before (e.g. killed): select would wait for the deadline on no pipe at all
                raise self._down("exited")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.kill()
                raise self._down(f"gave no reply within {flag} {seconds:g} s, killed")
            if self.stage.out_fd in wait_io([self.stage], left):
                self._lines.extend(self.stage.read_lines())
                if self.stage.eof:  # what came with the end is a line cut short, if anything
                    raise self._down("exited")
        return json.loads(self._lines.popleft())

    def _down(self, what: str) -> DraftModelError:
        self.proc.wait()
        tail = [line for line in self.stage.stderr_lines() if line.strip()][-3:]
        return DraftModelError(f"draft model {self.path}: worker {what} ({self.proc.returncode})"
                               + (f": {' | '.join(tail)}" if tail else ""))


class _Local:
    """One of the draft model's stages in the driver's process: the worker's own ``Worker`` over the engine a worker
    process would load (``build_engine``, from the same settings: its environment and ``env``), called directly, so a
    request costs no JSON line, pipe or process switch. What it answers is what a worker process would answer; a
    forward in progress cannot be cut short (no step timeout here: ``--draft-processes`` for that)."""

    def __init__(self, env: dict[str, str], stage: int, path: str):
        from pp_worker.worker.cli import build_engine, parse_config, start_background  # tinygrad: only with a draft
        from pp_worker.worker.dispatch import Worker
        from pp_worker.worker.events import Clock

        self.path, self.closed, env_count = path, False, os.environ.get("CPU_COUNT")
        try:
            self.cfg = parse_config([], {**os.environ, **env, "STAGE": str(stage), "NUM_STAGES": "2", "MODEL": path})
            self.threads = self.cfg.threads
            with _tinygrad_here(self.threads):
                engine = build_engine(self.cfg, _Silent())  # sets the CPU_COUNT variable for tinygrad's import
        except Exception as e:  # a file that is no model, a bad setting (ConfigError): the draft model's error
            raise DraftModelError(f"draft model {path}: cannot load: {str(e).splitlines()[0] if str(e) else e!r}") \
                from e
        finally:  # the process's own again (the value tinygrad reads, `_tinygrad_here` puts back per call)
            if env_count is None:
                os.environ.pop("CPU_COUNT", None)
            else:
                os.environ["CPU_COUNT"] = env_count
        self.worker = Worker(engine, Clock(), path, self.cfg.wire_dtype, self.cfg.strict_finite)
        # PP_WARMUP=background (pp-serve's): the forwards not compiled yet compiled by a child process into the cache
        # while this stage runs in the sizes it has, as a worker process's stage does: no guess waits on a compile
        with _tinygrad_here(self.threads):
            self.child = start_background(engine, self.cfg, env) if self.cfg.warmup == "background" else None

    def ready(self, timeout: float | None) -> dict[str, Any]:
        """What the worker process's ready line would say (it has loaded: the constructor loads)."""
        from pp_worker.worker.cli import ready_line

        with _tinygrad_here(self.threads):
            return ready_line(self.worker.engine, self.cfg, self.worker.clock)

    def call(self, obj: dict[str, Any]) -> dict[str, Any]:
        with _tinygrad_here(self.threads):
            reply = self._live().handle_line(json.dumps(obj).encode())
        if "error" in reply:
            raise DraftModelError(f"draft model {self.path}: {reply['error']}")
        return reply

    def batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several requests served as one ``batch`` line's, in order (each may be an error of its own); the hidden
        states stay ``B64`` objects from one stage to the next."""
        with _tinygrad_here(self.threads):
            return self._live().handle_objects(requests)

    def close(self) -> None:
        """The calls after this fail (a forward in progress ends first: it is the draft thread's, not the caller's);
        the engine goes with the last reference to it; a background compile stops (what it compiled is on disk)."""
        self.closed = True
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    kill = close

    def _live(self) -> Any:
        if self.closed:
            raise DraftModelError(f"draft model {self.path}: closed")
        return self.worker


_TINYGRAD = threading.Lock()  # held while a thread runs tinygrad here (an engine's load or call)
_connections: dict[int, Any] = {}  # thread -> its tinygrad compile cache connection, kept between its runs


@contextmanager
def _tinygrad_here(threads: int) -> Iterator[None]:
    """Run tinygrad on this thread, one thread at a time, on ``threads`` CPU threads. One draft model's engines are
    its thread's alone, but several draft models in one process (tests; pp-serve's is one) are several threads, and
    tinygrad's compile cache keeps one sqlite connection (``tinygrad.helpers._db_connection``) that only the thread
    that opened it may use, and its ``CPU_COUNT`` (the threads the kernels a call compiles split over) is the
    process's: each is set to this thread's own while it runs, and what was there before is put back after (the
    process's other users of tinygrad, e.g. a test's engines on the main thread, find theirs)."""
    from tinygrad import helpers

    with _TINYGRAD:
        me, before, count = threading.get_ident(), helpers._db_connection, helpers.CPU_COUNT.value
        helpers._db_connection = _connections.get(me)  # None: tinygrad opens one for this thread
        helpers.CPU_COUNT.value = threads
        try:
            yield
        finally:
            _connections[me] = helpers._db_connection
            helpers._db_connection, helpers.CPU_COUNT.value = before, count


class _Silent:
    """The events an in-process engine emits while it loads (a worker process's event lines): none; the driver's
    stdout is its own."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass


class DraftWorker:
    """The draft model, on this host: two stages (a worker is a stage of at least two: the first holds the embedding
    and the first half of the blocks, the second the rest and the head), in this process (``_Local``) or, with
    ``processes``, as two local worker processes (``_Process``), loaded and called by one thread of their own
    (``submit``)."""

    def __init__(self, path: str, env: dict[str, str] | None = None, *, processes: bool = False,
                 step_timeout: float | None = 120.0, load_timeout: float | None = 600.0, restarts: int = RESTARTS,
                 backoff_s: float = 1.0, log: TextIO | None = sys.stderr):
        """``env``: extra variables for its workers (their settings in this process too; PP_THREADS 1 by default for
        a file smaller than ONE_THREAD_BYTES, where the environment sets none); ``step_timeout`` and ``load_timeout``
        bound a worker process's reply and load (an in-process forward or load cannot be cut short)."""
        if not os.path.isfile(path):
            raise DraftModelError(f"draft model {path!r}: no such file")
        one = os.path.getsize(path) < ONE_THREAD_BYTES and "PP_THREADS" not in os.environ
        self.env, self.processes = {**({"PP_THREADS": "1"} if one else {}), **(env or {})}, processes
        self._launch = Launch(2, model=path, env=self.env)
        self.path, self._ids, self.step_timeout, self.log = path, itertools.count(1), step_timeout, log
        self.load_timeout = load_timeout
        self.restarts, self.backoff_s, self.failures = restarts, backoff_s, 0
        self.down = ""  # why it guesses nothing now: "restarting" after a failure, or "off" once restarts are spent
        self._jobs: deque[Callable[[], None] | Guess] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._loaded = threading.Event()
        self._loading: list[_Process | _Local] = []  # a restart's workers until they are ready (close() kills them)
        self.stages: list[_Process | _Local] = []  # its two stages (a restart replaces them)
        loaded: list[Exception | None] = []
        self._thread = threading.Thread(target=self._run, args=(loaded,), daemon=True, name="draft-model")
        self._thread.start()
        self._loaded.wait()
        if loaded[0] is not None:
            self._thread.join()
            raise loaded[0]

    def _run(self, loaded: list[Exception | None]) -> None:
        """The draft thread: load the stages (the engines are this thread's alone), then serve the jobs; a load that
        fails is the constructor's error."""
        try:
            self.stages = self._start()
            loaded.append(None)
        except Exception as e:
            loaded.append(e)
            return
        finally:
            self._loaded.set()
        self._serve()

    def _start(self) -> list[_Process | _Local]:
        """Start both stages and wait until they are ready, a worker process within ``load_timeout`` (a
        DraftModelError if they do not load, or if close() came meanwhile)."""
        with self._wake:
            if self._closing:
                raise DraftModelError(f"draft model {self.path}: closed")
            if self.processes:  # spawned, not loaded yet: close() meanwhile kills them
                stages = self._loading = [_Process(self._launch, stage, self.path, self.step_timeout)
                                          for stage in range(2)]
        if not self.processes:  # loaded here, on this thread (close() meanwhile waits for the load)
            stages = [_Local(self.env, stage, self.path) for stage in range(2)]
        try:
            ready = [stage.ready(self.load_timeout) for stage in stages]
        except DraftModelError:
            for stage in stages:
                stage.kill()
            raise
        finally:
            with self._wake:
                self._loading = []
        self.vocab_size: int = ready[1]["vocab_size"]
        self.max_context: int = min(r["max_context"] for r in ready)
        return stages

    def drafter(self, max_k: int) -> ModelDrafter:
        """A generation's drafter, on a session of its own here."""
        return ModelDrafter(max_k=max_k, worker=self, session=next(self._ids))

    def submit(self, job: Callable[[], None] | Guess) -> None:
        """Run ``job`` on the draft model's thread, after the jobs queued before it (none once closed); the guesses
        queued at the moment run together (``_guess_together``). While the draft model is ``down`` a guess gets none,
        at once: the generation goes on without."""
        with self._wake:
            if self._closing:
                return
            if not (self.down and isinstance(job, Guess)):
                self._jobs.append(job)
                self._wake.notify()
                return
        job.then([])

    def status(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each draft stage's ``status`` reply, once every job queued before has run (e.g. the sessions it holds)."""
        done, replies, failed = threading.Event(), [], []

        def ask() -> None:
            try:
                replies.extend(stage.call({"op": "status", "request_id": 0}) for stage in self.stages)
            except Exception as e:
                failed.append(e)
                raise  # the draft thread's: a failure of the draft model
            finally:
                done.set()
        self.submit(ask)
        if not done.wait(timeout):
            raise DraftModelError(f"draft model {self.path}: no status within {timeout:g} s")
        if failed:
            raise failed[0]
        return replies

    def state(self) -> dict[str, Any]:
        """For pp-serve's /health: ``status`` ok, restarting or off (``down``), and ``failures`` so far."""
        return {"status": self.down or "ok", "failures": self.failures}

    def next_tokens(self, asks: list[tuple[int, Ask]]) -> list[int | DraftModelError]:
        """The draft model's argmax after each ask (session, (tokens, position)): its tokens fed at that position of
        its session (a smaller position than the session holds rewinds it). In-process stages take the asks of
        sessions they hold straight to their engines (`_direct`); the others go in one ``batch`` line per stage.
        An ask that failed (e.g. its session was evicted) gets its error. On the draft model's thread only."""
        answers, asks = self._direct(asks)
        rest = [i for i, answer in enumerate(answers) if answer is None]
        for i, answer in zip(rest, self._batched([asks[i] for i in rest]) if rest else [], strict=True):
            answers[i] = answer
        return answers  # type: ignore[return-value]

    def _direct(self, asks: list[tuple[int, Ask]]) -> tuple[list[int | DraftModelError | None],
                                                            list[tuple[int, Ask]]]:
        """The asks that in-process stages (``_Local``) can take (a session's first ask of the round, token ids in
        the vocabulary, at a position of a session each stage holds: `Engine.can_batch`), run as one
        ``forward_batch`` of each stage's engine, called directly, several rows of a session mixed with others'
        rows; None for the others (and for all with worker processes), which go through the ``batch`` lines after
        them. What those would compute, without their requests and replies, which cost ~0.4 ms of a 0.6 ms round
        of 8 sessions here (bench/NOTES.md). A feed at position 0 of a session the stages do not hold (a
        generation's first: the prompt's window) opens it with a one-token forward first (`_open`). A round with a
        feed longer than SPLIT (a window) runs in the forwards' sizes compiled already: a forward of its rows would
        compile one (~2.5 s) at its first use, and no guess would come meanwhile. The hidden states go between the
        stages as the default wire (``auto``) carries them: float16, or float32 past its range. An engine's error
        is each of these asks' error, as in a batch line. Returns the answers and the asks as they are left (a
        session opened here is fed the rest of its feed from position 1, whichever way it goes)."""
        out: list[int | DraftModelError | None] = [None] * len(asks)
        if self.processes:
            return out, asks
        from pp_worker.worker import q8
        from pp_worker.worker.engines.base import EngineError

        firsts: dict[int, int] = {}
        for i, (session, _) in enumerate(asks):  # a session's later asks go after it, through the batch lines
            firsts.setdefault(session, i)
        asks = list(asks)
        for i, (session, ask) in enumerate(asks):
            if firsts[session] == i and ask[1] == 0 and self._known(ask[0]) and not self._held(session):
                out[i], rest = self._open(session, ask[0])
                asks[i] = (session, rest)
        take = [i for i, (session, ask) in enumerate(asks)
                if out[i] is None and firsts[session] == i and self._takes(session, ask)]
        if not take:
            return out, asks
        first, last = self._engines()
        sessions, positions = [asks[i][0] for i in take], [asks[i][1][1] for i in take]
        rows = [len(asks[i][1][0]) for i in take]
        ends, compile = list(itertools.accumulate(rows)), max(rows) <= SPLIT
        try:
            with self._here():
                hidden = first.forward_batch(sessions, positions, [asks[i][1][0] for i in take], rows, compile)
                payload, _ = q8.emit(hidden, first.hidden_dtype, "auto", first.info.hidden_dim)
                size = len(payload) // ends[-1]
                logits = last.forward_batch(sessions, positions, [payload[(end - n) * size:end * size]
                                                                  for n, end in zip(rows, ends, strict=True)], rows,
                                            compile)
        except EngineError as e:  # what each of these asks would have got from a batch line
            for i in take:
                out[i] = DraftModelError(f"draft model {self.path}: {e}")
            return out, asks
        for end, i in zip(ends, take, strict=True):
            out[i] = self._argmax(logits[end - 1])
        return out, asks

    def _open(self, session: int, tokens: list[int]) -> tuple[int | DraftModelError | None, Ask]:
        """Start ``session`` on both stages with the first of ``tokens`` (a one-token forward each, the decode
        call's size: a batch only continues sessions): its answer when that was the whole feed (or the error), and
        what is left to feed (from position 1)."""
        from pp_worker.worker.engines.base import EngineError

        first, last = self._engines()
        try:
            with self._here():
                logits = last.forward_logits(session, bytes(first.embed_and_forward(session, tokens[:1], 0)), 0, 1)
        except EngineError as e:
            return DraftModelError(f"draft model {self.path}: {e}"), (tokens, 0)
        return self._argmax(logits) if len(tokens) == 1 else None, (tokens[1:], 1)

    def _argmax(self, logits: Any) -> int | DraftModelError:
        from pp_worker.worker.sampling import argmax_sample

        try:
            return argmax_sample(logits)
        except ValueError as e:  # every logit NaN
            return DraftModelError(f"draft model {self.path}: no token: {e}")

    def _here(self) -> Any:
        """`_tinygrad_here` for the in-process stages' engines."""
        return _tinygrad_here(self.stages[0].threads)  # type: ignore[union-attr]

    def _engines(self) -> tuple[Any, Any]:
        return tuple(stage._live().engine for stage in self.stages)  # type: ignore[union-attr, return-value]

    def _known(self, tokens: list[int]) -> bool:
        """Token ids the draft's vocabulary has (others go through the batch lines, which answer their error)."""
        return bool(tokens) and all(0 <= t < self.vocab_size for t in tokens)

    def _held(self, session: int) -> bool:
        first, last = self._engines()
        return first.can_batch(session, 0) and last.can_batch(session, 0)

    def _takes(self, session: int, ask: Ask) -> bool:
        """Whether `_direct` can take ``ask`` as it is: stages in this process, token ids of the vocabulary, at a
        position of a session both engines hold, as many rows as both run in one forward (`Engine.can_batch`: a
        stage on tinygrad's kernels, a GPU's, mixes no several rows of a session)."""
        if self.processes:
            return False
        tokens, position = ask
        first, last = self._engines()
        return self._known(tokens) and first.can_batch(session, position, len(tokens)) and \
            last.can_batch(session, position, len(tokens))

    def _batched(self, asks: list[tuple[int, Ask]]) -> list[int | DraftModelError]:
        """``next_tokens`` through the stages' ``batch`` lines."""
        first, last = self.stages
        hidden = first.batch([{"op": "embed_and_forward", "request_id": session, "tokens": tokens,
                               "position": position} for session, (tokens, position) in asks])
        hops = [{"op": "forward_and_sample", "request_id": session, "hidden_b64": reply["hidden_b64"],
                 "position": position, "seq_len": len(tokens), **_dtype(reply)}
                for (session, (tokens, position)), reply in zip(asks, hidden, strict=True) if "error" not in reply]
        sampled = iter(last.batch(hops) if hops else [])
        return [self._answer(reply if "error" in reply else next(sampled)) for reply in hidden]

    def release(self, session: int) -> None:
        """Drop ``session`` on both stages. On the draft model's thread only."""
        for stage in self.stages:
            stage.call({"op": "release", "request_id": session})

    def close(self) -> None:
        """Stop the thread (a job in progress ends with an error, as its workers do) and the workers."""
        with self._wake:
            self._closing = True
            self._jobs.clear()
            self._wake.notify()
            loading = list(self._loading)
        for stage in loading:  # a restart still loading: its ready line would never be read
            stage.kill()
        for stage in self.stages:
            stage.close()
        self._thread.join()

    def _answer(self, reply: dict[str, Any]) -> int | DraftModelError:
        return DraftModelError(f"draft model {self.path}: {reply['error']}") if "error" in reply else reply["token_id"]

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                job = self._jobs.popleft()
                guesses = [job, *(j for j in self._jobs if isinstance(j, Guess))] if isinstance(job, Guess) else []
                if guesses:  # every generation's guesses queued now go together: one batch a forward
                    self._jobs = deque(j for j in self._jobs if not isinstance(j, Guess))
            try:
                if guesses:
                    self._guess_together(guesses)  # type: ignore[arg-type]
                else:
                    job()  # type: ignore[operator]
            except Exception as e:  # a worker died, froze or answered nonsense; or a bug: the thread lives on
                self._failed(e)

    def _guess_together(self, guesses: list[Guess]) -> None:
        """Advance several generations' guesses in rounds: each round feeds every one of them its next tokens, one
        batch per stage, until each has its guesses (or its error). Where the draft model fails, the ones left get
        no guesses (they go on without) and the failure goes on to ``_serve``."""
        running = [g for g in guesses if g.advance(None)]
        while running:
            try:  # a 2-token feed goes whole where the engines take it as it is (`_takes`), else a token a round
                asks = [g.round_ask(together=len(running) > 1 and not self._takes(g.session, g.ask)) for g in running]
                answers: list[int | DraftModelError] = self.next_tokens(
                    [(g.session, ask) for g, ask in zip(running, asks, strict=True)])
            except Exception:
                for g in running:
                    g.then([])
                raise
            running = [g for g, ask, answer in zip(running, asks, answers, strict=True) if g.fed(ask, answer)]

    def _failed(self, error: Exception) -> None:
        """The draft model failed: kill its workers, give the guesses queued none, and start it again after 1, 2,
        4... x ``backoff_s`` (``restarts`` times in all, a failed load counting too); until then, and for good after
        that, generations get no guesses (``down``). Its sessions went with its workers: the drafters feed theirs
        again (an error for a session it does not hold, as after an eviction)."""
        if self._closing or self.down == "off":  # close() ended a call; or its workers are gone for good
            return
        self.failures += 1
        retry = self.failures <= self.restarts
        with self._wake:
            self.down = "restarting" if retry else "off"
            queued = [j for j in self._jobs if isinstance(j, Guess)]
            self._jobs = deque(j for j in self._jobs if not isinstance(j, Guess))
        for guess in queued:
            guess.then([])
        for stage in self.stages:
            stage.kill()
        delay = self.backoff_s * 2 ** (self.failures - 1)
        self._say(f"draft model failed: {type(error).__name__}: {error}\n" + (
            f"draft model: restarting it in {delay:g} s (restart {self.failures} of {self.restarts}); "
            "generations go on without guesses meanwhile" if retry else
            f"draft model: drafting stays off after {self.restarts} restarts; generations go on without guesses"))
        if retry:
            self._restart(delay)

    def _restart(self, delay: float) -> None:
        with self._wake:
            if self._wake.wait_for(lambda: self._closing, delay):
                return
        try:
            stages = self._start()
        except DraftModelError as e:
            self._failed(e)
            return
        with self._wake:
            closing = self._closing
            if not closing:
                self.stages, self.down = stages, ""
        if closing:  # close() came while they loaded
            for stage in stages:
                stage.kill()
            return
        self._say("draft model: restarted, drafting again")

    def _say(self, text: str) -> None:
        if self.log:
            print(text, file=self.log, flush=True)


def _dtype(reply: dict[str, Any]) -> dict[str, Any]:
    """A hidden state's dtype field, handed on with its payload (float32 past float16's range)."""
    return {"hidden_dtype": reply["hidden_dtype"]} if "hidden_dtype" in reply else {}


Ask = tuple[list[int], int]  # tokens to feed a session, at this position
# The most tokens of a prompt a draft session is fed: a small model guesses the next few tokens from the last few
# dozen about as well as from all, and a long prompt's feed would cost the draft model more than the guesses save
# (bench/NOTES.md, Speculative decoding)
WINDOW = 32
SPLIT = 2  # a feed this short goes one token a round beside other generations' guesses through batch lines
# (Guess.round_ask); in the driver's process the longest in a round whose forwards may compile a size at its first
# use (a longer one, a window, runs in the sizes compiled: DraftWorker._direct)


@dataclass
class Guess:
    """One generation's guesses (or its prompt's feed) as the forwards they take: ``steps`` yields an ``Ask``, is
    sent the argmax after it (or has the error thrown in), and returns the guesses, which go to ``then``."""

    session: int
    steps: Generator[Ask, int, list[int]]
    then: Callable[[list[int] | Exception], None]
    ask: Ask = ([], 0)

    def round_ask(self, together: bool) -> Ask:
        """This round's forward: the ask, or, with other generations in the round (``together``, unless the engines
        in the driver's process take the feed whole, `DraftWorker._takes`), the first of a feed of SPLIT tokens (the
        one after every guess was kept: the last guess and the model's token). Through batch lines one-token
        forwards of several sessions are one batched forward, a 2-token one is a forward of its own on the last
        stage (which mixes only checks' rows with others): 8 sessions' 2-token feeds took 3.7-6.2 ms, two rounds of
        one-token forwards 2.8-3.6 ms (bench/NOTES.md)."""
        tokens, position = self.ask
        return (tokens[:1], position) if together and 1 < len(tokens) <= SPLIT else self.ask

    def fed(self, ask: Ask, answer: int | DraftModelError) -> bool:
        """``ask`` (this round's, `round_ask`) was answered: True while it asks for another forward. The answer to
        part of a feed is no guess: the rest of the feed is the next round's ask (an error goes to ``advance``)."""
        done = len(ask[0])
        if done < len(self.ask[0]) and not isinstance(answer, DraftModelError):
            self.ask = (self.ask[0][done:], self.ask[1] + done)
            return True
        return self.advance(answer)

    def advance(self, answer: int | DraftModelError | None) -> bool:
        """Hand it the last ask's answer (None: start it); True while it asks for another forward (``ask``)."""
        try:
            if answer is None:
                self.ask = next(self.steps)
            elif isinstance(answer, DraftModelError):
                self.ask = self.steps.throw(answer)
            else:
                self.ask = self.steps.send(answer)
            return True
        except StopIteration as stop:
            self.then(stop.value)
        except Exception as e:  # a refused ask, or a bug: that step goes without guesses, the thread lives on
            self.then(e)
        return False


@dataclass(kw_only=True)
class ModelDrafter(Adaptive):
    """One generation's guesses from the draft model: its session there and the tokens that session holds."""

    off_loop: ClassVar[bool] = True  # guesses come from ``propose_later``, on the draft model's thread
    worker: DraftWorker
    session: int = 0
    _held: list[int] = field(default_factory=list)  # read and written on the draft model's thread (once begun)
    _origin: int = 0  # where in the generation's tokens (prompt and output) the session's position 0 is
    _opened: bool = False  # the session exists on the draft's stages (a feed was queued), until ``end``

    def begin(self, prompt: list[int]) -> None:
        """Feed the prompt's last WINDOW tokens to the session now, while the pipeline prefills the prompt, so the
        first guess feeds one token."""
        self._origin = max(0, len(prompt) - WINDOW)
        if self._origin < len(prompt) < self.worker.max_context + self._origin:
            self._opened = True
            self._held = prompt[self._origin:]  # before the job: a guess queued behind it in the batch starts from it

            def feed() -> Generator[Ask, int, list[int]]:
                yield self._held, 0
                return []
            self.worker.submit(Guess(self.session, feed(), lambda _: None))  # an error shows at the first guess

    def propose_later(self, context: list[int], room: int, then: Callable[[list[int] | Exception], None]) -> None:
        """min(k, room) argmax tokens of the draft model after ``context`` ([] when paused or without room), made
        on the draft model's thread; ``then`` gets them, or the error that stopped them (on that thread: it posts
        them to the pipeline's loop)."""
        self._opened = True  # here, not on the thread: an ``end`` that comes meanwhile must release it
        self.worker.submit(Guess(self.session, self._guesses(context, room), then))

    def end(self) -> None:
        """The generation is over: release its session on the draft's stages (queued after its last guess)."""
        if self._opened:
            self._opened = False
            self.worker.submit(lambda: self.worker.release(self.session))

    def _guesses(self, context: list[int], room: int) -> Generator[Ask, int, list[int]]:
        """The guesses as the forwards they take: each feeds what the session does not hold yet and gets one. The
        session holds the context from ``_origin`` on; where it has no room left for k more, it starts again with
        the last WINDOW tokens."""
        k = self._budget(room)
        if len(context) - self._origin + k > self.worker.max_context:
            self._origin, self._held = max(0, len(context) - WINDOW), []  # a feed at position 0 rewinds the session
        context = context[self._origin:]
        k = min(k, self.worker.max_context - len(context))
        if k <= 0:
            return []
        guesses: list[int] = []
        fed = 0  # the session's tokens that are still the context's (a guess not kept is not)
        for held, token in zip(self._held, context[:-1], strict=False):  # the last token is always fed
            if held != token:
                break
            fed += 1
        while len(guesses) < k:
            want = context + guesses
            try:
                guesses.append((yield want[fed:], fed))
            except DraftModelError:
                if fed == 0:
                    raise
                fed = 0  # the draft's stages evict the least recently used session when they need room: all again
                continue
            fed = len(want)
        self._held = context + guesses[:-1]
        return guesses
