"""Speculative decoding's drafts (``--draft ngram``): guesses of the next tokens that the pipeline checks in one pass.

A decode step costs a trip through every stage, whatever its length: over a network the round trip, not the
compute, sets the rate. With a draft, the driver sends the token it has plus k guessed tokens as one step; the last
stage samples every row as a one-token step would (``verify``, docs/protocol.md) and answers how many guesses it
kept plus the model's next token, so one trip yields 1 to k + 1 tokens and the text is exactly the model's.

``ngram`` is prompt lookup: the last few tokens of the text so far (prompt and output) are looked up earlier in
it, and what followed them there is the guess. No model runs: it costs a dictionary lookup a step, and it guesses
well where the output repeats or edits the prompt (code, quotes, summaries, a passage retyped). ``--draft-model``
guesses with a small model of the same vocabulary instead (driver.draft_model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

DRAFTS = ("ngram",)  # --draft's choices; --draft-model PATH is the kind "model"
# the longest suffix that occurred before wins: it predicts best. Not one token: in free text a lone token recurs
# everywhere and what followed it there is seldom next (the embedded model's free task: 5 guesses in 47 steps, none
# kept), and a check that keeps nothing costs local stages ~half a step (~4% of the task: bench/NOTES.md)
NGRAM_SIZES = (3, 2)
MAX_PAUSE = 16  # steps without a guess after repeated misses, at most (doubling from 1)
MAX_GUESSES = 16  # behind a slow link k may pass --draft-max (Adaptive.limit), never this


def whole_calls(n: int) -> int:
    """The most guesses, at most ``n``, that make the check (the token and its guesses) a power of two of rows: 1, 3,
    7, 15... A stage runs a few rows as one call of its ladder of powers of two (docs/internals.md): 4 guesses are
    5 rows, calls of 4 and 1, and the second call reads all the weights again for one token."""
    return (1 << ((n + 1).bit_length() - 1)) - 1


class Penalised(Protocol):  # generation.Sampling, named by what is read of it (generation imports this module)
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logprobs: int | None


@dataclass(frozen=True)
class Draft:
    """How to draft (``--draft``, ``--draft-model``, ``--draft-max``): the kind, the most tokens guessed at a step,
    and for the kind "model" the draft model's worker (one for every generation)."""

    kind: str = "ngram"
    max_k: int = 3
    worker: DraftSource | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.kind == "model") != (self.worker is not None):
            raise ValueError("a draft of kind 'model' needs the draft model's worker, and only it")
        if self.kind not in (*DRAFTS, "model"):
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.kind!r}")
        if self.max_k < 1:
            raise ValueError(f"draft-max must be >= 1, got {self.max_k}")

    @staticmethod
    def usable(sampling: Penalised) -> bool:
        """Every sampling setting keeps its distribution under a check row by row, but a penalty's window (repetition,
        presence, frequency) would move with each guessed token, which the stage cannot know, and a check's reply
        carries one token's log-probabilities: those generations draft nothing."""
        penalties = (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty)
        return all(p is None for p in penalties) and sampling.logprobs is None

    def start(self) -> Drafter:
        return self.worker.drafter(self.max_k) if self.worker is not None else NgramDrafter(self.max_k)


class DraftSource(Protocol):
    """What makes a generation's drafter from a draft model (driver.draft_model.DraftWorker, which imports this
    module)."""

    def drafter(self, max_k: int) -> Drafter: ...


class Drafter(Protocol):
    """A generation's drafter, as the generation and the pipeline use it: ``propose_later`` hands the guesses to
    ``then``, at once, or, ``off_loop``, later from a thread of its own (a model's forwards: the pipeline's loop goes
    on meanwhile)."""

    proposed: int
    accepted: int
    link_s: float
    trip_s: float  # a trip through the stages as the generation has seen them (0 before the first)
    off_loop: ClassVar[bool]

    def begin(self, prompt: list[int]) -> None: ...

    def propose_later(self, context: list[int], room: int, then: Callable[[list[int] | Exception], None]) -> None:
        ...

    def update(self, proposed: int, kept: int) -> None: ...

    def timed(self, trip_s: float) -> None: ...

    def end(self) -> None: ...


@dataclass
class Adaptive:
    """How many tokens a generation's drafter guesses now (``k``, adapted to how many are kept and to how long a trip
    through the stages takes against their compute), and its totals."""

    max_k: int
    k: int = 1  # a first guess costs little if it misses; every kept one grows it
    proposed: int = 0  # totals, for the summary
    accepted: int = 0
    link_s: float = 0.0  # the links' share of a token's trip through the stages (the pipeline's pings; 0: local)
    trip_s: float = 0.0  # a token's trip through the stages as this generation has seen them (a moving average)
    fastest_s: float = 0.0  # its fastest trip: the links and its own compute, the least waiting behind others'
    _pause: int = 0  # steps left without a guess
    _misses: int = 0  # consecutive steps that kept nothing at k = 1

    @property
    def limit(self) -> int:
        """The most tokens to guess at a step: ``max_k`` (--draft-max) times a trip over its compute, at least
        ``max_k`` and at most MAX_GUESSES; ``max_k`` until both are measured. The trip is the moving average; its
        compute, the fastest trip less the links' pings (a trip's wait behind other generations' work, or their
        prompts', is no cost of its own rows). A check's guessed rows cost compute and a trip costs the links and
        the waits too: scaled so, the rows' compute stays the share of a trip it is where a trip is all compute,
        while each trip yields more tokens (25 ms one way: a trip of ~130 ms for ~30 of compute, 4 -> 16; local
        stages of a big model: ~max_k)."""
        compute = self.fastest_s - self.link_s
        if self.link_s <= 0 or self.trip_s <= 0:
            return self.max_k
        scaled = self.max_k * self.trip_s / compute if compute > 0 else MAX_GUESSES
        return max(self.max_k, min(MAX_GUESSES, round(scaled)))

    def timed(self, trip_s: float) -> None:
        """A decode step's or a check's trip through the stages, from its first stage's call to the last's reply."""
        self.trip_s = trip_s if not self.trip_s else (self.trip_s + trip_s) / 2
        self.fastest_s = min(self.fastest_s or trip_s, trip_s)

    def _budget(self, room: int) -> int:
        """How many tokens to guess at this step: min(k, limit, room) down to `whole_calls`, or 0 while paused (the
        pause counts down)."""
        if self._pause:
            self._pause -= 1
            return 0
        return whole_calls(min(self.k, self.limit, room))

    def update(self, proposed: int, kept: int) -> None:
        """After a check: double k (2k + 1: the next check of whole calls) while every guess is kept (up to
        ``limit``), shrink it to one past what was kept otherwise; after misses at one guess, draft nothing for a
        while (1, 2, 4... steps), so a text that does not repeat pays little."""
        self.proposed, self.accepted = self.proposed + proposed, self.accepted + kept
        if kept == proposed:
            self.k, self._misses = min(self.limit, 2 * self.k + 1), 0
            return
        self.k = max(1, kept + 1)
        if kept == 0 and proposed == 1:
            self._misses += 1
            self._pause = min(MAX_PAUSE, 1 << (self._misses - 1))
        else:
            self._misses = 0


@dataclass
class NgramDrafter(Adaptive):
    """One generation's prompt lookup."""

    off_loop: ClassVar[bool] = False  # a dictionary lookup: at once, on the pipeline's loop

    _index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where its latest occurrence ended
    _indexed: int = 0  # context positions indexed so far

    def propose(self, context: list[int], room: int) -> list[int]:
        """Up to min(k, room) tokens that followed the latest earlier occurrence of the context's longest
        recurring suffix (3, then 2 tokens); [] when none recurs, when paused, or when ``room`` is 0. Where that
        occurrence ends less than k tokens before the end (a loop: "a b a b", a token repeated), the copy goes on
        over its own guesses, as LZ77 copies a run: the loop is guessed to go on, k tokens, not only the few the
        context shows after the occurrence."""
        self._update_index(context)
        if self._pause:
            self._budget(room)  # 0: the pause counts down
            return []
        for n in NGRAM_SIZES:  # the budget only where a suffix recurs: every step of a free text runs this, on the
            # pipeline's loop between a reply and the next step's send
            if len(context) > n and (end := self._index.get(tuple(context[-n:]))) is not None:
                period = len(context) - end  # >= 1: the occurrence ended before the last token
                return [context[end + i % period] for i in range(self._budget(room))]
        return []

    def begin(self, prompt: list[int]) -> None:
        """Nothing to prepare: the prompt is indexed at the first guess."""

    def propose_later(self, context: list[int], room: int, then: Callable[[list[int] | Exception], None]) -> None:
        then(self.propose(context, room))

    def end(self) -> None:
        """Nothing to free: the index goes with the drafter."""

    def _update_index(self, context: list[int]) -> None:
        """Index every n-gram that ends before the last token (the suffix looked up must have occurred earlier)."""
        for end in range(max(self._indexed, 1), len(context)):
            for n in NGRAM_SIZES:
                if end >= n:
                    self._index[tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, len(context))
