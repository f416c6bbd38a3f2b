"""Exact epochs end where a step holds the target on average (averaging.StepSizeLoop), and
the progress screen keeps the other replicas' counts it feeds on (progress_guard)."""

from __future__ import annotations

import random

import pytest
from wanswarm.node.stage.averaging import StepSizeLoop
from wanswarm.node.stage.progress_guard import (
    EPOCHS_SEEN,
    PEERS_SEEN,
    ProgressBounds,
    ProgressScreen,
    screen,
)


def _plant(end: float, rng: random.Random, batch: int = 8) -> tuple[int, int]:
    """Two replicas, micro-batches of ``batch``: the first reaches ``end`` (whole
    micro-batches), the second, seeing the first's report late, adds one or two more.
    Returns the two replicas' samples."""
    total = 0
    while total < end:
        total += batch
    lag = batch * rng.choice((1, 1, 2))
    first = total // 2 // batch * batch
    return first, total - first + lag


def test_the_loop_brings_the_mean_step_to_the_target() -> None:
    rng = random.Random(0)
    loop = StepSizeLoop(64)
    seen: dict[int, int] = {}
    end: float | None = None
    sizes = []
    for epoch in range(60):
        own, other = _plant(64.0 if end is None else end, rng)
        seen[epoch] = other
        sizes.append(own + other)
        end = loop.record(epoch, own, end, lambda e: seen.get(e, 0))
    # without the loop every step holds 64 plus the lag: 74.7 on average here
    assert sum(sizes[:2]) / 2 >= 72
    late = sizes[20:]
    assert abs(sum(late) / len(late) - 64) / 64 < 0.05
    assert end is not None and 48 <= end < 64
    assert [t for _, t in loop.totals][-3:] == sizes[-4:-1]  # settled one step later


def test_nothing_is_learnt_without_the_other_replicas_counts() -> None:
    loop = StepSizeLoop(64)
    for epoch in range(5):
        assert loop.record(epoch, 70, None, lambda e: 0) is None  # alone: the target holds
    assert not loop.totals


def test_the_end_never_leaves_its_bounds() -> None:
    loop = StepSizeLoop(64)
    end = None
    for epoch in range(30):  # a forged, huge count of another replica
        end = loop.record(epoch, 8, end, lambda e: 256)
    assert end == 32.0  # at most half the target lower
    loop = StepSizeLoop(64)
    for epoch in range(30):  # steps smaller than their end never raise it above the target
        end = loop.record(epoch, 8, end, lambda e: 8)
    assert end == 64.0


def _record(peer: bytes, epoch: float, samples: float) -> object:
    class Item:
        value = {
            "peer_id": peer,
            "epoch": epoch,
            "samples_accumulated": samples,
            "samples_per_second": 1.0,
            "time": 0.0,
            "client_mode": False,
        }

    return Item()


def test_the_screen_keeps_each_replicas_largest_count_per_epoch() -> None:
    tally = ProgressScreen()
    bounds = ProgressBounds(target_batch_size=64)

    def read(records: dict[bytes, object]) -> None:
        screen(records, local_epoch=3, own_peer_id=b"me", now=0.0, bounds=bounds, tally=tally)

    read({b"a": _record(b"a", 3, 16), b"b": _record(b"b", 3, 8), b"me": _record(b"me", 3, 40)})
    read({b"a": _record(b"a", 3, 24), b"b": _record(b"b", 4, 0)})  # b moved on, a grew
    assert tally.others_samples(3) == 24 + 8  # not our own record
    assert tally.others_samples(4) == 0
    # refused records count for nothing: NaN, negative and oversize counts, absurd epochs
    read(
        {
            b"c": _record(b"c", 3, float("nan")),
            b"d": _record(b"d", 3, -5),
            b"e": _record(b"e", 3, 10_000),
            b"f": _record(b"f", 10**15, 8),
        }
    )
    assert tally.others_samples(3) == 32
    assert tally.reasons == {"samples": 3, "epoch": 1}


def test_the_screen_memory_is_bounded() -> None:
    tally = ProgressScreen()
    for epoch in range(EPOCHS_SEEN + 10):
        for peer in range(PEERS_SEEN + 10):
            tally.note(epoch, peer.to_bytes(4, "big"), 1)
    assert len(tally.seen) == EPOCHS_SEEN
    assert all(len(counts) == PEERS_SEEN for counts in tally.seen.values())
    tally.note(0, b"old", 5)  # older than every epoch kept: ignored
    assert 0 not in tally.seen
    assert tally.others_samples(EPOCHS_SEEN + 9) == pytest.approx(PEERS_SEEN)


def test_end_marks_keep_only_other_replicas_integer_epochs() -> None:
    from wanswarm.node.stage.progress_guard import end_marks
    from wanswarm.node.stage.state_plan import MAX_EPOCH

    class Item:
        def __init__(self, value: object) -> None:
            self.value = value

    marks = end_marks(
        {
            b"a": Item(7),
            b"me": Item(7),  # our own
            b"b": Item(True),  # not an epoch
            b"c": Item(-1),
            b"d": Item(MAX_EPOCH + 1),
            b"e": Item(7.0),
            "f": Item(7),  # not a signed subkey
            b"g": Item(None),
            b"h": Item(0),
        },
        own_subkey=b"me",
    )
    assert marks == {b"a": 7, b"h": 0}
    assert end_marks(None, b"me") == {} and end_marks([1, 2], b"me") == {}
    many = {i.to_bytes(4, "big"): Item(3) for i in range(PEERS_SEEN * 2)}
    assert len(end_marks(many, b"me")) == PEERS_SEEN
