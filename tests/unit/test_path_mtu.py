"""Path MTU probing's wire format, search and black-hole check (transport/path_mtu.py),
without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wanswarm.transport.path_mtu import (
    MTU_ACK_BYTES,
    MTU_NONCE_BYTES,
    MtuSearch,
    MtuWatch,
    Verdict,
    decode_mtu_ack,
    decode_mtu_probe,
    encode_mtu_ack,
    encode_mtu_probe,
)
from wanswarm.transport.relay import is_quic

NONCE = bytes(range(MTU_NONCE_BYTES))


@pytest.mark.parametrize("size", [1200, 1453, 8952, 16448, 65527])
def test_a_probe_is_as_long_as_the_size_it_tests_and_round_trips(size: int) -> None:
    probe = encode_mtu_probe(NONCE, size)
    assert len(probe) == size and not is_quic(probe)
    assert decode_mtu_probe(probe) == (NONCE, size)
    ack = encode_mtu_ack(NONCE, size)
    assert len(ack) == MTU_ACK_BYTES < 1200 and not is_quic(ack)  # no amplification
    assert decode_mtu_ack(ack) == (NONCE, size)


def test_truncated_padded_or_mislabelled_packets_decode_to_nothing() -> None:
    probe = encode_mtu_probe(NONCE, 2000)
    assert decode_mtu_probe(probe[:-1]) is None  # shorter than it claims
    assert decode_mtu_probe(probe + b"\0") is None  # longer than it claims
    assert decode_mtu_probe(probe[:1199]) is None
    assert decode_mtu_probe(b"\x25" + probe[1:]) is None
    ack = encode_mtu_ack(NONCE, 2000)
    assert decode_mtu_ack(ack[:-1]) is None and decode_mtu_ack(ack + b"\0") is None
    assert decode_mtu_ack(b"\x24" + ack[1:]) is None
    assert decode_mtu_ack(ack[:17] + (100).to_bytes(4, "big") + ack[21:]) is None  # < 1200


def test_encoding_refuses_what_cannot_be_sent() -> None:
    for size in (1199, 65528):
        with pytest.raises(ValueError):
            encode_mtu_probe(NONCE, size)
        with pytest.raises(ValueError):
            encode_mtu_ack(NONCE, size)
    with pytest.raises(ValueError):
        encode_mtu_probe(b"short", 1500)


@given(st.binary(max_size=3000))
def test_random_bytes_never_raise(data: bytes) -> None:
    probe = decode_mtu_probe(data)
    if probe is not None:
        assert probe[1] == len(data)
    ack = decode_mtu_ack(data)
    if ack is not None:
        assert len(data) == MTU_ACK_BYTES and 1200 <= ack[1] <= 65527


def test_the_search_tries_the_largest_first_and_stops_at_the_first_acknowledged() -> None:
    search = MtuSearch(1452, [8952, 16448, 1200, 1452], attempts=2)
    assert search.next_probe() == 16448  # sizes not above the current one are dropped
    search.on_lost(16448)
    assert search.next_probe() == 16448  # a second attempt
    search.on_lost(16448)
    assert search.next_probe() == 8952
    search.on_acked(8952)
    assert search.done and search.next_probe() is None and search.size == 8952


def test_a_search_with_every_probe_lost_keeps_the_size_in_use() -> None:
    search = MtuSearch(1452, [16448, 8952])
    probes = []
    while (size := search.next_probe()) is not None:
        probes.append(size)
        search.on_lost(size)
    assert probes == [16448] * 3 + [8952] * 3 and search.size == 1452


def test_late_or_stray_answers_change_nothing() -> None:
    search = MtuSearch(1452, [16448, 8952], attempts=1)
    search.on_acked(8952)  # not the size being probed
    search.on_lost(8952)
    assert search.next_probe() == 16448
    search.on_lost(16448)
    search.on_acked(16448)  # too late: the search moved on
    assert search.next_probe() == 8952 and search.size == 1452
    assert MtuSearch(1452, []).done and MtuSearch(16448, [8952]).done
    with pytest.raises(ValueError):
        MtuSearch(1452, [16448], attempts=0)


def test_a_confirmation_is_due_after_the_interval_or_soon_after_trouble() -> None:
    watch = MtuWatch(100.0, packets_lost=5, interval=30.0, min_gap=1.0)
    assert not watch.due(100.5, packets_lost=5, pto_count=0)
    assert not watch.due(100.5, packets_lost=9, pto_count=0)  # within the gap
    assert watch.due(101.0, packets_lost=9, pto_count=0)  # packets declared lost
    assert watch.due(101.0, packets_lost=5, pto_count=1)  # a probe timeout running
    assert not watch.due(129.0, packets_lost=5, pto_count=0)
    assert watch.due(130.0, packets_lost=5, pto_count=0)  # the interval, without trouble


def test_a_black_hole_takes_every_attempt_losing_the_size_while_the_base_crosses() -> None:
    watch = MtuWatch(0.0, packets_lost=0, interval=30.0, attempts=3)
    assert watch.attempt(1.0, 7, size_acked=False, base_acked=True) is Verdict.AGAIN
    assert watch.attempt(1.1, 7, size_acked=False, base_acked=True) is Verdict.AGAIN
    assert watch.attempt(1.2, 7, size_acked=False, base_acked=True) is Verdict.LOWER


def test_an_answered_probe_or_a_silent_path_ends_the_confirmation_without_a_change() -> None:
    watch = MtuWatch(0.0, packets_lost=0, interval=30.0, attempts=3)
    assert watch.attempt(1.0, 4, size_acked=False, base_acked=True) is Verdict.AGAIN
    assert watch.attempt(1.1, 4, size_acked=True, base_acked=True) is Verdict.KEEP
    # the evidence starts again, and losses count from the confirmation
    assert not watch.due(1.5, packets_lost=4, pto_count=0)
    assert watch.due(2.1, packets_lost=5, pto_count=0)
    assert watch.attempt(2.2, 5, size_acked=False, base_acked=True) is Verdict.AGAIN
    assert watch.attempt(2.3, 5, size_acked=False, base_acked=True) is Verdict.AGAIN
    # neither probe answered: the path is down or congested, not shrunk
    assert watch.attempt(2.4, 5, size_acked=False, base_acked=False) is Verdict.UNDECIDED
    assert watch.attempt(3.5, 6, size_acked=False, base_acked=True) is Verdict.AGAIN


def test_a_hint_from_the_peer_makes_a_confirmation_due_like_loss() -> None:
    """The peer probed our base size (its own larger probe was lost): confirm soon."""
    watch = MtuWatch(0.0, packets_lost=0, interval=30.0, min_gap=1.0)
    watch.hint()
    assert not watch.due(0.5, packets_lost=0, pto_count=0)  # within the gap
    assert watch.due(1.0, packets_lost=0, pto_count=0)
    assert watch.attempt(1.1, 0, size_acked=True, base_acked=True) is Verdict.KEEP
    assert not watch.due(2.5, packets_lost=0, pto_count=0)  # the hint was used up


def test_a_watch_needs_at_least_one_attempt() -> None:
    with pytest.raises(ValueError):
        MtuWatch(0.0, 0, interval=30.0, attempts=0)
