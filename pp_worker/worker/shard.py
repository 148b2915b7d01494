"""Which blocks a stage owns, and the role that follows from it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    FIRST = "first"
    MIDDLE = "middle"
    LAST = "last"


def compute_layer_range(stage: int, num_stages: int, total_blocks: int) -> tuple[int, int]:
    """Half-open ``[start, end)`` block range of ``stage``: ``k = total // num_stages`` blocks each,
    the last stage takes the remainder. Raises ValueError on an impossible split."""
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range [0, {num_stages})")
    if total_blocks < num_stages:
        raise ValueError(f"total_blocks {total_blocks} cannot be split into {num_stages} stages")
    k = total_blocks // num_stages
    return stage * k, (stage + 1) * k if stage < num_stages - 1 else total_blocks


class SplitError(ValueError):
    """A block range that does not fit the model (PP_LAYERS): a configuration error, reported in one line."""


_LAYERS = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")


def parse_layers(text: str) -> tuple[int, int]:
    """``PP_LAYERS``'s ``START:END`` (ASCII digits) -> ``(start, end)`` with start < end. Raises ValueError."""
    match = _LAYERS.fullmatch(text)
    if match is None or int(match[1]) >= int(match[2]):
        raise ValueError("expected START:END in ASCII digits with START < END (a half-open block range)")
    return int(match[1]), int(match[2])


def check_layers(stage: int, num_stages: int, total_blocks: int, layers: tuple[int, int]) -> tuple[int, int]:
    """An explicit block range (``PP_LAYERS``, an uneven split) for ``stage``, checked against the model: inside
    it, from block 0 on the first stage, to the last block on the last stage. Raises SplitError."""
    start, end = layers
    if end > total_blocks:
        raise SplitError(f"PP_LAYERS={start}:{end} ends past the model's {total_blocks} blocks")
    if stage == 0 and start != 0:
        raise SplitError(f"PP_LAYERS={start}:{end} on stage 0 must start at block 0")
    if stage == num_stages - 1 and end != total_blocks:
        raise SplitError(f"PP_LAYERS={start}:{end} on the last stage must end at the model's {total_blocks} blocks")
    return start, end


@dataclass(frozen=True)
class Shard:
    """A stage's place in the pipeline; block indices are absolute (``blk.{i}`` in the GGUF)."""

    stage: int
    num_stages: int
    start: int
    end: int
    total_blocks: int

    @staticmethod
    def of(stage: int, num_stages: int, total_blocks: int, layers: tuple[int, int] | None = None) -> Shard:
        """The even split of the contract, or ``layers`` (``PP_LAYERS``) where given. Raises ValueError."""
        if layers is None:
            return Shard(stage, num_stages, *compute_layer_range(stage, num_stages, total_blocks), total_blocks)
        return Shard(stage, num_stages, *check_layers(stage, num_stages, total_blocks, layers), total_blocks)

    @property
    def role(self) -> Role:
        if self.stage == 0:
            return Role.FIRST
        return Role.LAST if self.stage == self.num_stages - 1 else Role.MIDDLE

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1
