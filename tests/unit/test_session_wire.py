"""transport.session_wire: symbol datagrams and control messages."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.transport.errors import FecError, FramingError
from wanswarm.transport.fec import MAX_ESI, MAX_SYMBOL_SIZE, MIN_SYMBOL_SIZE
from wanswarm.transport.session_wire import (
    DATAGRAM_HEADER_BYTES,
    MAX_CONTROL_BYTES,
    MAX_REQUEST_ENTRIES,
    Completion,
    RepairRequest,
    decode_control,
    decode_datagram,
    encode_control,
    encode_datagram,
    symbol_size_for,
)

U32 = st.integers(0, (1 << 32) - 1)


def test_datagram_layout_is_byte_exact() -> None:
    symbol = bytes(range(64))
    data = encode_datagram(0x01020304, 0x0506, 0x0708, 0x090A0B0C, symbol, last=True)
    assert data[:DATAGRAM_HEADER_BYTES] == bytes.fromhex("01 01 0506 01020304 090a0b0c 00000708")
    assert data[DATAGRAM_HEADER_BYTES:] == symbol


@settings(max_examples=100, deadline=None)
@given(
    transfer_id=U32,
    block=st.integers(0, 0xFFFF),
    esi=st.integers(0, MAX_ESI),
    seq=U32,
    last=st.booleans(),
    symbol=st.binary(min_size=MIN_SYMBOL_SIZE, max_size=MIN_SYMBOL_SIZE + 300),
)
def test_datagram_round_trip(
    transfer_id: int, block: int, esi: int, seq: int, last: bool, symbol: bytes
) -> None:
    data = encode_datagram(transfer_id, block, esi, seq, symbol, last=last)
    decoded = decode_datagram(data)
    assert (decoded.transfer_id, decoded.block, decoded.esi, decoded.seq, decoded.last) == (
        transfer_id,
        block,
        esi,
        seq,
        last,
    )
    assert bytes(decoded.symbol) == symbol
    for cut in (0, 1, DATAGRAM_HEADER_BYTES - 1, DATAGRAM_HEADER_BYTES + MIN_SYMBOL_SIZE - 1):
        with pytest.raises(FramingError):
            decode_datagram(data[:cut])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: b"\x02" + d[1:],  # unknown version
        lambda d: d[:1] + b"\x02" + d[2:],  # reserved flag
        lambda d: d[:12] + b"\x01" + d[13:],  # ESI >= 2^24
        lambda d: d + bytes(MAX_SYMBOL_SIZE),  # too long
    ],
)
def test_datagram_decoder_rejects_malformed(mutate: object) -> None:
    data = encode_datagram(1, 2, 3, 4, bytes(64))
    assert callable(mutate)
    with pytest.raises(FramingError):
        decode_datagram(mutate(data))


def test_datagram_encoder_rejects_out_of_range_fields() -> None:
    for args in [(1 << 32, 0, 0, 0), (0, 1 << 16, 0, 0), (0, 0, MAX_ESI + 1, 0), (0, 0, 0, -1)]:
        with pytest.raises(FecError):
            encode_datagram(*args, bytes(64))
    with pytest.raises(FecError):
        encode_datagram(0, 0, 0, 0, bytes(MIN_SYMBOL_SIZE - 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * DATAGRAM_HEADER_BYTES + MIN_SYMBOL_SIZE))
def test_datagram_decoder_raises_only_framing_error(data: bytes) -> None:
    try:
        decoded = decode_datagram(data)
    except FramingError:
        return
    assert decoded.esi <= MAX_ESI and len(decoded.symbol) == len(data) - DATAGRAM_HEADER_BYTES


def test_symbol_size_for_fits_the_datagram_and_aligns() -> None:
    assert symbol_size_for(1350) == 1328  # 1350 - 16 = 1334, rounded down to 8
    assert symbol_size_for(1200) + DATAGRAM_HEADER_BYTES <= 1200
    assert symbol_size_for(65527) == MAX_SYMBOL_SIZE
    assert symbol_size_for(DATAGRAM_HEADER_BYTES + MIN_SYMBOL_SIZE) == MIN_SYMBOL_SIZE
    with pytest.raises(FecError):
        symbol_size_for(DATAGRAM_HEADER_BYTES + MIN_SYMBOL_SIZE - 1)


requests = st.builds(
    RepairRequest,
    transfer_id=U32,
    attempt=st.integers(1, (1 << 32) - 1),
    seq_count=U32,
    received=U32,
    missing=st.lists(
        st.tuples(st.integers(0, 0xFFFF), st.integers(1, 0xFFFF)),
        min_size=1,
        max_size=50,
        unique_by=lambda e: e[0],
    ).map(lambda entries: tuple(sorted(entries))),
)
completions = st.builds(Completion, U32, U32, U32, U32, U32)


@settings(max_examples=60, deadline=None)
@given(st.one_of(requests, completions))
def test_control_round_trip_and_truncation(message: RepairRequest | Completion) -> None:
    data = encode_control(message)
    assert decode_control(data) == message
    for cut in range(len(data)):
        with pytest.raises(FramingError):
            decode_control(data[:cut])
    with pytest.raises(FramingError):
        decode_control(data + b"\x00")


def test_control_layout_is_byte_exact() -> None:
    request = RepairRequest(7, 2, 1000, 990, ((0, 3), (5, 1)))
    assert encode_control(request) == bytes.fromhex(
        "01 01 00000007 00000002 000003e8 000003de 0002 0000 0003 0005 0001"
    )
    assert encode_control(Completion(7, 1000, 990, 1, 20)) == bytes.fromhex(
        "01 02 00000007 000003e8 000003de 00000001 00000014"
    )


@pytest.mark.parametrize(
    "data",
    [
        b"\x02\x02" + bytes(20),  # unknown version
        b"\x01\x09" + bytes(20),  # unknown type
        struct.pack("!BBIIIIH", 1, 1, 1, 0, 0, 0, 1) + b"\x00\x00\x00\x01",  # attempt 0
        struct.pack("!BBIIIIH", 1, 1, 1, 1, 0, 0, 0),  # no entries
        struct.pack("!BBIIIIH", 1, 1, 1, 1, 0, 0, 1) + b"\x00\x00\x00\x00",  # need 0
        struct.pack("!BBIIIIH", 1, 1, 1, 1, 0, 0, 2) + b"\x00\x05\x00\x01\x00\x05\x00\x01",
        struct.pack("!BBIIIIH", 1, 1, 1, 1, 0, 0, MAX_REQUEST_ENTRIES + 1)
        + bytes(4 * (MAX_REQUEST_ENTRIES + 1)),  # too many entries
    ],
)
def test_control_decoder_rejects_malformed(data: bytes) -> None:
    with pytest.raises(FramingError):
        decode_control(data)


def test_control_encoder_rejects_unencodable() -> None:
    bad: list[RepairRequest | Completion] = [
        RepairRequest(1, 0, 0, 0, ((0, 1),)),
        RepairRequest(1, 1, 0, 0, ()),
        RepairRequest(1, 1, 0, 0, ((1, 1), (0, 1))),
        RepairRequest(1, 1, 0, 0, ((0, 0),)),
        RepairRequest(1 << 32, 1, 0, 0, ((0, 1),)),
        Completion(-1, 0, 0, 0, 0),
    ]
    for message in bad:
        with pytest.raises(FecError):
            encode_control(message)


def test_largest_control_message_fits_the_default_control_frame() -> None:
    missing = tuple((b, 1) for b in range(MAX_REQUEST_ENTRIES))
    data = encode_control(RepairRequest(1, 1, 0, 0, missing))
    assert len(data) == MAX_CONTROL_BYTES <= 64 * 1024
    assert decode_control(data) == RepairRequest(1, 1, 0, 0, missing)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_control_decoder_raises_only_framing_error(data: bytes) -> None:
    try:
        message = decode_control(data)
    except FramingError:
        return
    assert encode_control(message) == data  # canonical: anything accepted re-encodes equal


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.binary(min_size=16, max_size=64))
def test_control_decoder_on_random_request_bodies(entries: int, tail: bytes) -> None:
    data = struct.pack("!BBIIIIH", 1, 1, 9, 1, 5, 4, entries) + tail
    try:
        message = decode_control(data)
    except FramingError:
        return
    assert isinstance(message, RepairRequest) and len(message.missing) == entries
