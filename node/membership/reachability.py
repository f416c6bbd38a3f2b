"""Reachability: the address peers see us at, our NAT's behaviour, and whether they can dial us.

A check asks up to two peers that can be dialled (announced reachable, or not measured
yet) for the address they observe our QUIC socket at, on their QUIC port and, from probe
packets we send from the same socket, on a second port of theirs (transport:
``observe_mapping``, a STUN-style "change port" test); and the first of them to dial us
back from a port we never sent to (``dial_back``):

- observed host is one of our interface addresses: ``public`` (no NAT);
- otherwise behind NAT: ``symmetric`` when any two observations differ (a mapping per
  destination: peers that cannot be dialled are relayed); ``cone`` when at least two agree
  and none differs (the mapping does not depend on the destination, so hole punching
  works): one observer suffices when its second port saw us. A single observation is no
  evidence either way: ``unknown``, or the kind the previous check found behind the same
  public address;
- reachable: the dial-back got through (a public host without a firewall, a forwarded
  port, a full-cone NAT).

One observer's two ports tell a mapping that depends on the destination port (Linux's
``masquerade random``, most "symmetric" routers); one that depends only on the destination
address takes two observers.

A node that is not reachable picks a rendezvous among the peers that answered (the
lowest RTT): the endpoint keeps a connection to it open, and peers that cannot dial us
ask it to introduce them (hole punching, connection reversal) or to relay. What we learn
goes into our record (:class:`~.records.Reach`), announced at once when it changes.

Checks run every few seconds until one succeeds (a first node has nobody to ask), then
every ``node.reach_period``, and again at once when an announced address stops working.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...transport.endpoint import PeerAddress
from ...transport.errors import TransportError
from ...transport.peer_address import Resolver
from ..logs import get_logger, short_peer
from .addresses import dialable, is_loopback, peer_address
from .peers import Peer, PeerTable
from .records import NatKind, PeerRef, QuicAddress, Reach

log = get_logger(__name__)

# peers asked per check for the address they observe (each observes on two ports)
OBSERVERS = 2
# candidates tried per check before giving up until the next one
MAX_TRIES = 4
# seconds between checks while none has succeeded
EARLY_PERIOD_S = 5.0


class ReachEndpoint(Protocol):
    """What a check needs of the transport endpoint."""

    reachable: bool

    async def observe_mapping(
        self, peer: PeerAddress, *, timeout: float
    ) -> tuple[tuple[str, int], tuple[str, int] | None]: ...

    async def dial_back(self, peer: PeerAddress, *, timeout: float) -> bool: ...

    async def keep(
        self, peer: PeerAddress, *, timeout: float, resolve: Resolver | None = None
    ) -> None: ...

    def release(self, peer_id: str) -> None: ...

    def paths(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Observation:
    """Our address as ``peer_id`` saw it on its QUIC port, and on its second port
    (``probed``; None when it could not tell)."""

    peer_id: str
    host: str
    port: int
    probed: tuple[str, int] | None = None


def classify(local_hosts: Sequence[str], observed: Sequence[Observation]) -> NatKind:
    """The NAT kind that ``observed`` shows (module docstring): ``unknown`` unless two
    observations agree or any differ."""
    if not observed:
        return "unknown"
    if observed[0].host in local_hosts:
        return "public"
    seen = [(o.host, o.port) for o in observed]
    seen += [o.probed for o in observed if o.probed is not None]
    if len(set(seen)) > 1:
        return "symmetric"
    return "cone" if len(seen) > 1 else "unknown"


@dataclass
class ReachState:
    """The outcome of the last successful check."""

    nat: NatKind = "unknown"
    reachable: bool = False
    observed: tuple[str, int] | None = None
    observers: tuple[str, ...] = ()  # the peers that observed us, lowest RTT first
    rendezvous: str | None = None
    checks: int = 0
    failures: int = 0


class Reachability:
    """Runs the checks (module docstring) and announces their outcome through ``publish``.

    ``local_hosts`` gives our interface addresses (addresses.local_hosts); ``bound_port``
    is the QUIC port; ``publish(quic, reach)`` changes our announced record."""

    def __init__(
        self,
        endpoint: ReachEndpoint,
        peers: PeerTable,
        *,
        local_hosts: Callable[[], list[str]],
        bound_port: int,
        publish: Callable[[QuicAddress, Reach], None],
        period_s: float,
        timeout_s: float,
        rng: random.Random,
    ) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.local_hosts = local_hosts
        self.bound_port = bound_port
        self.publish = publish
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.rng = rng
        self.state = ReachState()
        self._kept: PeerAddress | None = None  # the rendezvous' address as last handed over
        self._wake = asyncio.Event()

    def recheck(self) -> None:
        """Run a check now (e.g. our announced address stopped working)."""
        self._wake.set()

    async def run(self) -> None:
        """Check until cancelled (module docstring for the schedule)."""
        while True:
            self._wake.clear()  # a recheck asked for during this check runs after it
            try:
                known = await self.check()
            except TransportError as exc:  # a check never takes the node down
                log.info("reachability check failed: %s", exc)
                known = False
            period = self.period_s if known else EARLY_PERIOD_S
            try:
                async with asyncio.timeout(period * (0.9 + 0.2 * self.rng.random())):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _candidates(self) -> list[tuple[Peer, PeerAddress]]:
        """Peers we can dial, or that are connected to us (a first public node has only
        NATed peers, which connected to it), lowest RTT first (unmeasured ones shuffled
        after)."""
        found: list[tuple[float, float, Peer, PeerAddress]] = []
        connected = set(self.endpoint.paths())
        for peer in self.peers.peers():
            record = peer.record
            if record.quic is None or is_loopback(record.quic.host):
                continue
            if not dialable(record.reach) and peer.peer_id not in connected:
                continue
            address = peer_address(record)
            if address is None:
                continue
            rtt = peer.rtt.srtt if peer.rtt.srtt is not None else float("inf")
            found.append((rtt, self.rng.random(), peer, address))
        found.sort(key=lambda item: (item[0], item[1]))
        return [(peer, address) for _, _, peer, address in found[:MAX_TRIES]]

    async def check(self) -> bool:
        """One check; True when at least one peer observed us (the outcome is announced)."""
        observed: list[Observation] = []
        answered: list[PeerAddress] = []
        for _, address in self._candidates():
            try:
                (host, port), probed = await self.endpoint.observe_mapping(
                    address, timeout=self.timeout_s
                )
            except TransportError as exc:
                log.debug("%s did not observe us: %s", short_peer(address.peer_id), exc)
                continue
            observed.append(Observation(address.peer_id, host, port, probed))
            answered.append(address)
            if len(observed) >= OBSERVERS:
                break
        self.state.checks += 1
        if not observed:
            self.state.failures += 1
            return False
        local = self.local_hosts()
        nat = classify(local, observed)
        first = observed[0]
        previous = self.state
        if (
            nat == "unknown"
            and previous.nat in ("cone", "symmetric")
            and previous.observed is not None
            and previous.observed[0] == first.host
        ):  # one observation cannot tell; behind the same public address, the NAT told us
            nat = previous.nat
        reachable = False
        for address in answered:
            try:
                reachable = await self.endpoint.dial_back(address, timeout=self.timeout_s)
                break
            except TransportError as exc:
                log.debug("dial-back by %s failed: %s", short_peer(address.peer_id), exc)
        if nat == "public":
            public = QuicAddress(host=first.host, port=self.bound_port)
        else:
            public = QuicAddress(host=first.host, port=first.port)
        rendezvous: PeerAddress | None = None
        if not reachable:  # the lowest RTT among those that answered and others can dial
            rendezvous = next((a for a in answered if a.reachable), None)
        await self._keep(rendezvous)
        self.endpoint.reachable = reachable
        lan = tuple(
            QuicAddress(host=h, port=self.bound_port) for h in local if not is_loopback(h)
        )[:4] if nat != "public" else ()
        reach = Reach(
            nat=nat,
            reachable=reachable,
            lan=lan,
            rendezvous=None if rendezvous is None else PeerRef(
                peer_id=rendezvous.peer_id,
                quic=QuicAddress(host=rendezvous.host, port=rendezvous.port),
            ),
        )
        changed = (nat, reachable, (first.host, first.port)) != (
            self.state.nat, self.state.reachable, self.state.observed
        )
        self.state.nat, self.state.reachable = nat, reachable
        self.state.observed = (first.host, first.port)
        self.state.observers = tuple(o.peer_id for o in observed)
        self.state.rendezvous = None if rendezvous is None else rendezvous.peer_id
        self.peers.own_public_host = first.host if nat != "public" else None
        if changed:
            log.info(
                "reachability: %s, %s, seen at %s:%d%s",
                nat, "reachable" if reachable else "not reachable", first.host, first.port,
                "" if rendezvous is None else f", rendezvous {short_peer(rendezvous.peer_id)}",
            )
        self.publish(public, reach)
        return True

    async def _keep(self, rendezvous: PeerAddress | None) -> None:
        """Keep a connection to ``rendezvous`` (None: to no one), releasing the previous
        one. The endpoint's keeper looks the rendezvous' address up in the peer table
        before it re-dials (a rendezvous restarted on another port is found again at the
        address it announces, not only at our next check)."""
        kept = self._kept
        if kept is not None and (rendezvous is None or rendezvous.peer_id != kept.peer_id):
            self.endpoint.release(kept.peer_id)
            kept = self._kept = None
        if rendezvous is None or (
            kept is not None and (kept.host, kept.port) == (rendezvous.host, rendezvous.port)
        ):
            return
        self._kept = rendezvous
        try:
            await self.endpoint.keep(rendezvous, timeout=self.timeout_s, resolve=self._resolve)
        except TransportError as exc:  # the endpoint goes on trying in the background
            log.info("rendezvous %s not connected yet: %s", short_peer(rendezvous.peer_id), exc)

    def _resolve(self, peer_id: str) -> PeerAddress | None:
        """The newest address ``peer_id`` announces, if it can be dialled directly. When
        our rendezvous announces another address than the one in our record, a check
        runs at once: it re-announces our rendezvous where peers can reach it."""
        peer = self.peers.get(peer_id)
        if peer is None or peer.record.quic is None or is_loopback(peer.record.quic.host):
            return None
        address = peer_address(peer.record)
        if address is None or not address.reachable:
            return None
        kept = self._kept
        if kept is not None and kept.peer_id == peer_id and (kept.host, kept.port) != (
            address.host, address.port
        ):
            self.recheck()
        return address

    def status(self) -> dict[str, Any]:
        state = self.state
        observed = None if state.observed is None else f"{state.observed[0]}:{state.observed[1]}"
        return {
            "nat": state.nat,
            "reachable": state.reachable,
            "observed": observed,
            "rendezvous": state.rendezvous,
            "checks": state.checks,
        }


__all__ = ["Observation", "Reachability", "ReachEndpoint", "ReachState", "classify"]
