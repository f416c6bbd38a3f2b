"""Router: which peer of a stage gets the next hop of a micro-batch (pure, SWARM wiring).

The trainer asks, for one hop, which of a stage's live servers should serve it. The
router estimates each candidate's completion time from what it knows::

    cost = rtt                                          (measured by QUIC, else announced)
         + (queue_len + in_flight_from_us + 1) * batch / throughput   (queued work, ours)
         + payload_bytes * 8 / delivery_rate            (transfer at the measured rate)

and samples a peer with probability proportional to ``exp(-(cost - best) / tau)``, where
``tau = temperature * best + min_temperature_s``. The randomness is SWARM's stochastic
wiring: ties and near-ties are broken at random so that trainers that see the same
records do not all pile onto the same server, while a clearly slower peer is rarely
picked. Counting our own in-flight requests makes load spread in proportion to
throughput even between announcements of the (stale) queue length.

A peer that times out, errs or answers ``busy`` is banned for ``ban_base_s * 2**(k-1)``
seconds after its ``k``-th consecutive failure (capped at ``ban_max_s``, multiplied by a
jitter in ``[1 - ban_jitter, 1 + ban_jitter]``); a success resets ``k``. Failures of
requests that were already in flight when the ban began do not escalate it, and once the
ban ends the peer gets one probe at a time until it answers (half-open breaker). Banned
peers are skipped unless every candidate of the stage is banned, in which case the bans
are ignored (a stage with only sick peers is still better than no progress).

Throughput is a claim, so it is checked against measurement (issue #13, point 6): the
trainer reports the service time of every hop it completes (its wall time less the
path's RTT and the payload's transfer time, ``observe``), and a peer's figure in the
cost above is ``min(claimed, measured)``, where ``measured`` is the best work/service
time of its last ``measure_window`` hops, work in samples of forward+backward (the unit
of a claim: a forward hop counts a third of its samples); the best, not the mean, since
queueing behind other trainers' work slows a hop, not the server. A peer not yet
measured counts at most the **prior**: ``unmeasured_claim_ratio`` times the lower median
of the figures of its stage's other candidates (measured ones at their measured figure),
so a claim of 1e12 buys an unmeasured peer the share of a server a few times faster than
a typical one of its stage, not every hop, and its first replies measure it. A peer
convicted of lying (a spot check, ``convict``) is excluded for good.

Nothing here does I/O or reads a clock: ``now`` and ``rng`` are arguments, so tests are
exact.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RouterConfig(BaseModel):
    """How the trainer picks a server per hop and backs off from failing ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(
        default=0.1,
        ge=0.0,
        le=10.0,
        description=(
            "Randomness of the choice, relative to the best expected time: a peer whose "
            "expected time exceeds the best by temperature*best is e times less likely. "
            "0 picks the best peer (ties at random)."
        ),
    )
    min_temperature_s: float = Field(
        default=0.002,
        ge=0.0,
        le=10.0,
        description="Absolute floor of the temperature, seconds "
        "(spreads load when all costs are tiny).",
    )
    default_rtt_s: float = Field(
        default=0.1,
        gt=0.0,
        le=60.0,
        description="RTT assumed for a peer with no measurement, seconds.",
    )
    default_delivery_rate_bps: float = Field(
        default=100e6,
        gt=0.0,
        description="Delivery rate assumed for a peer with no measurement, bits per second.",
    )
    min_throughput: float = Field(
        default=0.1,
        gt=0.0,
        description="Floor of a peer's announced throughput, samples/s (a 0 or absent figure).",
    )
    ban_base_s: float = Field(
        default=1.0,
        gt=0.0,
        le=3600.0,
        description="Ban after a first failure, seconds (then doubles).",
    )
    ban_max_s: float = Field(default=60.0, gt=0.0, le=86400.0, description="Longest ban, seconds.")
    ban_jitter: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="Bans are multiplied by a uniform factor in [1-j, 1+j].",
    )
    unmeasured_claim_ratio: float = Field(
        default=4.0,
        ge=1.0,
        le=1000.0,
        description=(
            "A peer not yet measured counts at most this many times the lower median of "
            "its stage's other servers' figures (a huge claim buys no more until measured)."
        ),
    )
    measure_window: int = Field(
        default=16,
        ge=1,
        le=1024,
        description=(
            "Hops of a peer whose best service rate is its measured throughput "
            "(the claim is clamped to it)."
        ),
    )
    min_service_s: float = Field(
        default=1e-4,
        gt=0.0,
        le=10.0,
        description=(
            "Floor of a hop's service time, seconds (a hop faster than the RTT estimate "
            "says nothing about the server's speed)."
        ),
    )

    @model_validator(mode="after")
    def _ban_bounds(self) -> RouterConfig:
        if self.ban_max_s < self.ban_base_s:
            raise ValueError(
                f"ban_max_s ({self.ban_max_s}) must be at least ban_base_s ({self.ban_base_s})"
            )
        return self


@dataclass(frozen=True)
class Candidate:
    """What the router knows about one server of a stage at the time of a hop."""

    peer_id: str
    throughput: float  # announced samples/s of forward+backward
    queue_len: int = 0  # announced queued requests (stale by up to one announce period)
    rtt_s: float | None = None  # smoothed RTT, seconds, None if never measured
    delivery_rate_bps: float | None = None  # measured delivery rate to the peer, bits/s


def _positive_or(value: float | None, default: float) -> float:
    """``value`` if it is a finite positive number, else ``default`` (records are untrusted)."""
    if value is None or not math.isfinite(value) or value <= 0.0:
        return default
    return value


@dataclass
class _PeerState:
    in_flight: int = 0
    failures: int = 0
    banned_until: float = -math.inf
    convicted: bool = False  # caught lying by a spot check: never chosen again
    rates: deque[float] = field(default_factory=deque)  # samples/s of its recent hops

    def measured(self) -> float | None:
        return max(self.rates) if self.rates else None


def lower_median(values: Sequence[float]) -> float | None:
    """The lower median of ``values`` (None if empty): one value cannot move it past the
    others', whatever its size."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class Router:
    """Per-trainer routing state: in-flight counts, consecutive failures and bans."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._peers: dict[str, _PeerState] = {}

    def _state(self, peer_id: str) -> _PeerState:
        state = self._peers.get(peer_id)
        if state is None:
            state = self._peers[peer_id] = _PeerState()
        return state

    # ---- estimates ----------------------------------------------------------------

    def claimed(self, candidate: Candidate) -> float:
        """The candidate's announced throughput, floored (a 0, absent or absurd figure)."""
        cfg = self.config
        return max(_positive_or(candidate.throughput, cfg.min_throughput), cfg.min_throughput)

    def measured(self, peer_id: str) -> float | None:
        """Samples/s measured of ``peer_id`` (its best recent hop), None if never measured."""
        state = self._peers.get(peer_id)
        return state.measured() if state is not None else None

    def effective_throughputs(self, candidates: Sequence[Candidate]) -> dict[str, float]:
        """Each candidate's throughput as the router counts it: ``min(claimed, measured)``
        once measured, else ``min(claimed, prior)`` with the prior the lower median of the
        other candidates' figures (see the module docstring)."""
        known: dict[str, float] = {}
        for c in candidates:
            measured = self.measured(c.peer_id)
            if measured is not None:
                known[c.peer_id] = min(self.claimed(c), measured)
        out: dict[str, float] = {}
        for c in candidates:
            if c.peer_id in known:
                out[c.peer_id] = known[c.peer_id]
                continue
            others = [
                known.get(o.peer_id, self.claimed(o)) for o in candidates if o.peer_id != c.peer_id
            ]
            median = lower_median(others)
            prior = None if median is None else median * self.config.unmeasured_claim_ratio
            out[c.peer_id] = self.claimed(c) if prior is None else min(self.claimed(c), prior)
        return out

    def observe(self, peer_id: str, *, batch_size: float, service_s: float) -> None:
        """``batch_size`` samples of forward+backward work (a forward hop counts a third of
        its samples) took ``peer_id`` ``service_s`` seconds (wall time less RTT and
        transfer): one measurement of its throughput."""
        if not math.isfinite(service_s) or batch_size <= 0:
            return
        state = self._state(peer_id)
        state.rates.append(batch_size / max(service_s, self.config.min_service_s))
        while len(state.rates) > self.config.measure_window:
            state.rates.popleft()

    def expected_time(
        self,
        candidate: Candidate,
        *,
        payload_bytes: int,
        batch_size: int,
        throughput: float | None = None,
    ) -> float:
        """Expected seconds until ``candidate`` answers a hop of ``batch_size`` samples, at
        ``throughput`` (default: its claim clamped to its measurement)."""
        cfg = self.config
        rtt = _positive_or(candidate.rtt_s, cfg.default_rtt_s)
        rate = _positive_or(candidate.delivery_rate_bps, cfg.default_delivery_rate_bps)
        if throughput is None:
            measured = self.measured(candidate.peer_id)
            throughput = self.claimed(candidate)
            if measured is not None:
                throughput = min(throughput, measured)
        throughput = max(throughput, cfg.min_throughput)
        state = self._peers.get(candidate.peer_id)
        ours = state.in_flight if state is not None else 0
        queued = max(candidate.queue_len, 0) + ours + 1
        return rtt + queued * batch_size / throughput + payload_bytes * 8.0 / rate

    # ---- choice -------------------------------------------------------------------

    def is_banned(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` is banned at ``now``."""
        state = self._peers.get(peer_id)
        return state is not None and state.banned_until > now

    def is_available(self, peer_id: str, now: float) -> bool:
        """Not banned, and not on probation with a probe already in flight.

        A peer whose ban has ended but that has not answered successfully since gets one
        request at a time (a half-open circuit breaker): a dead peer that looks fast must
        not swallow a whole window of hops each time its ban ends.
        """
        state = self._peers.get(peer_id)
        if state is None:
            return True
        if state.convicted or state.banned_until > now:
            return False
        return state.failures == 0 or state.in_flight == 0

    def convict(self, peer_id: str) -> None:
        """``peer_id`` was caught lying: it is never chosen again (not even when every
        other candidate is banned), whatever stage it serves."""
        self._state(peer_id).convicted = True

    def is_convicted(self, peer_id: str) -> bool:
        state = self._peers.get(peer_id)
        return state is not None and state.convicted

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        payload_bytes: int | Mapping[str, int],
        batch_size: int,
        now: float,
        rng: random.Random,
        avoid: Iterable[str] = (),
    ) -> Candidate | None:
        """Sample the server for one hop; None only when ``candidates`` is empty (or all
        of them are convicted).

        ``payload_bytes`` may differ per peer (a server that still caches the input needs
        only the gradient). Peers in ``avoid`` (already tried for this hop) and banned peers
        are skipped while any other candidate remains; otherwise they are used anyway,
        avoided ones last.
        """
        candidates = [c for c in candidates if not self.is_convicted(c.peer_id)]
        if not candidates:
            return None
        avoided = set(avoid)
        pool = [
            c for c in candidates if c.peer_id not in avoided and self.is_available(c.peer_id, now)
        ]
        if not pool:
            # every fresh peer is banned: ignore bans, but still prefer untried peers
            pool = [c for c in candidates if c.peer_id not in avoided] or list(candidates)
        effective = self.effective_throughputs(candidates)

        def size(c: Candidate) -> int:
            if isinstance(payload_bytes, int):
                return payload_bytes
            return payload_bytes.get(c.peer_id, max(payload_bytes.values(), default=0))

        costs = [
            self.expected_time(
                c, payload_bytes=size(c), batch_size=batch_size, throughput=effective[c.peer_id]
            )
            for c in pool
        ]
        best = min(costs)
        tau = self.config.temperature * best + self.config.min_temperature_s
        if tau <= 0.0:
            ties = [c for c, cost in zip(pool, costs, strict=False) if cost == best]
            return ties[rng.randrange(len(ties))]
        weights = [math.exp(-(cost - best) / tau) for cost in costs]
        pick = rng.random() * sum(weights)
        for candidate, weight in zip(pool, weights, strict=False):
            pick -= weight
            if pick < 0.0:
                return candidate
        return pool[-1]  # rounding left a sliver at the end

    # ---- outcomes -----------------------------------------------------------------

    def started(self, peer_id: str) -> None:
        """A request to ``peer_id`` is now in flight."""
        self._state(peer_id).in_flight += 1

    def finished(self, peer_id: str, *, ok: bool, now: float, rng: random.Random) -> float | None:
        """A request to ``peer_id`` ended; on failure the peer is banned. Returns the ban (s)."""
        state = self._state(peer_id)
        state.in_flight = max(0, state.in_flight - 1)
        if ok:
            state.failures = 0
            return None
        return self.ban(peer_id, now=now, rng=rng)

    def ban(self, peer_id: str, *, now: float, rng: random.Random) -> float:
        """Ban ``peer_id`` with exponential, jittered back-off; returns the ban length (s).

        A failure reported while the peer is already banned (a request sent before the
        ban, failing late) neither escalates nor extends it: one outage is one failure,
        however many requests it caught in flight. Returns 0.0 in that case.
        """
        cfg = self.config
        state = self._state(peer_id)
        if state.banned_until > now:
            return 0.0
        state.failures += 1
        # 2**(k-1) overflows float for absurd k; the cap makes anything past 2**60 equal
        base = cfg.ban_base_s * 2.0 ** min(state.failures - 1, 60)
        duration = min(base, cfg.ban_max_s) * (1.0 + cfg.ban_jitter * (2.0 * rng.random() - 1.0))
        state.banned_until = now + duration
        return duration

    def clear_ban(self, peer_id: str) -> None:
        """Forget ``peer_id``'s failures and ban (it now serves another stage: a new server)."""
        state = self._peers.get(peer_id)
        if state is not None:
            state.failures = 0
            state.banned_until = -math.inf

    def in_flight(self, peer_id: str) -> int:
        """Requests this trainer has in flight to ``peer_id``."""
        state = self._peers.get(peer_id)
        return state.in_flight if state is not None else 0

    def failures(self, peer_id: str) -> int:
        """Consecutive failures of ``peer_id`` since its last success."""
        state = self._peers.get(peer_id)
        return state.failures if state is not None else 0

    def banned_until(self, peer_id: str) -> float | None:
        """When the ban of ``peer_id`` ends, or None if it was never banned."""
        state = self._peers.get(peer_id)
        if state is None or state.banned_until == -math.inf:
            return None
        return state.banned_until

    def prune(self, live: Iterable[str], now: float) -> None:
        """Forget peers not in ``live`` that have nothing in flight and no running ban."""
        keep = set(live)
        for peer_id in [p for p in self._peers if p not in keep]:
            state = self._peers[peer_id]
            if state.in_flight == 0 and state.banned_until <= now and not state.convicted:
                del self._peers[peer_id]

    def __len__(self) -> int:
        return len(self._peers)
