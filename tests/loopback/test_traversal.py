"""NAT traversal over real QUIC on 127.0.0.1: observed address, dial-back, connection
reversal, hole punching and relaying, with home routers' inbound filtering emulated on the
sockets (:class:`InboundFilter`, which test_traversal_hostile.py uses too)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from wanswarm.transport.config import TransportConfig, TraversalConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.relay import RELAY_BYTE, is_virtual

from .quic_helpers import address, config, endpoint, run


class InboundFilter:
    """Address-and-port-dependent filtering, as a home router's NAT applies it: a datagram
    reaches the endpoint's socket only from an address the socket has sent to before.

    This is the filtering half of a NAT (docs/netlab.md: Linux's cone NAT filters this way);
    the lab tests (tests/lab) have real routers. ``dropped`` counts what it kept out.
    """

    def __init__(self, ep: Endpoint) -> None:
        sock = ep._connections.socket
        self.sent_to: set[tuple[str, int]] = set()
        self.dropped = 0
        self.dropped_from: set[tuple[str, int]] = set()
        send, receive = sock.sendto, sock.datagram_received

        def sendto(data: bytes, addr: tuple[str, int]) -> None:
            if not is_virtual(addr):
                self.sent_to.add(addr)
            elif (end := sock.relay_ends.get(addr)) is not None:
                self.sent_to.add(end.relay)
            send(data, addr)

        def datagram_received(data: bytes, addr: tuple[str, int]) -> None:
            if addr not in self.sent_to:
                self.dropped += 1
                self.dropped_from.add(addr)
                return
            receive(data, addr)

        sock.sendto = sendto  # type: ignore[method-assign]
        sock.datagram_received = datagram_received  # type: ignore[method-assign]


class Capture:
    """Every datagram an endpoint's socket sends, with its destination."""

    def __init__(self, ep: Endpoint) -> None:
        sock = ep._connections.socket
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        send = sock.sendto

        def sendto(data: bytes, addr: tuple[str, int]) -> None:
            self.sent.append((bytes(data), addr))
            send(data, addr)

        sock.sendto = sendto  # type: ignore[method-assign]


def behind(ep: Endpoint, rendezvous: Endpoint) -> PeerAddress:
    """``ep``'s address as an unreachable peer whose rendezvous is ``rendezvous``."""
    host, port = ep.address
    return PeerAddress(ep.peer_id, host, port, reachable=False, rendezvous=address(rendezvous))


async def _echo(request: Request) -> Response:
    return Response(
        header={"remote": list(request.remote), **request.header},
        tensors=[t * 2 for t in request.tensors],
    )


def _cfg(**traversal: Any) -> TransportConfig:
    fields: dict[str, Any] = {"punch_timeout_s": 5.0, "dialback_timeout_s": 1.0}
    fields.update(traversal)
    return config(traversal=TraversalConfig(**fields))


def _tensor(item: object) -> torch.Tensor:
    assert isinstance(item, torch.Tensor)
    return item


def test_observe_returns_the_requesters_socket_address() -> None:
    async def main() -> None:
        async with endpoint() as a, endpoint() as b:
            assert await a.observe(address(b), timeout=10) == a.address

    run(main())


def test_dial_back_true_when_listening_false_when_inbound_is_filtered() -> None:
    async def main() -> None:
        async with endpoint(_cfg()) as helper, endpoint() as open_, endpoint() as home:
            assert await open_.dial_back(address(helper), timeout=10) is True
            wall = InboundFilter(home)
            # the existing connection to helper works; a new port of helper's does not
            assert await home.observe(address(helper), timeout=10) == home.address
            assert await home.dial_back(address(helper), timeout=10) is False
            # it came from another port of the helper's, which the filter kept out
            assert wall.dropped > 0 and helper.address not in wall.dropped_from

    run(main())


def test_connection_reversal_when_the_requester_is_reachable() -> None:
    async def main() -> None:
        async with endpoint() as r, endpoint(_cfg()) as a, endpoint(_cfg()) as b:
            InboundFilter(b)
            b.register("echo", _echo)
            await b.keep(address(r), timeout=10)
            a.reachable = True
            reply = await a.request(behind(b, r), "echo", {"n": 1}, timeout=15)
            assert reply.header["n"] == 1
            assert a.paths()[b.peer_id] == "reversed"
            assert b.paths()[a.peer_id] == "reversed"
            # B made the connection: it is B's client link, and A's request came over it
            (link,) = [lk for lk in b._connections.links() if lk.peer_id == a.peer_id]
            assert link.is_client and tuple(reply.header["remote"]) == a.address

    run(main())


def test_hole_punching_when_both_sides_filter() -> None:
    async def main() -> None:
        async with endpoint() as r, endpoint(_cfg()) as a, endpoint(_cfg()) as b:
            InboundFilter(a)
            wall_b = InboundFilter(b)
            b.register("echo", _echo)
            await b.keep(address(r), timeout=10)
            reply = await a.request(behind(b, r), "echo", {"n": 2}, timeout=15)
            assert reply.header["n"] == 2
            assert a.paths()[b.peer_id] == "punched" and b.paths()[a.peer_id] == "punched"
            assert b._connections.socket.counts["punch.sent"] == 3
            assert a.peer_id not in {lk.peer_id for lk in b._connections.links() if lk.is_client}
            assert wall_b.sent_to >= {a.address, r.address}

    run(main())


def test_relay_carries_tensors_end_to_end_and_sees_only_ciphertext() -> None:
    async def main() -> None:
        no_punch = _cfg(punch_packets=0)
        async with endpoint() as r, endpoint(no_punch) as a, endpoint(no_punch) as b:
            InboundFilter(a)
            InboundFilter(b)
            b.register("echo", _echo)
            await b.keep(address(r), timeout=10)
            seen = Capture(r)
            marker = torch.arange(4096, dtype=torch.int32)  # stream payload: 16 KiB
            big = torch.randn(256, 256)  # 256 KiB: FEC datagrams, relayed too
            reply = await a.request(behind(b, r), "echo", {"n": 3}, [marker, big], timeout=30)
            assert torch.equal(_tensor(reply.tensors[0]), marker * 2)
            assert torch.equal(_tensor(reply.tensors[1]), big * 2)
            assert a.paths()[b.peer_id] == "relayed" and b.paths()[a.peer_id] == "relayed"
            # the identity handshake ran between A and B, through R
            (link,) = [lk for lk in a._connections.links() if lk.peer_id == b.peer_id]
            assert link.tls_peer_id == b.peer_id and reply.header["remote"][0].startswith("relay:")
            relayed = [data for data, _ in seen.sent if data[0] == RELAY_BYTE]
            forwarded = b"".join(relayed)
            assert len(forwarded) > big.nbytes + marker.nbytes
            for payload in (marker.numpy().tobytes(), (marker * 2).numpy().tobytes()):
                for at in range(0, len(payload) - 32, 997):
                    assert payload[at : at + 32] not in forwarded
            counts = r.traversal_counts()
            assert counts["relay.channels"] == 1 and counts["relay.forwarded"] == len(relayed)

    run(main())


def test_relay_bandwidth_bound_is_enforced() -> None:
    async def main() -> None:
        rate = 100_000.0
        relay_cfg = _cfg(relay_bytes_per_s=rate, relay_burst_bytes=16 * 1024)
        no_punch = _cfg(punch_packets=0)
        async with endpoint(relay_cfg) as r, endpoint(no_punch) as a, endpoint(no_punch) as b:
            InboundFilter(a)
            InboundFilter(b)
            b.register("echo", _echo)
            await b.keep(address(r), timeout=10)
            loop = asyncio.get_running_loop()
            start = loop.time()
            x = torch.randn(200 * 256)  # 200 KiB up, 200 KiB back
            reply = await a.request(behind(b, r), "echo", {}, [x], timeout=40)
            elapsed = loop.time() - start
            assert torch.equal(_tensor(reply.tensors[0]), x * 2)
            relay = r._traversal.relay
            assert relay is not None
            (channel,) = relay.channels
            assert channel.forwarded_bytes <= 16 * 1024 + rate * elapsed
            assert elapsed >= (2 * x.nbytes - 16 * 1024) / rate
            assert relay.counts["dropped.rate"] > 0

    run(main(), timeout=90)
