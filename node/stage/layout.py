"""Stage layout: which blocks and which extra layers each pipeline stage holds (pure).

Blocks are numbered 0..n_layers-1 across the whole model; stage ``s`` holds the
contiguous span ``blocks(s)``. Stage 0 also holds the token and position embeddings;
the last stage also holds the final LayerNorm, the LM head and the loss. A single-stage
layout holds everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    """Contiguous split of ``sum(blocks_per_stage)`` blocks into ``len(blocks_per_stage)``
    stages."""

    blocks_per_stage: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.blocks_per_stage:
            raise ValueError("a layout needs at least one stage")
        if any(n < 1 for n in self.blocks_per_stage):
            raise ValueError(f"every stage needs at least one block: {self.blocks_per_stage}")

    @classmethod
    def from_counts(cls, blocks_per_stage: Sequence[int]) -> StageLayout:
        """Layout from a list of block counts, e.g. ``[2, 2, 2]``."""
        return cls(tuple(int(n) for n in blocks_per_stage))

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.blocks_per_stage)

    @property
    def n_layers(self) -> int:
        """Number of blocks in the whole model."""
        return sum(self.blocks_per_stage)

    def check_stage(self, stage: int) -> None:
        """Raise ValueError unless ``stage`` is in ``0..n_stages-1``."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} out of range: the layout has {self.n_stages} stages")

    def blocks(self, stage: int) -> range:
        """Global indices of the blocks held by ``stage``."""
        self.check_stage(stage)
        start = sum(self.blocks_per_stage[:stage])
        return range(start, start + self.blocks_per_stage[stage])

    def has_embedding(self, stage: int) -> bool:
        """Whether ``stage`` holds the token and position embeddings (takes token ids)."""
        self.check_stage(stage)
        return stage == 0

    def has_head(self, stage: int) -> bool:
        """Whether ``stage`` holds the final norm, the LM head and the loss."""
        self.check_stage(stage)
        return stage == self.n_stages - 1

    def stage_of_block(self, block: int) -> int:
        """The stage that holds global block ``block``."""
        if not 0 <= block < self.n_layers:
            raise ValueError(f"block {block} out of range: the model has {self.n_layers} blocks")
        for stage in range(self.n_stages):
            if block in self.blocks(stage):
                return stage
        raise AssertionError("unreachable: blocks cover 0..n_layers-1")


def even_split(n_layers: int, n_stages: int) -> StageLayout:
    """Split ``n_layers`` blocks over ``n_stages`` as evenly as possible (earlier stages larger)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(
            f"cannot split {n_layers} blocks over {n_stages} stages (need 1 <= stages <= blocks)"
        )
    base, extra = divmod(n_layers, n_stages)
    return StageLayout(tuple(base + (1 if s < extra else 0) for s in range(n_stages)))
