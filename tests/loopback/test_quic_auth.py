"""Mutual authentication over real QUIC on 127.0.0.1: who may talk, and who may not."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from wanswarm.transport.connections import Connections, _read_auth, client_handshake
from wanswarm.transport.endpoint import PeerAddress, Request, Response
from wanswarm.transport.errors import AuthenticationError, PeerIdMismatch
from wanswarm.transport.framing import FrameType, MessageHeader, StreamDecoder, encode_frame
from wanswarm.transport.framing import encode_header as encode_message_header
from wanswarm.transport.handshake import ClientHandshake, Hello, encode_auth
from wanswarm.transport.identity import Identity
from wanswarm.transport.quic_link import CloseCode, QuicLink

from .quic_helpers import address, config, endpoint, run

CFG = config()


class _LogWaiter(logging.Handler):
    """Sets an event when a record containing ``text`` is logged (no polling)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = asyncio.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.text in message:
            self.messages.append(message)
            self.event.set()


@contextmanager
def _log_waiter(text: str) -> Iterator[_LogWaiter]:
    waiter = _LogWaiter(text)
    log = logging.getLogger("wanswarm.transport.connections")
    old_level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(waiter)
    try:
        yield waiter
    finally:
        log.removeHandler(waiter)
        log.setLevel(old_level)


async def _raw_client(identity: Identity | None = None) -> Connections:
    """A QUIC socket that speaks the identity handshake by hand (or wrongly)."""
    conns = Connections(identity or Identity.generate(), CFG, lambda link: None)
    await conns.start("127.0.0.1", 0)
    return conns


async def _closed(link: QuicLink) -> None:
    async with asyncio.timeout(5):
        await link.wait_closed()


def test_requests_both_ways_on_one_authenticated_connection() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:

            async def who(request: Request) -> Response:
                return Response(header={"you": request.peer_id})

            server.register("who", who)
            client.register("who", who)
            reply = await client.request(address(server), "who", {}, timeout=10)
            assert reply.header["you"] == client.peer_id
            # the server reaches the client over the connection the client opened
            back = await server.request(address(client), "who", {}, timeout=10)
            assert back.header["you"] == server.peer_id
            assert len(server._connections.links()) == 1
            assert len(client._connections.links()) == 1
            link = client._connections.links()[0]
            assert link.tls_peer_id == server.peer_id and link.peer_id == server.peer_id
            incoming = server._connections.links()[0]
            assert incoming.tls_peer_id == client.peer_id  # mutual TLS: the client's cert

    run(main())


def test_client_expecting_another_peer_is_refused_on_both_sides() -> None:
    async def main() -> None:
        async with endpoint() as server, endpoint() as client:
            wrong = PeerAddress(Identity.generate().peer_id, *server.address)
            with _log_waiter("refused our identity") as server_log:
                with pytest.raises(PeerIdMismatch) as info:
                    await client.request(wrong, "anything", {}, timeout=10)
                async with asyncio.timeout(5):
                    await server_log.event.wait()
            message = str(info.value)
            assert wrong.peer_id in message and server.peer_id in message
            assert wrong.peer_id in server_log.messages[0]  # the client told it why
            assert server._connections.links() == []

    run(main())


def test_server_refuses_a_hello_for_another_peer_id() -> None:
    """A client that skipped the certificate check still gets refused by the server."""

    async def main() -> None:
        async with endpoint() as server:
            raw = await _raw_client()
            try:
                link = await raw.socket.connect(*server.address)
                other = Identity.generate().peer_id
                with _log_waiter("refused connection") as server_log:
                    with pytest.raises(PeerIdMismatch, match="peer refused"):
                        async with asyncio.timeout(5):
                            await client_handshake(raw.identity, link, other, CFG)
                    async with asyncio.timeout(5):
                        await server_log.event.wait()
                assert link.close_code == CloseCode.PEER_ID_MISMATCH and link.closed_by_peer
                assert other in server_log.messages[0]
            finally:
                await raw.close(1)

    run(main())


async def _handshake_by_hand(
    link: QuicLink, identity: Identity, expected: str, nonce: bytes, finish: bytes | None
) -> bytes:
    """Run the client side manually; send ``finish`` instead of our own if given."""
    assert link.binding is not None
    machine = ClientHandshake(identity, expected, link.binding, nonce)
    decoder = StreamDecoder(CFG.limits, allow_auth=True)
    stream = link.open_stream()
    await stream.write(encode_frame(FrameType.AUTH, machine.hello()))
    own_finish = machine.receive_proof(await _read_auth(stream, decoder))
    await stream.write(encode_frame(FrameType.AUTH, finish or own_finish), end=True)
    machine.receive_accept(await _read_auth(stream, decoder))
    return own_finish


def test_replayed_handshake_is_refused() -> None:
    async def main() -> None:
        async with endpoint() as server:
            identity = Identity.generate()
            raw = await _raw_client(identity)
            try:
                nonce = os.urandom(32)
                first = await raw.socket.connect(*server.address)
                finish = await _handshake_by_hand(first, identity, server.peer_id, nonce, None)
                # the same HELLO and the recorded FINISH on a second connection
                second = await raw.socket.connect(*server.address)
                with _log_waiter("refused connection") as server_log:
                    # The server closes mid-handshake; which of our awaits notices first (a
                    # reset stream or the closed connection) varies, so any error will do
                    # here: the assertions below check the refusal itself.
                    with pytest.raises(Exception):  # noqa: B017
                        async with asyncio.timeout(5):
                            await _handshake_by_hand(
                                second, identity, server.peer_id, nonce, finish
                            )
                    await _closed(second)
                    async with asyncio.timeout(5):
                        await server_log.event.wait()
                assert second.close_code == CloseCode.AUTH_FAILED and second.closed_by_peer
                assert "invalid for this connection" in server_log.messages[0]
                assert not first.is_closed  # the legitimate connection is untouched
            finally:
                await raw.close(1)

    run(main())


def test_forged_identity_claim_is_refused() -> None:
    """An attacker with its own key claims to be a victim: its TLS certificate says
    otherwise, and it cannot sign for the victim anyway."""

    async def main() -> None:
        async with endpoint() as server:
            raw = await _raw_client()
            try:
                victim = Identity.generate()
                link = await raw.socket.connect(*server.address)
                stream = link.open_stream()
                hello = encode_auth(Hello(os.urandom(32), victim.peer_id, server.peer_id))
                with _log_waiter("refused connection") as server_log:
                    await stream.write(encode_frame(FrameType.AUTH, hello))
                    await _closed(link)
                    async with asyncio.timeout(5):
                        await server_log.event.wait()
                assert link.close_code == CloseCode.AUTH_FAILED and link.closed_by_peer
                assert "TLS certificate" in server_log.messages[0]
            finally:
                await raw.close(1)

    run(main())


def test_no_request_is_served_before_authentication() -> None:
    async def main() -> None:
        async with endpoint() as server:
            served: list[str] = []

            async def handler(request: Request) -> Response:
                served.append(request.peer_id)
                return Response(header={})

            server.register("k", handler)
            raw = await _raw_client()
            try:
                link = await raw.socket.connect(*server.address)
                auth = link.open_stream()
                await auth.write(
                    encode_frame(
                        FrameType.AUTH,
                        encode_auth(Hello(os.urandom(32), raw.identity.peer_id, server.peer_id)),
                    )
                )
                request = link.open_stream()  # before FINISH: a request stream
                header = MessageHeader(version=1, type="request", request_id=1, kind="k")
                await request.write(encode_message_header(header, CFG.limits), end=True)
                await _closed(link)
                assert link.closed_by_peer and link.close_code == CloseCode.PROTOCOL
                assert served == []
            finally:
                await raw.close(1)

    run(main())


def test_unreachable_peer_is_a_connect_error() -> None:
    async def main() -> None:
        async with endpoint(config(connect_timeout_s=0.5)) as client:
            # a bound UDP port with no QUIC server behind it
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_datagram_endpoint(
                asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
            )
            try:
                host, port = transport.get_extra_info("sockname")[:2]
                peer = PeerAddress(Identity.generate().peer_id, host, port)
                with pytest.raises(Exception) as info:
                    await client.request(peer, "k", {}, timeout=5)
                assert "timed out" in str(info.value)
                assert type(info.value).__name__ == "ConnectError"
            finally:
                transport.close()

    run(main())


def test_authentication_error_is_the_parent_of_mismatch() -> None:
    assert issubclass(PeerIdMismatch, AuthenticationError)
