"""NAT traversal over real QUIC on 127.0.0.1: observed address and mapping, dial-back,
connection reversal, hole punching and relaying, with home routers' inbound filtering
emulated on the sockets (:class:`InboundFilter`, which test_traversal_hostile.py uses too)
and a symmetric NAT's per-destination mapping (:class:`PerDestinationMapping`)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from wanswarm.transport.config import TransportConfig, TraversalConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.identity import Identity
from wanswarm.transport.relay import RELAY_BYTE, is_virtual
from wanswarm.transport.traversal_wire import OBSERVE, OBSERVE_PROBE, encode_probe

from ..waiting import async_wait_for
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


class PerDestinationMapping:
    """The outbound half of a symmetric NAT: datagrams to the first destination leave from
    the endpoint's own socket, those to any other destination from a socket of their own
    (another source port, as a NAT that maps per destination gives them). Nothing comes
    back through the extra sockets: enough for an observer's alternate port, which never
    answers. ``ports`` maps each other destination to its source port."""

    def __init__(self, ep: Endpoint) -> None:
        sock = ep._connections.socket
        self.first: tuple[str, int] | None = None
        self.sockets: dict[tuple[str, int], socket.socket] = {}
        send = sock.sendto

        def sendto(data: bytes, addr: tuple[str, int]) -> None:
            if self.first is None:
                self.first = addr
            if addr == self.first or is_virtual(addr):
                send(data, addr)
                return
            out = self.sockets.get(addr)
            if out is None:
                out = self.sockets[addr] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                out.bind(("127.0.0.1", 0))
            out.sendto(data, addr)

        sock.sendto = sendto  # type: ignore[method-assign]

    @property
    def ports(self) -> dict[tuple[str, int], int]:
        return {addr: out.getsockname()[1] for addr, out in self.sockets.items()}

    def close(self) -> None:
        for out in self.sockets.values():
            out.close()


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


def _count_is(counts: Counter[str], key: str, n: int) -> Callable[[], bool]:
    return lambda: counts[key] == n


def _tensor(item: object) -> torch.Tensor:
    assert isinstance(item, torch.Tensor)
    return item


def test_observe_returns_the_requesters_socket_address() -> None:
    async def main() -> None:
        async with endpoint() as a, endpoint() as b:
            assert await a.observe(address(b), timeout=10) == a.address

    run(main())


def test_observe_mapping_sees_one_address_without_nat() -> None:
    async def main() -> None:
        async with endpoint() as a, endpoint() as b:
            seen, probed = await a.observe_mapping(address(b), timeout=10)
            assert seen == probed == a.address
            counts = b.traversal_counts()
            assert counts["probe_port.received"] >= 1
            assert a.traversal_counts()["socket.probe.sent"] == 3
            # the alternate port is one more port of b's host, opened once
            port = b._traversal.probe_port
            assert port is not None and port.address[0] == b.address[0]
            assert port.address[1] != b.address[1]
            assert await a.observe_mapping(address(b), timeout=10) == (a.address, a.address)
            assert b._traversal.probe_port is port

    run(main())


def test_observe_mapping_tells_a_per_destination_mapping() -> None:
    async def main() -> None:
        async with endpoint() as a, endpoint() as b:
            nat = PerDestinationMapping(a)
            try:
                seen, probed = await a.observe_mapping(address(b), timeout=10)
                assert seen == a.address
                port = b._traversal.probe_port
                assert port is not None
                assert probed == ("127.0.0.1", nat.ports[port.address])
                assert probed != seen
            finally:
                nat.close()

    run(main())


def test_observe_mapping_without_an_alternate_port_cannot_tell() -> None:
    async def main() -> None:
        async with endpoint(_cfg(probe_port=False)) as b, endpoint() as a, \
                endpoint(_cfg(probe_packets=0)) as c:
            assert await a.observe_mapping(address(b), timeout=10) == (a.address, None)
            assert b._traversal.probe_port is None
            # a lookup there is refused: there is nothing to look in
            with pytest.raises(RemoteError) as info:
                await a.request(address(b), OBSERVE_PROBE, {"nonce": "00" * 16}, timeout=10)
            assert info.value.code == "refused"
            # a requester that sends no probes does not ask
            assert await c.observe_mapping(address(a), timeout=10) == (c.address, None)
            assert c.traversal_counts().get("socket.probe.sent", 0) == 0

    run(main())


def test_probe_lookups_refuse_unknown_and_malformed_nonces_and_floods() -> None:
    async def main() -> None:
        observer_cfg = _cfg(probe_wait_s=0.2, probes_per_minute=6.0)
        async with endpoint(observer_cfg) as b, endpoint() as a, endpoint() as c:
            reply = (await a.request(address(b), OBSERVE, {}, timeout=10)).header
            alt = ("127.0.0.1", reply["alt_port"])
            port = b._traversal.probe_port
            assert port is not None and port.address == alt

            async def refusal(ep: Endpoint, header: dict[str, Any]) -> str:
                with pytest.raises(RemoteError) as info:
                    await ep.request(address(b), OBSERVE_PROBE, header, timeout=10)
                return info.value.code

            for bad in (
                {"nonce": "00" * 8},  # short
                {"nonce": "zz" * 16},  # not hex
                {"nonce": "AB" * 16},  # upper case
                {"nonce": 5},  # wrong type
                {},  # missing
                {"nonce": "00" * 16, "host": "10.0.0.1"},  # an address to report on: no
            ):
                assert await refusal(c, bad) == "bad_request", bad
            # junk and probes nobody asks about are recorded or dropped, never answered
            junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                junk.bind(("127.0.0.1", 0))
                for packet in (b"", b"\x23", b"\x23" + bytes(17), b"\x22" + bytes(8), b"x" * 1200):
                    junk.sendto(packet, alt)
                await async_wait_for(lambda: port.counts["dropped.not_probe"] == 5, 10, "junk")
                for sent in range(50, 1250, 50):  # more than the table holds: the oldest go
                    for _ in range(50):  # in batches, so that no receive buffer overflows
                        junk.sendto(encode_probe(os.urandom(16)), alt)
                    await async_wait_for(_count_is(port.counts, "received", sent), 10, "probes")
                assert len(port.table) == port.table.max_entries
            finally:
                junk.close()
            # a nonce whose probes never came: the observer waits probe_wait_s, then says so
            assert await refusal(a, {"nonce": os.urandom(16).hex()}) == "unknown_nonce"
            # a burst of 3, then rate_limited; other peers are not affected
            codes = [await refusal(a, {"nonce": os.urandom(16).hex()}) for _ in range(3)]
            assert codes == ["unknown_nonce", "unknown_nonce", "rate_limited"]
            assert await c.observe_mapping(address(b), timeout=10) == (c.address, c.address)
            assert port.waiting == 0

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


def test_a_kept_rendezvous_that_restarts_on_another_port_is_found_there() -> None:
    """The rendezvous restarts (same identity, a new port): the keeper looks its newest
    address up before re-dialling and reconnects there, so peers behind NAT are reachable
    through it again without waiting for the next reachability check."""

    async def main() -> None:
        rid = Identity.generate()
        announced: dict[str, PeerAddress] = {}
        fast = _cfg(keepalive_interval_s=0.3, keep_retry_s=0.2)
        async with endpoint(fast) as b:
            async with endpoint(identity=rid) as r1:
                await b.keep(address(r1), timeout=10, resolve=announced.get)
                assert b._connections.link_for(rid.peer_id) is not None
            async with endpoint(identity=rid) as r2:
                assert r2.address != r1.address
                # until the new address is announced the keeper dials the old one in vain
                await asyncio.sleep(1.0)
                assert r2._connections.link_for(b.peer_id) is None
                announced[rid.peer_id] = address(r2)
                await async_wait_for(
                    lambda: r2._connections.link_for(b.peer_id), 15, "the keeper at the new port"
                )
                assert [(p.host, p.port) for p in b.rendezvous] == [r2.address]
                b.register("echo", _echo)
                reply = await r2.request(address(b), "echo", {"n": 3}, timeout=10)
                assert reply.header["n"] == 3

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
