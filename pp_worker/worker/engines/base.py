"""The engine interface: what a stage can compute, independent of how.

Hidden states cross this boundary as raw little-endian float16 or float32 bytes (their length says which) of
shape (1, seq_len, hidden_dim), already length-checked by the protocol layer; an engine emits them in its
``hidden_dtype``. Outputs may be any buffer (bytes, memoryview) so the
tinygrad engine can hand its reusable host buffer to base64 without a copy: an output is valid until the
engine's next call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pp_worker.worker.shard import Shard

if TYPE_CHECKING:  # the stub (and the launcher's seed names) must import without numpy
    import numpy as np

    from pp_worker.worker.text.vocabulary import Vocabulary



@dataclass(frozen=True)
class ModelInfo:
    """What the ready line reports about the model."""

    hidden_dim: int
    vocab_size: int
    total_blocks: int
    eos_token_ids: list[int] = field(default_factory=list)
    max_context: int = 0
    name: str = ""
    chat_template: str | None = None
    bos_token_id: int | None = None
    add_bos: bool = False  # tokenize puts bos_token_id first (the GGUF's flag; see text.vocab.bos_token)
    bos_token: str | None = None  # the BOS's and EOS's texts: what a chat template calls bos_token / eos_token
    eos_token: str | None = None
    check_token_ids: bool = True  # token ids must be < vocab_size (the stub accepts any, as the seed did)


class EngineError(Exception):
    """A request the engine refuses (bad position, unknown session...): becomes an error reply."""


class Engine(Protocol):
    info: ModelInfo
    shard: Shard
    max_sessions: int  # KV sessions held at once (PP_MAX_SESSIONS)
    max_batch: int  # sessions one batched step advances at most (PP_MAX_BATCH, at most max_sessions)
    hidden_dtype: str  # of the hidden states it emits, "f16" or "f32" (the worker puts them on the wire, `q8.emit`)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``, with the BOS first when the model asks for it and ``add_special`` is true."""

    def detokenize(self, tokens: list[int]) -> str: ...

    def detokenize_partial(self, tokens: list[int]) -> tuple[str, int]:
        """For streaming: (text of every id but the last n, n), the last n ending in an unfinished character."""

    def embed_and_forward(self, session: int, tokens: list[int], position: int) -> bytes | memoryview:
        """First stage: embed ``tokens`` at ``position`` and run this stage's blocks. (1, T, D) in ``hidden_dtype``."""

    def forward_range(self, session: int, hidden: bytes, position: int, seq_len: int) -> bytes | memoryview:
        """Middle stage: run this stage's blocks over ``hidden``. (1, T, D), float16 or float32 in, ``hidden_dtype``
        out."""

    def forward_logits(self, session: int, hidden: bytes, position: int, seq_len: int) -> np.ndarray | Sequence[float]:
        """Last stage: blocks, output norm and head; float32 logits (vocab,) of the last position."""

    def forward_rows(self, session: int, hidden: bytes, position: int,
                     seq_len: int) -> np.ndarray | Sequence[Sequence[float]]:
        """Last stage: as `forward_logits`, with every position's logits (T, vocab), row i position + i's (up to the
        rounding of a multi-row forward): a check of drafted tokens."""

    def rewind(self, session: int, length: int) -> None:
        """Keep the session's first ``length`` positions (it holds at least that many): a check drops the rows after
        the last it kept."""

    def vocabulary(self) -> Vocabulary | None:
        """Last stage: the model's tokens for a grammar's matcher (`worker.grammar`); None where there is no model."""

    def can_batch(self, session: int, position: int, rows: int = 1) -> bool:
        """Whether a step of ``rows`` positions of ``session`` from ``position`` may join a batch: it continues a
        session held (appends, or rewinds to a position it holds), and the engine can batch that many rows."""

    def forward_batch(self, sessions: list[int], positions: list[int], inputs: list[list[int]] | list[bytes],
                      rows: list[int],
                      compile: bool = True) -> bytes | memoryview | np.ndarray | Sequence[Sequence[float]]:
        """Several distinct sessions (each `can_batch` with its rows) in one forward, ``rows[b]`` positions of session
        b from ``positions[b]``: inputs are token id lists (first stage) or ``rows[b]`` float16 or float32 rows
        each; the output is every row, session after session: (R, D) in ``hidden_dtype``, or (R, V) logits on the
        last stage (every row's, as `forward_rows`). Each session's result is its single op's (up to float rounding
        of the batched matmuls). ``compile`` False: the call compiles no forward of a new size (where an engine
        compiles them at first use, it runs the rows in the sizes it has: a long feed costs no compile)."""

    def release(self, session: int, keep: bool = False) -> bool:
        """Drop a session's KV cache; False when it held none. ``keep``: leave it held as cache (evicted before
        every live session)."""

    def claim(self, session: int) -> int:
        """Take a session back for a live generation (no longer cache); the positions it holds, 0 for none."""

    def fork(self, session: int, source: int, positions: int) -> int:
        """A new session holding a copy of the first ``positions`` positions of ``source`` (fewer where it holds
        fewer); how many, 0 where ``source`` is not held (no session made). The two are independent from then on."""

    def undo(self, session: int) -> None:
        """The last forward call failed for ``session`` (in it, or in what the worker did with its output): put the
        session back as that call found it (`sessions.SessionTable.undo`)."""

    def reset(self) -> int:
        """Drop every session; how many there were."""

    def sessions(self) -> dict[int, int]:
        """request_id -> number of positions its KV cache holds."""

    def cached_sessions(self) -> list[int]:
        """The sessions held as cache (``release`` with ``keep``), least recently used first."""

    def describe(self) -> dict[str, Any]:
        """How this stage runs (device, KV cache dtype and size...), for the ready line and `status`."""

    def defer_compiles(self) -> bool:
        """Use only what is compiled or kept on disk from now on; True when a background compile has work to do."""

    def cache_settings(self) -> dict[str, str]:
        """The environment a background compile of this stage needs besides the worker's own."""
