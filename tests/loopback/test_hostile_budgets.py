"""Hostile peers against the transport's budgets, over real QUIC on loopback.

Each attacker is a real identity with a real aioquic connection (transport.connections),
speaking the wire format by hand where an honest endpoint would refuse to. Each test
asserts the refusal, that memory stays within the budget (our accounting, and resident
memory with a generous margin: RSS is noisy), and that an honest peer is served after.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from wanswarm.transport.codecs import CodecSpec, encode
from wanswarm.transport.config import LimitsConfig, TransportConfig
from wanswarm.transport.connections import Connections
from wanswarm.transport.endpoint import Endpoint, Request, Response
from wanswarm.transport.errors import ConnectError, ProtocolError, RemoteError
from wanswarm.transport.framing import (
    WIRE_VERSION,
    HeaderReceived,
    MessageHeader,
    StreamDecoder,
    TensorSpec,
    encode_header,
)
from wanswarm.transport.identity import Identity
from wanswarm.transport.peer_address import PeerAddress
from wanswarm.transport.quic_config import ALPN
from wanswarm.transport.quic_link import QuicLink
from wanswarm.transport.session_wire import symbol_size_for
from wanswarm.transport.stream import QuicStream

from .quic_helpers import address, config, fec, run

MIB = 1 << 20
ATTACKER_HOST = "127.0.0.2"  # another source address than the honest peers' 127.0.0.1


def _rss() -> int:
    """Resident memory of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _echo(request: Request) -> Response:
    return Response(header=request.header, tensors=list(request.tensors))


async def _server(cfg: TransportConfig, **limits: int) -> Endpoint:
    """A server as a daemon has it: kinds take no tensors unless they declare a size."""
    server = Endpoint(Identity.generate(), cfg, default_request_bytes=0)
    await server.start("127.0.0.1", 0)
    server.register("echo", _echo, max_bytes=MIB)
    server.register("info", _echo)  # no tensors
    for kind, max_bytes in limits.items():
        server.register(kind, _echo, max_bytes=max_bytes)
    return server


async def _attacker(server: Endpoint, cfg: TransportConfig) -> tuple[Connections, QuicLink]:
    raw = Connections(Identity.generate(), cfg, lambda link: None)
    await raw.start(ATTACKER_HOST, 0)
    return raw, await raw.get(address(server))


async def _honest(server: Endpoint, client: Endpoint) -> None:
    x = torch.randn(100)
    reply = await client.request(address(server), "echo", {"ok": 1}, [x], timeout=10)
    assert reply.header == {"ok": 1} and torch.equal(reply.tensors[0], x)  # type: ignore[arg-type]


async def _answer(stream: QuicStream, limits: LimitsConfig) -> str:
    """The server's answer on ``stream``: its type or error code, or 'aborted'."""
    decoder = StreamDecoder(limits)
    try:
        async with asyncio.timeout(10):
            while True:
                data = await stream.read()
                for event in decoder.feed(data) if data else decoder.feed_eof():
                    if isinstance(event, HeaderReceived):
                        return event.header.error_code or event.header.type
    except ConnectError:
        return "aborted"


def _announce(kind: str, nbytes: int, *, datagram: bool, transfer_id: int = 0) -> bytes:
    """A request header announcing one float32 tensor of ``nbytes`` payload bytes."""
    fec: dict[str, object] = {}
    if datagram:  # an FEC transfer: the receiver allocates the whole payload up front
        fec = {"transport": "datagram", "transfer_id": transfer_id,
               "symbol_size": symbol_size_for(1200), "block_symbols": 1024}
    spec = TensorSpec(shape=((nbytes - 8) // 4,), dtype="float32", codec="none",
                      nbytes=nbytes, **fec)  # type: ignore[arg-type]
    header = MessageHeader(version=WIRE_VERSION, type="request", request_id=1, kind=kind,
                           tensors=(spec,))
    return encode_header(header, LimitsConfig())


# -- point 1: no buffering past an exchange's end ----------------------------------------


def test_data_after_the_exchange_is_refused_and_not_kept() -> None:
    """A complete request, its answer, then 192 MiB of junk on the same stream (the
    requester never ends it): the server stops reading (STOP_SENDING), grants no more
    credit and keeps nothing of it; the attacker's writes fail within one window."""
    cfg = config(path_bandwidth_bps=40e6)  # 1 MiB flow-control windows

    async def main() -> None:
        server = await _server(cfg)
        raw, link = await _attacker(server, cfg)
        honest = Endpoint(Identity.generate(), cfg)
        await honest.start("127.0.0.1", 0)
        try:
            x = torch.zeros(16)
            payload = CodecSpec("none").payload_nbytes(16, torch.float32)
            stream = link.open_stream()
            header = MessageHeader(
                version=WIRE_VERSION, type="request", request_id=1, kind="echo",
                tensors=(TensorSpec(shape=(16,), dtype="float32", codec="none",
                                    nbytes=payload),),
            )
            body = encode(x, CodecSpec("none")).payload
            await stream.write(encode_header(header, cfg.limits) + body)
            assert await _answer(stream, cfg.limits) == "response"
            rss = _rss()
            junk = bytes(MIB)
            sent = 0
            with pytest.raises(ConnectError, match="stopped reading"):
                async with asyncio.timeout(30):
                    while sent < 192 * MIB:
                        await stream.write(junk)
                        sent += len(junk)
            # refused within about one flow-control window (1 MiB, doubled at most once
            # while the request itself was read)
            assert sent <= 4 * MIB, f"{sent / MIB:.0f} MiB accepted after the exchange"
            await _honest(server, honest)
            grown = _rss() - rss
            assert grown < 64 * MIB, f"resident memory grew by {grown / MIB:.0f} MiB"
            served = [lk for lk in server._connections.socket.links if not lk.is_client
                      and lk.peer_id == raw.identity.peer_id]
            assert served and all(not s._chunks for s in served[0]._streams.values())
            assert not link.is_closed  # the connection lives on: only the stream was refused
            assert server.budget.used == 0
        finally:
            await raw.close(1)
            await honest.close()
            await server.close()

    run(main())


# -- point 2: committing memory by announcing ---------------------------------------------


def test_announced_sizes_are_bounded_by_kind_and_budget() -> None:
    """Headers announcing 256 MiB to a small kind and to a kind that takes no tensors are
    refused from the header (too_large); eight connections announcing 16 MiB FEC
    transfers each to a large kind fill the node's 32 MiB budget and the rest are
    answered busy; memory grows by the budget at most; once the attacker's exchanges end
    the budget is free and an honest request is served."""
    cfg = config(
        limits=LimitsConfig(max_inbound_bytes=32 * MIB, max_inflight_bytes=24 * MIB),
        fec=fec(max_repair_requests=16),  # the held transfers wait (backing off) to the end
    )

    async def main() -> None:
        server = await _server(cfg, big=512 * MIB)
        honest = Endpoint(Identity.generate(), cfg)
        await honest.start("127.0.0.1", 0)
        attackers = [await _attacker(server, cfg) for _ in range(8)]
        try:
            rss = _rss()
            link = attackers[0][1]
            for kind in ("echo", "info"):
                for datagram in (False, True):
                    stream = link.open_stream()
                    await stream.write(_announce(kind, 256 * MIB, datagram=datagram))
                    assert await _answer(stream, cfg.limits) == "too_large"
            assert server.totals()["errors_sent.too_large"] == 4
            assert server.budget.peak == 0

            held: list[QuicStream] = []
            answers = []
            for _, attacker in attackers:
                stream = attacker.open_stream()
                await stream.write(_announce("big", 16 * MIB, datagram=True))
                held.append(stream)
            for stream in held:  # the first two are reserved and wait for their symbols
                try:
                    async with asyncio.timeout(0.5):
                        answers.append(await _answer(stream, cfg.limits))
                except TimeoutError:
                    answers.append("held")
            assert answers.count("held") == 2 and answers.count("busy") == 6, answers
            assert server.budget.used == 32 * MIB
            grown = _rss() - rss
            assert grown < 32 * MIB + 32 * MIB, f"resident memory grew by {grown / MIB:.0f} MiB"
            with pytest.raises(RemoteError) as refused:  # honest but over the budget: busy
                await _honest(server, honest)
            assert refused.value.code == "busy"
            for stream in held:  # the attacker gives up: its reservations are released
                stream.abort()
            async with asyncio.timeout(5):
                while server.budget.used:
                    await asyncio.sleep(0.02)
            await _honest(server, honest)
            assert server.budget.used == 0
        finally:
            for raw, _ in attackers:
                await raw.close(1)
            await honest.close()
            await server.close()

    run(main())


# -- connection caps ------------------------------------------------------------------------


def test_connection_flood_from_one_host_and_one_peer_is_capped() -> None:
    """Many identities from one source address get max_connections_per_host; one identity
    keeps max_connections_per_peer (its oldest are closed); an honest peer from another
    address still connects."""
    cfg = config(max_connections_per_host=4, max_connections_per_peer=2,
                 connect_timeout_s=1.0, handshake_timeout_s=1.0)

    async def main() -> None:
        server = await _server(cfg)
        honest = Endpoint(Identity.generate(), cfg)
        await honest.start("127.0.0.1", 0)
        floods: list[Connections] = []
        try:
            made = 0
            for _ in range(7):
                raw = Connections(Identity.generate(), cfg, lambda link: None)
                await raw.start(ATTACKER_HOST, 0)
                floods.append(raw)
                try:
                    await raw.get(address(server))
                    made += 1
                except ConnectError:
                    pass
            assert made == 4
            assert server._connections.socket.counts["refused.caps"] >= 3
            await _honest(server, honest)

            for raw in floods:  # free the host's slots
                await raw.close(1)
            floods.clear()
            one = Connections(Identity.generate(), cfg, lambda link: None)
            await one.start(ATTACKER_HOST, 0)
            floods.append(one)
            host, port = server.address
            links = [await one.connect(server.peer_id, host, port) for _ in range(4)]
            async with asyncio.timeout(5):
                while sum(not lk.is_closed for lk in links) > 2:
                    await asyncio.sleep(0.02)
            assert [lk.is_closed for lk in links] == [True, True, False, False]
            await _honest(server, honest)
        finally:
            for raw in floods:
                await raw.close(1)
            await honest.close()
            await server.close()

    run(main())


async def _half_open(server: Endpoint, count: int) -> list[socket.socket]:
    """Clients that send their first Initial and never answer: each holds an
    unauthenticated slot until connect_timeout_s (or gets a Retry it ignores)."""
    sockets = []
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((f"127.0.0.{3 + i}", 0))  # one host each: the per-host cap is not at play
        sock.setblocking(False)
        quic = QuicConnection(configuration=QuicConfiguration(alpn_protocols=[ALPN],
                                                              is_client=True))
        quic.connect(server.address, now=0.0)
        for data, _ in quic.datagrams_to_send(now=0.0):
            sock.sendto(data, server.address)
        sockets.append(sock)
    await asyncio.sleep(0.2)  # let the server take them in
    return sockets


def test_retry_keeps_half_open_handshakes_from_taking_every_slot() -> None:
    """Half-open handshakes fill the unauthenticated pool up to retry_pressure; from then
    on new connections get a Retry (a spoofed or silent source holds no slot), and an
    honest peer, which answers it, still connects."""
    cfg = config(max_unauthenticated=8, retry="pressure", retry_pressure=0.5,
                 connect_timeout_s=3.0)

    async def main() -> None:
        server = await _server(cfg)
        honest = Endpoint(Identity.generate(), cfg)
        await honest.start("127.0.0.1", 0)
        sockets = await _half_open(server, 12)
        try:
            socket_ = server._connections.socket
            unauthenticated = sum(1 for lk in socket_.links if lk.peer_id is None)
            assert unauthenticated == 4  # half of the pool; the other 8 got a Retry
            assert socket_.counts["retry.sent"] == 8
            await _honest(server, honest)
            assert socket_.counts["retry.sent"] == 9  # the honest peer answered its Retry
        finally:
            for sock in sockets:
                sock.close()
            await honest.close()
            await server.close()

    run(main())


def test_retry_always_authenticates_and_outgoing_connects_survive_inbound_exhaustion() -> None:
    """With retry='always' every handshake (channel binding included) goes through a
    Retry; with every incoming slot taken, the node's own outgoing connects still work."""
    cfg = config(retry="always", max_connections=2, max_connections_per_host=64)

    async def main() -> None:
        server = await _server(cfg)
        other = await _server(config())
        floods = [await _attacker(server, cfg) for _ in range(2)]
        try:
            late = Connections(Identity.generate(), config(connect_timeout_s=1.0), lambda _: None)
            await late.start(ATTACKER_HOST, 0)
            floods.append((late, floods[0][1]))
            with pytest.raises(ConnectError):  # no incoming slot left
                await late.get(address(server))
            assert server._connections.socket.counts["refused.caps"] >= 1
            await _honest(other, server)  # ours goes out all the same
        finally:
            for raw, _ in floods:
                await raw.close(1)
            await other.close()
            await server.close()

    run(main())


def test_a_requester_keeps_nothing_a_server_sends_after_its_response() -> None:
    """The requester side (a trainer, a state downloader): a server that answers, then
    keeps sending on the stream, is stopped and nothing of it is kept."""
    cfg = config(path_bandwidth_bps=40e6)

    async def main() -> None:
        client = Endpoint(Identity.generate(), cfg)
        await client.start("127.0.0.1", 0)
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answered = asyncio.Event()

        def on_link(link: QuicLink) -> None:
            async def answer(stream: QuicStream) -> None:
                reply = encode_header(
                    MessageHeader(version=WIRE_VERSION, type="response", request_id=1),
                    cfg.limits,
                )
                await stream.read()
                try:
                    await stream.write(reply)  # the response, and no FIN
                    async with asyncio.timeout(20):
                        await answered.wait()
                        for _ in range(64):
                            await stream.write(bytes(MIB))
                    outcome.set_result("all sent")
                except (ConnectError, ProtocolError) as exc:
                    outcome.set_result(str(exc))

            link.on_stream = lambda stream: asyncio.ensure_future(answer(stream))

        hostile = Connections(Identity.generate(), cfg, on_link)
        await hostile.start(ATTACKER_HOST, 0)
        try:
            host, port = hostile.address
            target = PeerAddress(hostile.identity.peer_id, host, port)
            reply = await client.request(target, "anything", {}, timeout=10)
            assert reply.header == {}
            answered.set()
            async with asyncio.timeout(20):
                assert "stopped reading" in await outcome
            links = [lk for lk in client._connections.socket.links]
            assert links and all(not s._chunks for lk in links for s in lk._streams.values())
        finally:
            await hostile.close(1)
            await client.close()

    run(main())
