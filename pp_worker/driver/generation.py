"""One generation as the calls it makes: tokenize, prefill through every stage, decode steps, detokenize.

``Generation.steps`` is a coroutine that yields one ``Call`` at a time and gets each reply back; the pipeline
(``pipeline``) decides when to send it, so many generations can be in flight at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pp_worker.driver.prefix import PrefixCache, reusable
from pp_worker.wire import B64

if TYPE_CHECKING:
    from pp_worker.driver.draft import Drafter

DRAFT = -1  # a Call's "stage" for a draft model's guesses (fields: context, room), made off the pipeline's loop
WAIT = -2  # a Call's "stage" for waiting until generation ``for`` has sent its prefill (`PrefixCache.source`)
RECENT_TOKENS = 64  # the window the repetition penalty looks at, as llama.cpp's default penalty_last_n
Reply = dict[str, Any]


@dataclass(frozen=True)
class Sampling:
    """Optional fields of forward_and_sample; all None means argmax, exactly as without them."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), as OpenAI's logit_bias
    presence_penalty: float | None = None  # OpenAI's, over the same window as the repetition penalty (llama.cpp's)
    frequency_penalty: float | None = None
    logprobs: int | None = None  # set: each token comes with its log-probability and this many alternatives

    def fields(self, context: list[int]) -> dict[str, Any]:
        out = {f.name: v for f in fields(self) if f.name != "logit_bias" and (v := getattr(self, f.name)) is not None}
        if any(p is not None for p in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)):
            out["recent_tokens"] = context[-RECENT_TOKENS:]
        if self.logit_bias:
            out["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}  # JSON keys are strings
        return out


@dataclass
class Call:
    """One request of a generation. ``wait=False``: the generation goes on at once; ``on_reply`` gets the reply
    and may answer with the next call to send (a chain: a prefill chunk's next stage)."""

    stage: int
    op: str
    fields: dict[str, Any]
    wait: bool = True
    on_reply: Callable[[Reply], Call | None] | None = None
    check: bool = False  # a step of drafted tokens (the token and the guesses after it): batched as a one-token step


TextSink = Callable[["Generation", str, bool], None]  # (generation, text so far, finished)


@dataclass
class Generation:
    """One prompt's generation: its request_id is its KV session on every stage."""

    index: int
    prompt: str
    request_id: int
    max_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)
    cached: list[int] = field(default_factory=list)  # tokens the session already holds (a chat's earlier turns)
    on_text: TextSink | None = None  # set: stream the text (partial detokenize of the new ids, off the critical path)
    on_token: Callable[[Generation], None] | None = None  # after each token is appended (its time is ``t_end``)
    keep_session: bool = False  # a chat's turn: its KV session stays on the stages for the next turn
    # the last stage's ``grammar`` field (worker.grammar): the output is constrained to it; None: not constrained
    grammar: dict[str, Any] | None = None
    # pp-serve's prefix reuse: take the cached session with the longest common prefix, and leave this one's as cache
    cache_prompt: bool = False
    session: int = -1  # the KV session its forward ops go under: request_id, or a cached one it took (``steps``)
    reused: int = 0  # prompt tokens its session already held (not recomputed)
    draft: Drafter | None = None  # speculative decoding's guesses (driver.draft; the pipeline sets it)
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # with ``sampling.logprobs``: each token's ``logprobs`` from the last stage ({token_id, logprob, text, top})
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    # "eos", "max_tokens", "length" (max_context reached), "stop" (asked to stop, e.g. a chat stop string) or
    # "error" (this generation could not run; ``error`` says why, the others go on)
    stop_reason: str = ""
    error: str = ""
    error_code: str = ""  # with some errors, OpenAI's code for them: "context_length_exceeded"
    stop_requested: bool = False
    # streaming: a detokenize is in flight (later tokens do not queue more, the updates coalesce), the text streamed
    # so far, and how many tokens it covers (the rest end in an unfinished character or are not sent yet)
    _streaming: bool = field(default=False, init=False, repr=False)
    _streamed: str = field(default="", init=False, repr=False)
    _covered: int = field(default=0, init=False, repr=False)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def streamed_tokens(self) -> int:
        """How many tokens the text streamed so far (``on_text``) covers."""
        return self._covered

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_start

    @property
    def decode_tps(self) -> float:
        n, dt = len(self.tokens) - 1, self.t_end - self.t_first
        return n / dt if n > 0 and dt > 0 else 0.0

    def steps(self, num_stages: int, eos: frozenset[int], max_context: int | None = None,
              prefill_chunk: int | None = None,
              prefixes: PrefixCache | None = None) -> Generator[Call, Reply | None, None]:
        """The whole generation as the calls it makes, top to bottom. ``max_context``: positions a KV session
        holds (the stages' ready lines); the generation stops there with reason "length". ``prefill_chunk``: a
        longer prompt is pipelined through the stages in chunks of that many tokens (`_pipelined_prefill`).
        ``prefixes``: the sessions earlier generations left and those in flight, which a ``cache_prompt`` generation
        may take or fork.
        A generation that comes with ``tokens`` (one that went on after a failure: pp-serve's restarts) goes on
        from them: its prompt and those tokens are the prefill, whose forward gives the next token."""
        self.t_start = self.t_start or time.monotonic()
        self.session = self.request_id
        if not self.tokens:
            reply = yield Call(0, "tokenize", {"prompt": self.prompt})
            self.prompt_tokens = reply["tokens"]
            self.error, self.error_code = _refusal(self.prompt_tokens, max_context)
        if self.error:  # this generation alone cannot run; it never touches a KV session
            self.stop_reason = "error"
            self._finish("")
            return
        held = self.prompt_tokens + self.tokens  # what the sessions are to hold before the next token
        if self.draft:  # a draft model takes the prompt in while the stages do
            self.draft.begin(held)
        if self.cache_prompt and prefixes is not None:
            if not self.tokens:
                yield from self._share_prefix(prefixes, num_stages)
            prefixes.offer(self.request_id, self.session, held)  # others may fork it once the prefill below is sent
        start = self.reused = reusable(self.cached, held)  # only what is new is computed
        if prefill_chunk and len(held) - start > prefill_chunk:
            start = yield from self._pipelined_prefill(held, start, prefill_chunk, num_stages)
        op, feed, position = "embed_and_forward", {"tokens": held[start:]}, start
        seq_len, drafted = len(held) - start, []
        while True:
            sent = time.monotonic()
            reply = yield from self._forward(op, feed, position, seq_len, num_stages, drafted)
            if self.draft and self.tokens:  # a token's trip (not the prompt's): a slow link lets the draft guess more
                self.draft.timed(time.monotonic() - sent)
            kept = reply["accepted"] if drafted else 0
            if drafted and self.draft:
                self.draft.update(len(drafted), kept)
            for token in [*drafted[:kept], reply["token_id"]]:
                if self._append(token, eos):
                    break
            # where the next step would write (the guesses not kept are overwritten): checked before it is sent
            position += seq_len - len(drafted) + kept
            full = max_context is not None and position + 1 > max_context
            if token in eos or len(self.tokens) >= self.max_tokens or full or self.stop_requested:
                break
            if self.on_text and not self._streaming:
                yield self._stream_call(num_stages - 1)
            drafted = yield from self._guess(position, max_context)
            if drafted:  # the token and the guesses after it, checked by the last stage in one pass
                op, feed, seq_len = "embed_and_forward", {"tokens": [token, *drafted]}, 1 + len(drafted)
            else:
                op, feed, seq_len = "decode_step", {"token_id": token}, 1
        self.stop_reason = ("eos" if token in eos else "max_tokens" if len(self.tokens) >= self.max_tokens
                            else "length" if full else "stop")
        shown = self.tokens[:-1] if token in eos else self.tokens
        self._finish((yield Call(num_stages - 1, "detokenize", {"tokens": shown}))["text"])

    def _share_prefix(self, prefixes: PrefixCache, n: int) -> Generator[Call, Reply | None, None]:
        """Start from the session where the prompt begins already, if any (`PrefixCache.source`; where that is a
        generation still choosing where it starts, once it has sent its prefill): claim a cached one it continues
        whole, else fork the common positions into this generation's own session; on every stage, one at a time (a
        stage that evicted the source meanwhile says 0), holding as ``cached`` what all of them hold."""
        found = prefixes.source(self.prompt_tokens)
        prefixes.expect(self.request_id, self.prompt_tokens)
        if found is not None and found.wait:  # one that begins as this does is choosing where it starts: its prefill
            yield Call(WAIT, "wait", {"for": found.session})  # first, then fork it (or what else is there by then)
            found = prefixes.source(self.prompt_tokens, wait=False)
        if found is None:
            return
        if found.take:
            self.session, op, fields = found.session, "claim", {}
        else:
            op, fields = "fork", {"from": found.session, "positions": found.common}
        least = len(found.held)
        for s in range(n):
            least = min(least, (yield Call(s, op, fields))["positions"])
        self.cached = found.held[:least]

    def _forward(self, op: str, feed: dict[str, Any], position: int, seq_len: int, n: int,
                 drafted: list[int]) -> Generator[Call, Reply | None, Reply]:
        """One pass through every stage (a prefill of seq_len tokens, one decode step, or a step with ``drafted``
        guesses after its token) -> the last stage's reply (``token_id``; with guesses, ``accepted`` too)."""
        checking = bool(drafted)
        reply = yield Call(0, op, {**feed, "position": position}, check=checking)
        for s in range(1, n):
            hop = _hop(reply, position, seq_len)
            if s < n - 1:
                reply = yield Call(s, "forward_range", hop, check=checking)
            else:
                context = self.prompt_tokens + self.tokens
                verify = {"verify": drafted} if drafted else {}
                reply = yield Call(s, "forward_and_sample", hop | self.sampling.fields(context) | verify
                                   | self._grammar(not self.tokens), check=checking)
        if "logprobs" in reply:
            self.logprobs.append(reply["logprobs"])
        return reply

    def _append(self, token: int, eos: frozenset[int]) -> bool:
        """Add one generated token; True when the generation ends with it (EOS, max_tokens, asked to stop)."""
        self.tokens.append(token)
        self.t_first = self.t_first or time.monotonic()
        self.t_end = time.monotonic()
        if self.on_token:
            self.on_token(self)
        return token in eos or len(self.tokens) >= self.max_tokens or self.stop_requested

    def _guess(self, position: int, max_context: int | None) -> Generator[Call, Reply | None, list[int]]:
        """The draft's guesses for the tokens after the one at ``position`` (none without a draft): never past
        max_tokens nor past max_context, so a check never asks for what the generation would not keep. A draft
        model's come back as the reply to a ``DRAFT`` call, which the pipeline has made off its loop."""
        if self.draft is None:
            return []
        room = self.max_tokens - len(self.tokens) - 1
        if max_context is not None:
            room = min(room, max_context - position - 1)
        context = self.prompt_tokens + self.tokens
        if not self.draft.off_loop:  # a lookup: the guesses are there at once
            guesses: list[list[int] | Exception] = []
            self.draft.propose_later(context, room, guesses.append)
            return guesses[0]  # type: ignore[return-value]
        return (yield Call(DRAFT, "propose", {"context": context, "room": room}))["tokens"]

    def _grammar(self, first: bool) -> dict[str, Any]:
        """The first step (the prompt's last forward, before any token: a drafted check is an embed_and_forward too)
        starts the generation's grammar on the last stage; with none, a session kept from an earlier turn is told so
        (null), so that turn's matcher cannot constrain this one."""
        return {"grammar": self.grammar} if first and (self.grammar is not None or self.cached) else {}

    def _pipelined_prefill(self, held: list[int], start: int, chunk: int,
                           n: int) -> Generator[Call, Reply | None, int]:
        """Send every chunk of the prompt but the last without waiting: each stage's reply sends that chunk on to
        the next stage, so stage s+1 computes chunk i while stage s computes chunk i+1 (each stage serves its
        requests in order, so a session's chunks arrive in order everywhere). Returns where the last chunk starts;
        the caller sends it as a plain prefill, whose reply comes after every earlier chunk's. The last stage
        answers each chunk with an argmax nobody reads: it costs the head on one row."""
        last = start + (len(held) - start - 1) // chunk * chunk
        for position in range(start, last, chunk):
            tokens = held[position:position + chunk]
            yield Call(0, "embed_and_forward", {"tokens": tokens, "position": position}, wait=False,
                       on_reply=_onward(1, n, position, len(tokens)))
        return last

    def _stream_call(self, last_stage: int) -> Call:
        """A partial detokenize of the ids the streamed text does not cover yet: the new ones, plus the few held
        back last time because they end in an unfinished character. Linear in the generation's length."""
        self._streaming = True
        upto = len(self.tokens)

        def on_reply(reply: Reply) -> None:
            self._streaming = False
            self._streamed += reply["text"]
            self._covered = upto - reply.get("pending", 0)
            if self.on_text:
                self.on_text(self, self._streamed, False)

        return Call(last_stage, "detokenize", {"tokens": self.tokens[self._covered:upto], "partial": True},
                    wait=False, on_reply=on_reply)

    def _finish(self, text: str) -> None:
        self.text = text
        if self.on_text:
            self.on_text(self, text, True)


def _hop(reply: Reply, position: int, seq_len: int) -> dict[str, Any]:
    """The next stage's fields for a stage's hidden-state reply."""
    hop = {"hidden_b64": B64.checked(reply["hidden_b64"]), "position": position, "seq_len": seq_len}
    if "hidden_dtype" in reply:  # q8 or float32 (PP_WIRE_DTYPE): the next stage must know how to read it
        hop["hidden_dtype"] = reply["hidden_dtype"]
    return hop


def _onward(stage: int, n: int, position: int, seq_len: int) -> Callable[[Reply], Call | None]:
    """The reply of a prefill chunk's previous stage -> the call of stage ``stage`` for it (None past the last)."""
    def then(reply: Reply) -> Call | None:
        if stage == n:
            return None
        op = "forward_range" if stage < n - 1 else "forward_and_sample"
        return Call(stage, op, _hop(reply, position, seq_len), wait=False,
                    on_reply=_onward(stage + 1, n, position, seq_len))
    return then


def _refusal(prompt_tokens: list[int], max_context: int | None) -> tuple[str, str]:
    """Why a prompt cannot be generated from, and the error's code (both "" when it can)."""
    if not prompt_tokens:
        return "prompt is empty (no tokens)", ""
    if max_context is not None and len(prompt_tokens) > max_context:
        return f"prompt of {len(prompt_tokens)} tokens exceeds max_context {max_context}", "context_length_exceeded"
    return "", ""

