"""The pipeline core: N running stage workers chained over the wire protocol, and the generations they run.

A generation is a small coroutine (``Generation.steps``) that yields one ``Call`` at a time - tokenize, prefill
through every stage, decode steps, detokenize - and gets each reply back. One thread runs every generation: it
writes a call to its stage without waiting for that stage's earlier replies and matches replies by request_id,
so with K generations in flight stage s computes one while stage s+1 computes another. The worker serves its
stdin in order, so several calls queued on one stage simply run one after the other. A draft model's guesses
(``--draft-model``) are the one call made elsewhere: on the draft model's own thread, whose answer comes back
through the loop's ``Mailbox``.

The command line is ``cli`` (``pp-pipeline``, ``python -m pp_worker.driver``), the interactive chat ``chat``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from pp_worker.driver import split
from pp_worker.driver.draft import Draft
from pp_worker.driver.generation import DRAFT, WAIT, Call, Generation, Reply, Sampling, TextSink
from pp_worker.driver.prefix import PrefixCache
from pp_worker.driver.stage_proc import Launch, Stage, stop_all, wait_io
from pp_worker.wire import B64, parse_object
from pp_worker.worker.device import device_kind


class PipelineError(Exception):
    """The run cannot go on; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class StageFailed(PipelineError):
    def __init__(self, stage: Stage, reason: str):
        super().__init__(f"stage {stage.index} {reason}\nstage {stage.index} stderr (last lines):\n"
                         f"{stage.stderr_tail()}")
        self.stage = stage.index


class Interrupted(PipelineError):
    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def wake_pipe() -> tuple[int, int]:
    """A pipe whose read end wakes the loop's select (both ends non-blocking: a full pipe is already a wake-up)."""
    read_fd, write_fd = os.pipe()
    for fd in (read_fd, write_fd):
        os.set_blocking(fd, False)
    return read_fd, write_fd


class Cancel:
    """SIGINT/SIGTERM set a flag and wake the select loop through a pipe; the loop then stops in order."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.wake_fd, write_fd = wake_pipe()
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum
        self.count += 1

    def check(self, readable: list[int]) -> None:
        """Raise ``Interrupted`` once a signal came; ``readable`` is what select returned (drains the pipe)."""
        if self.wake_fd in readable:
            try:
                os.read(self.wake_fd, 512)
            except BlockingIOError:
                pass
        if self.signum is not None:
            raise Interrupted(self.signum)


class Mailbox:
    """Work other threads hand to the loop (a draft model's guesses, driver.draft_model): a queue, and a pipe that
    wakes the loop's select."""

    def __init__(self) -> None:
        self._work: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()  # post and close: no write to a closed pipe (its fd may be another file's)
        self.wake_fd, self._write_fd = wake_pipe()

    def post(self, work: Callable[[], None]) -> None:
        """Queue ``work`` for the loop's thread (from any thread); nothing once closed."""
        with self._lock:
            if self._write_fd < 0:
                return
            self._work.append(work)
            try:
                os.write(self._write_fd, b"!")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def take(self) -> list[Callable[[], None]]:
        """What was posted so far (the loop's thread)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        work = []
        while self._work:
            work.append(self._work.popleft())
        return work

    def close(self) -> None:
        with self._lock:
            if self._write_fd >= 0:
                os.close(self._write_fd)
                os.close(self.wake_fd)
                self._write_fd = -1


@dataclass
class RunStats:
    generations: list[Generation]
    wall_s: float
    stage_busy_s: list[float]  # time with at least one request outstanding on the stage
    stage_requests: list[int]

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)


Waiter = int | Callable[[Reply], "Call | None"] | None  # a generation's request id, a callback, or None (release)


@dataclass
class _Pending:
    op: str
    sent: float
    waiter: Waiter  # a callback may answer with the next call to send (a prefill chunk's next stage)
    step: bool = False  # a token's step: one token, or a check of drafted ones (what a batch request holds)
    one_token: bool = False  # a one-token forward of any kind: what a worker batches with others queued behind it


Outgoing = tuple[int, Call, _Pending]  # a call waiting to be written: (request_id, call, its pending entry)


BATCH_OPS = frozenset({"decode_step", "forward_range", "forward_and_sample"})  # one-token steps a batch can hold
SCHEDULES = ("auto", "lockstep", "groups", "overlap")  # how generations in flight share the stages (--schedule)


def is_step(call: Call) -> bool:
    return call.op in BATCH_OPS and call.fields.get("seq_len", 1) == 1


def is_token(call: Call) -> bool:
    """A decoding generation's step: one token, or a check of drafted tokens (a stage on the CPU's C kernels runs a
    batch's checks and steps as one mixed forward; docs/protocol.md)."""
    return is_step(call) or call.check


def is_one_token(call: Call) -> bool:
    """A forward the worker itself may batch with one-token forwards queued behind it (docs/protocol.md, Batched
    decode): every step, and a one-token prefill."""
    return is_step(call) or call.op == "embed_and_forward" and len(call.fields.get("tokens", ())) == 1


class Pipeline:
    """N running stages and the select loop that moves requests and replies between them."""

    def __init__(self, launch: Launch, *, load_timeout: float = 600.0, step_timeout: float = 120.0,
                 cancel: Cancel | None = None, echo_stderr: bool = False, log: TextIO | None = sys.stderr,
                 prefill_chunk: int | None = None, batch: bool = True, schedule: str = "auto",
                 reuse: bool | None = None, draft: Draft | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.step_timeout, self.cancel, self.log = step_timeout, cancel, log
        self._chunk_override, self.batch = prefill_chunk, batch
        self.draft = draft  # speculative decoding (--draft): each generation that can gets a drafter of its own
        self.schedule = schedule  # decided after the stages are ready where it is "auto" (_flush says what each does)
        self._stepping: set[int] = set()  # generations with a step (one token, or a check) sent and not answered yet
        self._drafting: dict[int, float] = {}  # generation -> until when its group waits for its draft model's guesses
        self._group_of: dict[int, int] = {}  # schedule "groups": each stepping session's group (_group)
        self._waiting: dict[int, list[int]] = {}  # generation -> those waiting for it to send its prefill (WAIT)
        self._woken: list[int] = []  # generations whose wait ended, to go on once the current one has sent its calls
        self.stages: list[Stage] = []
        self._pending: dict[tuple[int, int], deque[_Pending]] = {}
        self._outbox: list[tuple[int, Call, _Pending]] = []  # calls of this round, sent by _flush, batched if they may
        self._active: dict[int, tuple[Generation, Generator[Call, Reply | None, None]]] = {}  # by request_id
        self._kept: set[int] = set()  # sessions left on the stages between runs (a chat's conversation)
        self._mail = Mailbox()  # a draft model's guesses, from its thread
        # sessions finished cache_prompt generations left (docs/serve.md, Prefix reuse); None: no reuse. By default
        # on where the stages hold KV (not the stub, whose outputs depend on how a prompt is cut into calls)
        self.prefixes: PrefixCache | None = None
        self._loading_shown: dict[int, float] = {}
        self._next_id = 1  # 0 is the driver's own control id (shutdown)
        # set to a list to record (time, stage, request_id, op, "send" or "reply"), e.g. to check the overlap
        self.trace: list[tuple[float, int, int, str, str]] | None = None
        self.link_s = 0.0  # a token's trip's time on the links to and from the stages (_measure_links; 0: not yet)
        self._pinged = False
        try:
            if launch.split is not None:  # each stage's blocks, planned and checked before any of them loads
                launch = self._plan_split(launch, load_timeout)
            for i in range(launch.num_stages):
                try:
                    self.stages.append(Stage(i, launch, echo_stderr))
                except OSError as e:  # e.g. the launcher's program does not exist
                    raise PipelineError(f"cannot start stage {i}: {e}") from e
            self._wait_ready(load_timeout)
            if reuse or reuse is None and not any((st.ready or {}).get("stub") for st in self.stages):
                self.prefixes = PrefixCache(self.max_sessions or 1, self._room_for_a_fork, self._ready)
            if schedule == "auto":
                self.schedule = "lockstep" if self._share_cores(launch) else "groups"
        except BaseException as e:
            self.close(failed=not isinstance(e, Interrupted))
            raise

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(failed=exc_type is not None and not issubclass(exc_type, Interrupted))

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(self.stages[-1].ready.get("eos_token_ids") or [])  # type: ignore[union-attr]

    @property
    def max_context(self) -> int | None:
        """Positions a KV session holds on every stage (the smallest a ready line reports), None if none says."""
        return self._smallest("max_context")

    @property
    def vocab_size(self) -> int | None:
        """Token ids are below it (the last stage's ready line), None if it does not say."""
        return self._smallest("vocab_size")

    @property
    def max_sessions(self) -> int | None:
        """KV sessions every stage holds at once (PP_MAX_SESSIONS), None if no ready line says."""
        return self._smallest("max_sessions")

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens per prefill call when a prompt is pipelined through the stages (None: sent whole). The stages'
        own largest prefill call unless the driver was told otherwise (0: never pipelined)."""
        chunk = self._smallest("prefill_chunk") if self._chunk_override is None else self._chunk_override
        return chunk or None

    @property
    def chat_template(self) -> str | None:
        """The model's chat template, from stage 0's ready line: the driver needs no copy of the GGUF."""
        template = (self.stages[0].ready or {}).get("chat_template")
        return template if isinstance(template, str) else None

    def _plan_split(self, launch: Launch, timeout: float) -> Launch:
        """``--split``: probe every stage's host (driver.split), plan each stage's block range, or refuse (exit 2)."""
        try:
            probes = split.probe_stages(launch, timeout, self.cancel)
            ranges = split.plan(launch.split, probes)  # type: ignore[arg-type]
        except split.SplitError as e:
            error = PipelineError(f"--split: {e}")
            error.exit_code = 2
            raise error from None
        self._say(f"split: {split.describe(ranges, probes)}")
        return split.with_layers(launch, ranges)

    def _share_cores(self, launch: Launch) -> bool:
        """Whether the stages compute on the same cores: local processes on this machine's CPU (tinygrad spreads
        each kernel over every core it may use, so two CPU stages here share them all)."""
        return launch.launcher is None and all(device_kind(str((st.ready or {}).get("device", ""))) == "CPU"
                                               for st in self.stages)

    def _smallest(self, key: str) -> int | None:
        values = [v for st in self.stages if isinstance(v := (st.ready or {}).get(key), int) and v > 0]
        return min(values, default=None)

    def new_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def close(self, failed: bool = False) -> None:
        """Shut every stage down and reap it (idempotent). After a failure a stage may be hung, so it gets a
        shorter grace before SIGTERM; a second Ctrl-C skips the grace altogether."""
        self._flush()  # e.g. the releases of an interrupted run, ahead of the shutdown
        for g, _ in self._active.values():  # generations cut short (pp-serve's failed pipeline): their draft sessions
            if g.draft:
                g.draft.end()
        stop_all(self.stages, grace_s=2.0 if failed else 5.0,
                 hurry=lambda: self.cancel is not None and self.cancel.count >= 2)
        self._mail.close()

    # --- running generations ------------------------------------------------------------------------------------
    def run(self, gens: Iterable[Generation], concurrency: int = 1) -> RunStats:
        """Run the generations, at most ``concurrency`` in flight at once; returns them filled in, with timing."""
        gens, t0 = list(gens), time.monotonic()
        if len({g.request_id for g in gens}) < len(gens):
            raise ValueError("two generations share a request_id (it is their KV session)")
        concurrency = self._within_sessions(max(1, concurrency), {g.request_id for g in gens})
        busy0, req0 = [st.busy_s for st in self.stages], [st.requests for st in self.stages]
        waiting = deque(gens)
        try:
            while waiting or self._active:
                while waiting and len(self._active) < concurrency:
                    self.start(waiting.popleft())
                self._pump(time.monotonic() + self.step_timeout)
            while self._pending:  # the releases' acknowledgements: no stray reply later
                self._pump(time.monotonic() + self.step_timeout)
        except Interrupted:
            for g, _ in self._active.values():  # their sessions are released before the stages are shut down
                self._release(g.session)
                if g.draft:
                    g.draft.end()
            raise
        finally:
            for rid, (g, _) in self._active.items():
                if self.prefixes is not None:
                    self.prefixes.withdraw(rid, g.session)
            self._active.clear()
            self._group_of.clear()
            self._waiting.clear()
            self._woken.clear()
            self._drafting.clear()
        return RunStats(gens, time.monotonic() - t0, [st.busy_s - b for st, b in zip(self.stages, busy0, strict=True)],
                        [st.requests - r for st, r in zip(self.stages, req0, strict=True)])

    def release(self, rid: int) -> None:
        """Drop a kept session (a chat's, when the chat ends) on every stage, and wait for the acknowledgements."""
        self._kept.discard(rid)
        self._release(rid)
        while self._pending:
            self._pump(time.monotonic() + self.step_timeout)

    def _within_sessions(self, concurrency: int, run_ids: set[int]) -> int:
        """At most as many generations in flight as the stages hold sessions (beside the kept ones): one more would
        evict a live generation's KV cache and fail the run."""
        if self.max_sessions is None:
            return concurrency
        room = max(1, self.max_sessions - len(self._kept - run_ids))
        if concurrency > room:
            self._say(f"pp-pipeline: concurrency {concurrency} is more than the stages' sessions allow "
                      f"(max_sessions {self.max_sessions}, PP_MAX_SESSIONS); running {room} at a time")
        return min(concurrency, room)

    # --- one generation at a time, as they come (driver.service runs these in its own thread) ------------------------
    def start(self, g: Generation) -> None:
        """Put one more generation in flight; ``pump`` then moves it along with the others."""
        if g.request_id in self._active:
            raise ValueError(f"request_id {g.request_id} is already in flight (it is its KV session)")
        if self.draft is not None and g.draft is None and self.draft.usable(g.sampling):
            self._measure_links()
            g.draft = self.draft.start()
            g.draft.link_s = self.link_s
        self._active[g.request_id] = (g, g.steps(len(self.stages), self.eos, self.max_context, self.prefill_chunk,
                                                 self.prefixes))
        self._advance(g.request_id, None)

    def pump(self) -> None:
        """One round of the select loop: at most about a second, less when a stage or the wake-up pipe stirs."""
        self._pump(time.monotonic() + self.step_timeout)

    def ask(self, stage: int, op: str, request_id: int, on_reply: Callable[[Reply], None],
            fields: dict[str, Any] | None = None) -> None:
        """Send one op outside any generation (``status``, ``ping``, ``tokenize``, ``detokenize``) to one stage;
        ``on_reply`` gets its reply from ``pump``."""
        self._send(request_id, Call(stage, op, fields or {}), on_reply)

    def _advance(self, rid: int, reply: Reply | None) -> None:
        """Give a generation its reply and send what it asks for next (its release when it is done, unless its
        session is to be kept, or left as cache). Its calls go under its KV session's id (``g.session``)."""
        g, coro = self._active[rid]
        try:
            call = coro.send(reply)
            while not call.wait:
                self._send(g.session, call, call.on_reply)
                call = coro.send(None)
            if call.stage == DRAFT:
                self._propose(rid, g, call)
            elif call.stage == WAIT:
                self._waiting.setdefault(call.fields["for"], []).append(rid)
            else:
                self._send(g.session, call, rid)
        except StopIteration:
            del self._active[rid]
            self._group_of.pop(g.session, None)
            if self.prefixes is not None:
                self.prefixes.withdraw(rid, g.session)
            if g.draft:
                g.draft.end()
            if g.keep_session:
                self._kept.add(rid)
            elif g.cache_prompt and g.tokens and self.prefixes is not None:
                self._leave(g)
            else:
                self._release(g.session)
        except (KeyError, TypeError, ValueError) as e:  # a reply without its field, or a payload that is not base64
            raise PipelineError(f"request {rid}: malformed reply {reply!r:.200}: {type(e).__name__} {e}") from e
        while self._woken:  # after this generation's calls (its prefill's): theirs (their forks) go behind them
            if (woken := self._woken.pop(0)) in self._active:
                self._advance(woken, {})

    def _ready(self, rid: int) -> None:
        """Generation ``rid`` has sent its prefill, or ended: those waiting for it go on (`_advance`, once its calls
        are queued)."""
        self._woken += self._waiting.pop(rid, [])

    def _propose(self, rid: int, g: Generation, call: Call) -> None:
        """A draft model's guesses for ``g``: made on the draft model's thread, while this loop moves the other
        generations on; the reply comes back through the mailbox."""
        def then(guesses: list[int] | Exception) -> None:  # on the draft model's thread
            self._mail.post(lambda: self._proposed(rid, g, guesses))
        assert g.draft is not None
        # Its group's others wait for its guesses (their checks and its go together) for up to half a trip of its own
        # through the stages (`Adaptive.trip_s`, none before the first): a draft model's generations finish their
        # guesses in different rounds (by their k), and a check held back once the others' has gone waits for their
        # whole trip (8 streams, 25 ms one way: 257 tok/s against ngram's 509 with as many trips). Never longer: a
        # slow draft model costs the others half a trip a step, a frozen one does not stop them.
        self._drafting[rid] = time.monotonic() + g.draft.trip_s / 2
        g.draft.propose_later(call.fields["context"], call.fields["room"], then)

    def _proposed(self, rid: int, g: Generation, guesses: list[int] | Exception) -> None:
        self._drafting.pop(rid, None)
        if self._active.get(rid, (None,))[0] is not g:  # it ended meanwhile (an interrupted run): nothing waits
            return
        if isinstance(guesses, Exception):  # guesses are an optimisation: the step goes on without them
            self._say(f"request {rid}: no guesses at this step: {type(guesses).__name__}: {guesses}")
            guesses = []
        self._advance(rid, {"tokens": guesses})

    def _room_for_a_fork(self) -> bool:
        """Whether the stages hold a cached session beside every generation in flight (the one asking included)
        and the kept ones: a fork of it keeps it, and a stage never evicts a live session for a fork (it evicts the
        other cached ones as needed)."""
        return len(self._active) + len(self._kept) < (self.max_sessions or 0)

    def drop_cache(self) -> None:
        """Release every session left as cache, on every stage (a benchmark's rounds start from the same state)."""
        if self.prefixes is not None:
            for session in self.prefixes.sizes():
                self.prefixes.drop(session)
                self._release(session)
        while self._pending:
            self._pump(time.monotonic() + self.step_timeout)

    def cached_sessions(self) -> dict[int, int]:
        """The sessions left as cache for prefix reuse -> the tokens each holds (a copy, for any thread)."""
        return self.prefixes.sizes() if self.prefixes is not None else {}

    def _leave(self, g: Generation) -> None:
        """Leave a finished generation's session on the stages as cache: it holds the prompt and every token but
        the last (which was sampled, never forwarded)."""
        assert self.prefixes is not None
        for dropped in self.prefixes.put(g.session, g.prompt_tokens + g.tokens[:-1]):
            self._release(dropped)
        self._release(g.session, keep=True)

    def _release(self, rid: int, keep: bool = False) -> None:
        for st in self.stages:
            if not st.eof:
                self._send(rid, Call(st.index, "release", {"keep": True} if keep else {}), None)

    def _send(self, rid: int, call: Call, waiter: Waiter) -> None:
        """Queue a call; the next round's `_flush` writes it (with the others of this round: a batch can form)."""
        pending = _Pending(call.op, time.monotonic(), waiter, is_token(call), is_one_token(call))
        self._pending.setdefault((call.stage, rid), deque()).append(pending)
        self._outbox.append((rid, call, pending))

    def _flush(self) -> None:
        """Write this round's calls in order. On each stage, the steps (one-token, or checks) of distinct
        generations of one group go as one ``batch`` request, which the stage runs as one batched forward (the
        worker splits it by its max_batch). A batch's replies come back in one line, so its generations reach the
        next stage together and stay a batch from then on.

        Lock-step (``lockstep``): a generation's next token starts (its step on stage 0) only once no
        other generation is in the middle of a token, so every decoding generation steps together and the stages
        pass one batch of K around. Where the stages share the same cores that is the fastest way: a batch of 4
        costs about 1.6x one step (bench/NOTES.md), and two batches on two stages at once only share the cores.
        ``groups``: the same within each of as many groups as there are stages (a generation joins the smallest
        at its first step), each group a batch request of its own, so stage s works on one group's batch while
        stage s+1 works on another's, as stages on devices of their own should, and a generation whose token comes
        back waits for its group instead of going on alone (``overlap``'s way: its steps then meet others' only
        by chance, and a stage runs one-token forwards one after another). A check of drafted tokens counts as a
        step everywhere here: it starts a token, is held and goes in its group's batch request (a stage on the CPU's C
        kernels runs the batch's checks and steps as one mixed forward).

        Without batching (``batch`` false) a stage has at most one one-token forward outstanding: two queued on its
        stdin would be batched by the worker itself."""
        calls, self._outbox = self._outbox, []
        unsent = {id(p) for _, _, p in calls}
        if self.schedule != "overlap" and (busy := self._mid_token(calls)):
            held = {id(p) for rid, call, p in calls if self._starts_token(call) and self._group(rid) in busy}
            self._outbox = [c for c in calls if id(c[2]) in held]  # held until their group's token completes
            calls = [c for c in calls if id(c[2]) not in held]
        if not self.batch:
            calls = self._one_at_a_time(calls, unsent)
        for st in self.stages:
            batches: dict[int, list[Outgoing]] = {}  # this stage's batch of each group, in the order they opened
            for rid, call, pending in (c for c in calls if c[1].stage == st.index):
                if self._batchable(st, call) and all(r != rid for r, _, _ in batches.get(self._group(rid), [])):
                    batches.setdefault(self._group(rid), []).append((rid, call, pending))
                    continue
                for batch in batches.values():  # before this call: a stage serves its lines in order
                    self._write(st, batch)
                batches = {self._group(rid): [(rid, call, pending)]} if self._batchable(st, call) else {}
                if not batches:
                    self._write(st, [(rid, call, pending)])
            for batch in batches.values():
                self._write(st, batch)

    def _one_at_a_time(self, calls: list[Outgoing], unsent: set[int]) -> list[Outgoing]:
        """The calls to write now such that no stage gets a one-token forward while it has one outstanding; the
        rest wait in the outbox (with every later call to the same stage, which keeps each stage's order)."""
        busy = {s for (s, _), queue in self._pending.items() for p in queue if p.one_token and id(p) not in unsent}
        now: list[Outgoing] = []
        held: set[int] = set()
        for rid, call, pending in calls:
            if call.stage in held or (pending.one_token and call.stage in busy):
                held.add(call.stage)
                self._outbox.append((rid, call, pending))
                continue
            now.append((rid, call, pending))
            if pending.one_token:
                busy.add(call.stage)
        return now

    @staticmethod
    def _starts_token(call: Call) -> bool:
        return call.stage == 0 and (call.op == "decode_step" or call.check)

    def _mid_token(self, calls: list[Outgoing]) -> set[int]:
        """The groups some generation of which is in the middle of a token: a step of it in flight, or about to be
        sent (past stage 0), or its draft model's guesses still to come for a while (`_propose`)."""
        now = time.monotonic()
        return {self._group(rid) for rid in self._stepping} | \
            {self._group(rid) for rid, until in self._drafting.items() if now < until and rid in self._active} | \
            {self._group(rid) for rid, call, p in calls if p.step and not self._starts_token(call)}

    def _group(self, rid: int) -> int:
        """The group whose steps go together (``groups``; with any other schedule all are one): fixed from the
        session's first step to its generation's end, the group with the fewest members then (pp-serve's
        generations come and go)."""
        if self.schedule != "groups":
            return 0
        if (group := self._group_of.get(rid)) is None:
            members = [list(self._group_of.values()).count(k) for k in range(len(self.stages))]
            group = self._group_of[rid] = members.index(min(members))
        return group

    def _batchable(self, st: Stage, call: Call) -> bool:
        return self.batch and is_token(call) and (st.ready or {}).get("max_batch", 1) > 1

    def _write(self, st: Stage, group: list[tuple[int, Call, _Pending]]) -> None:
        group = sorted(group, key=lambda c: c[1].check)  # steps, then checks (one run where the stage mixes rows)
        self._stepping.update(rid for rid, _, pending in group if pending.step)
        if self.trace is not None:
            self.trace += [(time.monotonic(), st.index, rid, call.op, "send") for rid, call, _ in group]
        if len(group) == 1:
            rid, call, _ = group[0]
            st.send({"op": call.op, "request_id": rid, **call.fields})
        elif group:
            # The batch answers under its first call's id: its entry goes just before that call's own, so the
            # batch reply (which comes before the replies it holds) meets it first. No id of its own to collide.
            rid, _, first = group[0]
            queue = self._pending[(st.index, rid)]
            queue.insert(next(i for i, p in enumerate(queue) if p is first),
                         _Pending("batch", first.sent, self._batch_replies(st)))
            st.send({"op": "batch", "request_id": rid, "requests": [  # one-token payloads: plain strings
                {"op": call.op, "request_id": r, **{k: str(v) if isinstance(v, B64) else v
                                                    for k, v in call.fields.items()}} for r, call, _ in group]})

    def _batch_replies(self, st: Stage) -> Callable[[Reply], None]:
        def deliver(reply: Reply) -> None:
            for inner in reply["replies"]:
                self._on_reply(st, inner, counted=False)
        return deliver

    # --- the loop -------------------------------------------------------------------------------------------------
    def _pump(self, deadline: float) -> None:
        """One round: write what was queued, wait for output or room to write, handle every complete line, check
        signals and timeouts."""
        self._flush()
        alive = [st for st in self.stages if not st.eof]
        wake = [self._mail.wake_fd] + ([self.cancel.wake_fd] if self.cancel else [])
        now = time.monotonic()
        held = [until for until in self._drafting.values() if until > now] if self._outbox else []  # `_mid_token`
        r = wait_io(alive, max(0.0, min(deadline - now, 1.0, *(until - now for until in held))), wake)
        if self.cancel:
            self.cancel.check(r)
        if self._mail.wake_fd in r:
            for work in self._mail.take():
                work()
        for st in alive:
            if st.out_fd in r:
                for line in st.read_lines():
                    self._on_line(st, line)
                if st.eof:
                    raise StageFailed(st, st.exit_description())
        self._check_timeouts()

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for st in self.stages:
            if st.outstanding and now - st.last_progress > self.step_timeout:
                ops = sorted((p.sent, p.op, rid) for (s, rid), q in self._pending.items() if s == st.index for p in q)
                what = f" to {ops[0][1]} (request {ops[0][2]})" if ops else ""
                st.signal(signal.SIGKILL)  # hung or frozen (SIGSTOP): it would answer neither shutdown nor SIGTERM
                raise StageFailed(st, f"gave no reply{what} within --step-timeout {self.step_timeout:g} s")

    def _on_line(self, st: Stage, line: bytes) -> None:
        obj = parse_object(line)  # a reply's multi-MB hidden_b64 comes back as B64, never scanned by JSON
        if obj is None:
            self._say(f"[stage {st.index}] non-JSON on stdout: {line[:200]!r}")
        elif obj.get("status") == "ready":
            st.ready = obj
        elif isinstance(obj.get("event"), str):
            self._on_event(st, obj)
        else:
            self._on_reply(st, obj)

    def _on_reply(self, st: Stage, obj: Reply, counted: bool = True) -> None:
        """Match a reply to its call (``counted``: a line of its own, not one of a batch reply's)."""
        rid = obj.get("request_id")
        queue = self._pending.get((st.index, rid)) if isinstance(rid, int) else None
        if not queue:
            if "error" in obj:
                raise StageFailed(st, f"answered with an error: {obj['error']}")
            self._say(f"[stage {st.index}] unexpected reply for request {rid!r}")
            return
        p = queue.popleft()
        if not queue:
            del self._pending[(st.index, rid)]
        if p.step:
            self._stepping.discard(rid)
        if counted:
            st.replied()
        if self.trace is not None and p.op != "batch":  # a batch is traced as the calls it holds
            self.trace.append((time.monotonic(), st.index, rid, p.op, "reply"))
        if "error" in obj:
            raise StageFailed(st, f"answered {p.op} (request {rid}) with an error: {obj['error']}")
        if isinstance(p.waiter, int):
            self._advance(p.waiter, obj)
        elif p.waiter is not None:
            try:
                then = p.waiter(obj)
            except (KeyError, TypeError, ValueError) as e:  # as in _advance
                raise PipelineError(f"request {rid}: malformed reply {obj!r:.200}: {type(e).__name__} {e}") from e
            if then is not None:  # a chain: its next call
                self._send(rid, then, then.on_reply)

    def _on_event(self, st: Stage, obj: Reply) -> None:
        if obj["event"] == "loading":
            fetching = "bytes_total" in obj  # a model given by URL: the stage's bytes, downloading
            done, total = (obj.get("bytes_done"), obj.get("bytes_total")) if fetching else \
                (obj.get("blocks_done"), obj.get("blocks_total"))
            now = time.monotonic()
            if done == total or now - self._loading_shown.get(st.index, 0.0) >= 1.0:  # at most one line a second
                self._loading_shown[st.index] = now
                self._say(f"stage {st.index}: fetching its share of the model, {_mib(done)} of {_mib(total)} MiB"
                          if fetching else f"stage {st.index}: loading blocks {done}/{total}")
        elif obj["event"] == "session_evicted" and obj.get("cached"):
            # gone from one stage: useless on the others
            if self.prefixes is not None and self.prefixes.drop(obj.get("session")):
                self._release(obj["session"])
        elif obj["event"] in ("model_load_failed", "uncaught_exception", "session_evicted"):
            self._say(f"stage {st.index}: {obj['event']}: {obj.get('value') or obj.get('session', '')}")

    def _measure_links(self) -> None:
        """Ping every stage once, all at once, when the first drafting generation starts (its ping goes ahead of its
        first call): a token's trip crosses each stage's link both ways, so the pings' sum is the trip's time on the
        links, whatever the stages compute; speculative decoding guesses more behind a slow link
        (draft.Adaptive.limit). Local stages: ~1 ms. The drafters in flight learn it with the last pong."""
        if self._pinged:
            return
        self._pinged = True
        pongs: dict[int, float] = {}

        def pong(stage: int, sent: float) -> Callable[[Reply], None]:
            def on_reply(reply: Reply) -> None:
                pongs[stage] = time.monotonic() - sent
                if len(pongs) == len(self.stages):
                    self.link_s = sum(pongs.values())
                    for g, _ in self._active.values():
                        if g.draft:
                            g.draft.link_s = self.link_s
            return on_reply
        for st in self.stages:
            self.ask(st.index, "ping", self.new_request_id(), pong(st.index, time.monotonic()))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(st.ready is None for st in self.stages):
            if time.monotonic() >= deadline:
                late = next(st for st in self.stages if st.ready is None)
                raise StageFailed(late, f"was not ready within --load-timeout {timeout:g} s")
            self._pump(deadline)
        self._check_shape()
        for st in self.stages:
            r = st.ready or {}
            start, end = r.get("layer_range") or (None, None)
            self._say(f"stage {st.index} ready: pid {r.get('pid')} (process {st.proc.pid}), blocks "
                      f"[{start}, {end}) of {r.get('total_blocks')}, model {r.get('model')}")

    def _check_shape(self) -> None:
        """Catch a mis-launched pipeline (wrong STAGE/NUM_STAGES, different models) before any request."""
        n = len(self.stages)
        for st in self.stages:
            r, prev = st.ready or {}, (self.stages[st.index - 1].ready or {}) if st.index else {}
            if r.get("stage") != st.index or r.get("num_stages") != n:
                raise StageFailed(st, f"reports stage {r.get('stage')} of {r.get('num_stages')}; expected "
                                      f"stage {st.index} of {n}")
            if prev and (prev.get("layer_range", [0, 0])[1] != r.get("layer_range", [0])[0]
                         or prev.get("hidden_dim") != r.get("hidden_dim")):
                raise StageFailed(st, f"does not continue stage {st.index - 1} (layers {prev.get('layer_range')} "
                                      f"then {r.get('layer_range')}; hidden {prev.get('hidden_dim')} vs "
                                      f"{r.get('hidden_dim')}): different models?")

    def _say(self, text: str) -> None:
        if self.log:
            print(text, file=self.log, flush=True)


def _mib(n: object) -> str:
    return f"{n / 2**20:.1f}" if isinstance(n, int) else "?"


def run_pipeline(prompts: list[str], *, stages: int = 2, model: str | None = None, stub: bool = False,
                 max_tokens: int = 64, concurrency: int = 1, sampling: Sampling | None = None,
                 launcher: str | None = None, env: dict[str, str] | None = None, stream: TextSink | None = None,
                 load_timeout: float = 600.0, step_timeout: float = 120.0) -> RunStats:
    """Start a pipeline, run the prompts (``concurrency`` at a time), shut it down. Each result is the same as
    running that prompt alone. ``stream`` gets (generation, text so far, finished) as tokens arrive."""
    launch = Launch(stages, model=model, stub=stub, launcher=launcher, env=env or {})
    with Pipeline(launch, load_timeout=load_timeout, step_timeout=step_timeout, log=None) as p:
        return p.run(make_generations(p, prompts, max_tokens, sampling or Sampling(), stream), concurrency)


def make_generations(p: Pipeline, prompts: list[str], max_tokens: int, sampling: Sampling,
                     on_text: TextSink | None = None) -> list[Generation]:
    """One generation a prompt; where the pipeline reuses prefixes, prompts that begin alike compute that beginning
    once (a later one forks an earlier one's session) and leave their sessions as cache for the next run."""
    return [Generation(i, prompt, p.new_request_id(), max_tokens, sampling, on_text=on_text,
                       cache_prompt=p.prefixes is not None) for i, prompt in enumerate(prompts)]

