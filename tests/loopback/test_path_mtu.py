"""Path MTU probing over real QUIC sockets (transport/path_mtu.py): on 127.0.0.1 both ends
of a connection find that 16 KB datagrams pass and send them; across the WAN emulator
(a 1500-byte MTU, as on the internet) the probes are dropped and 1452 stays; a probe from
an address that holds no authenticated connection gets no answer. Black holes: a jumbo
path through the emulator that shrinks to a 1500-byte MTU under a connection sends both
ends back to 1452 with their requests completing; loss alone does not."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.endpoint import Endpoint, Handler, PeerAddress, Request, Response
from wanswarm.transport.path_mtu import MTU_NONCE_BYTES, encode_mtu_probe
from wanswarm.transport.wan import WanEmulator, WanProfile
from wanswarm.transport.wan_link import BernoulliLoss, LinkProfile

from ..waiting import async_wait_for
from .quic_helpers import address, config, endpoint, fec, run

BIG = 16448
SMALL = 1452


async def _echo(request: Request) -> Response:
    return Response(header={}, tensors=[t * 2 for t in request.tensors])


def _payload(endpoint: Endpoint, peer_id: str) -> int:
    stats = endpoint.path_stats(peer_id)
    return 0 if stats is None else stats.max_udp_payload


def _probe_counts(endpoint: Endpoint) -> dict[str, int]:
    counts = endpoint._connections.socket.counts
    return {k: v for k, v in counts.items() if k.startswith("mtu_")}


def test_both_ends_of_a_loopback_connection_send_16k_datagrams() -> None:
    async def main() -> None:
        cfg = config(fec=fec(threshold_bytes=64 * 1024), congestion=CongestionConfig())
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            small = torch.arange(4.0)
            await client.request(address(server), "echo", {}, [small], timeout=30)
            await async_wait_for(
                lambda: _payload(client, server.peer_id) == BIG
                and _payload(server, client.peer_id) == BIG,
                10, "both ends to adopt 16448-byte datagrams",
            )
            sent = client._connections.socket.counts
            assert sent["mtu_probe.acked"] >= 1
            # a payload above the FEC threshold travels as 16 KiB symbols now, both ways
            big = torch.randn(1024, 1024)
            before = client.path_stats(server.peer_id)
            assert before is not None
            reply = await client.request(address(server), "echo", {}, [big], timeout=60)
            assert torch.equal(reply.tensors[0], big * 2)  # type: ignore[arg-type]
            after = client.path_stats(server.peer_id)
            assert after is not None and after.bytes_sent - before.bytes_sent > big.nbytes

    run(main())


def test_across_a_1500_byte_mtu_the_probes_are_dropped_and_1452_stays() -> None:
    async def main() -> None:
        cfg = config(fec=fec(threshold_bytes=64 * 1024), congestion=CongestionConfig())
        profile = WanProfile.symmetric("lan", rate_bps=200e6, rtt_s=0.004)
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            async with WanEmulator(profile, target=server.address, seed=3) as wan:
                peer = PeerAddress(server.peer_id, *wan.address)
                payload = torch.randn(256 * 1024)
                reply = await client.request(peer, "echo", {}, [payload], timeout=60)
                assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]
                # every probe the client sends is too big for the emulated path
                await async_wait_for(
                    lambda: wan.stats()["uplink"]["too_big_packets"] >= 6,
                    20, "the client's six probes (two sizes, three tries) to be dropped",
                )
                assert _payload(client, server.peer_id) == SMALL
                assert client._connections.socket.counts["mtu_probe.acked"] == 0
                reply = await client.request(peer, "echo", {}, [payload], timeout=60)
                assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]

    run(main(), timeout=90)


def test_a_probe_from_an_unknown_address_is_not_answered() -> None:
    async def main() -> None:
        cfg = config(congestion=CongestionConfig())
        async with endpoint(cfg) as server:
            loop = asyncio.get_running_loop()
            stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            stranger.bind(("127.0.0.1", 0))
            stranger.setblocking(False)
            try:
                probe = encode_mtu_probe(os.urandom(MTU_NONCE_BYTES), 2000)
                await loop.sock_sendto(stranger, probe, server.address)
                await async_wait_for(
                    lambda: _probe_counts(server).get("mtu_probe.ignored", 0) == 1,
                    10, "the server to see the probe",
                )
                try:
                    async with asyncio.timeout(0.3):
                        answer = await loop.sock_recv(stranger, 100)
                except TimeoutError:
                    answer = b""
                assert answer == b""
                assert "mtu_probe.answered" not in _probe_counts(server)
            finally:
                stranger.close()

    run(main())


def test_probing_turned_off_keeps_the_configured_size() -> None:
    async def main() -> None:
        cfg = config(congestion=CongestionConfig(), mtu_probe_bytes=())
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            await client.request(address(server), "echo", {}, [torch.ones(3)], timeout=30)
            assert _payload(client, server.peer_id) == SMALL
            assert _probe_counts(client) == {} and _probe_counts(server) == {}

    run(main())


def test_a_flood_of_probes_from_a_peer_gets_at_most_twenty_answers_a_second() -> None:
    """An authenticated peer (the only kind answered) sending 200 probes at once gets the
    acknowledgement budget's burst of 20, give or take what refills meanwhile, and the
    connection serves on."""
    async def main() -> None:
        cfg = config(congestion=CongestionConfig(), mtu_probe_bytes=())
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            await client.request(address(server), "echo", {}, [torch.ones(3)], timeout=30)
            loop = asyncio.get_running_loop()
            started = loop.time()
            flood = client._connections.socket
            for _ in range(200):
                flood.sendto(encode_mtu_probe(os.urandom(MTU_NONCE_BYTES), 1300), server.address)
            await async_wait_for(
                lambda: sum(_probe_counts(server).values()) == 200,
                10, "the server to see all 200 probes",
            )
            took = loop.time() - started
            counts = _probe_counts(server)
            assert 20 <= counts["mtu_probe.answered"] <= 20 + 20 * took + 1, (counts, took)
            assert counts["mtu_probe.ignored"] == 200 - counts["mtu_probe.answered"]
            reply = await client.request(address(server), "echo", {}, [torch.ones(3)], timeout=30)
            assert torch.equal(reply.tensors[0], torch.ones(3) * 2)  # type: ignore[arg-type]

    run(main())


def _jumbo_path(loss: float = 0.0) -> WanProfile:
    """A 4 ms LAN path that carries 16448-byte datagrams (until ``set_mtu`` shrinks it)."""
    link = LinkProfile(delay_s=0.002, mtu_bytes=65535, loss=BernoulliLoss(rate=loss))
    return WanProfile(name="jumbo", uplink=link, downlink=link)


@asynccontextmanager
async def _adopted(
    kind: str, handler: Handler, *, fec_threshold: int, seed: int, loss: float = 0.0
) -> AsyncIterator[tuple[Endpoint, Endpoint, PeerAddress, WanEmulator]]:
    """(client, server, the server's address through a jumbo path, the emulator), once
    both ends send 16448-byte datagrams and their first confirmation could be due."""
    cfg = config(fec=fec(threshold_bytes=fec_threshold), congestion=CongestionConfig())
    async with endpoint(cfg) as server, endpoint(cfg) as client:
        server.register(kind, handler)
        async with WanEmulator(_jumbo_path(loss), target=server.address, seed=seed) as wan:
            peer = PeerAddress(server.peer_id, *wan.address)
            await client.request(peer, kind, {}, [torch.ones(3)], timeout=30)
            await async_wait_for(
                lambda: _payload(client, server.peer_id) == BIG
                and _payload(server, client.peer_id) == BIG,
                10, "both ends to adopt 16448-byte datagrams",
            )
            await asyncio.sleep(1.2)  # past the earliest confirmation after the search
            yield client, server, peer, wan


def test_a_path_whose_mtu_shrinks_is_found_and_the_connection_goes_back_to_1452() -> None:
    """Black-hole detection (path_mtu.MtuWatch): both ends adopted 16448-byte datagrams on
    a jumbo path; the path then moves to a 1500-byte MTU and silently drops every larger
    packet. A request in flight then (its payload on the stream, 400 KB) still completes
    on the same connection: both ends see loss, confirm their size, find that only
    1452-byte probes cross, and go back to 1452, in which aioquic re-sends what was lost.
    Later FEC payloads travel in symbols of the new size."""
    async def main() -> None:
        async with _adopted("echo", _echo, fec_threshold=1024 * 1024, seed=5) as (
            client, server, peer, wan
        ):
            (link,) = client._connections.links()
            wan.set_mtu(1500)
            loop = asyncio.get_running_loop()
            started = loop.time()
            payload = torch.randn(100 * 1024)  # 400 KB: stream data, both ways
            reply = await client.request(peer, "echo", {}, [payload], timeout=30)
            took = loop.time() - started
            assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]
            assert _payload(client, server.peer_id) == SMALL
            # on the same connection: not declared dead, nothing redialled
            assert client._connections.links() == [link] and not link.is_closed
            await async_wait_for(lambda: _payload(server, client.peer_id) == SMALL,
                                 10, "the server to go back to 1452 too")
            for side in (client, server):
                counts = _probe_counts(side)
                assert counts["mtu_probe.black_hole"] == 1, counts
            assert wan.stats()["uplink"]["too_big_packets"] > 0
            assert took < 5, took
            # an FEC payload now: symbols cut to fit 1452-byte datagrams
            big = torch.randn(512 * 1024)
            reply = await client.request(peer, "echo", {}, [big], timeout=30)
            assert torch.equal(reply.tensors[0], big * 2)  # type: ignore[arg-type]

    run(main(), timeout=90)


def test_a_path_that_keeps_its_mtu_is_confirmed_not_lowered() -> None:
    """Loss on a path whose MTU did not change (random drops of every size) triggers
    confirmations, and the size in use is kept."""
    async def main() -> None:
        async with _adopted("echo", _echo, fec_threshold=64 * 1024, seed=11, loss=0.02) as (
            client, server, peer, wan
        ):
            payload = torch.randn(256 * 1024)
            for _ in range(4):
                reply = await client.request(peer, "echo", {}, [payload], timeout=30)
                assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]
            await async_wait_for(
                lambda: _probe_counts(client).get("mtu_probe.confirmed", 0) >= 1,
                10, "a confirmation after the losses",
            )
            assert wan.stats()["uplink"]["lost_packets"] > 0
            assert "mtu_probe.black_hole" not in _probe_counts(client)
            assert _payload(client, server.peer_id) == BIG

    run(main(), timeout=90)


def test_a_request_whose_fec_transfer_outgrew_the_path_is_sent_again() -> None:
    """A 2 MB request crossing as 16 KiB FEC symbols when the path shrinks: its transfer
    stops (the symbols no longer fit), the server answers transfer_failed without having
    run its handler, and the endpoint sends the request again in 1452-byte datagrams; the
    server's reply, planned after the client's hint made it lower its own size, arrives."""
    calls = 0

    async def counting_echo(request: Request) -> Response:
        nonlocal calls
        calls += 1
        return await _echo(request)

    async def main() -> None:
        async with _adopted("echo", counting_echo, fec_threshold=64 * 1024, seed=5) as (
            client, server, peer, wan
        ):
            wan.set_mtu(1500)
            payload = torch.randn(512 * 1024)
            reply = await client.request(peer, "echo", {}, [payload], timeout=30)
            assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]
            assert client.totals()["requests_resent.path_shrank"] == 1
            assert calls == 2  # the first request, then the 2 MB one once
            for side in (client, server):
                assert _probe_counts(side)["mtu_probe.black_hole"] == 1

    run(main(), timeout=90)


def test_the_peer_that_sends_nothing_large_learns_of_the_black_hole_from_the_hint() -> None:
    """Only the client sends large packets (the server answers with a header alone), so
    the server's own connection shows no loss; the client's base-size probes after its
    lost larger ones hint the server to confirm, and it goes back to 1452 as well."""
    async def sink(request: Request) -> Response:
        return Response(header={"n": len(request.tensors)}, tensors=[])

    async def main() -> None:
        async with _adopted("sink", sink, fec_threshold=1024 * 1024, seed=7) as (
            client, server, peer, wan
        ):
            wan.set_mtu(1500)
            too_big_down = wan.stats()["downlink"]["too_big_packets"]
            await client.request(peer, "sink", {}, [torch.randn(100 * 1024)], timeout=30)
            await async_wait_for(lambda: _payload(server, client.peer_id) == SMALL,
                                 10, "the server to go back to 1452")
            # the server lost no packet of its own to the black hole, only its probes
            assert wan.stats()["downlink"]["too_big_packets"] - too_big_down == 3
            assert _probe_counts(server)["mtu_probe.black_hole"] == 1

    run(main(), timeout=90)
