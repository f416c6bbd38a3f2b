"""The peer table: what this node knows about the other peers of its run.

Pure (ARCHITECTURE §4): it is fed the records read from the DHT and the RTT samples the prober
or the transport measured, each call taking ``now``; it never does I/O. The trainer's router
will add loss/delivery rates and bans here; today it holds records and RTT estimates.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from ...transport.endpoint import PeerAddress
from .addresses import dialable, peer_address
from .records import (
    LISTED_STATES,
    MAX_RTT_ENTRIES,
    QuicAddress,
    RttEntry,
    RttRecord,
    ServerRecord,
    ServerState,
)
from .rtt import RttEstimator


@dataclass
class Peer:
    """One known peer: its latest record, when it expires, and our RTT estimate to it."""

    record: ServerRecord
    expiration: float  # wall-clock (DHT time)
    first_seen: float  # monotonic
    rtt: RttEstimator
    reported_rtts: dict[str, RttEntry] = field(default_factory=dict)  # what it measured to others

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def stage(self) -> int | None:
        return self.record.stage


@dataclass(frozen=True)
class ServerPeer:
    """A peer that serves a stage, as :meth:`PeerTable.servers` lists it."""

    peer: Peer
    stage: int
    quic: QuicAddress  # the address it announces
    address: PeerAddress  # how we reach it (addresses.peer_address: LAN, NAT traversal)

    @property
    def record(self) -> ServerRecord:
        return self.peer.record


@dataclass(frozen=True)
class TableChanges:
    joined: tuple[str, ...]
    left: tuple[str, ...]


# the states in which a server takes part in its stage's averaging
SERVING_STATES: frozenset[ServerState] = frozenset({"online", "draining"})
# how long a server that stopped serving a stage is remembered as gone from it: longer than
# hivemind's progress records live (metadata_expiration, 60 s), which is what it is for
GONE_MEMORY_S = 600.0


class PeerTable:
    """Peers of the run other than ourselves, keyed by peer id."""

    def __init__(self, own_peer_id: str, rtt_window: float = 120.0) -> None:
        self.own_peer_id = own_peer_id
        self.rtt_window = rtt_window
        self._peers: dict[str, Peer] = {}
        # (peer id, stage) of servers seen serving a stage -> when they stopped (None: they
        # still do); ``gone`` is the stopped ones, replaced (never changed) at each read so
        # that other threads may read it (the stage's progress tracker: ``gone_from``)
        self._served: dict[tuple[str, int], float | None] = {}
        self.gone: frozenset[tuple[str, int]] = frozenset()
        # our public address when we sit behind NAT (reachability.py): peers announcing the
        # same one are behind our NAT too, and reached at their LAN address
        self.own_public_host: str | None = None

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: str) -> Peer | None:
        return self._peers.get(peer_id)

    def peers(self) -> list[Peer]:
        """Known peers ordered by stage (unassigned last), then peer id."""
        return sorted(
            self._peers.values(),
            key=lambda p: (p.stage is None, p.stage if p.stage is not None else 0, p.peer_id),
        )

    def servers(
        self,
        states: Collection[ServerState] = LISTED_STATES,
        *,
        stage: int | None = None,
        run_id: str | None = None,
    ) -> list[ServerPeer]:
        """The peers whose records announce a stage server we can reach, in ``peers()`` order.

        A record counts when it says ``server``, names a stage and a QUIC address, and its
        state is one of ``states``; ``stage`` and ``run_id`` (the run spec's hash) narrow
        the list to that stage or that spec. Every view of the swarm's servers (stage
        selection, state donors, the trainer's routing) is built from this list.
        """
        out = []
        for peer in self.peers():
            record = peer.record
            if not record.server or record.stage is None or record.quic is None:
                continue
            if record.state not in states:
                continue
            if (stage is not None and record.stage != stage) or (
                run_id is not None and record.run_id != run_id
            ):
                continue
            address = self._address(record)
            assert address is not None  # record.quic is set
            out.append(ServerPeer(peer, record.stage, record.quic, address))
        return out

    def address(self, peer_id: str) -> PeerAddress | None:
        """How to reach ``peer_id`` (addresses.peer_address), None if unknown or unannounced."""
        peer = self._peers.get(peer_id)
        return None if peer is None else self._address(peer.record)

    def _address(self, record: ServerRecord) -> PeerAddress | None:
        """addresses.peer_address, with the rendezvous at the address the rendezvous itself
        announces: a record names its rendezvous as it was at its last reachability check,
        and a rendezvous that restarted on another port is reached at its new one (as its
        own record says) until the peer's next check re-announces it."""
        address = peer_address(record, self.own_public_host)
        ref = None if address is None else address.rendezvous
        if address is None or ref is None:
            return address
        rendezvous = self._peers.get(ref.peer_id)
        if rendezvous is None or rendezvous.record.quic is None:
            return address
        quic = rendezvous.record.quic
        if (quic.host, quic.port) == (ref.host, ref.port) or not dialable(rendezvous.record.reach):
            return address
        return replace(address, rendezvous=PeerAddress(ref.peer_id, quic.host, quic.port))

    def apply(
        self,
        servers: Mapping[str, tuple[ServerRecord, float]],
        rtts: Mapping[str, RttRecord],
        now: float,
        wall_now: float,
    ) -> TableChanges:
        """Replace the table's view with a complete read of ``{run}.servers`` and ``{run}.rtt``.

        ``servers`` maps peer id -> (record, expiration). Ourselves, tombstones (state ``left``)
        and records expired by ``wall_now`` are skipped; peers absent from the read are dropped
        with their RTT state. Call only with a read that succeeded.
        """
        listed = {
            peer_id: (record, expiration)
            for peer_id, (record, expiration) in servers.items()
            if peer_id != self.own_peer_id
            and record.state in LISTED_STATES
            and expiration > wall_now
        }
        left = tuple(sorted(set(self._peers) - set(listed)))
        for peer_id in left:
            del self._peers[peer_id]
        joined = []
        for peer_id, (record, expiration) in listed.items():
            peer = self._peers.get(peer_id)
            if peer is None:
                peer = Peer(record, expiration, now, RttEstimator(self.rtt_window))
                self._peers[peer_id] = peer
                joined.append(peer_id)
            else:
                peer.record, peer.expiration = record, expiration
            rtt_record = rtts.get(peer_id)
            peer.reported_rtts = dict(rtt_record.rtts) if rtt_record is not None else {}
        self._note_serving(listed, now)
        return TableChanges(tuple(sorted(joined)), left)

    def _note_serving(
        self, listed: Mapping[str, tuple[ServerRecord, float]], now: float
    ) -> None:
        serving = {
            (peer_id, record.stage) for peer_id, (record, _) in listed.items()
            if record.server and record.stage is not None and record.state in SERVING_STATES
        }
        for key in serving:
            self._served[key] = None
        for key, since in list(self._served.items()):
            if key in serving:
                continue
            if since is None:
                self._served[key] = now
            elif now - since > GONE_MEMORY_S:
                del self._served[key]
        self.gone = frozenset(key for key, since in self._served.items() if since is not None)

    def gone_from(self, stage: int) -> frozenset[str]:
        """Peers that served ``stage`` and no longer do: their record expired or was
        withdrawn, or names another stage, or is back at ``joining`` (restarted and loading
        its state). A peer never seen serving the stage is not in it. Safe from any thread.

        What it is for: a stage's averaging counts the other replicas from their progress
        records in hivemind's DHT, which live for 60 s after a replica dies; its server
        record goes within ``node.record_ttl`` (membership/dht.py's tracker drops the
        progress records of these peers)."""
        return frozenset(peer_id for peer_id, s in self.gone if s == stage)

    def on_rtt_sample(self, peer_id: str, rtt: float, now: float) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.rtt.on_sample(rtt, now)

    def on_probe_failure(self, peer_id: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.rtt.on_failure()

    def by_stage(self) -> dict[int | None, list[Peer]]:
        out: dict[int | None, list[Peer]] = {}
        for peer in self.peers():
            out.setdefault(peer.stage, []).append(peer)
        return out

    def measured_rtts(self, now: float, limit: int = MAX_RTT_ENTRIES) -> dict[str, RttEntry]:
        """Our estimates to publish in ``{run}.rtt``: peers with samples, most recent first."""
        measured = [p for p in self._peers.values() if p.rtt.srtt is not None]
        measured.sort(key=lambda p: -(p.rtt.last_sample_at or 0.0))
        out = {}
        for peer in measured[:limit]:
            srtt = peer.rtt.srtt
            assert srtt is not None
            low = peer.rtt.min_rtt(now)
            out[peer.peer_id] = RttEntry(
                srtt_ms=round(srtt * 1000, 3), min_ms=None if low is None else round(low * 1000, 3)
            )
        return out

    def peer_ids(self) -> Iterable[str]:
        return self._peers.keys()
