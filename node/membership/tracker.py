"""Membership: announcing our record, reading the swarm's, withdrawing on leave.

Talks to the DHT through :class:`RecordStore` (dht.py's ``Dht`` implements it), so it is tested
with an in-memory store. Our record is re-announced at a third of its lifetime (jittered) and
at once when its state, stage or address changes; the swarm's records are read every
``node.membership_period`` (jittered) into the peer table.

Components change what we announce through :meth:`Membership.update` (stage, throughput,
queue length, QUIC address, reachability) and never touch the DHT themselves.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Protocol

from .. import __version__
from ..config.sections import NodeSection
from ..errors import DhtError, RecordError
from ..logs import get_logger, set_log_context, short_peer
from ..metrics import NodeMetrics
from ..timing import jittered
from .peers import PeerTable, TableChanges
from .records import MembershipRead, QuicAddress, Reach, RttRecord, ServerRecord, ServerState

log = get_logger(__name__)

_UNSET: object = object()
# after a failed announce, retry this much sooner than the regular period
_RETRY_FRACTION = 1 / 4


class RecordStore(Protocol):
    async def publish(self, server: ServerRecord, rtt: RttRecord, expiration: float) -> bool: ...

    async def read_membership(self) -> MembershipRead: ...


class Membership:
    """Our announced record and our view of everyone else's."""

    def __init__(
        self,
        store: RecordStore,
        config: NodeSection,
        peer_id: str,
        table: PeerTable,
        rng: random.Random,
        metrics: NodeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config
        self.peer_id = peer_id
        self.table = table
        self.rng = rng
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self.state: ServerState = "joining"
        self.stage: int | None = None
        self.throughput = 0.0
        self.queue = 0
        self.run_id = ""
        self.movable = True
        self.quic: QuicAddress | None = None
        self.reach: Reach | None = None
        self.published = 0
        self.last_announce_ok: bool | None = None
        self.last_read_at: float | None = None
        self._last_expiration = 0.0
        self._changed = asyncio.Event()

    # -- what we announce

    def update(
        self,
        *,
        stage: int | None | object = _UNSET,
        throughput: float | object = _UNSET,
        queue: int | object = _UNSET,
        quic: QuicAddress | None | object = _UNSET,
        reach: Reach | None | object = _UNSET,
        run_id: str | object = _UNSET,
        movable: bool | object = _UNSET,
    ) -> None:
        """Change announced fields; a stage, address or reachability change is announced at
        once."""
        urgent = False
        if stage is not _UNSET and stage != self.stage:
            self.stage = stage  # type: ignore[assignment]
            set_log_context(stage=self.stage)
            urgent = True
        if quic is not _UNSET and quic != self.quic:
            self.quic = quic  # type: ignore[assignment]
            urgent = True
        if reach is not _UNSET and reach != self.reach:
            self.reach = reach  # type: ignore[assignment]
            urgent = True
        if isinstance(run_id, str) and run_id != self.run_id:
            self.run_id = run_id
            urgent = True
        if isinstance(movable, bool) and movable != self.movable:
            self.movable = movable
            urgent = True
        if isinstance(throughput, int | float):
            self.throughput = float(throughput)
        if isinstance(queue, int):
            self.queue = queue
        if urgent:
            self._changed.set()

    def set_state(self, state: ServerState) -> None:
        if state != self.state:
            self.state = state
            self._changed.set()

    def own_record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.peer_id,
            state=self.state,
            stage=self.stage,
            server=self.config.server,
            trainer=self.config.trainer,
            movable=self.movable,
            throughput=self.throughput,
            queue=self.queue,
            quic=self.quic,
            reach=self.reach,
            version=__version__,
            run_id=self.run_id,
        )

    async def announce(self) -> bool:
        """Store our record now (expiring after node.record_ttl). Raises DhtError on failure.

        Expirations only grow: hivemind refuses a sub-key value that does not expire later than
        the one it holds, so after a backward step of the wall clock we keep counting from the
        last one rather than being refused until the clock catches up.
        """
        expiration = max(self.wall_clock() + self.config.record_ttl, self._last_expiration + 0.001)
        rtts = RttRecord(peer_id=self.peer_id, rtts=self.table.measured_rtts(self.clock()))
        return await self._publish(self.own_record(), rtts, expiration)

    async def _publish(self, server: ServerRecord, rtts: RttRecord, expiration: float) -> bool:
        # remembered before sending: a store that timed out may still have landed somewhere
        self._last_expiration = max(self._last_expiration, expiration)
        try:
            ok = await self.store.publish(server, rtts, expiration)
        except DhtError:
            self.last_announce_ok = False
            if self.metrics is not None:
                self.metrics.publish_failures.inc()
            raise
        self.last_announce_ok = ok
        if ok:
            self.published += 1
        if self.metrics is not None:
            (self.metrics.records_published if ok else self.metrics.publish_failures).inc()
        return ok

    @property
    def has_announced(self) -> bool:
        """Whether a record of ours may be in the DHT (a store was at least attempted)."""
        return self._last_expiration > 0

    async def announce_loop(self, first_delay: float = 0.0) -> None:
        """Re-announce at a third of the record lifetime (jittered), or at once on a change."""
        period = self.config.record_ttl / 3
        delay = first_delay
        while True:
            if delay > 0:
                try:
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                except TimeoutError:
                    pass
            self._changed.clear()
            try:
                ok = await self.announce()
            except (DhtError, RecordError) as exc:
                log.warning("announce failed: %s", exc)
                ok = False
            if not ok:
                log.debug("announce not accepted; retrying early")
            fraction = 1.0 if ok else _RETRY_FRACTION
            delay = jittered(period * fraction, self.config.announce_jitter, self.rng)

    async def withdraw(self) -> bool:
        """Replace our records with tombstones (state ``left``) so peers stop listing us now.

        hivemind refuses a sub-key value that expires earlier than the one it holds, so the
        tombstone expires just after the last record we ever sent (and at least a second from
        now); readers drop ``left`` at once.
        """
        self.state = "left"
        expiration = max(self._last_expiration + 0.001, self.wall_clock() + 1.0)
        tombstone = self.own_record()
        return await self._publish(tombstone, RttRecord(peer_id=self.peer_id), expiration)

    # -- what we read

    async def refresh(self) -> TableChanges:
        """Read the run's records into the peer table. Raises DhtError when the read fails."""
        try:
            read = await self.store.read_membership()
        except DhtError:
            if self.metrics is not None:
                self.metrics.membership_reads.labels("failed").inc()
            raise
        now = self.clock()
        changes = self.table.apply(read.servers, read.rtts, now, self.wall_clock())
        self.last_read_at = now
        if self.metrics is not None:
            self.metrics.membership_reads.labels("ok").inc()
            self.metrics.count_dropped(read.dropped)
            self.metrics.observe_table(self.table, now)
        for peer_id in changes.joined:
            peer = self.table.get(peer_id)
            stage = "-" if peer is None or peer.stage is None else peer.stage
            log.info(
                "peer %s joined (stage %s, %d known)", short_peer(peer_id), stage, len(self.table)
            )
        for peer_id in changes.left:
            log.info("peer %s left (%d known)", short_peer(peer_id), len(self.table))
        return changes

    async def refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except DhtError as exc:
                log.warning("reading the swarm's records failed: %s", exc)
            await asyncio.sleep(
                jittered(self.config.membership_period, self.config.announce_jitter, self.rng)
            )
