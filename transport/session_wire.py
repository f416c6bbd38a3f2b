"""Wire formats of FEC transfers: symbol datagrams and the stream's control messages.

Pure encode/decode functions; every field is bounded and every decode failure is a
``FramingError`` (nothing else escapes, whatever the bytes). All integers big-endian.

Symbol datagram, version 1 (the payload of one QUIC DATAGRAM frame, RFC 9221)::

    0        1        2        4              8              12             16
    +--------+--------+--------+--------------+--------------+--------------+------------+
    | ver=1  | flags  | block  | transfer_id  | seq          | esi          | symbol ... |
    | u8     | u8     | u16    | u32          | u32          | u32 < 2^24   | T bytes    |
    +--------+--------+--------+--------------+--------------+--------------+------------+

    flags   bit 0 LAST: the sender had nothing more queued for this transfer after this
            datagram (the end of a burst); other bits are zero in version 1.
    block   block number in the transfer's layout (fec.TransferLayout).
    seq     the datagram's position in the transfer's send order, 0, 1, 2, ...; never
            reused, so the receiver can count losses and the sender can tell which
            symbols were still in flight when a repair request was written.
    esi     RaptorQ encoding symbol id: < k is a source symbol, >= k a repair symbol.

Control messages, version 1 (the body of a CONTROL frame on the request's stream)::

    REPAIR_REQUEST (receiver -> sender)
      ver=1 u8 | type=1 u8 | transfer_id u32 | attempt u32 | seq_count u32 | received u32
      | entries u16 | entries x (block u16, need u16)       blocks strictly increasing
    COMPLETION (receiver -> sender)
      ver=1 u8 | type=2 u8 | transfer_id u32 | seq_count u32 | received u32
      | duplicates u32 | useless u32

    attempt     1, 2, ... per transfer; the sender ignores one not above the last it served.
    seq_count   1 + the highest seq the receiver has seen (0: none yet).
    received    distinct symbol datagrams received, useful or not.
    need        more symbols the block needs to decode (>= 1).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, NamedTuple

from .errors import FecError, FramingError
from .fec import MAX_ESI, MAX_SYMBOL_SIZE, MIN_SYMBOL_SIZE, SYMBOL_ALIGNMENT

WIRE_VERSION: Final[int] = 1
FLAG_LAST: Final[int] = 0x01
MAX_TRANSFER_ID: Final[int] = (1 << 32) - 1
MAX_U32: Final[int] = (1 << 32) - 1

DATAGRAM_HEADER: Final[struct.Struct] = struct.Struct("!BBHIII")
DATAGRAM_HEADER_BYTES: Final[int] = DATAGRAM_HEADER.size  # 16

REPAIR_REQUEST: Final[int] = 1
COMPLETION: Final[int] = 2
MAX_REQUEST_ENTRIES: Final[int] = 8192
"""Blocks named in one repair request (32 KiB of entries): fits LimitsConfig's default
64 KiB control frame. Further missing blocks are asked for in the next request."""
MAX_NEED: Final[int] = 0xFFFF

_CONTROL_PREFIX: Final[struct.Struct] = struct.Struct("!BB")
_REQUEST_FIXED: Final[struct.Struct] = struct.Struct("!BBIIIIH")
_COMPLETION: Final[struct.Struct] = struct.Struct("!BBIIIII")
MAX_CONTROL_BYTES: Final[int] = _REQUEST_FIXED.size + 4 * MAX_REQUEST_ENTRIES


def symbol_size_for(max_datagram_payload: int) -> int:
    """Largest symbol size whose datagram fits ``max_datagram_payload`` bytes.

    ``max_datagram_payload`` is what the QUIC connection can put in one DATAGRAM frame
    (aioquic never splits one, and one too big blocks its queue). FecError if too small.
    """
    size = min(MAX_SYMBOL_SIZE, max_datagram_payload - DATAGRAM_HEADER_BYTES)
    size -= size % SYMBOL_ALIGNMENT
    if size < MIN_SYMBOL_SIZE:
        raise FecError(
            f"datagrams of {max_datagram_payload} bytes leave no room for a "
            f"{MIN_SYMBOL_SIZE}-byte symbol after the {DATAGRAM_HEADER_BYTES}-byte header"
        )
    return size


class SymbolDatagram(NamedTuple):
    """A decoded symbol datagram; ``symbol`` is a view into the datagram's bytes."""

    transfer_id: int
    block: int
    esi: int
    seq: int
    last: bool
    symbol: memoryview


def encode_datagram(
    transfer_id: int,
    block: int,
    esi: int,
    seq: int,
    symbol: bytes | bytearray | memoryview,
    *,
    last: bool = False,
) -> bytes:
    """One symbol datagram. FecError if a field is out of range (our own bug)."""
    if not (
        0 <= transfer_id <= MAX_TRANSFER_ID
        and 0 <= block <= 0xFFFF
        and 0 <= esi <= MAX_ESI
        and 0 <= seq <= MAX_U32
        and MIN_SYMBOL_SIZE <= len(symbol) <= MAX_SYMBOL_SIZE
    ):
        raise FecError(f"datagram field out of range: {transfer_id=} {block=} {esi=} {seq=}")
    header = DATAGRAM_HEADER.pack(
        WIRE_VERSION, FLAG_LAST if last else 0, block, transfer_id, seq, esi
    )
    return header + symbol


def decode_datagram(data: bytes | bytearray | memoryview) -> SymbolDatagram:
    """Parse a symbol datagram; FramingError if it is not a well-formed version-1 one."""
    size = len(data)
    if size < DATAGRAM_HEADER_BYTES + MIN_SYMBOL_SIZE:
        raise FramingError(f"datagram of {size} bytes is too short")
    if size > DATAGRAM_HEADER_BYTES + MAX_SYMBOL_SIZE:
        raise FramingError(f"datagram of {size} bytes is too long")
    version, flags, block, transfer_id, seq, esi = DATAGRAM_HEADER.unpack_from(data)
    if version != WIRE_VERSION:
        raise FramingError(f"unknown datagram version {version}")
    if flags & ~FLAG_LAST:
        raise FramingError(f"reserved datagram flags set: {flags:#04x}")
    if esi > MAX_ESI:
        raise FramingError(f"ESI {esi} out of range")
    return SymbolDatagram(
        transfer_id, block, esi, seq, bool(flags), memoryview(data)[DATAGRAM_HEADER_BYTES:]
    )


@dataclass(frozen=True, slots=True)
class RepairRequest:
    """The receiver still misses blocks: ``missing`` is ((block, need), ...), ascending."""

    transfer_id: int
    attempt: int
    seq_count: int
    received: int
    missing: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Completion:
    """The receiver decoded the whole payload; its counts let the sender measure loss."""

    transfer_id: int
    seq_count: int
    received: int
    duplicates: int
    useless: int


ControlMessage = RepairRequest | Completion


def _u32(*values: int) -> bool:
    return all(0 <= v <= MAX_U32 for v in values)


def encode_control(message: ControlMessage) -> bytes:
    """The body of a CONTROL frame. FecError if a field is out of range (our own bug)."""
    if isinstance(message, Completion):
        m = message
        if not _u32(m.transfer_id, m.seq_count, m.received, m.duplicates, m.useless):
            raise FecError(f"completion field out of range: {m}")
        return _COMPLETION.pack(
            WIRE_VERSION,
            COMPLETION,
            m.transfer_id,
            m.seq_count,
            m.received,
            m.duplicates,
            m.useless,
        )
    r = message
    if not _u32(r.transfer_id, r.attempt, r.seq_count, r.received) or r.attempt < 1:
        raise FecError(f"repair request field out of range: {r}")
    if not 1 <= len(r.missing) <= MAX_REQUEST_ENTRIES:
        raise FecError(f"repair request names {len(r.missing)} blocks")
    flat: list[int] = []
    previous = -1
    for block, need in r.missing:
        if not previous < block <= 0xFFFF or not 1 <= need <= MAX_NEED:
            raise FecError(f"bad repair request entry ({block}, {need})")
        previous = block
        flat += (block, need)
    fixed = _REQUEST_FIXED.pack(
        WIRE_VERSION,
        REPAIR_REQUEST,
        r.transfer_id,
        r.attempt,
        r.seq_count,
        r.received,
        len(r.missing),
    )
    return fixed + struct.pack(f"!{len(flat)}H", *flat)


def decode_control(data: bytes | bytearray | memoryview) -> ControlMessage:
    """Parse a CONTROL frame body; FramingError if it is not a well-formed one."""
    size = len(data)
    if size < _CONTROL_PREFIX.size:
        raise FramingError("control message too short")
    if size > MAX_CONTROL_BYTES:
        raise FramingError(f"control message of {size} bytes is too long")
    version, kind = _CONTROL_PREFIX.unpack_from(data)
    if version != WIRE_VERSION:
        raise FramingError(f"unknown control message version {version}")
    if kind == COMPLETION:
        if size != _COMPLETION.size:
            raise FramingError(f"completion of {size} bytes, expected {_COMPLETION.size}")
        _, _, transfer_id, seq_count, received, duplicates, useless = _COMPLETION.unpack_from(data)
        return Completion(transfer_id, seq_count, received, duplicates, useless)
    if kind != REPAIR_REQUEST:
        raise FramingError(f"unknown control message type {kind}")
    if size < _REQUEST_FIXED.size:
        raise FramingError("repair request truncated")
    _, _, transfer_id, attempt, seq_count, received, entries = _REQUEST_FIXED.unpack_from(data)
    if not 1 <= entries <= MAX_REQUEST_ENTRIES:
        raise FramingError(f"repair request names {entries} blocks")
    if attempt < 1:
        raise FramingError("repair request attempt 0")
    if size != _REQUEST_FIXED.size + 4 * entries:
        raise FramingError(f"repair request of {size} bytes for {entries} entries")
    flat = struct.unpack_from(f"!{2 * entries}H", data, _REQUEST_FIXED.size)
    missing = tuple(zip(flat[0::2], flat[1::2], strict=True))
    previous = -1
    for block, need in missing:
        if block <= previous:
            raise FramingError("repair request blocks not strictly increasing")
        if need < 1:
            raise FramingError(f"repair request asks 0 symbols for block {block}")
        previous = block
    return RepairRequest(transfer_id, attempt, seq_count, received, missing)


__all__ = [
    "COMPLETION",
    "DATAGRAM_HEADER_BYTES",
    "FLAG_LAST",
    "MAX_CONTROL_BYTES",
    "MAX_REQUEST_ENTRIES",
    "MAX_TRANSFER_ID",
    "REPAIR_REQUEST",
    "WIRE_VERSION",
    "Completion",
    "ControlMessage",
    "RepairRequest",
    "SymbolDatagram",
    "decode_control",
    "decode_datagram",
    "encode_control",
    "encode_datagram",
    "symbol_size_for",
]
