"""Path MTU probing over real QUIC sockets (transport/path_mtu.py): on 127.0.0.1 both ends
of a connection find that 16 KB datagrams pass and send them; across the WAN emulator
(a 1500-byte MTU, as on the internet) the probes are dropped and 1452 stays; a probe from
an address that holds no authenticated connection gets no answer."""

from __future__ import annotations

import asyncio
import os
import socket

import torch
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.path_mtu import MTU_NONCE_BYTES, encode_mtu_probe
from wanswarm.transport.wan import WanEmulator, WanProfile

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
