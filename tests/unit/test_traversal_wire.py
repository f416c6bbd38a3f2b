"""The pure parts of NAT traversal: relay and probe packets, the relay's and the probe port's
tables, token buckets, the traversal messages and the replay guard. No sockets, no clocks:
time is passed in."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.identity import Identity
from wanswarm.transport.peer_address import PeerAddress
from wanswarm.transport.rate_limit import KeyedBuckets, TokenBucket
from wanswarm.transport.relay import (
    PUNCH_BYTE,
    RELAY_BYTE,
    RELAY_HEADER_BYTES,
    RelayEnds,
    RelayTable,
    decode_relay,
    encode_punch,
    encode_relay,
    is_quic,
    is_virtual,
)
from wanswarm.transport.traversal_wire import (
    PROBE_BYTE,
    PROBE_BYTES,
    Introduce,
    Introduction,
    ObserveReply,
    ProbeQuery,
    ProbeTable,
    ReplayGuard,
    decode_probe,
    encode_probe,
    parse,
)

A, B, R = ("10.0.0.1", 1000), ("10.0.0.2", 2000), ("10.0.0.3", 3000)


def _tokens() -> itertools.cycle[bytes]:
    return itertools.cycle([bytes([i]) * 8 for i in range(1, 256)])


def _table(**overrides: float) -> RelayTable:
    tokens = _tokens()
    fields = {"max_channels": 2, "bytes_per_s": 1000.0, "burst_bytes": 3000.0,
              "idle_timeout_s": 60.0}
    fields.update(overrides)
    return RelayTable(token_bytes=lambda n: next(tokens), **fields)  # type: ignore[arg-type]


def test_peer_address_keeps_positional_construction_and_is_hashable() -> None:
    r = PeerAddress("r", "1.2.3.4", 5)
    b = PeerAddress("b", "h", 1, reachable=False, rendezvous=r)
    assert PeerAddress("b", "h", 1) == PeerAddress("b", "h", 1, True, None)
    assert len({b, PeerAddress("b", "h", 1, False, r), r}) == 2


def test_packet_kinds_are_told_apart_by_the_first_byte() -> None:
    assert not is_quic(encode_relay(b"t" * 8, b"x")) and not is_quic(encode_punch(b"n" * 8))
    assert is_quic(bytes([0xC0])) and is_quic(bytes([0x40])) and is_quic(bytes([0x80]))
    assert not is_quic(b"")
    assert encode_relay(b"t" * 8, b"inner") == bytes([RELAY_BYTE]) + b"t" * 8 + b"inner"
    assert decode_relay(encode_relay(b"t" * 8, b"inner")) == (b"t" * 8, b"inner")
    assert decode_relay(bytes([RELAY_BYTE]) + b"t" * 8) is None  # no inner packet
    assert decode_relay(bytes([PUNCH_BYTE]) + b"t" * 9) is None
    assert len(encode_punch(b"n")) == RELAY_HEADER_BYTES
    with pytest.raises(ValueError):
        encode_relay(b"short", b"x")
    assert is_virtual(("relay:abc", 1)) and not is_virtual(("127.0.0.1", 1))


def test_relay_table_forwards_only_matching_token_and_source_and_rewrites() -> None:
    table = _table()
    channel = table.allocate(("a", A), ("b", B), now=0.0)
    assert channel is not None and channel.a.token != channel.b.token
    packet = encode_relay(channel.a.token, b"q" * 100)
    assert table.forward(packet, A, 0.0) == (encode_relay(channel.b.token, b"q" * 100), B)
    back = encode_relay(channel.b.token, b"r" * 10)
    assert table.forward(back, B, 0.0) == (encode_relay(channel.a.token, b"r" * 10), A)
    assert table.forward(packet, B, 0.0) is None  # a's token from b's address
    assert table.forward(packet, ("10.0.0.1", 1001), 0.0) is None  # another port
    assert table.forward(encode_relay(b"\xee" * 8, b"x"), A, 0.0) is None
    assert table.forward(b"\x21abc", A, 0.0) is None
    assert table.counts == {"allocated": 1, "forwarded": 2, "dropped.wrong_source": 2,
                            "dropped.unknown_token": 1, "dropped.malformed": 1}
    assert channel.forwarded_bytes == len(packet) + len(back)


def test_relay_table_bucket_bounds_bytes_per_channel() -> None:
    table = _table(bytes_per_s=1000.0, burst_bytes=3000.0)
    channel = table.allocate(("a", A), ("b", B), now=0.0)
    assert channel is not None
    packet = encode_relay(channel.a.token, b"q" * (1000 - RELAY_HEADER_BYTES))
    sent = [table.forward(packet, A, 0.0) is not None for _ in range(5)]
    assert sent == [True, True, True, False, False]  # the burst: 3000 bytes
    assert table.forward(packet, A, 0.5) is None  # 500 bytes back
    assert table.forward(packet, A, 1.0) is not None  # 1000
    forwarded = 0
    for step in range(1, 101):  # 10 s at 10 packets/s offered: 1000 B/s gets through
        for _ in range(10):
            if table.forward(packet, A, 1.0 + step / 10) is not None:
                forwarded += len(packet)
    assert forwarded <= 1000 * 10 + 1000
    assert table.counts["dropped.rate"] > 0


def test_relay_table_capacity_expiry_and_peer_drop() -> None:
    table = _table(max_channels=2, idle_timeout_s=10.0)
    first = table.allocate(("a", A), ("b", B), 0.0)
    second = table.allocate(("a", A), ("c", R), 5.0)
    assert first is not None and second is not None
    assert table.allocate(("b", B), ("c", R), 5.0) is None  # full
    assert table.expire(12.0) == [first] and table.channels == [second]
    assert table.forward(encode_relay(first.a.token, b"x"), A, 12.0) is None
    assert table.drop_peer("c") == 1 and table.channels == []
    assert table.counts["refused.full"] == 1 and table.counts["expired"] == 1


def test_relay_ends_wrap_and_unwrap_only_from_the_relay() -> None:
    ends = RelayEnds()
    end = ends.add(b"k" * 8, R, "relay-id", "peer-b")
    assert end.virtual == ("relay:relay-id", 1) and ends.get(end.virtual) == end
    assert ends.wrap(b"quic", end.virtual) == (encode_relay(b"k" * 8, b"quic"), R)
    assert ends.unwrap(encode_relay(b"k" * 8, b"quic"), R) == (b"quic", end.virtual)
    assert ends.unwrap(encode_relay(b"k" * 8, b"quic"), A) is None
    assert ends.unwrap(encode_relay(b"j" * 8, b"quic"), R) is None
    ends.remove(end.virtual)
    assert ends.wrap(b"quic", end.virtual) is None and len(ends) == 0


@given(st.binary(max_size=64), st.sampled_from([A, B, R]))
def test_random_bytes_never_raise_or_forward(data: bytes, src: tuple[str, int]) -> None:
    table = _table()
    table.allocate(("a", A), ("b", B), 0.0)
    ends = RelayEnds()
    ends.add(b"\x7f" * 8, R, "r", "b")
    # the cycle's tokens are bytes([i]) * 8; random data hitting one exactly is negligible
    if len(data) > RELAY_HEADER_BYTES and data[1:9] in {b"\x01" * 8, b"\x02" * 8, b"\x7f" * 8}:
        return
    assert table.forward(data, src, 1.0) is None
    assert ends.unwrap(data, src) is None


def test_token_buckets() -> None:
    bucket = TokenBucket(rate=2.0, burst=4.0, now=0.0)
    assert [bucket.take(1, 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert bucket.take(1, 0.5) and not bucket.take(1, 0.5)
    assert bucket.available(100.0) == 4.0
    keyed = KeyedBuckets(rate=1.0, burst=2.0, max_keys=2)
    assert keyed.take("a", 0) and keyed.take("a", 0) and not keyed.take("a", 0)
    keyed.take("b", 0)
    keyed.take("c", 0)  # forgets "a", the least recently used
    assert len(keyed) == 2 and keyed.take("a", 0)
    with pytest.raises(ValueError):
        TokenBucket(0.0, 1.0, 0.0)


def test_messages_parse_or_refuse_with_bad_request() -> None:
    peer = Identity.generate().peer_id
    assert parse(Introduce, {"target": peer, "reachable": True}).target == peer
    fields = {"peer": peer, "host": "1.2.3.4", "port": 5, "reachable": False,
              "nonce": "ab" * 16, "ts": 1.5}
    assert parse(Introduction, fields).port == 5
    for bad in (
        {"target": peer},
        {"target": peer, "reachable": 1},
        {"target": peer, "reachable": True, "more": 0},
        {"target": "x" * 65, "reachable": True},
        {"target": "Qm" + "1" * 44, "reachable": True},
        {"target": None, "reachable": True},
    ):
        with pytest.raises(RemoteError) as info:
            parse(Introduce, bad)
        assert info.value.code == "bad_request"
    for key, value in (("nonce", "AB" * 16), ("nonce", "ab"), ("port", 0), ("port", 70000),
                       ("host", ""), ("ts", "now")):
        with pytest.raises(RemoteError):
            parse(Introduction, {**fields, key: value})


def test_replay_guard_refuses_stale_and_seen_nonces() -> None:
    guard = ReplayGuard(max_age_s=30.0, max_entries=3)
    assert guard.check("n1", ts=100.0, now=110.0) is None
    assert guard.check("n1", ts=100.0, now=111.0) == "replayed"
    assert guard.check("n2", ts=50.0, now=110.0) == "stale"
    assert guard.check("n3", ts=150.0, now=110.0) == "stale"  # from the future
    assert guard.check("n4", ts=math.nan, now=110.0) == "stale"
    assert guard.check("n1", ts=170.0, now=171.0) is None  # forgotten after 2 x max_age
    for i in range(5):
        assert guard.check(f"m{i}", ts=171.0, now=171.0) is None
    assert guard.check("m4", ts=171.0, now=171.0) == "replayed"
    assert guard.check("fresh", ts=time.time(), now=time.time()) is None


def test_probe_packets_round_trip_and_are_not_quic() -> None:
    nonce = bytes(range(16))
    packet = encode_probe(nonce)
    assert packet == bytes([PROBE_BYTE]) + nonce and len(packet) == PROBE_BYTES
    assert not is_quic(packet) and decode_probe(packet) == nonce
    for bad in (packet[:-1], packet + b"\0", b"", bytes([PUNCH_BYTE]) + nonce,
                encode_punch(nonce)):
        assert decode_probe(bad) is None
    with pytest.raises(ValueError):
        encode_probe(b"short")


@given(st.binary(max_size=64))
def test_random_bytes_are_a_probe_only_in_its_exact_form(data: bytes) -> None:
    nonce = decode_probe(data)
    assert (nonce is not None) == (len(data) == PROBE_BYTES and data[0] == PROBE_BYTE)
    if nonce is not None:
        assert encode_probe(nonce) == data


def test_probe_table_keeps_the_first_source_expires_and_is_bounded() -> None:
    table = ProbeTable(max_entries=3, ttl_s=30.0)
    assert table.record(b"n1", A, 0.0) and not table.record(b"n1", B, 1.0)
    assert table.take(b"n1", 2.0) == A  # the first source, once
    assert table.take(b"n1", 2.0) is None
    assert table.record(b"n2", A, 10.0)
    assert table.take(b"n2", 40.0) is None  # expired
    for i in range(5):
        assert table.record(bytes([i]), B, 50.0)
    assert len(table) == 3  # the oldest forgotten first
    assert table.take(bytes([0]), 50.0) is None and table.take(bytes([4]), 50.0) == B
    assert table.take(b"never", 50.0) is None


def test_observe_and_probe_messages() -> None:
    assert parse(ObserveReply, {"host": "1.2.3.4", "port": 5}).alt_port is None
    assert parse(ObserveReply, {"host": "1.2.3.4", "port": 5, "alt_port": 6}).alt_port == 6
    assert parse(ProbeQuery, {"nonce": "0f" * 16}).nonce == "0f" * 16
    for model, bad in (
        (ObserveReply, {"host": "1.2.3.4", "port": 5, "alt_port": 0}),
        (ObserveReply, {"host": "1.2.3.4", "port": 5, "alt_port": "6"}),
        (ProbeQuery, {"nonce": "0f" * 15}),
        (ProbeQuery, {"nonce": "0F" * 16}),
        (ProbeQuery, {"nonce": "0f" * 16, "to": "1.2.3.4"}),
        (ProbeQuery, {}),
    ):
        with pytest.raises(RemoteError) as info:
            parse(model, bad)
        assert info.value.code == "bad_request", bad
