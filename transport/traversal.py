"""NAT traversal for the endpoint: observed address, dial-back, introductions, relaying.

:class:`Traversal` serves the built-in request kinds of traversal_wire.py on every
endpoint and makes connections to peers that cannot be dialled (the ``indirect`` strategy
of connections.py). The protocol, and what bounds each part, is in docs/nat.md; in short:

- ``_observe``: the requester's address as we see it (the UDP source of its connection),
  and our alternate port (a :class:`~.quic_socket.ProbePort`, opened on the first request).
- ``_observe_probe``: the source address of the probe packets with the requester's nonce
  at our alternate port (waiting up to ``probe_wait_s`` for them). The requester sends
  them from its QUIC socket: a NAT that maps per destination gives them another mapping
  than its connection, so one observer tells the NAT's mapping (:meth:`observe_mapping`).
  Rate-limited per requester; the alternate port never sends.
- ``_dialback``: a new QUIC connection from a fresh UDP socket (another source port, so a
  NAT mapping toward us does not let it in) to the requester's *observed* address, never
  one it names; true iff TLS completed with the requester's certificate. Rate-limited per
  requester, ``max_dialbacks`` at once.
- ``_introduce`` (A asks R, its target B's rendezvous): R tells B over B's connection who
  wants it and where R sees it (``_introduction``), then answers A with B's address as R
  sees it. B reverses (connects to A) if A said it is reachable, else sends a few punch
  packets toward A while A dials B. B accepts introductions only from the rendezvous it
  keeps, at most ``accept_per_minute``, each fresh (timestamp) and new (nonce).
- ``_relay`` (A asks R): R asks B (``_relay_offer``), allocates a channel with one token
  per end (relay.py) and answers A with its token; A then runs QUIC to B through R.

A's strategy for an unreachable peer: introduce; wait ``punch_timeout_s`` for the
reversed connection, or dial the observed address as long (punching); else a relay.
Rendezvous peers the node names are kept connected (``keep``), with a PING every
``keepalive_interval_s`` so that our NAT keeps the mapping R reaches us by.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .config import TransportConfig
from .connections import Connections
from .errors import AuthenticationError, ConnectError, RemoteError, TransportError
from .identity import Identity
from .peer_address import PeerAddress, Resolver
from .quic_link import Address, CloseCode, QuicLink
from .quic_socket import ProbePort, QuicSocket
from .rate_limit import KeyedBuckets, TokenBucket
from .relay import RelayTable, is_virtual
from .traversal_wire import (
    DIALBACK,
    INTRODUCE,
    INTRODUCTION,
    OBSERVE,
    OBSERVE_PROBE,
    PROBE_NONCE_BYTES,
    RELAY,
    RELAY_OFFER,
    DialbackReply,
    Empty,
    Introduce,
    Introduction,
    ObservedReply,
    ObserveReply,
    ProbeQuery,
    RelayOffer,
    RelayReply,
    RelayRequest,
    ReplayGuard,
    parse,
)

__all__ = ["Ask", "BuiltinHandler", "Traversal"]

logger = logging.getLogger(__name__)

# a request to a peer (by address) or over one connection; the response header
Ask = Callable[[PeerAddress | QuicLink, str, dict[str, Any], float], Awaitable[dict[str, Any]]]
# a built-in handler: (requester's peer id, its observed address, header) -> response header
BuiltinHandler = Callable[[str, Address, dict[str, Any]], Awaitable[dict[str, Any]]]


class Traversal:
    """The traversal half of one endpoint (see the module docstring).

    ``reachable`` is what the node found out about us (its dial-back): it decides
    whether introduced peers reverse or punch. ``wall_clock`` stamps and checks
    introductions; ``monotonic`` drives the rate limits (tests replace both).
    """

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        connections: Connections,
        ask: Ask,
        *,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.identity = identity
        self.config = config
        self.cfg = cfg = config.traversal
        self.reachable = False
        self._connections = connections
        self._socket = connections.socket
        self._ask = ask
        self._wall = wall_clock
        self._now = monotonic
        self._rendezvous: dict[str, PeerAddress] = {}
        # per kept peer: where to look up its newest address before a re-dial
        self._resolvers: dict[str, Resolver] = {}
        self._keepers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        per_peer = cfg.introductions_per_minute / 60.0
        self._asks = KeyedBuckets(per_peer, max(2.0, cfg.introductions_per_minute / 5))
        self._dialback_limits = KeyedBuckets(cfg.dialbacks_per_minute / 60.0, 2.0)
        self._accepts = TokenBucket(
            cfg.accept_per_minute / 60.0, max(2.0, cfg.accept_per_minute / 5), monotonic()
        )
        self._replay = ReplayGuard(cfg.introduction_max_age_s)
        self._dialbacks = 0
        self._probe_limits = KeyedBuckets(cfg.probes_per_minute / 60.0, 3.0)
        self._probe_port: ProbePort | None = None
        self._probe_port_tried = False
        self._probe_port_lock = asyncio.Lock()
        self.relay: RelayTable | None = None
        if cfg.relay_enabled and cfg.relay_channels_max > 0:
            self.relay = RelayTable(
                max_channels=cfg.relay_channels_max,
                bytes_per_s=cfg.relay_bytes_per_s,
                burst_bytes=cfg.relay_burst_bytes,
                idle_timeout_s=cfg.relay_idle_timeout_s,
            )
        self._socket.relay = self.relay
        connections.indirect = self.connect_indirect

    def handlers(self) -> dict[str, BuiltinHandler]:
        return {
            OBSERVE: self._on_observe,
            OBSERVE_PROBE: self._on_observe_probe,
            DIALBACK: self._on_dialback,
            INTRODUCE: self._on_introduce,
            INTRODUCTION: self._on_introduction,
            RELAY: self._on_relay,
            RELAY_OFFER: self._on_relay_offer,
        }

    @property
    def probe_port(self) -> ProbePort | None:
        """Our alternate port, once an ``_observe`` opened it."""
        return self._probe_port

    @property
    def rendezvous(self) -> list[PeerAddress]:
        return list(self._rendezvous.values())

    def on_link(self, link: QuicLink) -> None:
        """Every authenticated connection: check relayed ones, clean up after each."""
        if is_virtual(link.remote_address):
            end = self._socket.relay_ends.get(link.remote_address)
            if end is None or end.peer_id != link.peer_id:
                logger.warning("relayed connection from %s is not the peer its channel was "
                               "opened for; closing it", link.peer_id)
                link.close(CloseCode.AUTH_FAILED, "not the peer this relay channel is for")
                return
        link.on_closed.append(self._link_closed)

    def _link_closed(self, link: QuicLink) -> None:
        if is_virtual(link.remote_address):
            self._socket.relay_ends.remove(link.remote_address)
        elif self.relay is not None and link.peer_id is not None:
            still = self._connections.link_for(link.peer_id)
            if still is None or still.remote_address != link.remote_address:
                dropped = self.relay.drop_peer(link.peer_id)
                if dropped:
                    logger.info("dropped %d relay channel(s) of %s: its connection closed",
                                dropped, link.peer_id)

    # keeping rendezvous connections

    async def keep(self, peer: PeerAddress, timeout: float, resolve: Resolver | None = None
                   ) -> None:
        """Keep an authenticated connection to ``peer`` open from now on (re-made when
        it dies, PINGed every ``keepalive_interval_s``), and accept introductions and
        relay offers from it. ConnectError if the first connection is not up within
        ``timeout`` s (it goes on being tried).

        A rendezvous that restarts may come back at another address (a new port, a new
        host): before every re-dial after a failed one the keeper asks ``resolve`` for
        the peer's newest announced address (None: keep the last one). Calling ``keep``
        again for a peer already kept updates its address (and resolver) for the next
        dial."""
        self._rendezvous[peer.peer_id] = peer
        if resolve is not None:
            self._resolvers[peer.peer_id] = resolve
        if peer.peer_id not in self._keepers:
            self._keepers[peer.peer_id] = self._spawn(self._keep(peer.peer_id))
        if await self._connections.wait_link(peer.peer_id, timeout) is None:
            raise ConnectError(f"no connection to {peer.peer_id} within {timeout:.3g} s")

    def release(self, peer_id: str) -> None:
        """Stop keeping ``peer_id`` and accepting introductions from it."""
        self._rendezvous.pop(peer_id, None)
        self._resolvers.pop(peer_id, None)
        keeper = self._keepers.pop(peer_id, None)
        if keeper is not None:
            keeper.cancel()

    def _kept_address(self, peer_id: str, failures: int) -> PeerAddress | None:
        """Where the keeper dials ``peer_id`` next: after a failure, its newest announced
        address when the resolver knows one (a direct one: a rendezvous is dialled, never
        introduced), else the last one we were given."""
        peer = self._rendezvous.get(peer_id)
        resolve = self._resolvers.get(peer_id)
        if peer is None or failures == 0 or resolve is None:
            return peer
        try:
            newest = resolve(peer_id)
        except Exception:  # noqa: BLE001 - a failing lookup must not end the keeper
            logger.exception("looking up the address of %s failed", peer_id)
            return peer
        if newest is None or (newest.host, newest.port) == (peer.host, peer.port):
            return peer
        logger.info("%s now announces %s:%d (was %s:%d): dialling it there",
                    peer_id, newest.host, newest.port, peer.host, peer.port)
        peer = self._rendezvous[peer_id] = PeerAddress(peer_id, newest.host, newest.port)
        return peer

    async def _keep(self, peer_id: str) -> None:
        cfg, failures = self.cfg, 0
        while True:
            peer = self._kept_address(peer_id, failures)
            if peer is None:  # released
                return
            try:
                link = await self._connections.dial(peer.peer_id, peer.host, peer.port)
                failures = 0
                while not link.is_closed:
                    interval = cfg.keepalive_interval_s * random.uniform(0.8, 1.0)
                    try:
                        async with asyncio.timeout(interval):
                            await link.wait_closed()
                    except TimeoutError:
                        await self._keepalive(link)
                # it died: look the address up again before re-dialling (a restart)
                failures = 1
            except TransportError as exc:
                failures += 1
                logger.info("keeping the connection to %s: %s", peer.peer_id, exc)
            backoff = cfg.keep_retry_s * min(8, 2 ** max(0, failures - 1))
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))  # jittered retry period

    async def _keepalive(self, link: QuicLink) -> None:
        """One PING; a connection that does not answer within ``dead_peer_timeout_s``
        is ended (and re-made by the keeper)."""
        try:
            async with asyncio.timeout(self.config.dead_peer_timeout_s):
                await link.ping()
        except TimeoutError:
            link.abandon(CloseCode.PEER_SILENT, "keep-alive PING unanswered")
        except ConnectError:
            pass  # closed meanwhile

    # the requester's side

    async def observe(self, peer: PeerAddress, timeout: float) -> Address:
        reply = parse(ObserveReply, await self._ask(peer, OBSERVE, {}, timeout))
        return reply.host, reply.port

    async def observe_mapping(
        self, peer: PeerAddress, timeout: float
    ) -> tuple[Address, Address | None]:
        """(our address as ``peer`` sees it on its QUIC port, as it saw our probe packets
        on its alternate port); the second is None when it could not tell (no alternate
        port, probes lost, refused, or out of time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        reply = parse(ObserveReply, await self._ask(peer, OBSERVE, {}, timeout))
        seen = (reply.host, reply.port)
        link = self._connections.link_for(peer.peer_id)
        if (
            reply.alt_port is None
            or self.cfg.probe_packets == 0
            or link is None
            or is_virtual(link.remote_address)
        ):
            return seen, None
        nonce = os.urandom(PROBE_NONCE_BYTES)
        # from our QUIC socket, to the host we reach the peer's QUIC port at: its NAT
        # mapping toward that new destination is what the peer reports
        target = (link.remote_address[0], reply.alt_port)
        self._socket.probe(target, self.cfg.probe_packets, self.cfg.punch_interval_s, nonce)
        remaining = deadline - loop.time()
        if remaining <= 0:
            return seen, None
        try:
            answer = await self._ask(
                link, OBSERVE_PROBE, ProbeQuery(nonce=nonce.hex()).model_dump(), remaining
            )
            probed = parse(ObservedReply, answer)
        except TransportError as exc:
            logger.info("%s did not observe our probe packets: %s", peer.peer_id, exc)
            return seen, None
        return seen, (probed.host, probed.port)

    async def dial_back(self, peer: PeerAddress, timeout: float) -> bool:
        return parse(DialbackReply, await self._ask(peer, DIALBACK, {}, timeout)).reachable

    async def connect_indirect(self, peer: PeerAddress) -> QuicLink:
        """A connection to an unreachable peer through its rendezvous: reversal or hole
        punching after an introduction, else a relay channel."""
        rendezvous = peer.rendezvous
        if rendezvous is None:
            raise ConnectError(f"{peer.peer_id} is unreachable and names no rendezvous")
        if rendezvous.peer_id == self.identity.peer_id:  # we are its rendezvous
            link = self._connections.link_for(peer.peer_id)
            if link is None:
                raise ConnectError(f"{peer.peer_id} has no connection to us, its rendezvous")
            return link
        cfg = self.cfg
        try:
            reply = await self._ask(
                rendezvous, INTRODUCE,
                Introduce(target=peer.peer_id, reachable=self.reachable).model_dump(),
                2 * cfg.introduce_timeout_s + self.config.connect_timeout_s,
            )
            observed = parse(ObservedReply, reply)
        except TransportError as exc:
            logger.info("introduction to %s through %s failed: %s",
                        peer.peer_id, rendezvous.peer_id, exc)
        else:
            link = await self._after_introduction(peer, observed)
            if link is not None:
                return link
        return await self._relayed(peer, rendezvous)

    async def _after_introduction(
        self, peer: PeerAddress, observed: ObservedReply
    ) -> QuicLink | None:
        cfg = self.cfg
        if self.reachable:  # it connects to us
            link = await self._connections.wait_link(peer.peer_id, cfg.punch_timeout_s)
            if link is not None and link.path == "direct" and not link.is_client:
                link.path = "reversed"
            if link is None:
                logger.info("%s did not reverse within %.3g s", peer.peer_id, cfg.punch_timeout_s)
            return link
        try:  # it punches toward us; our Initial (retransmitted) punches our side
            return await self._connections.connect(
                peer.peer_id, observed.host, observed.port,
                path="punched", timeout=cfg.punch_timeout_s,
            )
        except (ConnectError, AuthenticationError) as exc:
            logger.info("hole punching to %s at %s:%d failed: %s",
                        peer.peer_id, observed.host, observed.port, exc)
            return None

    async def _relayed(self, peer: PeerAddress, rendezvous: PeerAddress) -> QuicLink:
        cfg = self.cfg
        reply = await self._ask(
            rendezvous, RELAY, RelayRequest(target=peer.peer_id).model_dump(),
            2 * cfg.introduce_timeout_s + self.config.connect_timeout_s,
        )
        token = bytes.fromhex(parse(RelayReply, reply).token)
        to_relay = self._connections.link_for(rendezvous.peer_id)
        if to_relay is None or is_virtual(to_relay.remote_address):
            raise ConnectError(f"connection to the relay {rendezvous.peer_id} is gone")
        ends = self._socket.relay_ends
        end = ends.add(token, to_relay.remote_address, rendezvous.peer_id, peer.peer_id)
        try:
            return await self._connections.connect(
                peer.peer_id, *end.virtual, path="relayed"
            )
        except BaseException:
            ends.remove(end.virtual)
            raise

    # serving

    async def _on_observe(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        _no_relay(remote)
        parse(Empty, header)
        port = await self._open_probe_port()
        alt_port = None if port is None else port.address[1]
        return ObserveReply(host=remote[0], port=remote[1], alt_port=alt_port).model_dump()

    async def _on_observe_probe(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        _no_relay(remote)
        query = parse(ProbeQuery, header)
        if not self._probe_limits.take(peer_id, self._now()):
            raise RemoteError("rate_limited", "too many probe lookups asked")
        port = self._probe_port
        if port is None:
            raise RemoteError("refused", "no alternate port here")
        try:
            seen = await port.wait(bytes.fromhex(query.nonce), self.cfg.probe_wait_s)
        except ValueError:
            raise RemoteError("busy", "too many probe lookups under way") from None
        if seen is None:
            raise RemoteError("unknown_nonce", "no probe packet with this nonce arrived")
        return ObservedReply(host=seen[0], port=seen[1]).model_dump()

    async def _open_probe_port(self) -> ProbePort | None:
        """Our alternate port, opened on first use on the QUIC socket's host (None when
        ``probe_port`` is off or it cannot be bound: then we just do not offer one)."""
        if self._probe_port is not None or self._probe_port_tried or not self.cfg.probe_port:
            return self._probe_port
        async with self._probe_port_lock:
            if not self._probe_port_tried:
                port = ProbePort()
                try:
                    await port.start(self._socket.address[0])
                    self._probe_port = port
                except ConnectError as exc:
                    logger.warning("no alternate port for observations: %s", exc)
                self._probe_port_tried = True
        return self._probe_port

    async def _on_dialback(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        _no_relay(remote)
        parse(Empty, header)
        if not self._dialback_limits.take(peer_id, self._now()):
            raise RemoteError("rate_limited", "too many dial-backs asked")
        if self._dialbacks >= self.cfg.max_dialbacks:
            raise RemoteError("busy", "too many dial-backs under way")
        self._dialbacks += 1
        try:
            reachable = await self._dial_back(peer_id, remote)
        finally:
            self._dialbacks -= 1
        return DialbackReply(reachable=reachable).model_dump()

    async def _dial_back(self, peer_id: str, remote: Address) -> bool:
        probe = QuicSocket(self.identity, self.config, lambda link: None)
        probe.accepting = False
        bound = self._socket.address[0]
        try:
            await probe.start(bound, 0)
        except ConnectError as exc:
            logger.warning("dial-back: no socket for it: %s", exc)
            raise RemoteError("internal", "no socket for the dial-back") from None
        try:
            link = await probe.connect(*remote, timeout=self.cfg.dialback_timeout_s)
            reachable = link.tls_peer_id == peer_id
            await link.refuse(CloseCode.NO_ERROR, "dial-back done", timeout=0.5)
        except (ConnectError, AuthenticationError) as exc:
            logger.info("dial-back to %s at %s:%d: %s", peer_id, *remote, exc)
            reachable = False
        finally:
            await probe.close(timeout=0.5)
        return reachable

    async def _on_introduce(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        _no_relay(remote)
        ask = parse(Introduce, header)
        self._limit(peer_id)
        target = self._target(peer_id, ask.target)
        introduction = Introduction(
            peer=peer_id, host=remote[0], port=remote[1], reachable=ask.reachable,
            nonce=os.urandom(16).hex(), ts=self._wall(),
        )
        await self._tell(target, INTRODUCTION, introduction.model_dump())
        host, port = target.remote_address
        return ObservedReply(host=host, port=port).model_dump()

    async def _on_introduction(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        self._from_rendezvous(peer_id, remote)
        message = parse(Introduction, header)
        self._admit(message.nonce, message.ts, message.peer)
        addr = (message.host, message.port)
        if message.reachable:
            self._spawn(self._reverse(message.peer, addr))
        elif self.cfg.punch_packets > 0:
            self._connections.expect(message.peer, "punched", self.cfg.punch_timeout_s)
            nonce = bytes.fromhex(message.nonce)[:8]
            self._socket.punch(addr, self.cfg.punch_packets, self.cfg.punch_interval_s, nonce)
        else:
            raise RemoteError("refused", "hole punching is off here")
        return {}

    async def _reverse(self, peer_id: str, addr: Address) -> None:
        try:
            await self._connections.dial(
                peer_id, *addr, path="reversed", timeout=self.cfg.punch_timeout_s
            )
        except TransportError as exc:
            logger.info("connection reversal to %s at %s:%d failed: %s", peer_id, *addr, exc)

    async def _on_relay(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        _no_relay(remote)
        ask = parse(RelayRequest, header)
        if self.relay is None:
            raise RemoteError("refused", "this peer relays nothing")
        self._limit(peer_id)
        target = self._target(peer_id, ask.target)
        now = asyncio.get_running_loop().time()  # the socket's clock: RelayTable.forward's
        channel = self.relay.allocate(
            (peer_id, remote), (ask.target, target.remote_address), now
        )
        if channel is None:
            raise RemoteError("relay_full", "no relay channel free")
        offer = RelayOffer(
            peer=peer_id, token=channel.b.token.hex(), nonce=os.urandom(16).hex(),
            ts=self._wall(),
        )
        try:
            await self._tell(target, RELAY_OFFER, offer.model_dump())
        except RemoteError:
            self.relay.remove(channel)
            raise
        logger.info("relaying between %s and %s", peer_id, ask.target)
        return RelayReply(token=channel.a.token.hex()).model_dump()

    async def _on_relay_offer(
        self, peer_id: str, remote: Address, header: dict[str, Any]
    ) -> dict[str, Any]:
        self._from_rendezvous(peer_id, remote)
        offer = parse(RelayOffer, header)
        self._admit(offer.nonce, offer.ts, offer.peer)
        ends = self._socket.relay_ends
        end = ends.add(bytes.fromhex(offer.token), remote, peer_id, offer.peer)
        # a channel no connection came through is forgotten; one in use when its link closes
        loop = asyncio.get_running_loop()
        loop.call_later(self.cfg.punch_timeout_s + self.config.connect_timeout_s,
                        self._unused_end, end.virtual)
        return {}

    def _unused_end(self, virtual: Address) -> None:
        if not any(link.remote_address == virtual for link in self._socket.links):
            self._socket.relay_ends.remove(virtual)

    # checks

    def _limit(self, peer_id: str) -> None:
        if not self._asks.take(peer_id, self._now()):
            raise RemoteError("rate_limited", "too many introductions or relay requests")

    def _target(self, peer_id: str, target_id: str) -> QuicLink:
        if target_id in (peer_id, self.identity.peer_id):
            raise RemoteError("bad_request", "cannot introduce a peer to itself or to us")
        target = self._connections.link_for(target_id)
        if target is None or is_virtual(target.remote_address):
            raise RemoteError("unknown_peer", f"{target_id} has no connection to this peer")
        return target

    async def _tell(self, target: QuicLink, kind: str, header: dict[str, Any]) -> None:
        try:
            await self._ask(target, kind, header, self.cfg.introduce_timeout_s)
        except RemoteError as exc:
            raise RemoteError("refused", f"{target.peer_id} refused: {exc}") from None
        except TransportError as exc:
            raise RemoteError("unreachable", f"{target.peer_id} did not answer: {exc}") from None

    def _from_rendezvous(self, peer_id: str, remote: Address) -> None:
        if peer_id not in self._rendezvous or is_virtual(remote):
            raise RemoteError("refused", "introductions are accepted only from our rendezvous")

    def _admit(self, nonce: str, ts: float, peer: str) -> None:
        refusal = self._replay.check(nonce, ts, self._wall())
        if refusal is not None:
            raise RemoteError(refusal, "introduction is stale or was seen before")
        if peer == self.identity.peer_id:
            raise RemoteError("bad_request", "an introduction to ourselves")
        if not self._accepts.take(1.0, self._now()):
            raise RemoteError("rate_limited", "too many introductions")

    # tasks

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, timeout: float) -> None:
        """Stop keeping connections and cancel reversals under way (bounded wait)."""
        self._keepers.clear()
        self._rendezvous.clear()
        self._resolvers.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if self._probe_port is not None:
            await self._probe_port.close(timeout)
            self._probe_port = None


def _no_relay(remote: Address) -> None:
    if is_virtual(remote):
        raise RemoteError("relayed", "not over a relayed connection")
