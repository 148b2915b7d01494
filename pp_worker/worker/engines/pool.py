"""How big a stage's KV pool is, and the context it offers: pure arithmetic over the numbers the engine gives it
(no tinygrad), so the rules are tested alone.

The pool has a byte cap: ``PP_KV_BYTES`` (``--kv-memory``), or by default a share of the memory the machine has
free once the stage's weights are in, never more than every session slot at the full context needs. The context is
the model's own by default, lowered to what the pool holds; a context asked for that the pool cannot hold for even
one session is an error at startup, as is a pool too small for one page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
FREE_SHARE = 0.5  # of the memory free at startup, the part a host's stages may fill with KV pages


class PoolError(ValueError):
    """The KV pool cannot hold what was asked: a startup error naming the numbers."""


@dataclass(frozen=True)
class PoolPlan:
    max_context: int  # positions a session may hold
    page: int  # positions in a page
    n_pages: int

    def bytes(self, position_bytes: int) -> int:
        return self.n_pages * self.page * position_bytes


def parse_bytes(text: str) -> int:
    """A byte count as ``PP_KV_BYTES`` and ``--kv-memory`` take it: an integer, optionally with a binary unit
    (``1536M``, ``2G``, ``512MiB``); ValueError naming the text otherwise."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in UNITS else ""
    number = raw[:len(raw) - len(unit)]
    if not number.isascii() or not number.isdigit() or int(number) < 1:
        raise ValueError(f"{text!r} is not a positive number of bytes (an integer, optionally with K, M, G or T)")
    return int(number) * UNITS[unit]


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of the memory free for new work (MemAvailable), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_kv_bytes(available: int | None, position_bytes: int, context: int, max_sessions: int,
                     weight_bytes: int, host_stages: int = 1, page: int | None = None) -> int:
    """The default cap: ``FREE_SHARE`` of ``available`` (read once this stage's weights are in) less the weights the
    host's other stages may still be loading, shared by the ``host_stages`` stages; at most what ``max_sessions``
    sessions of ``context`` positions take; at least one session at the full context (the memory is touched only as
    pages fill, so a cap above what the machine has costs nothing until the pages are used). Unknown free memory:
    every slot at the full context. A session's context counts in whole pages of ``page`` positions (None: one page
    a session)."""
    session = -(-context // page) * page * position_bytes if page else context * position_bytes
    whole = max_sessions * session
    if available is None:
        return whole
    share = (available * FREE_SHARE - (host_stages - 1) * weight_bytes) / max(1, host_stages)
    return int(min(whole, max(share, session)))


def plan_pool(context: int, requested: bool, cap: int, position_bytes: int, page: int | None) -> PoolPlan:
    """Pages of ``page`` positions (None: one page a session, the whole context) within ``cap`` bytes, and the
    context a session may then hold: ``context`` if the pool holds it (else an error when it was ``requested``,
    else what the pool holds)."""
    fits = cap // position_bytes  # positions the cap holds
    size = page or context
    holds = fits // size * size if page else fits
    if page and holds < page:
        raise PoolError(f"a KV pool of {cap} bytes (PP_KV_BYTES) holds no page of {page} positions "
                        f"({page * position_bytes} bytes)")
    if holds < context:
        if requested or holds < 1:
            raise PoolError(f"a KV pool of {cap} bytes (PP_KV_BYTES) holds {holds} positions of {position_bytes} "
                            f"bytes, less than one session at max_context {context}")
        context = holds
    size = page or context
    return PoolPlan(context, size, fits // size)
