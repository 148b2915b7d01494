"""One generation as the calls it makes: tokenize, prefill through every stage, decode steps, detokenize.

``Generation.steps`` is a coroutine that yields one ``Call`` at a time and gets each reply back; the pipeline
(``pipeline``) decides when to send it, so many generations can be in flight at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, fields
from typing import Any

from pp_worker.wire import B64

RECENT_TOKENS = 64  # the window the repetition penalty looks at, as llama.cpp's default penalty_last_n
Reply = dict[str, Any]


class GenerationError(Exception):
    """A generation cannot go on (e.g. an empty prompt)."""


@dataclass(frozen=True)
class Sampling:
    """Optional fields of forward_and_sample; all None means argmax, exactly as without them."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def fields(self, context: list[int]) -> dict[str, Any]:
        out = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        if self.repetition_penalty is not None:
            out["recent_tokens"] = context[-RECENT_TOKENS:]
        return out


@dataclass
class Call:
    """One request of a generation. ``wait=False``: the generation goes on at once; ``on_reply`` gets the reply."""

    stage: int
    op: str
    fields: dict[str, Any]
    wait: bool = True
    on_reply: Callable[[Reply], None] | None = None


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
    on_text: TextSink | None = None  # set: stream the text (one detokenize per token, off the critical path)
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""  # "eos", "max_tokens" or "stop" (asked to stop, e.g. a chat stop string)
    stop_requested: bool = False
    # a streaming detokenize is in flight: later tokens do not queue more of them, the updates coalesce
    _streaming: bool = field(default=False, init=False, repr=False)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_start

    @property
    def decode_tps(self) -> float:
        n, dt = len(self.tokens) - 1, self.t_end - self.t_first
        return n / dt if n > 0 and dt > 0 else 0.0

    def steps(self, num_stages: int, eos: frozenset[int]) -> Generator[Call, Reply | None, None]:
        """The whole generation as the calls it makes, top to bottom."""
        self.t_start = time.monotonic()
        reply = yield Call(0, "tokenize", {"prompt": self.prompt})
        self.prompt_tokens = reply["tokens"]
        if not self.prompt_tokens:
            raise GenerationError(f"prompt {self.index + 1} is empty after tokenization")
        start = _reusable(self.cached, self.prompt_tokens)  # a chat turn recomputes only what is new
        op, feed, position = "embed_and_forward", {"tokens": self.prompt_tokens[start:]}, start
        seq_len = len(self.prompt_tokens) - start
        while True:
            token = yield from self._forward(op, feed, position, seq_len, num_stages)
            self.tokens.append(token)
            self.t_first = self.t_first or time.monotonic()
            self.t_end = time.monotonic()
            if token in eos or len(self.tokens) >= self.max_tokens or self.stop_requested:
                break
            if self.on_text and not self._streaming:
                self._streaming = True
                yield Call(num_stages - 1, "detokenize", {"tokens": self.tokens}, wait=False, on_reply=self._stream)
            op, feed, position, seq_len = "decode_step", {"token_id": token}, position + seq_len, 1
        self.stop_reason = "eos" if token in eos else "max_tokens" if len(self.tokens) >= self.max_tokens else "stop"
        shown = self.tokens[:-1] if token in eos else self.tokens
        self.text = (yield Call(num_stages - 1, "detokenize", {"tokens": shown}))["text"]
        if self.on_text:
            self.on_text(self, self.text, True)

    def _forward(self, op: str, feed: dict[str, Any], position: int, seq_len: int,
                 n: int) -> Generator[Call, Reply | None, int]:
        """One pass through every stage (a prefill of seq_len tokens or one decode step) -> the sampled token."""
        reply = yield Call(0, op, {**feed, "position": position})
        for s in range(1, n):
            hop = {"hidden_b64": B64.checked(reply["hidden_b64"]), "position": position, "seq_len": seq_len}
            if s < n - 1:
                reply = yield Call(s, "forward_range", hop)
            else:
                context = self.prompt_tokens + self.tokens
                reply = yield Call(s, "forward_and_sample", hop | self.sampling.fields(context))
        return reply["token_id"]

    def _stream(self, reply: Reply) -> None:
        self._streaming = False
        if self.on_text:
            self.on_text(self, reply["text"], False)


def _reusable(cached: list[int], tokens: list[int]) -> int:
    """Length of the common prefix, leaving at least one token to prefill (it yields the next token)."""
    n = 0
    while n < min(len(cached), len(tokens) - 1) and cached[n] == tokens[n]:
        n += 1
    return n
