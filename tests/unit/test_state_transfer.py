"""Pure parts of state transfer: chunk plan, byte views, manifests, grouping, scheduling, donor."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from wanswarm.node.stage.state_donor import (
    StateDonor,
)
from wanswarm.node.stage.state_plan import (
    MIN_CHUNK_BYTES,
    ChunkScheduler,
    Manifest,
    Segment,
    Snapshot,
    StateErrorCode,
    StateTransferConfig,
    TensorEntry,
    byte_view,
    chunk_digests,
    chunk_kind,
    gather_chunk,
    group_manifests,
    manifest_kind,
    plan_chunks,
    scatter_chunk,
    state_digest,
)
from wanswarm.transport.endpoint import PeerAddress, Request
from wanswarm.transport.errors import RemoteError

# ---- chunk plan -------------------------------------------------------------------------


def _check_cover(nbytes: list[int], chunk_bytes: int) -> None:
    chunks = plan_chunks(nbytes, chunk_bytes)
    offsets = [sum(nbytes[:i]) for i in range(len(nbytes))]
    pieces = []  # absolute byte ranges of every segment
    pos = 0
    for i, chunk in enumerate(chunks):
        assert chunk.index == i and chunk.start == pos
        assert 0 < chunk.nbytes <= chunk_bytes
        assert chunk.nbytes == chunk_bytes or i == len(chunks) - 1  # only the last is short
        at = chunk.start
        for seg in chunk.segments:  # segments are in order and abut inside the chunk
            assert 0 <= seg.start < seg.end <= nbytes[seg.tensor]
            assert offsets[seg.tensor] + seg.start == at
            at = offsets[seg.tensor] + seg.end
            pieces.append((offsets[seg.tensor] + seg.start, at))
        assert at == chunk.end
        pos = chunk.end
    assert pos == sum(nbytes)
    # each piece starts where the previous ended: [0, total) is covered exactly once
    starts = [0] + [b for _, b in pieces]
    assert [a for a, _ in pieces] == starts[:-1] and starts[-1] == sum(nbytes)


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.lists(st.integers(min_value=0, max_value=300), min_size=0, max_size=12),
    chunk_bytes=st.integers(min_value=1, max_value=200),
)
def test_plan_covers_every_byte_exactly_once(nbytes: list[int], chunk_bytes: int) -> None:
    _check_cover(nbytes, chunk_bytes)


def test_plan_groups_small_tensors_and_splits_large_ones() -> None:
    chunks = plan_chunks([10, 20, 5, 100], 40)
    assert [(c.start, c.end) for c in chunks] == [(0, 40), (40, 80), (80, 120), (120, 135)]
    # three small tensors and the head of the large one share chunk 0
    assert chunks[0].segments == (Segment(0, 0, 10), Segment(1, 0, 20), Segment(2, 0, 5),
                                  Segment(3, 0, 5))
    # the large tensor is split over four chunks
    assert [c.segments for c in chunks[1:]] == [
        (Segment(3, 5, 45),), (Segment(3, 45, 85),), (Segment(3, 85, 100),)
    ]


def test_plan_skips_empty_tensors_and_handles_empty_state() -> None:
    assert plan_chunks([], 16) == [] and plan_chunks([0, 0], 16) == []
    chunks = plan_chunks([0, 8, 0, 0, 8, 0], 12)
    assert [c.segments for c in chunks] == [
        (Segment(1, 0, 8), Segment(4, 0, 4)),
        (Segment(4, 4, 8),),
    ]
    with pytest.raises(ValueError):
        plan_chunks([4], 0)
    with pytest.raises(ValueError):
        plan_chunks([-1], 4)


def _mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(33, 17, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(13, generator=g) > 0.5,
        "step": torch.tensor([12345678901], dtype=torch.int64),
        "fp16": torch.randn(3, 5, generator=g).to(torch.float16),
        "i8": torch.randint(-128, 128, (9,), generator=g, dtype=torch.int8),
    }


def test_gather_then_scatter_is_bit_identical_across_dtypes() -> None:
    state = _mixed_state()
    views = [byte_view(t) for t in state.values()]
    out = {k: torch.empty_like(v) for k, v in state.items()}
    out_views = [byte_view(t) for t in out.values()]
    for chunk in plan_chunks([t.nbytes for t in state.values()], 10):
        data = gather_chunk(views, chunk)
        assert data.dtype == torch.uint8 and data.shape == (chunk.nbytes,)
        scatter_chunk(out_views, chunk, data.clone())
    for k in state:
        assert out[k].dtype == state[k].dtype and out[k].shape == state[k].shape
        assert torch.equal(byte_view(out[k]), byte_view(state[k])), k


def test_chunk_digests_match_the_gathered_bytes() -> None:
    state = _mixed_state()
    views = [byte_view(t) for t in state.values()]
    chunks = plan_chunks([t.nbytes for t in state.values()], 64)
    digests = chunk_digests(views, chunks)
    assert digests == [state_digest(gather_chunk(views, c).numpy().data) for c in chunks]
    assert len(set(digests)) == len(digests)


# ---- manifest ---------------------------------------------------------------------------


def _manifest(epoch: int = 3, snapshot_id: int = 1, fill: int = 0, meta: Any = None) -> Manifest:
    state = {"a": torch.full((1000,), float(fill)), "b": torch.arange(3000, dtype=torch.int32)}
    views = [byte_view(t) for t in state.values()]
    chunks = plan_chunks([t.nbytes for t in state.values()], MIN_CHUNK_BYTES)
    return Manifest(
        epoch=epoch, snapshot_id=snapshot_id, chunk_bytes=MIN_CHUNK_BYTES,
        total_bytes=sum(t.nbytes for t in state.values()),
        tensors=tuple(
            TensorEntry(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                        nbytes=t.nbytes)
            for k, t in state.items()
        ),
        digests=tuple(chunk_digests(views, chunks)), meta=meta or {"lr": 0.001},
    )


def test_manifest_round_trip_and_truncation() -> None:
    m = _manifest()
    body = m.model_dump_json().encode()
    assert Manifest.model_validate_json(body) == m
    for cut in (0, 1, len(body) // 2, len(body) - 1):
        with pytest.raises(ValidationError):
            Manifest.model_validate_json(body[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_manifest_from_random_bytes_is_refused_cleanly(blob: bytes) -> None:
    with pytest.raises(ValidationError):
        Manifest.model_validate_json(blob)


@pytest.mark.parametrize(
    "change",
    [
        {"total_bytes": 1},  # not the sum of the tensors
        {"digests": ["0" * 64]},  # one digest per chunk
        {"digests": None},  # mutated below: a digest that is not hex
        {"tensors": "repeat"},  # two tensors with one name
        {"chunk_bytes": 1},  # below the minimum
        {"epoch": -1},
        {"v": 2},  # unknown version
        {"extra": 1},  # unknown field
    ],
)
def test_manifest_inconsistencies_are_refused(change: dict[str, Any]) -> None:
    raw = json.loads(_manifest().model_dump_json())
    if change == {"digests": None}:
        raw["digests"][0] = "Z" * 64
    elif change == {"tensors": "repeat"}:
        raw["tensors"][1]["name"] = raw["tensors"][0]["name"]
    else:
        raw.update(change)
    with pytest.raises(ValidationError):
        Manifest.model_validate(raw)


def test_tensor_entry_checks_bytes_against_shape_and_dtype() -> None:
    TensorEntry(name="x", dtype="bfloat16", shape=(3, 4), nbytes=24)
    with pytest.raises(ValidationError):
        TensorEntry(name="x", dtype="bfloat16", shape=(3, 4), nbytes=48)
    with pytest.raises(ValidationError):
        TensorEntry(name="x", dtype="complex64", shape=(1,), nbytes=8)
    with pytest.raises(ValidationError):
        TensorEntry(name="x", dtype="float32", shape=(2**60, 2**60), nbytes=0)


def test_grouping_prefers_newest_epoch_then_most_donors() -> None:
    d = [PeerAddress(f"peer{i}", "127.0.0.1", 1000 + i) for i in range(5)]
    old_a = _manifest(epoch=3, snapshot_id=11)
    old_a2 = _manifest(epoch=3, snapshot_id=12)  # same content, other snapshot id
    old_b = _manifest(epoch=3, snapshot_id=13, fill=1)  # same epoch, other bytes
    new = _manifest(epoch=4, snapshot_id=14)
    other_meta = _manifest(epoch=3, snapshot_id=15, meta={"lr": 0.002})
    groups = group_manifests([(d[0], old_a), (d[1], old_b), (d[2], new), (d[3], old_a2),
                              (d[4], other_meta)])
    assert [g.manifest.epoch for g in groups] == [4, 3, 3, 3]
    assert groups[0].members == ((d[2], 14),)
    assert groups[1].members == ((d[0], 11), (d[3], 12))  # the larger group of epoch 3
    assert {g.members[0][0] for g in groups[2:]} == {d[1], d[4]}
    assert old_a.layout_key() == old_b.layout_key() and old_a.content_key() != old_b.content_key()


# ---- scheduler ----------------------------------------------------------------------------


def test_scheduler_pulls_in_order_and_completes() -> None:
    s = ChunkScheduler(5, ["a", "b"], done=[1])
    assert [s.take("a", 0, 9), s.take("b", 0, 9), s.take("a", 0, 9)] == [0, 2, 3]
    assert s.accept("a", 0) and s.accept("b", 2)
    assert s.take("b", 1, 9) == 4
    assert s.accept("a", 3) and s.accept("b", 4)
    assert s.complete and not s.exhausted
    assert s.take("a", 2, 9) is None and s.next_straggler("a", 2, 9) is None


def test_scheduler_ban_reoffers_in_flight_chunks_and_keeps_done_ones() -> None:
    s = ChunkScheduler(4, ["a", "b"])
    assert (s.take("a", 0, 9), s.take("a", 0, 9), s.take("b", 0, 9)) == (0, 1, 2)
    assert s.accept("a", 0)
    s.ban("a")  # chunk 1 was in flight at a
    assert s.take("a", 1, 9) is None
    assert s.take("b", 1, 9) == 1 and s.take("b", 1, 9) == 3
    assert s.done == {0}  # the chunk a delivered is kept
    s.ban("b")
    assert s.exhausted and not s.complete


def test_scheduler_duplicates_only_stragglers_and_ignores_the_late_copy() -> None:
    s = ChunkScheduler(2, ["a", "b", "c"])
    assert (s.take("a", 0.0, 5.0), s.take("b", 1.0, 5.0)) == (0, 1)
    assert s.take("c", 4.0, 5.0) is None  # nothing pending, nobody late yet
    assert s.next_straggler("c", 4.0, 5.0) == pytest.approx(1.0)  # chunk 0 turns late at 5
    assert s.take("c", 5.5, 5.0) == 0  # a has held chunk 0 for 5.5 s: duplicate it
    assert s.take("a", 5.5, 5.0) is None  # a holds 0 and chunk 1 is not late for a yet
    assert s.take("c", 6.0, 5.0) == 1  # b's chunk 1 is late now
    assert s.take("a", 99.0, 5.0) is None  # a chunk is duplicated at most once
    assert s.accept("c", 0) and not s.accept("a", 0)
    s.release("b", 1)  # b answered busy: c still fetches chunk 1, since 6.0
    assert s.in_flight == {1: {"c": 6.0}}
    assert s.take("b", 7.0, 5.0) is None and s.take("b", 11.0, 5.0) == 1
    assert s.accept("c", 1) and s.complete


def test_scheduler_release_puts_an_unheld_chunk_back() -> None:
    s = ChunkScheduler(1, ["a"])
    assert s.take("a", 0, 1) == 0 and s.take("a", 5, 1) is None  # never duplicates itself
    s.release("a", 0)
    assert s.take("a", 5, 1) == 0


# ---- donor handlers (called directly, no sockets) -------------------------------------------


class _Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def register(self, kind: str, handler: Any) -> None:
        self.handlers[kind] = handler


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _donor(states: list[Snapshot], **cfg: Any) -> tuple[StateDonor, _Registry, _Clock, list[int]]:
    registry, clock, taken = _Registry(), _Clock(), []

    async def snapshot() -> Snapshot:
        taken.append(1)
        return states[min(len(taken), len(states)) - 1]

    donor = StateDonor(
        registry, snapshot, kind_prefix="state.s1",  # type: ignore[arg-type]
        config=StateTransferConfig(**cfg), clock=clock, rng=random.Random(7),
    )
    return donor, registry, clock, taken


def _call(registry: _Registry, kind: str, header: dict[str, Any], tensors: Any = ()) -> Any:
    return asyncio.run(registry.handlers[kind](Request("peer", kind, header, list(tensors))))


def _get_manifest(registry: _Registry) -> Manifest:
    reply = _call(registry, manifest_kind("state.s1"), {"v": 1, "chunk_bytes": MIN_CHUNK_BYTES})
    return Manifest.model_validate_json(reply.tensors[0].numpy().tobytes())


def test_donor_reuses_young_snapshots_and_never_evicts_busy_ones() -> None:
    snaps = [Snapshot(e, {"w": torch.full((2000,), float(e))}, {"e": e}) for e in (1, 2, 3)]
    donor, registry, clock, taken = _donor(snaps, snapshot_reuse_s=5.0, max_retained=2)
    assert _get_manifest(registry).epoch == 1
    clock.now += 1.0
    assert _get_manifest(registry).epoch == 1 and len(taken) == 1  # young: reused
    clock.now += 10.0
    assert _get_manifest(registry).epoch == 2 and donor.retained_epochs == [1, 2]
    clock.now += 6.0
    m2 = _get_manifest(registry)  # both slots idle for > reuse_s: evict the least recently used
    assert m2.epoch == 3 and donor.retained_epochs == [2, 3]
    clock.now += 1000.0  # past the idle TTL: everything is dropped
    req = {"v": 1, "epoch": 3, "snapshot_id": m2.snapshot_id, "chunk_bytes": MIN_CHUNK_BYTES,
           "index": 0}
    with pytest.raises(RemoteError) as err:
        _call(registry, chunk_kind("state.s1"), req)
    assert err.value.code == StateErrorCode.UNKNOWN_SNAPSHOT and donor.retained_epochs == []


def test_donor_refuses_hostile_requests_and_keeps_serving() -> None:
    state = _mixed_state()
    donor, registry, _, _ = _donor([Snapshot(9, state, {"k": [1, 2]})])
    m = _get_manifest(registry)
    good = {"v": 1, "epoch": 9, "snapshot_id": m.snapshot_id, "chunk_bytes": MIN_CHUNK_BYTES,
            "index": 0}
    ck = chunk_kind("state.s1")
    hostile: list[tuple[str, dict[str, Any], str]] = [
        (ck, {**good, "index": len(m.digests)}, "bad_request"),
        (ck, {**good, "index": -1}, "bad_request"),
        (ck, {**good, "index": 10**30}, "bad_request"),
        (ck, {**good, "epoch": 8}, "unknown_snapshot"),
        (ck, {**good, "snapshot_id": (m.snapshot_id + 1) % 2**63}, "unknown_snapshot"),
        (ck, {**good, "chunk_bytes": 2 * MIN_CHUNK_BYTES}, "unknown_snapshot"),
        (ck, {**good, "chunk_bytes": 2**62}, "bad_request"),
        (ck, {**good, "v": 2}, "bad_request"),
        (ck, {**good, "index": "0; drop"}, "bad_request"),
        (ck, {**good, "more": 1}, "bad_request"),
        (ck, {}, "bad_request"),
        (manifest_kind("state.s1"), {"v": 1, "chunk_bytes": 0}, "bad_request"),
        (manifest_kind("state.s1"), {"v": 1, "chunk_bytes": [1]}, "bad_request"),
    ]
    for kind, header, code in hostile:
        with pytest.raises(RemoteError) as err:
            _call(registry, kind, header)
        assert err.value.code == code, header
    with pytest.raises(RemoteError) as err:
        _call(registry, ck, good, [torch.zeros(3)])
    assert err.value.code == "bad_request"
    reply = _call(registry, ck, good)
    assert state_digest(reply.tensors[0].contiguous().numpy().data) == m.digests[0]
    donor.close()
    with pytest.raises(RemoteError) as err:
        _call(registry, ck, good)
    assert err.value.code == StateErrorCode.GONE


def test_donor_refuses_state_it_cannot_describe() -> None:
    _, registry, _, _ = _donor([Snapshot(1, {"c": torch.zeros(2, dtype=torch.complex64)}, {})])
    with pytest.raises(RemoteError) as err:
        _get_manifest(registry)
    assert err.value.code == StateErrorCode.INTERNAL
    _, registry, _, _ = _donor([Snapshot(1, {"w": torch.zeros(2)}, {"x": float("nan")})])
    with pytest.raises(RemoteError) as err:
        _get_manifest(registry)
    assert err.value.code == StateErrorCode.INTERNAL
