"""One direction of an emulated WAN link, without I/O: loss, a drop-tail queue, a
serializer at the link rate, propagation delay and jitter.

This is the packet-scheduling core of the user-space WAN emulator (``wan.py``, which
only pumps it). Every decision takes ``now`` (seconds, any monotonic origin) and draws
randomness from the ``random.Random`` it was given, so a seeded link is reproducible
packet for packet and is tested without sockets.

The path of a packet offered at time ``now``::

    loss model ──lost──> counted as ``lost``
        │ kept
    drop-tail queue ──full──> counted as ``overflow``
        │ queued
    serializer: finishes at max(now, link free) + size * 8 / rate
        │
    propagation delay ± jitter (FIFO unless ``reorder``) ──> due for delivery

Random loss is applied on ingress, before the queue, so a lost packet takes neither
queue space nor link time (netem applies its loss the same way). The queue holds the
packets that have not finished serialization, the one on the wire included, so its
bound covers everything the link still owes.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from dataclasses import dataclass, fields
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "BernoulliLoss",
    "GilbertElliottLoss",
    "LinkCounters",
    "LinkEmulator",
    "LinkProfile",
    "LossModel",
    "LossSpec",
    "Verdict",
    "make_loss_model",
]

T = TypeVar("T")
_IPV4_UDP_HEADER_BYTES = 28


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BernoulliLoss(_Model):
    """Independent loss: every packet is dropped with the same probability."""

    kind: Literal["bernoulli"] = "bernoulli"
    rate: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Probability that a packet is lost."
    )

    @property
    def mean_loss_rate(self) -> float:
        """Long-run fraction of packets lost."""
        return self.rate


class GilbertElliottLoss(_Model):
    """Bursty loss: a two-state Markov chain (Good, Bad) stepped once per packet.

    In state Good a packet is lost with probability ``loss_good``, in Bad with
    ``loss_bad``. With the defaults (0 and 1: Gilbert's model) losses come in bursts
    whose length is geometric with mean ``1 / p_bad_to_good``.
    """

    kind: Literal["gilbert_elliott"] = "gilbert_elliott"
    p_good_to_bad: float = Field(
        ..., ge=0.0, le=1.0, description="Per-packet probability of moving from Good to Bad."
    )
    p_bad_to_good: float = Field(
        ..., gt=0.0, le=1.0, description="Per-packet probability of moving from Bad to Good."
    )
    loss_good: float = Field(default=0.0, ge=0.0, le=1.0, description="Loss probability in Good.")
    loss_bad: float = Field(default=1.0, ge=0.0, le=1.0, description="Loss probability in Bad.")

    @classmethod
    def from_mean(cls, loss_rate: float, mean_burst: float) -> GilbertElliottLoss:
        """Gilbert's model (loss 0 in Good, 1 in Bad) with a given long-run loss rate and
        mean burst length in packets: pi_bad = p / (p + r) = loss_rate, r = 1 / mean_burst."""
        if not 0.0 <= loss_rate < 1.0 or mean_burst < 1.0:
            raise ValueError("need 0 <= loss_rate < 1 and mean_burst >= 1")
        r = 1.0 / mean_burst
        p = loss_rate * r / (1.0 - loss_rate)
        return cls(p_good_to_bad=min(p, 1.0), p_bad_to_good=r)

    @property
    def mean_loss_rate(self) -> float:
        """Long-run fraction of packets lost (stationary distribution of the chain)."""
        total = self.p_good_to_bad + self.p_bad_to_good
        pi_bad = self.p_good_to_bad / total
        return pi_bad * self.loss_bad + (1.0 - pi_bad) * self.loss_good


LossSpec = Annotated[BernoulliLoss | GilbertElliottLoss, Field(discriminator="kind")]


class LinkProfile(_Model):
    """One direction of a link. ``rate_bps=None`` means no rate limit (and no queue)."""

    rate_bps: float | None = Field(
        default=None, gt=0.0, description="Link rate in bits per second; None for unlimited."
    )
    delay_s: float = Field(
        default=0.0, ge=0.0, le=10.0, description="One-way propagation delay, seconds."
    )
    jitter_s: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Each packet's propagation delay is delay_s plus a uniform draw in "
        "[-jitter_s, +jitter_s] (never below zero).",
    )
    reorder: bool = Field(
        default=False,
        description="Let jitter reorder packets. False keeps FIFO order: a packet is never "
        "delivered before the one sent ahead of it.",
    )
    loss: LossSpec = Field(default=BernoulliLoss(), description="Random loss model.")
    queue_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Drop-tail bound on queued bytes (packet on the wire included).",
    )
    queue_packets: int | None = Field(
        default=None,
        ge=1,
        description="Drop-tail bound on queued packets (packet on the wire included).",
    )
    mtu_bytes: int = Field(
        default=1500,
        ge=1228,
        le=65535,
        description="Largest IP packet the link carries: a datagram whose UDP payload plus "
        "28 bytes (IPv4 and UDP headers) is larger is dropped, as on a path where it may not "
        "be fragmented (QUIC sets DF, RFC 9000 §14). 1500: Ethernet, the internet's usual.",
    )

    @model_validator(mode="after")
    def _queue_bounded(self) -> LinkProfile:
        if self.rate_bps is not None and self.queue_bytes is None and self.queue_packets is None:
            raise ValueError(
                "a rate-limited link needs a queue bound: set queue_bytes or queue_packets"
            )
        return self


class LossModel:
    """A loss process: ``lose(rng)`` decides the fate of the next packet."""

    def lose(self, rng: random.Random) -> bool:
        raise NotImplementedError


class _Bernoulli(LossModel):
    def __init__(self, spec: BernoulliLoss) -> None:
        self._rate = spec.rate

    def lose(self, rng: random.Random) -> bool:
        return self._rate > 0.0 and rng.random() < self._rate


class _GilbertElliott(LossModel):
    def __init__(self, spec: GilbertElliottLoss) -> None:
        self._spec = spec
        self.bad = False  # the chain starts in Good

    def lose(self, rng: random.Random) -> bool:
        s = self._spec
        if self.bad:
            if rng.random() < s.p_bad_to_good:
                self.bad = False
        elif rng.random() < s.p_good_to_bad:
            self.bad = True
        p = s.loss_bad if self.bad else s.loss_good
        return p > 0.0 and rng.random() < p


def make_loss_model(spec: BernoulliLoss | GilbertElliottLoss) -> LossModel:
    """The stateful loss process described by ``spec``."""
    if isinstance(spec, BernoulliLoss):
        return _Bernoulli(spec)
    return _GilbertElliott(spec)


class Verdict(enum.Enum):
    """What became of an offered packet."""

    QUEUED = "queued"
    LOST = "lost"
    OVERFLOW = "overflow"
    TOO_BIG = "too_big"  # beyond the link's MTU


@dataclass
class LinkCounters:
    """What one direction did. Invariant:
    ``offered = delivered + lost + overflow + too_big + pending`` (packets and bytes alike)."""

    offered_packets: int = 0
    offered_bytes: int = 0
    delivered_packets: int = 0
    delivered_bytes: int = 0
    lost_packets: int = 0
    lost_bytes: int = 0
    overflow_packets: int = 0
    overflow_bytes: int = 0
    too_big_packets: int = 0  # beyond the link's MTU
    too_big_bytes: int = 0
    queue_hwm_bytes: int = 0
    queue_hwm_packets: int = 0
    total_delay_s: float = 0.0
    max_delay_s: float = 0.0

    @property
    def pending_packets(self) -> int:
        """Packets accepted but not yet delivered."""
        return (
            self.offered_packets
            - self.delivered_packets
            - self.lost_packets
            - self.overflow_packets
            - self.too_big_packets
        )

    @property
    def mean_delay_s(self) -> float:
        """Mean delay added to delivered packets (queue + serialization + propagation)."""
        return self.total_delay_s / self.delivered_packets if self.delivered_packets else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Every counter plus the derived ``pending_packets`` and ``mean_delay_s``."""
        out: dict[str, float | int] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["pending_packets"] = self.pending_packets
        out["mean_delay_s"] = self.mean_delay_s
        return out


class LinkEmulator(Generic[T]):
    """One direction of a link as a sans-I/O packet scheduler.

    ``submit`` a packet when it arrives; ask ``next_deadline`` when to come back and
    ``pop_due`` at (or after) that time for the packets to deliver. ``payload`` is
    opaque: the emulator only looks at ``size``.
    """

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.profile = profile
        self.counters = LinkCounters()
        self._rng = rng
        self._loss = make_loss_model(profile.loss)
        # bytes per second, or None when the link is not rate limited
        self._byte_rate = profile.rate_bps / 8.0 if profile.rate_bps is not None else None
        self._mtu = profile.mtu_bytes  # set_mtu changes it: a route change
        # packets not yet serialized: (serialization end time, size), in FIFO order
        self._backlog: deque[tuple[float, int]] = deque()
        self._backlog_bytes = 0
        self._link_free_at = float("-inf")
        self._last_delivery = float("-inf")
        # (delivery time, sequence number, arrival time, size, payload)
        self._due: list[tuple[float, int, float, int, T]] = []
        self._seq = 0

    @property
    def rate_bps(self) -> float | None:
        """The link rate now, bits per second (None: unlimited)."""
        return self._byte_rate * 8.0 if self._byte_rate is not None else None

    def set_rate(self, rate_bps: float) -> None:
        """Change the rate of a rate-limited link (a route change, a competing burst on a
        shared access link). Packets already queued keep their schedule; the ones offered
        from now on are serialized at the new rate."""
        if self._byte_rate is None:
            raise ValueError("only a rate-limited link can change its rate")
        if not rate_bps > 0.0:
            raise ValueError("rate_bps must be positive")
        self._byte_rate = rate_bps / 8.0

    @property
    def mtu_bytes(self) -> int:
        """The largest IP packet the link carries now."""
        return self._mtu

    def set_mtu(self, mtu_bytes: int) -> None:
        """Change the largest IP packet the link carries (a route change onto a path with
        a smaller or larger MTU, with no ICMP telling the sender: a black hole for what no
        longer fits). Packets already queued are delivered."""
        if not 1228 <= mtu_bytes <= 65535:
            raise ValueError(f"mtu_bytes must be 1228-65535, got {mtu_bytes}")
        self._mtu = mtu_bytes

    def queue_bytes(self, now: float) -> int:
        """Bytes queued or on the wire at ``now``."""
        self._expire_backlog(now)
        return self._backlog_bytes

    def queue_packets(self, now: float) -> int:
        """Packets queued or on the wire at ``now``."""
        self._expire_backlog(now)
        return len(self._backlog)

    def submit(self, payload: T, size: int, now: float, *, stream: bool = False) -> Verdict:
        """Offer a packet of ``size`` bytes at ``now``; returns whether it was queued.

        ``stream``: a chunk of a byte stream (the TCP relay's): never lost, never dropped
        by the queue (its sender waits for room instead, as TCP's flow control would:
        :meth:`room`) and never reordered, whatever the profile says."""
        c = self.counters
        c.offered_packets += 1
        c.offered_bytes += size
        if not stream and size + _IPV4_UDP_HEADER_BYTES > self._mtu:
            c.too_big_packets += 1
            c.too_big_bytes += size
            return Verdict.TOO_BIG
        if not stream and self._loss.lose(self._rng):
            c.lost_packets += 1
            c.lost_bytes += size
            return Verdict.LOST
        p = self.profile
        if self._byte_rate is None:
            leave_link = now
        else:
            self._expire_backlog(now)
            if not stream and (
                (p.queue_bytes is not None and self._backlog_bytes + size > p.queue_bytes)
                or (p.queue_packets is not None and len(self._backlog) + 1 > p.queue_packets)
            ):
                c.overflow_packets += 1
                c.overflow_bytes += size
                return Verdict.OVERFLOW
            leave_link = max(now, self._link_free_at) + size / self._byte_rate
            self._link_free_at = leave_link
            self._backlog.append((leave_link, size))
            self._backlog_bytes += size
            c.queue_hwm_bytes = max(c.queue_hwm_bytes, self._backlog_bytes)
            c.queue_hwm_packets = max(c.queue_hwm_packets, len(self._backlog))
        delay = p.delay_s
        if p.jitter_s > 0.0:
            delay = max(0.0, delay + self._rng.uniform(-p.jitter_s, p.jitter_s))
        deliver_at = leave_link + delay
        if stream or not p.reorder:
            deliver_at = max(deliver_at, self._last_delivery)
            self._last_delivery = deliver_at
        self._seq += 1
        heapq.heappush(self._due, (deliver_at, self._seq, now, size, payload))
        return Verdict.QUEUED

    def room(self, now: float) -> float:
        """Seconds until the queue holds less than its bound (0.0: there is room now; a link
        without a rate limit always has room). A stream sender waits this long before its
        next chunk, so streams fill the queue to its bound and no further."""
        if self._byte_rate is None:
            return 0.0
        self._expire_backlog(now)
        bound = self.profile.queue_bytes
        if bound is None:  # bounded in packets: count each as a full-size datagram
            bound = (self.profile.queue_packets or 1) * 1500
        excess = self._backlog_bytes - bound
        return excess / self._byte_rate if excess > 0 else 0.0

    def next_deadline(self) -> float | None:
        """When the next packet is due, or None when nothing is pending."""
        return self._due[0][0] if self._due else None

    def pop_due(self, now: float) -> list[tuple[float, T]]:
        """Remove and return ``(due time, payload)`` of every packet due at or before
        ``now``, earliest first."""
        out: list[tuple[float, T]] = []
        due = self._due
        c = self.counters
        while due and due[0][0] <= now:
            deliver_at, _, arrived, size, payload = heapq.heappop(due)
            c.delivered_packets += 1
            c.delivered_bytes += size
            delay = deliver_at - arrived
            c.total_delay_s += delay
            c.max_delay_s = max(c.max_delay_s, delay)
            out.append((deliver_at, payload))
        return out

    def _expire_backlog(self, now: float) -> None:
        backlog = self._backlog
        while backlog and backlog[0][0] <= now:
            self._backlog_bytes -= backlog.popleft()[1]
