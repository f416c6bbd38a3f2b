"""Progress pushes (stage/progress_push.py): the wire format and the book that screens and
merges what the stage's other replicas push. Pure: ``now`` is passed in."""

from __future__ import annotations

import random
import struct

import pytest
from wanswarm.node.stage.progress_push import (
    PUSH_BYTES,
    PushBook,
    PushedCount,
    PushError,
    decode_push,
    encode_push,
)

A, B, STRANGER = b"replica-a", b"replica-b", b"stranger"
KNOWN = {A, B}


def _push(epoch: int = 5, samples: float = 24.0, seq: int = 1) -> bytes:
    return encode_push(PushedCount(seq=seq, epoch=epoch, samples=samples))


def test_a_push_round_trips_and_is_one_fixed_size() -> None:
    count = PushedCount(seq=1_700_000_000_123_456_789, epoch=12, samples=40.0)
    data = encode_push(count)
    assert len(data) == PUSH_BYTES == 25
    assert decode_push(data) == count


def test_truncated_long_and_foreign_pushes_are_refused() -> None:
    data = _push()
    for bad in (b"", data[:-1], data + b"\0", b"\x02" + data[1:]):
        with pytest.raises(PushError):
            decode_push(bad)
    nan = struct.pack("!BQQd", 1, 1, 5, float("nan"))
    with pytest.raises(PushError, match="out of range"):
        decode_push(nan)
    huge_epoch = struct.pack("!BQQd", 1, 1, 2**63, 8.0)
    with pytest.raises(PushError, match="out of range"):
        decode_push(huge_epoch)


def test_random_bytes_decode_or_raise_push_error_only() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.choice([PUSH_BYTES, rng.randrange(40)])))
        try:
            count = decode_push(data)
        except PushError:
            continue
        assert len(data) == PUSH_BYTES and count.epoch <= 2**62


def test_the_book_takes_a_known_replicas_push_and_merges_it_with_the_records() -> None:
    book = PushBook(target_batch_size=64)
    records = {A: (5, 16.0), B: (5, 8.0)}
    assert book.merged(records, now=0.0) == {5: 24.0}
    assert book.accept(A, _push(5, 32.0), known=KNOWN, local_epoch=5, now=1.0) is None
    # A's push is further on than its record: it counts; B's record stands
    assert book.merged(records, now=1.5) == {5: 40.0}
    # a record that caught up and passed the push wins (the push is older news)
    assert book.merged({A: (5, 40.0), B: (5, 8.0)}, now=1.5) == {5: 48.0}
    # A stepped: its push says epoch 6 with nothing yet, so it no longer counts for epoch 5
    assert book.accept(A, _push(6, 0.0, seq=2), known=KNOWN, local_epoch=5, now=2.0) is None
    assert book.merged(records, now=2.0) == {6: 0.0, 5: 8.0}
    assert book.received == 2 and book.refused == {}


def test_pushes_expire_and_the_records_count_again() -> None:
    book = PushBook(target_batch_size=64, ttl_s=10.0)
    book.accept(A, _push(5, 48.0), known=KNOWN, local_epoch=5, now=0.0)
    assert book.merged({A: (5, 16.0)}, now=10.0) == {5: 48.0}
    assert book.merged({A: (5, 16.0)}, now=10.5) == {5: 16.0}
    # once expired, even an older sequence number is taken (the sender restarted)
    assert book.accept(A, _push(5, 8.0, seq=0), known=KNOWN, local_epoch=5, now=11.0) is None


def test_the_book_refuses_what_a_hostile_replica_could_push() -> None:
    book = PushBook(target_batch_size=64, max_lead=2, max_samples_factor=4.0)

    def refused(sender: bytes, data: bytes, local_epoch: int = 5) -> str | None:
        return book.accept(sender, data, known=KNOWN, local_epoch=local_epoch, now=0.0)

    assert refused(STRANGER, _push()) == "unknown"  # no progress record of the stage
    assert refused(A, b"\x01" * 7) == "malformed"
    assert refused(A, _push(epoch=8)) == "epoch"
    assert refused(A, _push(epoch=2)) == "epoch"
    assert refused(A, _push(samples=257.0)) == "samples"
    assert refused(A, _push(samples=-1.0)) == "samples"
    assert refused(A, _push(seq=10)) is None
    assert refused(A, _push(samples=56.0, seq=9)) == "stale"  # reordered: the newer one stands
    assert refused(A, _push(samples=56.0, seq=10)) == "stale"
    assert book.merged({A: (5, 0.0)}, now=0.0) == {5: 24.0}
    assert book.refused == {"unknown": 1, "malformed": 1, "epoch": 2, "samples": 2, "stale": 2}
    assert book.received == 1


def test_a_flooding_replica_is_held_to_its_rate() -> None:
    book = PushBook(target_batch_size=64, rate_per_s=50.0)
    taken = sum(
        book.accept(A, _push(seq=i + 1), known=KNOWN, local_epoch=5, now=0.0) is None
        for i in range(500)
    )
    assert taken == 50 and book.refused == {"rate": 450}
    # a second later the bucket has refilled
    assert book.accept(A, _push(seq=1000), known=KNOWN, local_epoch=5, now=1.0) is None
    # the other replica is not held back by it
    assert book.accept(B, _push(seq=1), known=KNOWN, local_epoch=5, now=0.0) is None


def test_replicas_that_left_the_records_lose_their_entries() -> None:
    book = PushBook(target_batch_size=64)
    book.accept(A, _push(5, 40.0), known=KNOWN, local_epoch=5, now=0.0)
    book.accept(B, _push(5, 8.0), known={B}, local_epoch=5, now=0.1)
    assert set(book.entries) == {B}
    # and a push only counts for a replica that has a record
    assert book.merged({}, now=0.2) == {}
