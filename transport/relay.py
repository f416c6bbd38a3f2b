"""Packet relaying through a peer both ends reach: the wire format and both sides' tables.

A relayed packet is a plain UDP datagram between an end's QUIC port and the relay's::

    relay packet = 0x21 | token[8] | inner QUIC packet
    punch packet = 0x22 | nonce[8]                      (opens a NAT mapping; dropped)

Every QUIC packet has the fixed bit 0x40 set (RFC 9000 §17.2, §17.3; we never negotiate
greasing it, RFC 9287) and a Version Negotiation packet has 0x80 set, so a first byte with
both clear can never be QUIC: the socket (quic_socket.py) tells the three apart by it.

The relay (:class:`RelayTable`) holds channels, each joining two ends that have an
authenticated connection to it. Each end has its own random token. A packet is forwarded
only if its token names a channel *and* it comes from the UDP address of that end's
connection to the relay; the token is rewritten to the other end's and the packet sent to
the other end's address, within the channel's token bucket. Anything else is dropped and
counted. An end (:class:`RelayEnds`) maps each channel to a virtual address that its QUIC
connection uses as the peer's address: packets to it are wrapped and sent to the relay,
packets from the relay unwrapped and handed to QUIC as coming from it.

The inner QUIC connection runs end to end (TLS and the identity handshake between the two
ends), so the relay forwards ciphertext it cannot read, and cannot pose as either end.

Pure: no sockets, no clocks (``now`` is passed in).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .rate_limit import TokenBucket

__all__ = [
    "PUNCH_BYTE",
    "RELAY_BYTE",
    "RELAY_HEADER_BYTES",
    "TOKEN_BYTES",
    "RelayChannel",
    "RelayEnd",
    "RelayEnds",
    "RelayTable",
    "decode_relay",
    "encode_punch",
    "encode_relay",
    "is_quic",
    "is_virtual",
]

Address = tuple[str, int]

RELAY_BYTE = 0x21
PUNCH_BYTE = 0x22
TOKEN_BYTES = 8
RELAY_HEADER_BYTES = 1 + TOKEN_BYTES
VIRTUAL_PREFIX = "relay:"
_NOT_QUIC = 0xC0  # the long-header bit and the fixed bit: a QUIC packet has one of them


def is_quic(data: bytes) -> bool:
    """Whether the datagram may be a QUIC packet (else a relay or punch packet, or junk)."""
    return bool(data) and bool(data[0] & _NOT_QUIC)


def encode_relay(token: bytes, inner: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a relay token is {TOKEN_BYTES} bytes")
    return bytes([RELAY_BYTE]) + token + inner


def decode_relay(data: bytes) -> tuple[bytes, bytes] | None:
    """(token, inner packet) of a relay packet; None if it is not a well-formed one."""
    if len(data) <= RELAY_HEADER_BYTES or data[0] != RELAY_BYTE:
        return None
    return data[1:RELAY_HEADER_BYTES], data[RELAY_HEADER_BYTES:]


def encode_punch(nonce: bytes) -> bytes:
    return bytes([PUNCH_BYTE]) + nonce[:TOKEN_BYTES].ljust(TOKEN_BYTES, b"\0")


def is_virtual(addr: Address) -> bool:
    """Whether an address is a relay channel's virtual address (see :class:`RelayEnds`)."""
    return isinstance(addr[0], str) and addr[0].startswith(VIRTUAL_PREFIX)


# -- the relay's side ------------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    peer_id: str
    token: bytes
    address: Address


@dataclass
class RelayChannel:
    """Two ends joined by the relay, their tokens, and what crossed."""

    a: _Side
    b: _Side
    bucket: TokenBucket
    created: float
    last_used: float
    forwarded_packets: int = 0
    forwarded_bytes: int = 0
    dropped_packets: int = 0

    def other(self, token: bytes) -> tuple[_Side, _Side]:
        """(the side whose token this is, the other side)."""
        return (self.a, self.b) if token == self.a.token else (self.b, self.a)


class RelayTable:
    """The channels this node relays (see the module docstring).

    ``max_channels`` bounds the table; ``bytes_per_s`` and ``burst_bytes`` make each
    channel's token bucket (both directions together, outer bytes); a channel that
    forwarded nothing for ``idle_timeout_s`` is removed (checked at most once a second,
    on the packets and allocations that arrive).
    """

    def __init__(
        self,
        *,
        max_channels: int,
        bytes_per_s: float,
        burst_bytes: float,
        idle_timeout_s: float,
        token_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.max_channels = max_channels
        self.bytes_per_s = bytes_per_s
        self.burst_bytes = burst_bytes
        self.idle_timeout_s = idle_timeout_s
        self._token_bytes = token_bytes
        self._by_token: dict[bytes, RelayChannel] = {}
        self._channels: list[RelayChannel] = []
        self._swept_at = float("-inf")
        self.counts: Counter[str] = Counter()

    @property
    def channels(self) -> list[RelayChannel]:
        return list(self._channels)

    def allocate(
        self, a: tuple[str, Address], b: tuple[str, Address], now: float
    ) -> RelayChannel | None:
        """A new channel between ``a`` and ``b`` (peer id, address of its connection to
        us); None when the table is full."""
        self.expire(now)
        if len(self._channels) >= self.max_channels:
            self.counts["refused.full"] += 1
            return None
        token_a, token_b = self._new_token(), self._new_token()
        while token_b == token_a:
            token_b = self._new_token()
        channel = RelayChannel(
            a=_Side(a[0], token_a, a[1]),
            b=_Side(b[0], token_b, b[1]),
            bucket=TokenBucket(self.bytes_per_s, self.burst_bytes, now),
            created=now,
            last_used=now,
        )
        self._channels.append(channel)
        self._by_token[token_a] = self._by_token[token_b] = channel
        self.counts["allocated"] += 1
        return channel

    def _new_token(self) -> bytes:
        while True:
            token = self._token_bytes(TOKEN_BYTES)
            if len(token) == TOKEN_BYTES and token not in self._by_token:
                return token

    def owns(self, data: bytes) -> bool:
        """Whether a relay packet's token is one of our channels' (a quick look)."""
        return data[1:RELAY_HEADER_BYTES] in self._by_token

    def forward(self, data: bytes, src: Address, now: float) -> tuple[bytes, Address] | None:
        """The packet to send and where, for a relay packet that arrived from ``src``;
        None (counted) if it must be dropped."""
        if now - self._swept_at >= 1.0:
            self.expire(now)
        decoded = decode_relay(data)
        if decoded is None:
            self.counts["dropped.malformed"] += 1
            return None
        token, inner = decoded
        channel = self._by_token.get(token)
        if channel is None:
            self.counts["dropped.unknown_token"] += 1
            return None
        sender, receiver = channel.other(token)
        if src != sender.address:
            self.counts["dropped.wrong_source"] += 1
            channel.dropped_packets += 1
            return None
        if not channel.bucket.take(len(data), now):
            self.counts["dropped.rate"] += 1
            channel.dropped_packets += 1
            return None
        channel.last_used = now
        channel.forwarded_packets += 1
        channel.forwarded_bytes += len(data)
        self.counts["forwarded"] += 1
        return encode_relay(receiver.token, inner), receiver.address

    def expire(self, now: float) -> list[RelayChannel]:
        """Remove and return the channels idle for ``idle_timeout_s``."""
        self._swept_at = now
        idle = [c for c in self._channels if now - c.last_used >= self.idle_timeout_s]
        for channel in idle:
            self.remove(channel)
            self.counts["expired"] += 1
        return idle

    def remove(self, channel: RelayChannel) -> None:
        if channel in self._channels:
            self._channels.remove(channel)
            self._by_token.pop(channel.a.token, None)
            self._by_token.pop(channel.b.token, None)

    def drop_peer(self, peer_id: str) -> int:
        """Remove every channel with an end ``peer_id`` (its connection to us closed)."""
        doomed = [c for c in self._channels if peer_id in (c.a.peer_id, c.b.peer_id)]
        for channel in doomed:
            self.remove(channel)
        return len(doomed)


# -- an end's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class RelayEnd:
    """One channel as an end sees it: our token, the relay, the far end."""

    token: bytes
    relay: Address
    relay_peer_id: str
    peer_id: str
    virtual: Address


@dataclass
class RelayEnds:
    """The relay channels this node is an end of, by token and by virtual address.

    A virtual address is ``("relay:<relay peer id>", n)``: never a socket address, and it
    says which relay a connection goes through (``Request.remote`` shows it).
    """

    _by_token: dict[bytes, RelayEnd] = field(default_factory=dict)
    _by_virtual: dict[Address, RelayEnd] = field(default_factory=dict)
    _next: int = 1
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, token: bytes, relay: Address, relay_peer_id: str, peer_id: str) -> RelayEnd:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a relay token is {TOKEN_BYTES} bytes")
        virtual = (VIRTUAL_PREFIX + relay_peer_id, self._next)
        self._next += 1
        end = RelayEnd(token, relay, relay_peer_id, peer_id, virtual)
        self._by_token[token] = end
        self._by_virtual[virtual] = end
        return end

    def remove(self, virtual: Address) -> None:
        end = self._by_virtual.pop(virtual, None)
        if end is not None:
            self._by_token.pop(end.token, None)

    def get(self, virtual: Address) -> RelayEnd | None:
        return self._by_virtual.get(virtual)

    def __len__(self) -> int:
        return len(self._by_virtual)

    def unwrap(self, data: bytes, src: Address) -> tuple[bytes, Address] | None:
        """(inner packet, virtual address) of a relay packet from our relay; None
        (counted) for an unknown token or a packet not from that channel's relay."""
        decoded = decode_relay(data)
        if decoded is None:
            self.counts["dropped.malformed"] += 1
            return None
        token, inner = decoded
        end = self._by_token.get(token)
        if end is None:
            self.counts["dropped.unknown_token"] += 1
            return None
        if src != end.relay:
            self.counts["dropped.wrong_source"] += 1
            return None
        return inner, end.virtual

    def wrap(self, data: bytes, virtual: Address) -> tuple[bytes, Address] | None:
        end = self._by_virtual.get(virtual)
        if end is None:
            return None
        return encode_relay(end.token, data), end.relay
