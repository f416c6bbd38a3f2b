"""The prober: pings known peers on a jittered period and feeds the peer table's RTT estimates.

The measuring is behind :class:`RttSource` (``async ping(peer_id, timeout) -> seconds``). Today
the DHT adapter provides it (a timed libp2p ping RPC, dht.py's ``Dht.ping``); the QUIC
endpoint's ``Endpoint.ping(peer, timeout=)`` has the same shape and replaces it when the
transport lands, without changes here. Target choice is a pure function.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import DhtError, ProbeError
from ..logs import get_logger
from ..timing import jittered
from .peers import Peer, PeerTable

log = get_logger(__name__)


class ProberConfig(BaseModel):
    """Periodic RTT probes to the peers this node talks to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    period: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds between probe rounds (jittered)."
    )
    timeout: float = Field(
        default=3.0, gt=0, le=60, description="Seconds to wait for one ping's answer."
    )
    max_peers: int = Field(
        default=16,
        ge=1,
        le=256,
        description="Most peers pinged per round; neighbouring stages go first.",
    )
    min_window: float = Field(
        default=120.0, gt=0, le=86400, description="Seconds over which the minimum RTT is taken."
    )
    jitter: float = Field(
        default=0.2, ge=0, le=0.5, description="Relative jitter of the probe period."
    )

    @model_validator(mode="after")
    def _timeout_fits(self) -> ProberConfig:
        if self.timeout >= self.period:
            raise ValueError(
                f"timeout ({self.timeout}) must be shorter than period ({self.period}); "
                f"lower prober.timeout or raise prober.period"
            )
        return self


@runtime_checkable
class RttSource(Protocol):
    """Anything that can time one round trip to a peer."""

    async def ping(self, peer_id: str, timeout: float) -> float:
        """Seconds for one round trip; raises ProbeError (or DhtError) when none completes."""
        ...


def choose_targets(
    peers: Sequence[Peer], own_stage: int | None, limit: int, rng: random.Random
) -> list[str]:
    """Up to ``limit`` peer ids: peers of our own and neighbouring stages first, in random order.

    Those are the peers a server hands activations to and averages with; the rest are sampled
    so that everyone is measured now and then.
    """
    ids_near: list[str] = []
    ids_far: list[str] = []
    for peer in peers:
        near = own_stage is not None and peer.stage is not None and abs(peer.stage - own_stage) <= 1
        (ids_near if near else ids_far).append(peer.peer_id)
    rng.shuffle(ids_near)
    rng.shuffle(ids_far)
    return (ids_near + ids_far)[:limit]


class Prober:
    """Measures RTTs to peers from ``table`` through ``source`` every ``config.period``
    (jittered)."""

    def __init__(
        self,
        config: ProberConfig,
        source: RttSource,
        table: PeerTable,
        own_stage: Callable[[], int | None],
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        on_sample: Callable[[str, float], None] | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.table = table
        self.own_stage = own_stage
        self.rng = rng
        self.clock = clock
        self.on_sample = on_sample
        self.rounds = 0

    async def run(self) -> None:
        """Probe forever; cancel to stop."""
        while True:
            await asyncio.sleep(jittered(self.config.period, self.config.jitter, self.rng))
            await self.probe_round()

    async def probe_round(self) -> dict[str, float | None]:
        """Ping the chosen peers concurrently; returns peer id -> RTT seconds (None: failed)."""
        targets = choose_targets(
            self.table.peers(), self.own_stage(), self.config.max_peers, self.rng
        )
        results = await asyncio.gather(*(self._probe(peer_id) for peer_id in targets))
        self.rounds += 1
        return dict(zip(targets, results, strict=True))

    async def _probe(self, peer_id: str) -> float | None:
        try:
            async with asyncio.timeout(self.config.timeout):
                rtt = await self.source.ping(peer_id, self.config.timeout)
        except (TimeoutError, ProbeError, DhtError) as exc:
            log.debug("ping to %s failed: %s", peer_id, exc or type(exc).__name__)
            self.table.on_probe_failure(peer_id)
            return None
        self.table.on_rtt_sample(peer_id, rtt, self.clock())
        if self.on_sample is not None:
            self.on_sample(peer_id, rtt)
        return rtt
