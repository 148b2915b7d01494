"""The stub engine: deterministic fake tensors for CI and for the caller's own tests. No tinygrad.

hidden_dim 16 and vocab 32 are part of the contract (the caller's tests hard-code both). Every output is a
SHA-256 function of every input (tokens, position, hidden bytes), so it is identical across processes and
runs, and a caller that gets the position wrong sees different outputs. Hidden values are finite float16
in [-1, 1) so a caller may decode them as real numbers.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any

from pp_worker.worker.engines.base import EngineError, ModelInfo
from pp_worker.worker.shard import Shard

STUB_HIDDEN_DIM = 16
STUB_VOCAB_SIZE = 32
STUB_BLOCKS = 16  # lets a stub pipeline have up to 16 stages
STUB_MAX_CONTEXT = 4096
_MAX_TRACKED = 1024  # sessions remembered for status/release; the stub never refuses an op for its sessions


# A float16's high byte (odd offsets, little-endian) holds the sign (bit 7), the 5 exponent bits (6-2) and two
# mantissa bits; mapping the exponent to itself mod 15 keeps it <= 14: never inf or NaN, and |x| < 1.
_FINITE_HIGH_BYTE = bytes((b & 0x83) | ((((b >> 2) & 0x1F) % 15) << 2) for b in range(256))


def _fp16_stream(seed: bytes, n_values: int) -> bytes:
    """n_values float16 in [-1, 1): sign bit, exponent 0..14, random mantissa, from a SHA-256 counter stream."""
    raw = bytearray()
    counter = 0
    while len(raw) < 2 * n_values:
        raw += hashlib.sha256(seed + counter.to_bytes(8, "little")).digest()
        counter += 1
    del raw[2 * n_values:]
    raw[1::2] = raw[1::2].translate(_FINITE_HIGH_BYTE)
    return bytes(raw)


class StubEngine:
    """Implements engines.base.Engine with no model at all."""

    def __init__(self, stage: int, num_stages: int, delay_s: float = 0.0, max_sessions: int = 8, max_batch: int = 8,
                 busy_file: str | None = None, layers: tuple[int, int] | None = None,
                 max_context: int | None = None):
        self.delay_s = delay_s  # simulated compute time per forward op (PP_STUB_DELAY_MS), for latency tests
        # PP_STUB_BUSY_FILE: a line (the session) appended as each forward op starts, before its delay, so a test
        # can wait until an op is in flight instead of guessing with a sleep
        self.busy_file = busy_file
        self.max_sessions = max_sessions  # reported (ready line, status) like a real stage's; the stub evicts none
        self.max_batch = max(1, min(max_batch, max_sessions))
        self.hidden_dtype = "f16"  # its outputs (the worker widens them for a float32 wire)
        self.batches: list[int] = []  # the size of every batched step, for tests of who batches what
        self.shard = Shard.of(stage, num_stages, STUB_BLOCKS, layers)  # layers: PP_LAYERS
        self.info = ModelInfo(hidden_dim=STUB_HIDDEN_DIM, vocab_size=STUB_VOCAB_SIZE, total_blocks=STUB_BLOCKS,
                              eos_token_ids=[], max_context=max_context or STUB_MAX_CONTEXT, name="stub",
                              check_token_ids=False)  # max_context: MAX_CONTEXT, as a real stage's (no model caps it)
        self._sessions: OrderedDict[int, int] = OrderedDict()
        self._cached: set[int] = set()  # sessions released with keep (the stub evicts none, as it holds nothing)
        self._before: dict[int, int | None] = {}  # session -> its length before its last op (`undo`)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """One token per whitespace-separated word, a stable hash of the word and its index (no BOS)."""
        return [hashlib.sha256(f"{i}:{w}".encode()).digest()[0] % STUB_VOCAB_SIZE for i, w in enumerate(text.split())]

    def detokenize(self, tokens: list[int]) -> str:
        """Each id as a word after a space (" 3 14"): the text of a list is the text of its parts, end to end."""
        return "".join(f" {t}" for t in tokens)

    def detokenize_partial(self, tokens: list[int]) -> tuple[str, int]:
        return self.detokenize(tokens), 0  # no word is ever split

    def embed_and_forward(self, session: int, tokens: list[int], position: int) -> bytes:
        self._track(session, position, len(tokens))
        seed = hashlib.sha256(b"pp-stub-embed:%d|%s" % (position, ",".join(map(str, tokens)).encode())).digest()
        return _fp16_stream(seed, len(tokens) * STUB_HIDDEN_DIM)

    def forward_range(self, session: int, hidden: bytes, position: int, seq_len: int) -> bytes:
        self._track(session, position, seq_len)
        seed = hashlib.sha256(b"pp-stub-range:%d:%d|" % (self.shard.stage, position) + hidden).digest()
        return _fp16_stream(seed, seq_len * STUB_HIDDEN_DIM)

    def forward_logits(self, session: int, hidden: bytes, position: int, seq_len: int) -> list[float]:
        self._track(session, position, seq_len)
        return self._logits(hidden, position)

    def forward_rows(self, session: int, hidden: bytes, position: int, seq_len: int) -> list[list[float]]:
        """Each row's logits exactly as a one-token step at its position computes them."""
        self._track(session, position, seq_len)
        size = len(hidden) // seq_len
        return [self._logits(hidden[i * size:(i + 1) * size], position + i) for i in range(seq_len)]

    def rewind(self, session: int, length: int) -> None:
        self._sessions[session] = min(self._sessions[session], length)

    def vocabulary(self) -> None:
        """No vocabulary: a ``grammar`` field is validated and then not applied (the stub's logits are no model's)."""
        return None

    def can_batch(self, session: int, position: int, rows: int = 1) -> bool:
        """As a real stage's: a session held, continued (position at most its length), within max_context (past it
        the step runs alone, to fail alone)."""
        length = self._sessions.get(session)
        return length is not None and position <= length and position + rows <= self.info.max_context

    def forward_batch(self, sessions: list[int], positions: list[int], inputs: list[list[int]] | list[bytes],
                      rows: list[int], compile: bool = True) -> Any:
        """Each session's rows exactly as its single op computes them (every row's logits on the last stage), for
        one delay in all (it compiles nothing: ``compile`` changes nothing)."""
        self.batches.append(len(sessions))
        delay, self.delay_s = self.delay_s, 0.0
        steps = list(zip(sessions, inputs, positions, rows, strict=True))
        try:
            if self.shard.is_first:
                return b"".join(self.embed_and_forward(s, t, p) for s, t, p, _ in steps)  # type: ignore[arg-type]
            if self.shard.is_last:
                return [row for s, h, p, n in steps for row in self.forward_rows(s, h, p, n)]  # type: ignore[arg-type]
            return b"".join(self.forward_range(s, h, p, n) for s, h, p, n in steps)  # type: ignore[arg-type]
        finally:
            self.delay_s = delay
            if delay:
                time.sleep(delay)

    def release(self, session: int, keep: bool = False) -> bool:
        if keep and session in self._sessions:
            self._cached.add(session)
            return True
        self._cached.discard(session)
        self._before.pop(session, None)
        return self._sessions.pop(session, None) is not None

    def claim(self, session: int) -> int:
        self._cached.discard(session)
        return self._sessions.get(session, 0)

    def fork(self, session: int, source: int, positions: int) -> int:
        """As a real stage's (`sessions.SessionTable.fork`), for the lengths the stub tracks."""
        if session in self._sessions:
            raise EngineError(f"session {session} is held already: a fork makes a new session (release it first)")
        n = min(positions, self._sessions.get(source, 0))
        if n:
            self._sessions.move_to_end(source)
            self._sessions[session] = n
            self._forget_oldest()
        return n

    def undo(self, session: int) -> None:
        if session not in self._before:
            return
        before = self._before.pop(session)
        if before is None:
            self._sessions.pop(session, None)
        else:
            self._sessions[session] = before

    def reset(self) -> int:
        held = len(self._sessions)
        self._sessions.clear()
        self._before.clear()
        self._cached.clear()
        return held

    def sessions(self) -> dict[int, int]:
        return dict(self._sessions)

    def cached_sessions(self) -> list[int]:
        return [s for s in self._sessions if s in self._cached]

    def describe(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch}  # no device, no KV cache

    def defer_compiles(self) -> bool:
        return False  # nothing to compile

    def cache_settings(self) -> dict[str, str]:
        return {}

    @staticmethod
    def _logits(hidden: bytes, position: int) -> list[float]:
        digest = hashlib.sha256(b"pp-stub-logits:%d|" % position + hidden).digest()  # 32 bytes = 32 logits
        return [(b - 128) / 16.0 for b in digest]

    def _track(self, session: int, position: int, seq_len: int) -> None:
        """Record the op's session length (the stub keeps no KV: any position that fits the context is fine)."""
        self._before.pop(session, None)  # an op refused here has nothing to undo
        limit = self.info.max_context
        if position + seq_len > limit:  # as a real stage: status never shows a session past the context
            raise EngineError(f"position {position} + seq_len {seq_len} = {position + seq_len} exceeds "
                              f"max_context {limit}")
        if self.busy_file:
            with open(self.busy_file, "a") as f:
                f.write(f"{session}\n")
        if self.delay_s:
            time.sleep(self.delay_s)
        self._before[session] = self._sessions.get(session)
        self._sessions[session] = position + seq_len
        self._sessions.move_to_end(session)
        self._cached.discard(session)
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Forget the least recently used session past the ones the stub remembers."""
        if len(self._sessions) > _MAX_TRACKED:
            evicted = self._sessions.popitem(last=False)[0]
            self._cached.discard(evicted)
            self._before.pop(evicted, None)
