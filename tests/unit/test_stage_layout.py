"""Stage layout: contiguous spans, embeddings on the first stage, head on the last."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wanswarm.node.stage.layout import StageLayout, even_split


def test_three_stages() -> None:
    layout = StageLayout.from_counts([2, 3, 1])
    assert layout.n_stages == 3 and layout.n_layers == 6
    assert [list(layout.blocks(s)) for s in range(3)] == [[0, 1], [2, 3, 4], [5]]
    assert [layout.has_embedding(s) for s in range(3)] == [True, False, False]
    assert [layout.has_head(s) for s in range(3)] == [False, False, True]
    assert [layout.stage_of_block(b) for b in range(6)] == [0, 0, 1, 1, 1, 2]


def test_single_stage_holds_everything() -> None:
    layout = StageLayout((4,))
    assert layout.has_embedding(0) and layout.has_head(0)
    assert list(layout.blocks(0)) == [0, 1, 2, 3]


def test_errors() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        StageLayout(())
    with pytest.raises(ValueError, match="at least one block"):
        StageLayout((2, 0))
    layout = StageLayout((1, 1))
    with pytest.raises(ValueError, match="stage 2 out of range"):
        layout.blocks(2)
    with pytest.raises(ValueError, match="stage -1 out of range"):
        layout.has_head(-1)
    with pytest.raises(ValueError, match="block 2 out of range"):
        layout.stage_of_block(2)
    with pytest.raises(ValueError, match="cannot split"):
        even_split(2, 3)


def test_even_split() -> None:
    assert even_split(6, 3).blocks_per_stage == (2, 2, 2)
    assert even_split(7, 3).blocks_per_stage == (3, 2, 2)
    assert even_split(5, 1).blocks_per_stage == (5,)


@given(st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12))
def test_spans_tile_the_model(counts: list[int]) -> None:
    layout = StageLayout.from_counts(counts)
    covered = [b for s in range(layout.n_stages) for b in layout.blocks(s)]
    assert covered == list(range(sum(counts)))
    assert sum(layout.has_embedding(s) for s in range(layout.n_stages)) == 1
    assert sum(layout.has_head(s) for s in range(layout.n_stages)) == 1
    assert all(
        layout.stage_of_block(b) == s for s in range(layout.n_stages) for b in layout.blocks(s)
    )
