"""The request/response endpoint over real QUIC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gc
import math
from unittest import mock

import pytest
import torch
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.errors import (
    CodecError,
    ConnectError,
    PayloadError,
    RemoteError,
    RequestTimeout,
)
from wanswarm.transport.identity import Identity
from wanswarm.transport.tensors import ReceivedTensor
from wanswarm.transport.wan import WanEmulator, WanProfile
from wanswarm.transport.wan_link import BernoulliLoss

from ..waiting import async_wait_for
from .quic_helpers import address, config, endpoint, fec, run


async def _echo(request: Request) -> Response:
    """Returns each tensor doubled and the header back."""
    return Response(header=dict(request.header), tensors=[t * 2 for t in request.tensors])


@pytest.mark.parametrize("use_fec", [False, True], ids=["stream", "fec-datagrams"])
def test_request_response_with_megabytes_of_tensors(use_fec: bool) -> None:
    async def main() -> None:
        cfg = config(fec=fec(use_fec))
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            big = torch.randn(1024, 1024)  # 4 MiB
            small = torch.arange(12, dtype=torch.int64).reshape(3, 4)
            half = torch.randn(256, 512, dtype=torch.bfloat16)
            reply = await client.request(
                address(server), "echo", {"step": 3, "ids": [1, 2]}, [big, small, half],
                timeout=60,
            )
            assert reply.header == {"step": 3, "ids": [1, 2]}
            out = [t for t in reply.tensors if isinstance(t, torch.Tensor)]
            assert len(out) == 3
            assert torch.equal(out[0], big * 2) and torch.equal(out[1], small * 2)
            assert out[2].dtype == torch.bfloat16 and torch.equal(out[2], half * 2)
            stats = client.path_stats(server.peer_id)
            assert stats is not None and stats.connected and stats.smoothed_rtt > 0
            assert stats.bytes_sent > big.nbytes and stats.delivery_rate_bps > 0
            totals = client.totals()
            assert totals["requests_sent"] == 1 and totals["bytes_out"] > big.nbytes
            assert server.totals()["requests_served"] == 1

    run(main())


def test_codecs_and_preencoded_tensors() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:

            async def reply_int8(request: Request) -> Response:
                return Response(header={}, tensors=request.tensors, codec=CodecSpec("bf16"))

            server.register("k", reply_int8)
            x = torch.randn(64, 64)
            pre = encode(torch.ones(10), CodecSpec("none"))
            codec = CodecSpec.from_wire("int8/b64/f32")
            reply = await client.request(
                address(server), "k", {}, [x, pre], codec=codec, timeout=20
            )
            back = reply.tensors[0]
            assert isinstance(back, torch.Tensor) and back.dtype == torch.float32
            assert (back - x).abs().max() < 0.05  # int8 there, bf16 back
            assert isinstance(reply.tensors[1], torch.Tensor)
            assert torch.equal(reply.tensors[1], torch.ones(10))

    run(main())


def test_a_handler_gets_each_tensors_peak_from_its_payload() -> None:
    """Request.peaks: the largest |value| of every float tensor, read from its payload on
    the host (int8's scales, a raw payload's values), equal to the decoded tensor's; None
    for token ids, which stay on the CPU whatever device the handler decodes on."""

    async def main() -> None:
        async with endpoint() as server, endpoint() as client:
            seen: list[tuple[list[float | None], list[float]]] = []

            async def peaks(request: Request) -> Response:
                maxima = [float(t.abs().max()) for t in request.tensors]
                seen.append((request.peaks(), maxima))
                return Response(header={})

            server.register("k", peaks)
            x = torch.randn(16, 384) * 3
            ids = encode(torch.randint(0, 256, (4, 8)), CodecSpec("none"))
            raw = encode(torch.randn(40), CodecSpec("none"))
            codec = CodecSpec.from_wire("int8/b64/f16")
            await client.request(address(server), "k", {}, [x, ids, raw], codec=codec, timeout=20)
            (got, maxima), = seen
            assert got[1] is None
            assert got[0] == maxima[0] and got[2] == maxima[2]

    run(main())


@pytest.mark.parametrize("use_fec", [False, True], ids=["stream", "fec-datagrams"])
def test_lazy_responses_relay_payloads_undecoded(use_fec: bool) -> None:
    """A stage's reply taken lazily and relayed to the next one: the same payload bytes
    arrive there, and the relaying side decodes nothing."""

    async def main() -> None:
        cfg = config(fec=fec(use_fec, threshold_bytes=16 * 1024))
        async with endpoint(cfg) as stage, endpoint(cfg) as sink, endpoint(cfg) as client:
            int8 = CodecSpec.from_wire("int8/b64/f32")
            y = encode(torch.randn(64, 1024), int8)  # 64 KiB of codes: an FEC transfer
            seen: list[torch.Tensor] = []

            async def produce(request: Request) -> Response:
                return Response(header={"ok": True}, tensors=[y])

            async def consume(request: Request) -> Response:
                seen.extend(request.tensors)
                return Response(header={})

            stage.register("produce", produce)
            sink.register("consume", consume)
            reply = await client.request(address(stage), "produce", {}, timeout=20, lazy=True)
            (got,) = reply.tensors
            assert isinstance(got, ReceivedTensor) and not got.is_decoded
            assert got.shape == (64, 1024) and got.dtype == torch.float32 and got.codec == int8
            assert got.sender == stage.peer_id and bytes(got.payload) == y.payload
            await client.request(address(sink), "consume", {}, [got], timeout=20)
            assert not got.is_decoded  # relayed as it came
            assert len(seen) == 1 and torch.equal(seen[0], decode(y))
            assert torch.equal(got.tensor(), decode(y)) and got.tensor() is got.tensor()

    run(main())


def test_hostile_payloads_in_lazy_responses() -> None:
    """Headers are checked on receipt even when the response is lazy; values when the
    payload is decoded: by its receiver, or by the next peer it is relayed to, which
    refuses it before its handler runs."""

    async def main() -> None:
        async with endpoint() as stage, endpoint() as sink, endpoint() as client:
            nan = encode(torch.tensor([1.0, float("nan")]), CodecSpec("none"))
            good = encode(torch.ones(4), CodecSpec.from_wire("int8/b64/f32"))
            bad_head = EncodedTensor(good.spec, good.shape, good.dtype, b"\x09" + good.payload[1:])
            handled = []

            async def reply_with(request: Request) -> Response:
                return Response(
                    header={}, tensors=[{"nan": nan, "bad_head": bad_head}[request.kind]]
                )

            async def consume(request: Request) -> Response:
                handled.append(request)
                return Response(header={})

            stage.register("nan", reply_with)
            stage.register("bad_head", reply_with)
            sink.register("consume", consume)
            peer = address(stage)
            with pytest.raises(CodecError):  # a malformed header is refused on receipt
                await client.request(peer, "bad_head", {}, timeout=10, lazy=True)
            with pytest.raises(PayloadError) as refused:  # eager: values checked on receipt
                await client.request(peer, "nan", {}, timeout=10)
            assert refused.value.code == "non_finite"
            reply = await client.request(peer, "nan", {}, timeout=10, lazy=True)
            (got,) = reply.tensors
            assert isinstance(got, ReceivedTensor)
            with pytest.raises(RemoteError) as info:
                await client.request(address(sink), "consume", {}, [got], timeout=10)
            assert info.value.code == "non_finite" and not handled
            for _ in range(2):  # the error is kept, like a decoded tensor
                with pytest.raises(PayloadError) as refused:
                    got.tensor()
                assert refused.value.code == "non_finite"

    run(main())


def test_concurrent_requests_share_one_connection() -> None:
    async def main() -> None:
        cfg = config(fec=fec(threshold_bytes=16 * 1024))
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            accepted = []
            server._connections.socket._on_accept = (
                lambda link, orig=server._connections.socket._on_accept: (
                    accepted.append(link),
                    orig(link),
                )
            )
            tensors = [torch.full((1000 * (i + 1),), float(i)) for i in range(16)]
            replies = await asyncio.gather(
                *(
                    client.request(address(server), "echo", {"i": i}, [t], timeout=60)
                    for i, t in enumerate(tensors)
                )
            )
            for i, reply in enumerate(replies):
                assert reply.header == {"i": i}
                assert torch.equal(reply.tensors[0], tensors[i] * 2)  # type: ignore[arg-type]
            assert len(accepted) == 1 and len(client._connections.links()) == 1
            # and a later request reuses it
            await client.request(address(server), "echo", {}, [], timeout=10)
            assert len(accepted) == 1

    run(main())


def test_remote_errors() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:

            async def busy(request: Request) -> Response:
                raise RemoteError("busy", "queue full")

            async def broken(request: Request) -> Response:
                raise ValueError("bug")

            async def ok(request: Request) -> Response:
                return Response(header={"n": len(request.tensors)})

            server.register("busy", busy)
            server.register("broken", broken)
            server.register("finite", ok)
            server.register("anything", ok, allow_nonfinite=True)
            peer = address(server)
            with pytest.raises(RemoteError) as info:
                await client.request(peer, "busy", {}, timeout=10)
            assert info.value.code == "busy" and info.value.message == "queue full"
            with pytest.raises(RemoteError) as info:
                await client.request(peer, "broken", {}, timeout=10)
            assert info.value.code == "internal"
            with pytest.raises(RemoteError) as info:
                await client.request(peer, "nope", {}, timeout=10)
            assert info.value.code == "unknown_kind"
            nan = torch.tensor([1.0, float("nan")])
            with pytest.raises(RemoteError) as info:
                await client.request(peer, "finite", {}, [nan], timeout=10)
            assert info.value.code == "non_finite"
            reply = await client.request(peer, "anything", {}, [nan], timeout=10)
            assert reply.header == {"n": 1}
            totals = server.totals()
            assert totals["errors_sent.busy"] == 1 and totals["errors_sent.internal"] == 1
            assert totals["errors_sent.non_finite"] == 1
            assert client.totals()["errors_received.busy"] == 1

    run(main())


def test_request_timeout_cancels_the_handler() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:
            started, cancelled = asyncio.Event(), asyncio.Event()
            never = asyncio.Event()

            async def stuck(request: Request) -> Response:
                started.set()
                try:
                    await never.wait()
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return Response(header={})

            server.register("stuck", stuck)
            with pytest.raises(RequestTimeout):
                await client.request(address(server), "stuck", {}, timeout=0.5)
            assert started.is_set()
            async with asyncio.timeout(5):
                await cancelled.wait()  # the stream reset reached the server
            assert client.totals()["errors.timeout"] == 1
            # the connection is still good
            server.register("ok", _echo)
            await client.request(address(server), "ok", {}, timeout=10)

    run(main())


def test_a_request_abandoned_mid_transfer_leaves_no_unretrieved_error() -> None:
    """A requester that gives up while its FEC transfer is under way resets the exchange;
    the server stops waiting for it. Nothing is left for asyncio to report as an
    exception never retrieved (once an ERROR log line per abandoned exchange: a daemon's
    log filled with them at shutdown). The path is slow (20 Mb/s) so that the server is
    surely waiting for the transfer when the requester gives up."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        reported: list[str] = []
        loop.set_exception_handler(lambda _, context: reported.append(str(context["message"])))
        cfg = config(fec=fec(threshold_bytes=64 * 1024), congestion=CongestionConfig())
        slow = WanProfile.symmetric("slow", rate_bps=20e6, rtt_s=0.004)
        payload = encode(torch.randn(1 << 20), CodecSpec("none"))  # 4 MB: 1.6 s
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            async with WanEmulator(slow, target=server.address, seed=1) as wan:
                peer = PeerAddress(server.peer_id, *wan.address)
                await client.request(peer, "echo", {}, [torch.ones(3)], timeout=10)
                for _ in range(3):
                    request = loop.create_task(
                        client.request(peer, "echo", {}, [payload], timeout=30))
                    await async_wait_for(lambda: bool(server._serving), 10,
                                         "the server to start receiving the request")
                    await asyncio.sleep(0.2)  # its transfer under way
                    request.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await request
                    await async_wait_for(lambda: not server._serving, 10,
                                         "the server to stop serving the abandoned request")
                gc.collect()
                await asyncio.sleep(0)
        gc.collect()
        assert reported == []

    run(main())


def test_ping_and_path_stats() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:
            assert client.path_stats(server.peer_id) is None
            rtt = await client.ping(address(server), timeout=10)
            assert 0 < rtt < 1
            stats = client.path_stats(server.peer_id)
            assert stats is not None and stats.min_rtt > 0 and stats.loss_rate == 0.0
            assert server.path_stats(client.peer_id) is not None

    run(main())


def test_ping_is_timed_finer_than_the_loops_clock() -> None:
    """uvloop's loop.time() counts whole milliseconds: a loopback ping timed with it measured
    0.0 (a peer's RTT of 0 ms in status) or 1 ms. Here the loop's clock is made as coarse;
    the ping must still measure the round trip itself, not in whole milliseconds."""

    async def main() -> None:
        async with endpoint() as server, endpoint() as client:
            await client.ping(address(server), timeout=10)  # connected
            loop = asyncio.get_running_loop()
            fine = loop.time
            with mock.patch.object(loop, "time", lambda: math.floor(fine() * 1000) / 1000):
                rtts = [await client.ping(address(server), timeout=10) for _ in range(5)]
            assert all(0 < rtt < 1 for rtt in rtts), rtts
            whole_ms = [abs(rtt * 1000 - round(rtt * 1000)) < 1e-6 for rtt in rtts]
            assert not all(whole_ms), rtts

    run(main())


def test_reconnects_after_a_graceful_server_restart() -> None:
    async def main() -> None:
        identity = Identity.generate()
        async with endpoint() as client:
            async with endpoint(identity=identity) as server:
                server.register("echo", _echo)
                port = server.address[1]
                await client.request(address(server), "echo", {}, timeout=10)
            async with endpoint(identity=identity, port=port) as again:
                again.register("echo", _echo)
                reply = await client.request(address(again), "echo", {"n": 2}, timeout=10)
                assert reply.header == {"n": 2}
                assert len(client._connections.links()) == 1

    run(main())


def test_reconnects_after_the_server_vanished_silently() -> None:
    """The server process dies without a CONNECTION_CLOSE: the client's connection
    looks alive until the silence detector declares it dead; the request is re-sent
    on a new connection, within its deadline."""

    async def main() -> None:
        identity = Identity.generate()
        async with endpoint(config(dead_peer_timeout_s=0.6)) as client:
            server = Endpoint(identity, config())
            await server.start("127.0.0.1", 0)
            server.register("echo", _echo)
            port = server.address[1]
            await client.request(address(server), "echo", {}, timeout=10)
            for link in server._connections.socket.links:  # crash: no close sent
                link._terminate(None, "crashed", by_peer=False)
            socket_ = server._connections.socket
            assert socket_._transport is not None and socket_._protocol is not None
            socket_._transport.close()
            socket_._transport = None
            await socket_._protocol.lost
            async with endpoint(identity=identity, port=port) as again:
                again.register("echo", _echo)
                reply = await client.request(address(again), "echo", {"n": 3}, timeout=10)
                assert reply.header == {"n": 3}
            await server.close()

    run(main())


def test_close_waits_for_in_flight_handlers() -> None:
    async def main() -> None:
        async with endpoint() as client:
            server = Endpoint(Identity.generate(), config())
            await server.start("127.0.0.1", 0)
            entered, release = asyncio.Event(), asyncio.Event()

            async def slow(request: Request) -> Response:
                entered.set()
                await release.wait()
                return Response(header={"done": True})

            server.register("slow", slow)
            pending = asyncio.ensure_future(
                client.request(address(server), "slow", {}, timeout=20)
            )
            await entered.wait()
            closing = asyncio.ensure_future(server.close())
            finished, _ = await asyncio.wait([closing], timeout=0.3)
            assert not finished  # close() waits for the handler
            release.set()
            reply = await pending
            assert reply.header == {"done": True}
            await closing
            with pytest.raises(ConnectError):
                await client.request(address(server), "slow", {}, timeout=5)

    run(main())


def test_fec_transfer_through_a_lossy_wan() -> None:
    async def main() -> None:
        cfg = config(fec=fec(threshold_bytes=32 * 1024), congestion=CongestionConfig())
        profile = WanProfile.symmetric(
            "lossy", rate_bps=100e6, rtt_s=0.02, loss=BernoulliLoss(rate=0.03)
        )
        async with endpoint(cfg) as server, endpoint(cfg) as client:
            server.register("echo", _echo)
            payload = torch.randn(256 * 1024)  # 1 MiB each way
            async with WanEmulator(profile, target=server.address, seed=7) as wan:
                peer = PeerAddress(server.peer_id, *wan.address)
                reply = await client.request(peer, "echo", {}, [payload], timeout=60)
                assert torch.equal(reply.tensors[0], payload * 2)  # type: ignore[arg-type]
                assert wan.stats()["uplink"]["lost_packets"] > 0
            stats = client.path_stats(server.peer_id)
            assert stats is not None and stats.loss_rate > 0

    run(main(), timeout=90)


def test_a_failure_below_the_pump_closes_only_that_connection() -> None:
    """If aioquic (or a congestion controller) raises while handling a packet, that
    connection's state is unknown: it is closed; the socket and other peers go on."""

    async def main() -> None:
        async with endpoint() as server, endpoint() as first, endpoint() as second:
            server.register("echo", _echo)
            await first.request(address(server), "echo", {}, timeout=10)
            (doomed,) = server._connections.links()
            broken = asyncio.get_running_loop().create_future()

            def explode(*args: object, **kwargs: object) -> None:
                if not broken.done():
                    broken.set_result(None)
                raise RuntimeError("bug below the pump")

            doomed._quic.receive_datagram = explode  # type: ignore[method-assign]
            (old_link,) = first._connections.links()
            # the server closes that connection (INTERNAL); the request, which got no
            # byte of reply, is re-sent once on a new connection
            reply = await first.request(address(server), "echo", {"n": 1}, timeout=10)
            assert reply.header == {"n": 1}
            assert broken.done() and doomed.is_closed and doomed.close_code == 0x105
            assert old_link.is_closed and first._connections.links() != [old_link]
            reply = await second.request(address(server), "echo", {"n": 2}, timeout=10)
            assert reply.header == {"n": 2}

    run(main())


def test_inflight_budget_answers_busy() -> None:
    async def main() -> None:
        from wanswarm.transport.config import LimitsConfig

        tight = config(limits=LimitsConfig(max_inflight_bytes=4096))
        async with endpoint(tight) as server, endpoint() as client:
            server.register("echo", _echo)
            with pytest.raises(RemoteError) as info:
                await client.request(address(server), "echo", {}, [torch.randn(4096)], timeout=10)
            assert info.value.code == "busy"
            reply = await client.request(address(server), "echo", {}, [torch.randn(16)], timeout=10)
            assert reply.header == {}

    run(main())
