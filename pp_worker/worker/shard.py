"""Which blocks a stage owns, and the role that follows from it."""

from __future__ import annotations

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


@dataclass(frozen=True)
class Shard:
    """A stage's place in the pipeline; block indices are absolute (``blk.{i}`` in the GGUF)."""

    stage: int
    num_stages: int
    start: int
    end: int
    total_blocks: int

    @staticmethod
    def of(stage: int, num_stages: int, total_blocks: int) -> Shard:
        return Shard(stage, num_stages, *compute_layer_range(stage, num_stages, total_blocks), total_blocks)

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
