"""Path MTU probing's wire format and search (transport/path_mtu.py), without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wanswarm.transport.path_mtu import (
    MTU_ACK_BYTES,
    MTU_NONCE_BYTES,
    MtuSearch,
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
