"""Which addresses a node announces, and how to reach a peer from its record.

A node bound to all addresses (``0.0.0.0``) must never announce loopback to other hosts:
before any peer has told it its public address (reachability.py), it announces the
interface address it would use toward the swarm (the source address of the route to a
known peer), else its first non-loopback interface address; loopback only on a machine
that has nothing else. Once peers have observed it, it announces what they see.

:func:`peer_address` turns a peer's record into the transport's :class:`PeerAddress`: its
announced address, or its LAN address when it sits behind the same public address as we do
(home routers rarely hairpin), with its reachability and rendezvous for NAT traversal.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from ...transport.endpoint import PeerAddress
from .records import QuicAddress, Reach, ServerRecord

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces that are up, loopback last (Linux ioctl;
    an empty list where interfaces cannot be listed)."""
    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address, or down
                continue
            host = socket.inet_ntoa(reply[20:24])
            if host not in found:
                found.append(host)
    return sorted(found, key=is_loopback)


def route_source(host: str) -> str | None:
    """The local address this host sends from toward ``host`` (a connected UDP socket: no
    packet leaves), None when there is no route or ``host`` is not an IPv4 address."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def local_hosts(bound: str, toward: list[str]) -> list[str]:
    """The hosts to announce before any peer observed us: ``bound`` when it is a specific
    address; for a wildcard bind, the route source toward the first of ``toward`` that has
    one, then the other interface addresses, never loopback unless there is nothing else."""
    if not is_wildcard(bound):
        return [bound]
    hosts: list[str] = []
    for host in toward:
        source = route_source(host)
        if source is not None and not is_loopback(source):
            hosts.append(source)
            break
    hosts += [h for h in interface_addresses() if h not in hosts and not is_loopback(h)]
    return hosts or ["127.0.0.1"]


def dialable(reach: Reach | None) -> bool:
    """Whether others can dial a peer announcing ``reach``. Not measured (no reach, or an
    unknown NAT and no rendezvous: a first node has nobody to ask) counts as yes; a peer that
    names a rendezvous was measured unreachable, even when it could not tell its NAT's kind."""
    if reach is None or reach.reachable:
        return True
    return reach.nat == "unknown" and reach.rendezvous is None


def peer_address(record: ServerRecord, own_public_host: str | None = None) -> PeerAddress | None:
    """How to reach the peer of ``record`` (see the module docstring); None without an
    announced QUIC address."""
    quic = record.quic
    if quic is None:
        return None
    reach = record.reach
    if reach is None:  # announced by hand or not measured: dial what it announces
        return PeerAddress(record.peer_id, quic.host, quic.port)
    if own_public_host is not None and quic.host == own_public_host and reach.lan:
        lan: QuicAddress = reach.lan[0]
        return PeerAddress(record.peer_id, lan.host, lan.port)
    rendezvous = None
    if reach.rendezvous is not None:
        ref = reach.rendezvous
        rendezvous = PeerAddress(ref.peer_id, ref.quic.host, ref.quic.port)
    return PeerAddress(
        record.peer_id,
        quic.host,
        quic.port,
        reachable=dialable(reach),
        rendezvous=rendezvous,
    )


__all__ = [
    "dialable",
    "interface_addresses",
    "is_loopback",
    "is_wildcard",
    "local_hosts",
    "peer_address",
    "route_source",
]
