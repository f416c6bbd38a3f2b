"""Path MTU probing: whether a connection's path carries datagrams larger than the
configured ``max_udp_payload_bytes`` (1452: a 1500-byte MTU), and if so which.

Why. aioquic's packet path costs a roughly fixed amount of Python per packet, so a QUIC
connection's throughput is set by packets per second, not bytes: on loopback, 16 KB
datagrams move about six times the bytes of 1452-byte ones for the same CPU
(docs/wire.md). Loopback (daemons on one machine, the demo, a swarm sharing one GPU) and
LANs with jumbo frames carry such datagrams; the internet does not. QUIC must not send
datagrams that get fragmented (RFC 9000 §14), so a larger size is used only once a probe
of that size, sent with fragmentation forbidden, has crossed the path and been
acknowledged: datagram packetization layer PMTU discovery (RFC 8899), reduced to what
we need (a few fixed candidates, tried once per connection, largest first).

How. After a connection is authenticated, each end probes its own sending direction
(paths may differ each way). A probe is a non-QUIC datagram on the node's QUIC port
(told apart by its first byte, as relay and punch packets are), padded to the size it
tests and sent with the don't-fragment bit (Linux ``IP_PMTUDISC_PROBE``: DF set, the
kernel's cached path MTU ignored; a probe larger than the outgoing interface's MTU fails
locally with EMSGSIZE, which counts as lost). The peer answers with a 26-byte
acknowledgement carrying the probe's nonce and size, and only to the address of one of
its authenticated connections: an unknown source gets nothing, and what it does get is
far smaller than what it sent (no amplification). A probe not acknowledged within its
timeout is lost; after ``attempts`` losses the next smaller candidate is tried. Probes
are outside QUIC's congestion control and its loss accounting: a lost probe is not
congestion (RFC 8899 §4.1).

Black holes (RFC 8899 §4.3). A size found once may stop crossing later: the path moved
onto a route with a smaller MTU, and nothing says so (routers drop what is too big, ICMP
is filtered). Every larger packet is then lost while small ones may still cross: requests
stall until the connection is declared dead (``dead_peer_timeout_s``, only once nothing
at all comes back) and redialled, failing every exchange on it, or until each request
times out. So once a larger size is in use it is confirmed with a probe of that size
every ``mtu_confirm_interval_s``, and within a second of any sign of trouble (a packet
declared lost, a probe timeout without an acknowledgement, a hint from the peer). A
confirmation sends a probe of the size in use and, if it is lost, one of the configured
base size; the size is kept as soon as its probe is acknowledged. The path is taken for
a black hole only when ``attempts`` attempts in a row lost the larger probe while the
base one crossed (a path that answers neither is down or congested, not shrunk: nothing
changes, and the connection's own timeouts deal with it). The base-size probe, sent only
after a larger one was lost, is also the hint: the peer confirms its own direction
within a second, as routes often shrink both ways (without it the peer would find out
only once its next large packets were lost, with whatever they carried).

Then the connection goes back to the base size: packets in flight that were larger are
re-sent at once in smaller ones (stream data survives on the same connection), FEC
transfers whose symbols no longer fit stop (a request whose own transfer stopped is sent
again by the endpoint, as its handler never ran; a response's fails its exchange), and
larger sizes are probed for again after ``mtu_research_s``, doubling each time.

This module holds the wire format and :class:`MtuSearch` and :class:`MtuWatch`, the
decisions without I/O; quic_socket.py sends and answers probes, connections.py runs the
search and the watch of each connection.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Final

__all__ = [
    "MTU_ACK_BYTE",
    "MTU_ACK_BYTES",
    "MTU_NONCE_BYTES",
    "MTU_PROBE_BYTE",
    "MtuSearch",
    "MtuWatch",
    "Verdict",
    "decode_mtu_ack",
    "decode_mtu_probe",
    "encode_mtu_ack",
    "encode_mtu_probe",
]

# Non-QUIC datagrams are told apart by their first byte (relay.is_quic): relay 0x21,
# punch 0x22, observer probe 0x23 (traversal_wire.py).
MTU_PROBE_BYTE: Final[int] = 0x24
MTU_ACK_BYTE: Final[int] = 0x25
MTU_NONCE_BYTES: Final[int] = 16
_SIZE = struct.Struct("!I")
_PROBE_HEADER_BYTES: Final[int] = 1 + MTU_NONCE_BYTES + _SIZE.size
MTU_ACK_BYTES: Final[int] = 1 + MTU_NONCE_BYTES + _SIZE.size + 5  # padded: 26 bytes
MIN_PROBE_BYTES: Final[int] = 1200  # RFC 9000 §14: every path carries this much
MAX_PROBE_BYTES: Final[int] = 65527  # 65535 less the UDP header


def _fields(kind: int, nonce: bytes, size: int) -> bytes:
    """The kind byte, nonce and size that start a probe and its acknowledgement."""
    if len(nonce) != MTU_NONCE_BYTES:
        raise ValueError(f"a probe nonce is {MTU_NONCE_BYTES} bytes")
    if not MIN_PROBE_BYTES <= size <= MAX_PROBE_BYTES:
        raise ValueError(f"a probe is {MIN_PROBE_BYTES}-{MAX_PROBE_BYTES} bytes, not {size}")
    return bytes([kind]) + nonce + _SIZE.pack(size)


def encode_mtu_probe(nonce: bytes, size: int) -> bytes:
    """A probe datagram of exactly ``size`` bytes (header, then zeros)."""
    header = _fields(MTU_PROBE_BYTE, nonce, size)
    return header + bytes(size - len(header))


def decode_mtu_probe(data: bytes) -> tuple[bytes, int] | None:
    """(nonce, size) of a probe whose length is the size it claims; None for anything
    else."""
    if len(data) < max(_PROBE_HEADER_BYTES, MIN_PROBE_BYTES) or data[0] != MTU_PROBE_BYTE:
        return None
    (size,) = _SIZE.unpack_from(data, 1 + MTU_NONCE_BYTES)
    if size != len(data) or size > MAX_PROBE_BYTES:
        return None
    return bytes(data[1 : 1 + MTU_NONCE_BYTES]), size


def encode_mtu_ack(nonce: bytes, size: int) -> bytes:
    """The acknowledgement of the probe ``nonce`` of ``size`` bytes."""
    body = _fields(MTU_ACK_BYTE, nonce, size)
    return body + bytes(MTU_ACK_BYTES - len(body))


def decode_mtu_ack(data: bytes) -> tuple[bytes, int] | None:
    """(nonce, size) of an acknowledgement; None for anything else."""
    if len(data) != MTU_ACK_BYTES or data[0] != MTU_ACK_BYTE:
        return None
    (size,) = _SIZE.unpack_from(data, 1 + MTU_NONCE_BYTES)
    if not MIN_PROBE_BYTES <= size <= MAX_PROBE_BYTES:
        return None
    return bytes(data[1 : 1 + MTU_NONCE_BYTES]), size


class MtuSearch:
    """Which sizes to probe on one path, largest first, and the size to use once done.

    ``current`` is the size in use (the configured ``max_udp_payload_bytes``); only
    ``candidates`` above it are tried, each up to ``attempts`` times."""

    def __init__(self, current: int, candidates: Sequence[int], attempts: int = 3) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.size = current
        self._left = sorted((c for c in set(candidates) if c > current), reverse=True)
        self._attempts = attempts
        self._lost = 0

    @property
    def done(self) -> bool:
        return not self._left

    def next_probe(self) -> int | None:
        """The size to probe next; None once the search is over."""
        return self._left[0] if self._left else None

    def on_acked(self, size: int) -> None:
        """A probe of ``size`` was acknowledged: it is the size to use; the search ends."""
        if self._left and size == self._left[0]:
            self.size = size
            self._left.clear()

    def on_lost(self, size: int) -> None:
        """A probe of ``size`` was not acknowledged in time (or could not be sent)."""
        if not self._left or size != self._left[0]:
            return
        self._lost += 1
        if self._lost >= self._attempts:
            self._left.pop(0)
            self._lost = 0


class Verdict(enum.Enum):
    """What one confirmation attempt (a probe of the size in use, then one of the base
    size) says about the path."""

    KEEP = "keep"  # the size in use was acknowledged: it still crosses
    AGAIN = "again"  # only the base size crossed: evidence of a black hole, try again
    LOWER = "lower"  # only the base size crossed, ``attempts`` times in a row
    UNDECIDED = "undecided"  # neither crossed: the path is down or congested, not shrunk


class MtuWatch:
    """When to confirm a size in use, and what the answers mean (RFC 8899 §4.3).

    ``due`` is asked every tick with the connection's loss counters: a confirmation is due
    ``interval`` seconds after the last one, or ``min_gap`` seconds after it when packets
    were declared lost since, or a probe timeout is running (nothing sent lately was
    acknowledged), or the peer hinted at trouble (:meth:`hint`). ``attempt`` takes the
    answers of one attempt."""

    def __init__(
        self, now: float, packets_lost: int, *, interval: float, min_gap: float = 1.0,
        attempts: int = 3,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.interval = interval
        self.min_gap = min_gap
        self.attempts = attempts
        self._since = now
        self._lost = packets_lost
        self._evidence = 0
        self._hinted = False

    def hint(self) -> None:
        """The peer sent a probe of the base size, which it does only after its own larger
        probe was lost: the route may have shrunk both ways, so confirm (as on loss)."""
        self._hinted = True

    def due(self, now: float, packets_lost: int, pto_count: int) -> bool:
        waited = now - self._since
        if waited >= self.interval:
            return True
        trouble = packets_lost > self._lost or pto_count > 0 or self._hinted
        return trouble and waited >= self.min_gap

    def attempt(self, now: float, packets_lost: int, size_acked: bool,
                base_acked: bool) -> Verdict:
        """The answers of one attempt; after KEEP, UNDECIDED and LOWER the next
        confirmation is counted from ``now`` (and losses from ``packets_lost``)."""
        if size_acked:
            verdict = Verdict.KEEP
        elif not base_acked:
            verdict = Verdict.UNDECIDED
        else:
            self._evidence += 1
            if self._evidence < self.attempts:
                return Verdict.AGAIN
            verdict = Verdict.LOWER
        self._evidence = 0
        self._hinted = False
        self._since = now
        self._lost = packets_lost
        return verdict
