"""Authenticated connections to peers: one per peer, shared, re-established on failure.

Every connection, in either direction, runs the identity handshake (handshake.py) on the
client's first bidirectional stream before anything else may use it; only then is it
handed to the application (``on_link``) and entered in the table. Until then the server
side refuses any other stream and closes the connection if one appears.

Refusals, with a QUIC application close code on the wire and an error on each side:

- the client reached a server whose certificate is not the expected peer id: the client
  raises :class:`PeerIdMismatch` (expected vs actual) and closes with PEER_ID_MISMATCH;
  the server logs the refusal;
- a client that asks for a peer id other than the server's (HELLO names it): the server
  logs it and closes with PEER_ID_MISMATCH; the client raises PeerIdMismatch;
- a bad, replayed or relayed signature, a claimed id other than the TLS certificate's,
  or no certificate: AUTH_FAILED; the client raises AuthenticationError.

How a connection to a peer is made (:meth:`Connections.get`): an open one by peer id;
else a direct dial if the peer is reachable or names no rendezvous; else the ``indirect``
strategy (traversal.py: introduction through the rendezvous, then reversal, hole punching
or a relay). Each link records how it was made in ``link.path``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from .config import TransportConfig
from .errors import (
    AuthenticationError,
    ConnectError,
    PeerIdMismatch,
    ProtocolError,
    TransportError,
    settle,
)
from .framing import AuthReceived, FrameType, StreamDecoder, encode_frame
from .handshake import ClientHandshake, ServerHandshake
from .identity import Identity
from .path_mtu import MtuSearch, MtuWatch, Verdict
from .peer_address import PeerAddress
from .quic_link import Address, CloseCode, QuicLink
from .quic_socket import QuicSocket
from .relay import is_virtual
from .stream import QuicStream, StreamCode

logger = logging.getLogger(__name__)


class Connections:
    """The node's QUIC socket and its table of authenticated connections by peer id."""

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        on_link: Callable[[QuicLink], None],
    ) -> None:
        self.identity = identity
        self.config = config
        self._on_link = on_link
        self.socket = QuicSocket(identity, config, self._accepted)
        self.socket.on_mtu_hint = self._mtu_hint
        # the black-hole check of each connection using a larger size than configured
        self._mtu_watches: dict[QuicLink, MtuWatch] = {}
        self._by_peer: dict[str, list[QuicLink]] = {}
        self._connecting: dict[str, asyncio.Task[QuicLink]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._arrivals: dict[str, list[asyncio.Future[QuicLink]]] = {}
        self._expected: dict[str, tuple[str, float]] = {}
        # how to reach a peer that is not reachable directly (set by traversal.py)
        self.indirect: Callable[[PeerAddress], Coroutine[Any, Any, QuicLink]] | None = None

    @property
    def address(self) -> Address:
        return self.socket.address

    async def start(self, host: str, port: int) -> None:
        await self.socket.start(host, port)

    def link_for(self, peer_id: str) -> QuicLink | None:
        """The newest open authenticated connection with ``peer_id``, if any."""
        for link in reversed(self._by_peer.get(peer_id, [])):
            if not link.is_closed:
                return link
        return None

    async def get(self, peer: PeerAddress) -> QuicLink:
        """An authenticated connection with ``peer``: an open one, the one being made,
        or a new one (see the module docstring for how). Concurrent callers share one
        connection attempt."""
        if peer.reachable or peer.rendezvous is None or self.indirect is None:
            return await self.dial(peer.peer_id, peer.host, peer.port)
        indirect = self.indirect
        return await self._shared(peer.peer_id, lambda: indirect(peer))

    async def dial(
        self,
        peer_id: str,
        host: str,
        port: int,
        *,
        path: str = "direct",
        timeout: float | None = None,
    ) -> QuicLink:
        """An open connection with ``peer_id``, or a new one dialled to ``host:port``
        (``timeout``: the QUIC handshake's deadline, default ``connect_timeout_s``);
        the new link's ``path`` is ``path``."""
        return await self._shared(
            peer_id, lambda: self.connect(peer_id, host, port, path=path, timeout=timeout)
        )

    async def _shared(
        self, peer_id: str, make: Callable[[], Coroutine[Any, Any, QuicLink]]
    ) -> QuicLink:
        if self._closing:
            raise ConnectError("endpoint is closing")
        link = self.link_for(peer_id)
        if link is not None:
            return link
        task = self._connecting.get(peer_id)
        if task is None:
            task = self._spawn(make())
            self._connecting[peer_id] = task
            task.add_done_callback(lambda _: self._connecting.pop(peer_id, None))
        # shield: one caller's deadline must not cancel the attempt the others await
        return await asyncio.shield(task)

    async def wait_link(self, peer_id: str, timeout: float) -> QuicLink | None:
        """The authenticated connection with ``peer_id`` that is open or arrives within
        ``timeout`` s (either direction); None if none does."""
        link = self.link_for(peer_id)
        if link is not None:
            return link
        waiter: asyncio.Future[QuicLink] = asyncio.get_running_loop().create_future()
        self._arrivals.setdefault(peer_id, []).append(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            return None
        finally:
            waiters = self._arrivals.get(peer_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._arrivals.pop(peer_id, None)

    def expect(self, peer_id: str, path: str, timeout: float) -> None:
        """Mark the next connection from ``peer_id`` that authenticates within ``timeout``
        s as made by ``path`` (an introduction we accepted: "punched" or "relayed")."""
        self._expected[peer_id] = (path, asyncio.get_running_loop().time() + timeout)
        if len(self._expected) > 4096:  # bounded by the callers' rate limits anyway
            self._expected.pop(next(iter(self._expected)))

    async def connect(
        self,
        peer_id: str,
        host: str,
        port: int,
        *,
        path: str = "direct",
        timeout: float | None = None,
    ) -> QuicLink:
        """A new authenticated connection with ``peer_id`` at ``host:port``, never a
        shared one (what :meth:`dial` and the indirect strategy make connections with)."""
        link = await self.socket.connect(host, port, timeout=timeout)
        link.path = path
        if link.tls_peer_id != peer_id:
            message = (
                f"expected peer {peer_id} at {host}:{port}, "
                f"but its certificate is for {link.tls_peer_id}"
            )
            await link.refuse(
                CloseCode.PEER_ID_MISMATCH,
                f"client expected {peer_id}",
                timeout=self.config.handshake_timeout_s,
            )
            raise PeerIdMismatch(message)
        try:
            async with asyncio.timeout(self.config.handshake_timeout_s):
                await client_handshake(self.identity, link, peer_id, self.config)
        except TimeoutError:
            link.abandon(CloseCode.AUTH_FAILED, "identity handshake timed out")
            raise ConnectError(f"identity handshake with {peer_id} timed out") from None
        except TransportError as exc:
            if not link.is_closed:
                code = (
                    CloseCode.PEER_ID_MISMATCH
                    if isinstance(exc, PeerIdMismatch)
                    else CloseCode.AUTH_FAILED
                )
                link.abandon(code, str(exc))
            raise
        link.peer_id = peer_id
        self._register(link)
        return link

    def _accepted(self, link: QuicLink) -> None:
        self._spawn(self._authenticate_incoming(link))

    async def _authenticate_incoming(self, link: QuicLink) -> None:
        first: asyncio.Future[QuicStream] = asyncio.get_running_loop().create_future()

        def on_stream(stream: QuicStream) -> None:
            if first.done():  # anything but the handshake stream before we are done
                stream.abort(StreamCode.REFUSED)
                link.close(CloseCode.PROTOCOL, "stream opened before authentication")
            else:
                first.set_result(stream)

        def on_closed(closed: QuicLink) -> None:
            if not first.done():
                first.set_exception(closed.closed_error())
                first.exception()  # seen: the authentication may be over (cancelled)

        link.on_stream = on_stream
        link.on_closed.append(on_closed)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await link.handshake_done
            if link.tls_peer_id is None:
                raise AuthenticationError("client presented no certificate")
            async with asyncio.timeout(self.config.handshake_timeout_s):
                stream = await first
                peer_id = await server_handshake(self.identity, link, stream, self.config)
        except (TimeoutError, TransportError) as exc:
            self._refuse(link, exc)
            return
        finally:
            if first.done() and not first.cancelled():
                first.exception()  # seen: the close that set it may have come first
        link.peer_id = peer_id
        link.on_stream = None
        expected = self._expected.pop(peer_id, None)
        if expected is not None and link.path == "direct":
            if expected[1] >= asyncio.get_running_loop().time():
                link.path = expected[0]
        logger.info("authenticated %s at %s (%s)", peer_id, link.remote_address, link.path)
        self._register(link)
        self._cap_peer(peer_id)

    def _cap_peer(self, peer_id: str) -> None:
        """Close the oldest incoming connections of ``peer_id`` beyond
        ``max_connections_per_peer``: only the key's holder can make them, so an honest
        peer that restarted (its old connection not yet known dead) gets through."""
        incoming = [
            link for link in self._by_peer.get(peer_id, [])
            if not link.is_client and not link.is_closed
        ]
        for old in incoming[: max(0, len(incoming) - self.config.max_connections_per_peer)]:
            logger.info("closing an older connection of %s: over max_connections_per_peer",
                        peer_id)
            old.close(CloseCode.SHUTDOWN, "too many connections of this peer")

    def _refuse(self, link: QuicLink, exc: BaseException) -> None:
        if link.is_closed:
            if link.closed_by_peer and link.close_code == CloseCode.PEER_ID_MISMATCH:
                logger.warning(
                    "peer at %s refused our identity %s: %s",
                    link.remote_address, self.identity.peer_id, link.close_reason,
                )
            else:
                logger.info("connection from %s ended during authentication: %s",
                            link.remote_address, link.close_reason)
            return
        if isinstance(exc, TimeoutError):
            code, reason = CloseCode.AUTH_FAILED, "authentication timed out"
        elif isinstance(exc, PeerIdMismatch):
            code, reason = CloseCode.PEER_ID_MISMATCH, str(exc)
        else:
            code, reason = CloseCode.AUTH_FAILED, str(exc)
        logger.warning("refused connection from %s: %s", link.remote_address, reason)
        link.close(code, reason)

    def _register(self, link: QuicLink) -> None:
        assert link.peer_id is not None  # called only after authentication
        peer_id = link.peer_id
        links = [other for other in self._by_peer.get(peer_id, []) if not other.is_closed]
        links.append(link)
        self._by_peer[peer_id] = links

        def forget(closed: QuicLink) -> None:
            remaining = [o for o in self._by_peer.get(peer_id, []) if o is not closed]
            if remaining:
                self._by_peer[peer_id] = remaining
            else:
                self._by_peer.pop(peer_id, None)

        link.on_closed.append(forget)
        if self.config.mtu_probe_bytes and not is_virtual(link.remote_address):
            self._spawn(self._search_mtu(link))
        self._on_link(link)
        for waiter in self._arrivals.pop(peer_id, []):
            if not waiter.done():
                waiter.set_result(link)

    async def _search_mtu(self, link: QuicLink) -> None:
        """Probe ``link``'s path for larger datagrams (path_mtu.py) and adopt the largest
        size acknowledged; then watch that it keeps crossing, back to the configured size
        when it does not, and search again later (after ``mtu_research_s``, doubling)."""
        base = link.max_udp_payload
        research = self.config.mtu_research_s
        while not link.is_closed:
            size = await self._find_mtu(link, base)
            if size <= base or not link.raise_max_udp_payload(size):
                return
            logger.info("the path to %s at %s carries %d-byte datagrams",
                        link.peer_id, link.remote_address, size)
            if not await self._watch_mtu(link, size, base):
                return
            await asyncio.sleep(research)
            research = min(2 * research, 16 * self.config.mtu_research_s)

    async def _find_mtu(self, link: QuicLink, base: int) -> int:
        """The largest candidate size acknowledged, or ``base``. Each probe waits four
        smoothed RTTs, between 0.1 and 1 s."""
        search = MtuSearch(base, self.config.mtu_probe_bytes)
        while (size := search.next_probe()) is not None and not link.is_closed:
            if await self.socket.probe_mtu(link.remote_address, size, _probe_timeout(link)):
                search.on_acked(size)
            else:
                search.on_lost(size)
        return search.size

    async def _watch_mtu(self, link: QuicLink, size: int, base: int) -> bool:
        """Confirm ``size`` while the connection lives (path_mtu.MtuWatch); True once it
        went back to ``base`` because ``size`` stopped crossing the path."""
        loop = asyncio.get_running_loop()
        watch = MtuWatch(loop.time(), link.stats().packets_lost,
                         interval=self.config.mtu_confirm_interval_s)
        self._mtu_watches[link] = watch
        try:
            return await self._run_watch(link, watch, size, base)
        finally:
            self._mtu_watches.pop(link, None)

    def _mtu_hint(self, addr: Address) -> None:
        """The peer at ``addr`` sent a probe of our base size: it found its larger size
        lost, so ours toward it is worth confirming now (path_mtu.MtuWatch.hint)."""
        for link, watch in self._mtu_watches.items():
            if link.remote_address == addr:
                watch.hint()

    async def _run_watch(self, link: QuicLink, watch: MtuWatch, size: int, base: int) -> bool:
        loop = asyncio.get_running_loop()
        while not link.is_closed:
            await asyncio.sleep(min(0.5, max(0.05, 2 * link.stats().smoothed_rtt)))
            stats = link.stats()
            if link.is_closed or not watch.due(loop.time(), stats.packets_lost, stats.pto_count):
                continue
            verdict = Verdict.AGAIN
            while verdict is Verdict.AGAIN and not link.is_closed:
                size_acked = await self.socket.probe_mtu(
                    link.remote_address, size, _probe_timeout(link))
                # only after a loss: a probe of the base size tells the peer to confirm its
                # own direction's size (its watch's hint), as routes often shrink both ways
                base_acked = size_acked or await self.socket.probe_mtu(
                    link.remote_address, base, _probe_timeout(link))
                verdict = watch.attempt(loop.time(), link.stats().packets_lost,
                                        size_acked, base_acked)
            if verdict is Verdict.KEEP:
                self.socket.counts["mtu_probe.confirmed"] += 1
            elif verdict is Verdict.LOWER and link.lower_max_udp_payload(base):
                self.socket.counts["mtu_probe.black_hole"] += 1
                logger.warning(
                    "the path to %s at %s stopped carrying %d-byte datagrams (%d probes "
                    "lost while %d-byte ones crossed): back to %d bytes",
                    link.peer_id, link.remote_address, size, watch.attempts, base, base)
                return True
        return False

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(settle)
        task.add_done_callback(self._tasks.discard)
        return task

    def links(self) -> list[QuicLink]:
        return [link for links in self._by_peer.values() for link in links]

    async def close(self, timeout: float) -> None:
        """Cancel connection attempts, close every connection (bounded wait), unbind."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        await self.socket.close(timeout)


def _probe_timeout(link: QuicLink) -> float:
    """How long a path MTU probe on ``link`` waits for its answer: four smoothed RTTs,
    0.1-1 s."""
    return min(1.0, max(0.1, 4 * link.stats().smoothed_rtt))


# -- the identity handshake, pumped over the first stream ------------------------------


async def _read_auth(stream: QuicStream, decoder: StreamDecoder) -> bytes:
    """The next AUTH frame's body; AuthenticationError for anything else."""
    while True:
        data = await stream.read()
        try:
            found = decoder.feed(data) if data else decoder.feed_eof()
        except ProtocolError as exc:
            raise AuthenticationError(f"bad handshake frame: {exc}") from exc
        for event in found:
            if isinstance(event, AuthReceived):
                return event.body
            raise AuthenticationError(f"unexpected {type(event).__name__} in the handshake")


def _peer_refusal(link: QuicLink) -> AuthenticationError | None:
    """The error matching the peer's reason for closing during the handshake, if any."""
    if not (link.is_closed and link.closed_by_peer):
        return None
    if link.close_code == CloseCode.PEER_ID_MISMATCH:
        return PeerIdMismatch(f"peer refused: {link.close_reason}")
    if link.close_code == CloseCode.AUTH_FAILED:
        return AuthenticationError(f"peer refused: {link.close_reason}")
    return None


async def client_handshake(
    identity: Identity, link: QuicLink, expected: str, config: TransportConfig
) -> None:
    """Run the client side on a new stream (no deadline here: the caller sets one)."""
    if link.binding is None:
        raise AuthenticationError("connection has no channel binding")
    machine = ClientHandshake(identity, expected, link.binding, os.urandom(32))
    decoder = StreamDecoder(config.limits, allow_auth=True)
    stream = link.open_stream()
    try:
        await stream.write(encode_frame(FrameType.AUTH, machine.hello()))
        finish = machine.receive_proof(await _read_auth(stream, decoder))
        await stream.write(encode_frame(FrameType.AUTH, finish), end=True)
        machine.receive_accept(await _read_auth(stream, decoder))
    except ConnectError:
        refusal = _peer_refusal(link)
        if refusal is not None:
            raise refusal from None
        raise


async def server_handshake(
    identity: Identity, link: QuicLink, stream: QuicStream, config: TransportConfig
) -> str:
    """Run the server side on the client's first stream; the client's peer id."""
    if link.binding is None:
        raise AuthenticationError("connection has no channel binding")
    machine = ServerHandshake(identity, link.binding, os.urandom(32), link.tls_peer_id)
    decoder = StreamDecoder(config.limits, allow_auth=True)
    proof = machine.receive_hello(await _read_auth(stream, decoder))
    await stream.write(encode_frame(FrameType.AUTH, proof))
    accept = machine.receive_finish(await _read_auth(stream, decoder))
    await stream.write(encode_frame(FrameType.AUTH, accept), end=True)
    if machine.client_id is None:  # receive_finish sets it or raises
        raise AuthenticationError("handshake ended without a client id")
    return machine.client_id
