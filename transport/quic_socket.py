"""The node's QUIC port: one UDP socket for every connection, both directions.

:class:`QuicSocket` accepts incoming connections and makes outgoing ones from the same
port, demultiplexing packets by destination connection id, so that a peer is always
reached at the address it announces. Each connection is a :class:`~.quic_link.QuicLink`;
the socket only routes packets to links, answers unknown QUIC versions (RFC 9000 §6) and
caps the connections it holds: incoming ones (all, per source address, and those still
unauthenticated, all and per address) apart from outgoing ones, so that a flood of
incoming connections never blocks our own connects. While the unauthenticated pool is
under pressure (``retry``), a new connection first gets a QUIC Retry (RFC 9000 §8.1.2):
only a client that receives at its address and echoes the token gets a slot.

The same port carries NAT traversal's non-QUIC datagrams (relay.py), told apart by their
first byte: punch packets are dropped (they only opened a NAT mapping on the way), relay
packets go to the relay table when we relay for others (``relay``), else to the channels
we are an end of (``relay_ends``), whose inner packets reach QUIC as coming from the
channel's virtual address; what QUIC sends to a virtual address is wrapped and sent to
that channel's relay. Relayed connections send packets smaller by the relay header.
Path MTU probes and their acknowledgements (path_mtu.py) share the port too: a probe is
answered only toward the address of an authenticated connection, and is sent with
fragmentation forbidden.

:class:`ProbePort` is an observer's alternate port (traversal_wire.py): a second UDP socket
on the same host that only records where probe packets come from and never sends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from aioquic.buffer import Buffer
from aioquic.quic.packet import (
    QuicHeader,
    QuicPacketType,
    encode_quic_retry,
    encode_quic_version_negotiation,
    pull_quic_header,
)
from aioquic.quic.retry import QuicRetryTokenHandler

from .config import TransportConfig
from .errors import AuthenticationError, ConnectError
from .identity import Identity
from .path_mtu import (
    MTU_ACK_BYTE,
    MTU_NONCE_BYTES,
    MTU_PROBE_BYTE,
    decode_mtu_ack,
    decode_mtu_probe,
    encode_mtu_ack,
    encode_mtu_probe,
)
from .quic_config import CID_LENGTH, CreditedConnection, ServerConnection, build_configuration
from .quic_link import Address, CloseCode, QuicLink
from .relay import (
    PUNCH_BYTE,
    RELAY_BYTE,
    RELAY_HEADER_BYTES,
    RelayEnds,
    RelayTable,
    encode_punch,
    is_quic,
    is_virtual,
)
from .traversal_wire import ProbeTable, decode_probe, encode_probe
from .upload_limit import UploadLimiter

__all__ = ["ProbePort", "QuicSocket"]

_MTU_PROBE_PREFIX = bytes([MTU_PROBE_BYTE])

logger = logging.getLogger(__name__)

MIN_INITIAL_BYTES = 1200  # RFC 9000 §14.1: a client's Initial datagram is padded to this
MAX_MTU_PROBES = 64  # our probes awaiting their acknowledgement, at most
MTU_ACKS_PER_S = 20.0  # acknowledgements we send, at most (a burst of as many)
# Linux: set DF and ignore the cached path MTU, for this socket's sends (<linux/in.h>)
_IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
_IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
_PMTUDISC_PROBE = 3


class _Receiver(Protocol):
    def datagram_received(self, data: bytes, addr: Address) -> None: ...


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, owner: _Receiver) -> None:
        self._owner = owner
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._owner.datagram_received(data, (addr[0], addr[1]))
        except Exception:  # one packet must never take the socket down
            logger.exception("dropped a packet from %s that raised", addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("UDP socket error: %s", exc)


class QuicSocket:
    """The node's QUIC port. ``on_accept`` gets each incoming connection as soon as it
    exists (before TLS completes); :meth:`connect` makes outgoing ones."""

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        on_accept: Callable[[QuicLink], None],
    ) -> None:
        self.identity = identity
        self.config = config
        self._on_accept = on_accept
        self._server_config = build_configuration(identity, config, is_client=False)
        self._client_config = build_configuration(identity, config, is_client=True)
        # relayed connections: the inner packet plus the relay header fits one datagram
        relayed_udp_payload = max(
            MIN_INITIAL_BYTES, config.max_udp_payload_bytes - RELAY_HEADER_BYTES
        )
        relayed = config.model_copy(update={"max_udp_payload_bytes": relayed_udp_payload})
        self._relayed_server_config = build_configuration(identity, relayed, is_client=False)
        self._relayed_client_config = build_configuration(identity, relayed, is_client=True)
        self.relay: RelayTable | None = None  # set when we relay for others
        self.relay_ends = RelayEnds()
        self.counts: Counter[str] = Counter()
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Protocol | None = None
        self._family = socket.AF_INET
        self._by_cid: dict[bytes, QuicLink] = {}
        self._links: set[QuicLink] = set()
        self.accepting = True
        self.address: Address = ("", 0)
        self._retry = QuicRetryTokenHandler()  # a fresh key per socket: tokens live 30 s
        # transport.upload_limit_mbps: every datagram we send goes through it (None: no limit)
        self._upload = UploadLimiter.from_mbps(config.upload_limit_mbps, self._send_now)
        self._warned = 0
        # path MTU probes we sent: nonce -> (address, size, its acknowledgement)
        self._mtu_probes: dict[bytes, tuple[Address, int, asyncio.Future[None]]] = {}
        self._mtu_ack_credit = MTU_ACKS_PER_S
        self._mtu_ack_at = 0.0
        # told of a probe of the base size from a connection's address (path_mtu.py)
        self.on_mtu_hint: Callable[[Address], None] | None = None

    @property
    def links(self) -> list[QuicLink]:
        return list(self._links)

    async def start(self, host: str, port: int) -> None:
        self._transport, self._protocol, self._family, self.address = await _bind(
            self, host, port, self.config.socket_buffer_bytes
        )

    def sendto(self, data: bytes, addr: Address) -> None:
        if is_virtual(addr):
            wrapped = self.relay_ends.wrap(data, addr)
            if wrapped is None:  # the channel is gone: QUIC sees it as loss
                return
            data, addr = wrapped
        if self._upload is not None:
            self._upload.sendto(data, addr)
        else:
            self._send_now(data, addr)

    def _send_now(self, data: bytes, addr: Address) -> None:
        if self._transport is not None and not self._transport.is_closing():
            if data[:1] == _MTU_PROBE_PREFIX:
                self._send_unfragmented(data, addr)
            else:
                self._transport.sendto(data, addr)

    def _send_unfragmented(self, data: bytes, addr: Address) -> None:
        """A path MTU probe, sent with fragmentation forbidden: it arrives whole or not at
        all (too big for the outgoing interface: EMSGSIZE, reported to error_received).
        Where the socket option is missing, or the datagram could not leave at once (the
        option would be off again by the time it does), the probe is given up."""
        transport = self._transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        levels = [(socket.IPPROTO_IP, _IP_MTU_DISCOVER)]
        if self._family == socket.AF_INET6:
            levels.append((socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER))
        try:
            before = [sock.getsockopt(level, option) for level, option in levels]
            for level, option in levels:
                sock.setsockopt(level, option, _PMTUDISC_PROBE)
        except (OSError, AttributeError):
            self._mtu_probe_failed(data)
            return
        try:
            transport.sendto(data, addr)
            # asyncio's and uvloop's datagram transports buffer what the kernel refused
            buffered: Callable[[], int] = getattr(transport, "get_write_buffer_size", lambda: 0)
            if buffered():
                self._mtu_probe_failed(data)
        finally:
            for (level, option), value in zip(levels, before, strict=True):
                sock.setsockopt(level, option, value)

    async def probe_mtu(self, addr: Address, size: int, timeout: float) -> bool:
        """Whether a probe of ``size`` bytes to ``addr`` is acknowledged within ``timeout``
        (path_mtu.py)."""
        if len(self._mtu_probes) >= MAX_MTU_PROBES or self._transport is None:
            return False
        nonce = os.urandom(MTU_NONCE_BYTES)
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._mtu_probes[nonce] = (addr, size, acked)
        try:
            self.sendto(encode_mtu_probe(nonce, size), addr)
            self.counts["mtu_probe.sent"] += 1
            async with asyncio.timeout(timeout):
                await acked
            self.counts["mtu_probe.acked"] += 1
            return True
        except (TimeoutError, ConnectionError):
            return False
        finally:
            self._mtu_probes.pop(nonce, None)

    def _mtu_probe_failed(self, data: bytes) -> None:
        entry = self._mtu_probes.get(bytes(data[1 : 1 + MTU_NONCE_BYTES]))
        if entry is not None and not entry[2].done():
            entry[2].set_exception(ConnectionError("the probe could not be sent unfragmented"))

    def punch(self, addr: Address, count: int, interval: float, nonce: bytes) -> None:
        """Send ``count`` punch packets to ``addr``, ``interval`` s apart (the first now):
        each opens or refreshes our NAT's mapping toward it."""
        packet = encode_punch(nonce)
        loop = asyncio.get_running_loop()
        for i in range(count):
            loop.call_later(i * interval, self.sendto, packet, addr)
        self.counts["punch.sent"] += count

    def probe(self, addr: Address, count: int, interval: float, nonce: bytes) -> None:
        """Send ``count`` probe packets to ``addr`` (an observer's :class:`ProbePort`),
        ``interval`` s apart (the first now)."""
        packet = encode_probe(nonce)
        loop = asyncio.get_running_loop()
        for i in range(count):
            loop.call_later(i * interval, self.sendto, packet, addr)
        self.counts["probe.sent"] += count

    def register_cid(self, cid: bytes, link: QuicLink) -> None:
        self._by_cid[cid] = link

    def unregister_cid(self, cid: bytes) -> None:
        self._by_cid.pop(cid, None)

    def forget(self, link: QuicLink) -> None:
        self._links.discard(link)
        for cid in [c for c, other in self._by_cid.items() if other is link]:
            del self._by_cid[cid]

    def datagram_received(self, data: bytes, addr: Address) -> None:
        if not is_quic(data):
            self._traversal_datagram(data, addr)
        else:
            self._quic_datagram(data, addr)

    def _quic_datagram(self, data: bytes, addr: Address) -> None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return
        versions = self._server_config.supported_versions
        if (
            header.packet_type != QuicPacketType.VERSION_NEGOTIATION
            and header.version is not None
            and header.version not in versions
        ):  # RFC 9000 §6, never in answer to a version negotiation packet
            self.sendto(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=versions,
                ),
                addr,
            )
            return
        link = self._by_cid.get(header.destination_cid)
        if link is None:
            if (
                not self.accepting
                or header.packet_type != QuicPacketType.INITIAL
                or len(data) < MIN_INITIAL_BYTES
            ):
                return
            link = self._admit_initial(header, addr)
            if link is None:
                return
        link.datagram_received(data, addr)

    def _admit_initial(self, header: QuicHeader, addr: Address) -> QuicLink | None:
        """A new connection for a client's first Initial, a Retry in its place (the
        address not yet validated while unauthenticated slots are under pressure), or
        None (dropped: over a cap, or a token that is not ours for this address)."""
        odcid: bytes = header.destination_cid
        retry_scid: bytes | None = None
        if header.token and not is_virtual(addr):
            try:
                odcid = self._retry.validate_token(
                    address=addr, destination_cid=header.destination_cid,
                    token=header.token, now=asyncio.get_running_loop().time(),
                )
            except ValueError:
                self.counts["retry.bad_token"] += 1
                return None
            retry_scid = header.destination_cid
        elif self._wants_retry(addr) and header.version is not None:
            scid = os.urandom(CID_LENGTH)
            token = self._retry.create_token(
                address=addr, original_destination_connection_id=header.destination_cid,
                retry_source_connection_id=scid, now=asyncio.get_running_loop().time(),
            )
            self.sendto(
                encode_quic_retry(
                    version=header.version, source_cid=scid,
                    destination_cid=header.source_cid,
                    original_destination_cid=header.destination_cid, retry_token=token,
                ),
                addr,
            )
            self.counts["retry.sent"] += 1
            return None
        return self._accept(header.destination_cid, addr, odcid, retry_scid)

    def _wants_retry(self, addr: Address) -> bool:
        """Whether a new connection from ``addr`` must first echo a Retry token."""
        if is_virtual(addr):  # a relay channel: its relay checked the path already
            return False
        mode = self.config.retry
        if mode == "never":
            return False
        if mode == "always":
            return True
        pressure = self.config.retry_pressure * self.config.max_unauthenticated
        return self._count_incoming()[1] >= pressure

    def _count_incoming(self, host: str | None = None) -> tuple[int, int]:
        """(incoming connections, those still unauthenticated), all or from ``host``."""
        total = unauthenticated = 0
        for link in self._links:
            if link.is_client or (host is not None and link.remote_address[0] != host):
                continue
            total += 1
            if link.peer_id is None:
                unauthenticated += 1
        return total, unauthenticated

    def _traversal_datagram(self, data: bytes, addr: Address) -> None:
        """A relay or punch packet (relay.py); anything else that is not QUIC is dropped."""
        kind = data[0] if data else -1
        if kind == RELAY_BYTE:
            relay = self.relay
            if relay is not None and relay.owns(data):
                forwarded = relay.forward(data, addr, asyncio.get_running_loop().time())
                if forwarded is not None:
                    self.sendto(*forwarded)
                return
            unwrapped = self.relay_ends.unwrap(data, addr)
            if unwrapped is not None and is_quic(unwrapped[0]):  # one level of relaying
                self._quic_datagram(*unwrapped)
        elif kind == PUNCH_BYTE:
            self.counts["punch.received"] += 1
        elif kind == MTU_PROBE_BYTE:
            self._answer_mtu_probe(data, addr)
        elif kind == MTU_ACK_BYTE:
            self._take_mtu_ack(data, addr)
        else:
            self.counts["dropped.not_quic"] += 1

    def _answer_mtu_probe(self, data: bytes, addr: Address) -> None:
        """Acknowledge a path MTU probe: only toward an authenticated connection's address,
        at most MTU_ACKS_PER_S a second; an acknowledgement is far smaller than a probe."""
        now = asyncio.get_running_loop().time()
        self._mtu_ack_credit = min(
            MTU_ACKS_PER_S, self._mtu_ack_credit + (now - self._mtu_ack_at) * MTU_ACKS_PER_S
        )
        self._mtu_ack_at = now
        if self._mtu_ack_credit < 1.0:  # every probe looked at is paid for: bounded work
            self.counts["mtu_probe.ignored"] += 1
            return
        self._mtu_ack_credit -= 1.0
        probe = decode_mtu_probe(data)
        if probe is None or not any(
            link.remote_address == addr and link.peer_id is not None and not link.is_closed
            for link in self._links
        ):
            self.counts["mtu_probe.ignored"] += 1
            return
        self.counts["mtu_probe.answered"] += 1
        self.sendto(encode_mtu_ack(*probe), addr)
        if probe[1] <= self.config.max_udp_payload_bytes and self.on_mtu_hint is not None:
            # a probe of the base size follows a lost larger one (path_mtu.py): a hint
            self.on_mtu_hint(addr)

    def _take_mtu_ack(self, data: bytes, addr: Address) -> None:
        ack = decode_mtu_ack(data)
        entry = None if ack is None else self._mtu_probes.get(ack[0])
        if ack is None or entry is None or entry[0] != addr or entry[1] != ack[1]:
            self.counts["mtu_ack.ignored"] += 1
            return
        if not entry[2].done():
            entry[2].set_result(None)

    def _accept(
        self, dcid: bytes, addr: Address, odcid: bytes, retry_scid: bytes | None
    ) -> QuicLink | None:
        """An incoming connection, unless a cap is reached: incoming connections
        (``max_connections``; outgoing ones are not counted), unauthenticated ones, and
        both from one source address."""
        cfg = self.config
        total, unauthenticated = self._count_incoming()
        on_host, unauthenticated_on_host = self._count_incoming(addr[0])
        refused = (
            "incoming connections" if total >= cfg.max_connections
            else "unauthenticated connections" if unauthenticated >= cfg.max_unauthenticated
            else "connections from this host" if on_host >= cfg.max_connections_per_host
            else "unauthenticated connections from this host"
            if unauthenticated_on_host >= cfg.max_unauthenticated_per_host
            else None
        )
        if refused is not None:
            self.counts["refused.caps"] += 1
            if self._warned < 10:  # a flood must not flood the log too
                self._warned += 1
                logger.warning("ignoring a new connection from %s: too many %s", addr, refused)
            return None
        relayed = is_virtual(addr)
        quic = ServerConnection(
            configuration=self._relayed_server_config if relayed else self._server_config,
            original_destination_connection_id=odcid,
            retry_source_connection_id=retry_scid,
        )
        link = QuicLink(self, quic, addr, is_client=False)
        if relayed:
            link.path = "relayed"
        self._links.add(link)
        self._by_cid[dcid] = link
        self._by_cid[quic.host_cid] = link
        self._on_accept(link)
        return link

    async def connect(self, host: str, port: int, *, timeout: float | None = None) -> QuicLink:
        """A new connection to ``host:port`` (a relay channel's virtual address included)
        once QUIC/TLS completed (deadline: ``timeout``, default ``connect_timeout_s``).
        The caller checks ``tls_peer_id`` and authenticates."""
        if self._transport is None:
            raise ConnectError("QUIC socket not started")
        outgoing = sum(1 for link in self._links if link.is_client)
        if outgoing >= self.config.max_outgoing_connections:
            raise ConnectError("too many outgoing connections")
        relayed = is_virtual((host, port))
        if relayed:
            if self.relay_ends.get((host, port)) is None:
                raise ConnectError(f"no relay channel {host}:{port}")
            addr: Address = (host, port)
        else:
            addr = await self._resolve(host, port)
        quic = CreditedConnection(
            configuration=self._relayed_client_config if relayed else self._client_config
        )
        link = QuicLink(self, quic, addr, is_client=True)
        self._links.add(link)
        self._by_cid[quic.host_cid] = link
        quic.connect(addr, now=asyncio.get_running_loop().time())
        link.transmit()
        try:
            async with asyncio.timeout(timeout or self.config.connect_timeout_s):
                await link.handshake_done
        except TimeoutError:
            link.abandon(CloseCode.NO_ERROR, "handshake timed out")
            raise ConnectError(f"QUIC handshake with {host}:{port} timed out") from None
        except AuthenticationError:
            link.abandon(CloseCode.AUTH_FAILED, "unacceptable TLS peer")
            raise
        return link

    async def _resolve(self, host: str, port: int) -> Address:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot resolve {host}:{port}: {exc!r}") from exc
        for family, _, _, _, sockaddr in infos:
            if family == self._family:
                return (str(sockaddr[0]), int(sockaddr[1]))
            if family == socket.AF_INET and self._family == socket.AF_INET6:
                return ("::ffff:" + str(sockaddr[0]), int(sockaddr[1]))
        raise ConnectError(f"{host}:{port} has no address our socket can reach")

    async def close(self, timeout: float) -> None:
        """Stop accepting, close every connection, wait (bounded) for the closes to go."""
        self.accepting = False
        links = list(self._links)
        for link in links:
            link.close(CloseCode.SHUTDOWN, "endpoint closing")
        if links:
            waits = [asyncio.ensure_future(link.wait_closed()) for link in links]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for waiter in pending:
                waiter.cancel()
        for link in list(self._links):
            link.abandon(CloseCode.SHUTDOWN, "endpoint closed")
        if self._upload is not None:
            self._upload.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._protocol is not None:  # the port is free once the socket is closed
            await asyncio.wait([self._protocol.lost], timeout=timeout)


class ProbePort:
    """An observer's alternate port: records the source address of each probe packet
    (traversal_wire.py) in a bounded, expiring table, for :meth:`wait` to look up.

    It never sends anything, so it can neither reflect nor amplify; anything that is not a
    probe packet is dropped and counted. ``max_waits`` bounds the lookups waiting at once.
    """

    def __init__(self, max_entries: int = 1024, ttl_s: float = 30.0, max_waits: int = 64) -> None:
        self.table = ProbeTable(max_entries, ttl_s)
        self.max_waits = max_waits
        self.counts: Counter[str] = Counter()
        self.address: Address = ("", 0)
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Protocol | None = None
        self._waiters: dict[bytes, asyncio.Future[Address | None]] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def start(self, host: str) -> None:
        """Bind a free port on ``host`` (the QUIC socket's bound host)."""
        self._transport, self._protocol, _, self.address = await _bind(self, host, 0, 1 << 16)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        nonce = decode_probe(data)
        if nonce is None:
            self.counts["dropped.not_probe"] += 1
            return
        self.counts["received"] += 1
        now = asyncio.get_running_loop().time()
        waiter = self._waiters.get(nonce)
        if waiter is not None:  # a lookup is waiting for it: answer it at once
            if not waiter.done():
                waiter.set_result(addr)
        elif not self.table.record(nonce, addr, now):
            self.counts["duplicate"] += 1

    async def wait(self, nonce: bytes, timeout: float) -> Address | None:
        """The source of the probe packets with ``nonce`` (waiting up to ``timeout`` s for
        the first to arrive); None if none came. ValueError if ``max_waits`` lookups are
        already waiting, or one for this nonce."""
        loop = asyncio.get_running_loop()
        seen = self.table.take(nonce, loop.time())
        if seen is not None:
            return seen
        if len(self._waiters) >= self.max_waits or nonce in self._waiters:
            raise ValueError("too many probe lookups waiting")
        waiter = self._waiters[nonce] = loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            return None
        finally:
            del self._waiters[nonce]

    async def close(self, timeout: float) -> None:
        for waiter in self._waiters.values():  # lookups under way answer "none came"
            if not waiter.done():
                waiter.set_result(None)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._protocol is not None:
            await asyncio.wait([self._protocol.lost], timeout=timeout)


async def _bind(
    owner: _Receiver, host: str, port: int, buffer_bytes: int
) -> tuple[asyncio.DatagramTransport, _Protocol, socket.AddressFamily, Address]:
    """A UDP socket bound to ``host:port`` (dual-stack for IPv6 hosts) whose datagrams go
    to ``owner``: (transport, protocol, family, bound address)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
        sock.bind((host, port))
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _Protocol(owner), sock=sock
        )
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot bind UDP {host}:{port}: {exc}") from exc
    bound = sock.getsockname()
    return transport, protocol, family, (str(bound[0]), int(bound[1]))
