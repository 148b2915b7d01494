"""``--draft-model PATH``: a small GGUF with the pipeline's vocabulary guesses the next tokens (speculative decoding).

The draft model runs on the driver's host as a two-stage pipeline of local worker processes, driven by a thread of
its own: a generation's guesses are a job queued to that thread, whose result the pipeline's loop gets back through
its mailbox (pipeline.Mailbox), so while one generation waits for its guesses the others' steps go on. The thread
runs one job at a time, in order. Each generation keeps a KV session there; to guess, it feeds what the session does
not hold yet (the tokens kept since, the model's own token) and takes k argmax tokens, one forward each; a guess
the pipeline did not keep is rewound over by the next feed (a forward at a smaller position rewinds,
docs/protocol.md). When the generation ends its session is released there (``ModelDrafter.end``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pp_worker.driver.draft import Adaptive
from pp_worker.driver.stage_proc import Launch


class DraftModelError(RuntimeError):
    pass


class _Process:
    """One of the draft model's worker processes, and a blocking request -> reply over its pipes."""

    def __init__(self, launch: Launch, stage: int, path: str):
        self.path, self._stderr = path, tempfile.TemporaryFile()
        self.proc = subprocess.Popen(launch.argv(stage), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env={**os.environ, **launch.worker_env(stage)})

    def ready(self) -> dict[str, Any]:
        line = self._line()
        while line.get("status") != "ready":  # load progress events may come before it
            line = self._line()
        return line

    def call(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it died, or close() ended it under this call (a closed pipe)
            raise self._died() from None
        reply = self._line()
        while "event" in reply:  # pp_worker_ready after the ready line, progress...: not the reply
            reply = self._line()
        if "error" in reply:
            raise DraftModelError(f"draft model {self.path}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # PP_EXIT_ON_EOF: the worker ends
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died()
        return json.loads(line)

    def _died(self) -> DraftModelError:
        self.proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        return DraftModelError(f"draft model {self.path}: worker exited ({self.proc.returncode}): " + " | ".join(tail))


class DraftWorker:
    """The draft model, on this host: two local worker processes (a worker is a stage of at least two: the first
    holds the embedding and the first half of the blocks, the second the rest and the head), called by one thread
    of their own, one job at a time (``submit``)."""

    def __init__(self, path: str, env: dict[str, str] | None = None):
        if not os.path.isfile(path):
            raise DraftModelError(f"draft model {path!r}: no such file")
        launch = Launch(2, model=path, env=env or {})  # env: extra variables for its workers
        self.path, self._ids = path, itertools.count(1)
        self._jobs: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._stages = [_Process(launch, stage, path) for stage in range(2)]
        try:
            ready = [stage.ready() for stage in self._stages]
        except DraftModelError:
            self.close()
            raise
        self.vocab_size: int = ready[1]["vocab_size"]
        self.max_context: int = min(r["max_context"] for r in ready)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="draft-model")
        self._thread.start()

    def drafter(self, max_k: int) -> ModelDrafter:
        """A generation's drafter, on a session of its own here."""
        return ModelDrafter(max_k=max_k, worker=self, session=next(self._ids))

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the draft model's thread, after the jobs queued before it (none once closed)."""
        with self._wake:
            if not self._closing:
                self._jobs.append(job)
                self._wake.notify()

    def status(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each draft stage's ``status`` reply, once every job queued before has run (e.g. the sessions it holds)."""
        done, replies, failed = threading.Event(), [], []

        def ask() -> None:
            try:
                replies.extend(stage.call({"op": "status", "request_id": 0}) for stage in self._stages)
            except DraftModelError as e:
                failed.append(e)
            done.set()
        self.submit(ask)
        if not done.wait(timeout):
            raise DraftModelError(f"draft model {self.path}: no status within {timeout:g} s")
        if failed:
            raise failed[0]
        return replies

    def next_token(self, session: int, tokens: list[int], position: int) -> int:
        """The draft model's argmax after ``tokens`` fed at ``position`` of ``session`` (a smaller position than the
        session holds rewinds it). On the draft model's thread only."""
        first, last = self._stages
        reply = first.call({"op": "embed_and_forward", "request_id": session, "tokens": tokens, "position": position})
        hop = {"hidden_b64": reply["hidden_b64"], "position": position, "seq_len": len(tokens)}
        if "hidden_dtype" in reply:
            hop["hidden_dtype"] = reply["hidden_dtype"]
        return last.call({"op": "forward_and_sample", "request_id": session, **hop})["token_id"]

    def release(self, session: int) -> None:
        """Drop ``session`` on both stages. On the draft model's thread only."""
        for stage in self._stages:
            stage.call({"op": "release", "request_id": session})

    def close(self) -> None:
        """Stop the thread (a job in progress ends with an error, as its workers do) and the workers."""
        with self._wake:
            self._closing = True
            self._jobs.clear()
            self._wake.notify()
        for stage in self._stages:
            stage.close()
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                job = self._jobs.popleft()
            job()


@dataclass(kw_only=True)
class ModelDrafter(Adaptive):
    """One generation's guesses from the draft model: its session there and the tokens that session holds."""

    off_loop: ClassVar[bool] = True  # guesses come from ``propose_later``, on the draft model's thread
    worker: DraftWorker
    session: int = 0
    _held: list[int] = field(default_factory=list)
    _opened: bool = False  # the session exists on the draft's stages (a guess was asked for), until ``end``

    def propose_later(self, context: list[int], room: int, then: Callable[[list[int] | Exception], None]) -> None:
        """``propose`` on the draft model's thread; ``then`` gets the guesses, or the error that stopped them (on
        that thread: it posts them to the pipeline's loop)."""
        self._opened = True  # here, not on the thread: an ``end`` that comes meanwhile must release it

        def job() -> None:
            try:
                guesses: list[int] | Exception = self.propose(context, room)
            except Exception as e:  # a dead draft worker, or a bug: the pipeline reports it, the thread lives on
                guesses = e
            then(guesses)
        self.worker.submit(job)

    def end(self) -> None:
        """The generation is over: release its session on the draft's stages (queued after its last guess)."""
        if self._opened:
            self._opened = False

            def release() -> None:
                try:
                    self.worker.release(self.session)
                except DraftModelError:
                    pass  # the draft worker died: its sessions went with it (the next guess reports it)
            self.worker.submit(release)

    def propose(self, context: list[int], room: int) -> list[int]:
        """min(k, room) argmax tokens of the draft model after ``context`` ([] when paused or without room)."""
        k = min(self._budget(room), self.worker.max_context - len(context))
        if k <= 0:
            return []
        common = 0  # the session's tokens that are still the context's (a guess not kept is not)
        for held, token in zip(self._held, context[:-1], strict=False):  # the last token is always fed
            if held != token:
                break
            common += 1
        try:
            guesses = [self.worker.next_token(self.session, context[common:], common)]
        except DraftModelError:
            if common == 0:
                raise
            # the draft's stages evict the least recently used session when they need room: feed it all again
            guesses = [self.worker.next_token(self.session, context, 0)]
        for position in range(len(context), len(context) + k - 1):
            guesses.append(self.worker.next_token(self.session, guesses[-1:], position))
        self._held = context + guesses[:-1]
        return guesses
