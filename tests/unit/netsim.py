"""A discrete-event network simulator for congestion controllers (tests only, no I/O).

Bulk senders share one bottleneck, modelled by the WAN emulator's own sans-I/O link
(``wan_link.LinkEmulator``: loss on ingress, drop-tail queue, serializer, propagation
delay). Receivers ACK every packet at once; ACKs return after the reverse propagation
delay, never lost or queued. Each sender behaves as aioquic's does: it sends while
``bytes_in_flight + size <= congestion_window``, paced at the controller's
``pacing_rate`` by ``wanswarm.transport.pacing.Pacer`` (what the QUIC adapter paces
with; aioquic's own pacer cannot pace below the ACK rate); it declares a packet lost when a
packet sent 3 later is ACKed or when it is older than 9/8 of the RTT behind an ACKed one
(RFC 9002 §6.1), and everything in flight after a probe timeout with no ACK at all; a loss
spanning three PTOs is persistent congestion (RFC 9002 §7.6).

``RenoController`` mirrors aioquic's NewReno (slow start, halve once per recovery
period, +1 packet per window), paced at window / smoothed RTT as aioquic paces it.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from wanswarm.transport.pacing import Pacer
from wanswarm.transport.wan_link import BernoulliLoss, LinkEmulator, LinkProfile, LossSpec

MSS = 1200
TIMER_TICK_S = 0.001  # the senders' timer granularity


class Controller(Protocol):
    @property
    def congestion_window(self) -> int: ...
    @property
    def pacing_rate(self) -> float: ...
    @property
    def bytes_in_flight(self) -> int: ...
    def on_packet_sent(self, key: Hashable, sent_bytes: int, now: float) -> None: ...
    def on_packet_acked(self, key: Hashable, now: float) -> None: ...
    def on_packets_lost(self, keys: Iterable[Hashable], now: float) -> None: ...
    def on_rtt_measurement(self, latest_rtt: float, now: float) -> None: ...
    def on_persistent_congestion(self, now: float) -> None: ...


class RenoController:
    """aioquic's NewReno (quic/congestion/reno.py) on the plain-number interface."""

    def __init__(self, max_datagram_size: int = MSS) -> None:
        self._mss = max_datagram_size
        self.congestion_window = 10 * max_datagram_size
        self.ssthresh: int | None = None
        self.bytes_in_flight = 0
        self._recovery_start = 0.0
        self._stash = 0
        self._sent: dict[Hashable, tuple[int, float]] = {}
        self._srtt = 0.0

    @property
    def pacing_rate(self) -> float:
        # aioquic's QuicPacketPacer.update_rate: window / smoothed RTT
        return self.congestion_window / max(self._srtt, 1e-6) if self._srtt else math.inf

    def on_packet_sent(self, key: Hashable, sent_bytes: int, now: float) -> None:
        self._sent[key] = (sent_bytes, now)
        self.bytes_in_flight += sent_bytes

    def on_packet_acked(self, key: Hashable, now: float) -> None:
        size, sent = self._sent.pop(key)
        self.bytes_in_flight -= size
        if sent <= self._recovery_start:
            return
        if self.ssthresh is None or self.congestion_window < self.ssthresh:
            self.congestion_window += size
        else:
            self._stash += size
            count = self._stash // self.congestion_window
            if count:
                self._stash -= count * self.congestion_window
                self.congestion_window += count * self._mss

    def on_packets_lost(self, keys: Iterable[Hashable], now: float) -> None:
        largest_sent = -1.0
        for key in keys:
            size, sent = self._sent.pop(key)
            self.bytes_in_flight -= size
            largest_sent = max(largest_sent, sent)
        if largest_sent > self._recovery_start:
            self._recovery_start = now
            self.congestion_window = max(self.congestion_window // 2, 2 * self._mss)
            self.ssthresh = self.congestion_window

    def on_rtt_measurement(self, latest_rtt: float, now: float) -> None:
        self._srtt = latest_rtt if not self._srtt else 0.875 * self._srtt + 0.125 * latest_rtt

    def on_persistent_congestion(self, now: float) -> None:
        self.congestion_window = 2 * self._mss
        self._recovery_start = 0.0


@dataclass
class FlowStats:
    """What one flow got across (bytes delivered to its receiver, per time bin)."""

    bin_s: float
    delivered: list[int] = field(default_factory=list)
    sent_packets: int = 0
    lost_packets: int = 0  # declared lost by the sender
    persistent_congestion: int = 0

    def add(self, now: float, size: int) -> None:
        i = int(now / self.bin_s)
        if i >= len(self.delivered):
            self.delivered.extend([0] * (i + 1 - len(self.delivered)))
        self.delivered[i] += size

    def rate_bps(self, start: float, end: float) -> float:
        """Mean goodput over [start, end), bits per second."""
        a, b = int(start / self.bin_s), int(end / self.bin_s)
        return sum(self.delivered[a:b]) * 8.0 / (end - start)


class _Flow:
    def __init__(self, sim: Simulation, index: int, cc: Controller, start: float) -> None:
        self.sim = sim
        self.index = index
        self.cc = cc
        self.stats = FlowStats(sim.bin_s)
        self.pacer = Pacer(max_datagram_size=MSS)
        self.pacer.set_rate(cc.pacing_rate, start)
        self.next_seq = 0
        self.outstanding: dict[int, float] = {}  # seq -> sent time, in send order
        self.largest_acked = -1
        self.srtt = 0.0
        self.rttvar = 0.0
        self.latest_rtt = 0.0
        self.last_ack_time = start
        self.wakeup_at = math.inf  # when a pacing wake-up is scheduled
        sim.at(start, self.try_send)
        sim.at(start, self.watchdog)

    def pto(self) -> float:
        if not self.srtt:
            return 2 * self.sim.rtt_s
        return self.srtt + max(4 * self.rttvar, 0.001)

    def wake(self, at: float) -> None:
        if at != self.wakeup_at:
            return  # superseded by an earlier wake-up (the rate went up meanwhile)
        self.wakeup_at = math.inf
        self.try_send()

    def try_send(self) -> None:
        sim, cc, pacer = self.sim, self.cc, self.pacer
        now = sim.now
        while cc.bytes_in_flight + MSS <= cc.congestion_window:
            at = pacer.next_send_time(now)
            if at is not None:
                # an event loop's timers tick in whole milliseconds (uvloop, epoll)
                at = math.ceil(at / TIMER_TICK_S - 1e-9) * TIMER_TICK_S
                if at < self.wakeup_at:
                    self.wakeup_at = at
                    sim.at(at, functools.partial(self.wake, at))
                return
            seq = self.next_seq
            self.next_seq += 1
            self.outstanding[seq] = now
            cc.on_packet_sent(seq, MSS, now)
            self.stats.sent_packets += 1
            sim.link.submit((self.index, seq), MSS, now)
            pacer.on_packet_sent(MSS, now)

    def on_ack(self, seq: int, now: float) -> None:
        sent = self.outstanding.pop(seq, None)
        if sent is None:  # declared lost already (reordered: never on a FIFO link)
            return
        self.last_ack_time = now
        cc = self.cc
        cc.on_packet_acked(seq, now)
        if seq > self.largest_acked:
            self.largest_acked = seq
            rtt = now - sent
            self.latest_rtt = rtt
            if not self.srtt:
                self.srtt, self.rttvar = rtt, rtt / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
                self.srtt = 0.875 * self.srtt + 0.125 * rtt
            cc.on_rtt_measurement(rtt, now)
        self.detect_loss(now)
        self.pacer.set_rate(cc.pacing_rate, now)
        self.try_send()

    def detect_loss(self, now: float) -> None:
        threshold = now - 9 / 8 * max(self.srtt, self.latest_rtt)
        lost = []
        for seq, sent in self.outstanding.items():
            if seq >= self.largest_acked:
                break
            if seq <= self.largest_acked - 3 or sent <= threshold:
                lost.append(seq)
            else:
                break
        self.declare_lost(lost, now)

    def declare_lost(self, lost: list[int], now: float) -> None:
        if not lost:
            return
        first = self.outstanding[lost[0]]
        for seq in lost:
            del self.outstanding[seq]
        self.stats.lost_packets += len(lost)
        self.cc.on_packets_lost(lost, now)
        if now - first > 3 * self.pto() and now - self.last_ack_time > 3 * self.pto():
            self.stats.persistent_congestion += 1
            self.cc.on_persistent_congestion(now)

    def watchdog(self) -> None:
        """Probe timeout: no ACK for a PTO with packets out means they are gone."""
        now = self.sim.now
        if self.outstanding and now - self.last_ack_time > self.pto():
            cutoff = now - self.pto()
            self.declare_lost([s for s, t in self.outstanding.items() if t <= cutoff], now)
            self.pacer.set_rate(self.cc.pacing_rate, now)
            self.try_send()
        self.sim.at(now + max(self.pto() / 2, 0.005), self.watchdog)


class Simulation:
    """Flows through one bottleneck. ``rtt_s`` is the propagation RTT (half each way)."""

    def __init__(
        self,
        bottleneck: LinkProfile,
        *,
        rtt_s: float,
        seed: int = 0,
        bin_s: float = 0.1,
        queue_sample_s: float = 0.01,
    ) -> None:
        self.rtt_s = rtt_s
        self.bin_s = bin_s
        self.now = 0.0
        self.link: LinkEmulator[tuple[int, int]] = LinkEmulator(
            bottleneck.model_copy(update={"delay_s": rtt_s / 2}), random.Random(seed)
        )
        self.flows: list[_Flow] = []
        self.queue_samples: list[tuple[float, int]] = []  # (time, queued bytes)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        # ACKs come back in the order the link delivered: a FIFO, not the heap
        self._acks: deque[tuple[float, _Flow, int]] = deque()
        self._seq = 0
        self._queue_sample_s = queue_sample_s
        self.at(0.0, self._sample_queue)

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, action))

    def add_flow(self, cc: Controller, start: float = 0.0) -> FlowStats:
        flow = _Flow(self, len(self.flows), cc, start)
        self.flows.append(flow)
        return flow.stats

    def run(self, until: float) -> None:
        events, link, acks, flows = self._events, self.link, self._acks, self.flows
        back = self.rtt_s / 2
        inf = math.inf
        while True:
            t_event = events[0][0] if events else inf
            t_ack = acks[0][0] if acks else inf
            due = link.next_deadline()
            t_link = inf if due is None else due
            if t_ack <= t_event and t_ack <= t_link:
                if t_ack > until:
                    break
                self.now = t_ack
                _, flow, seq = acks.popleft()
                flow.on_ack(seq, t_ack)
            elif t_link <= t_event:
                if t_link > until:
                    break
                self.now = t_link
                for _, (index, seq) in link.pop_due(t_link):
                    flow = flows[index]
                    flow.stats.add(t_link, MSS)
                    acks.append((t_link + back, flow, seq))
            else:
                if t_event > until:
                    break
                when, _, action = heapq.heappop(events)
                self.now = when
                action()
        self.now = until

    def queue_delay_s(self, start: float, end: float, rate_bps: float) -> list[float]:
        """Queue occupancy samples in [start, end) as queueing delay at ``rate_bps``."""
        return [b * 8.0 / rate_bps for t, b in self.queue_samples if start <= t < end]

    def _sample_queue(self) -> None:
        self.queue_samples.append((self.now, self.link.queue_bytes(self.now)))
        self.at(self.now + self._queue_sample_s, self._sample_queue)


# -- scenarios (shared by tests/unit/test_congestion.py and benchmarks/congestion_sim.py) --


def bottleneck(
    rate_bps: float, rtt_s: float, *, queue_bdp: float, loss: LossSpec | None = None
) -> LinkProfile:
    """A bottleneck whose drop-tail queue holds ``queue_bdp`` bandwidth-delay products."""
    return LinkProfile(
        rate_bps=rate_bps,
        queue_bytes=int(rate_bps / 8 * rtt_s * queue_bdp),
        loss=loss if loss is not None else BernoulliLoss(),
    )


@dataclass
class Figures:
    """What a scenario measured, for assertions and for the benchmark's printout."""

    goodput_bps: list[float]  # per flow, over the measurement window
    utilization: float  # all flows' goodput over the link rate
    queue_p95_ms: float
    queue_max_ms: float

    @property
    def share_ratio(self) -> float:
        return max(self.goodput_bps) / max(min(self.goodput_bps), 1.0)


def run_flows(
    link: LinkProfile,
    controllers: list[Controller],
    *,
    rtt_s: float,
    starts: list[float],
    duration: float,
    measure_from: float,
    seed: int = 0,
) -> tuple[Simulation, Figures]:
    """Run bulk flows through ``link``; figures over [measure_from, duration)."""
    sim = Simulation(link, rtt_s=rtt_s, seed=seed, bin_s=0.05)
    stats = [sim.add_flow(cc, start) for cc, start in zip(controllers, starts, strict=True)]
    sim.run(duration)
    assert link.rate_bps is not None
    goodput = [s.rate_bps(measure_from, duration) for s in stats]
    queue = sorted(sim.queue_delay_s(measure_from, duration, link.rate_bps))
    return sim, Figures(
        goodput_bps=goodput,
        utilization=sum(goodput) / link.rate_bps,
        queue_p95_ms=1000 * queue[int(0.95 * (len(queue) - 1))],
        queue_max_ms=1000 * queue[-1],
    )


@dataclass
class RateCut:
    """How a flow followed a cut of the bottleneck rate at ``cut_at``."""

    backoff_s: float  # cut -> pacing rate within 1.5x of the new rate
    drained_s: float  # cut -> queue under one (old) min RTT's worth at the new rate, for good
    goodput_after_bps: float  # over the last second
    max_queue_ms: float


def rate_cut(
    cc: Controller,
    *,
    before_bps: float,
    after_bps: float,
    rtt_s: float,
    cut_at: float,
    duration: float,
    loss: LossSpec | None = None,
    pacing_rate: Callable[[], float],
) -> RateCut:
    """One flow; the bottleneck (queue: one BDP at the old rate) drops to ``after_bps``."""
    link = bottleneck(before_bps, rtt_s, queue_bdp=1.0, loss=loss)
    sim = Simulation(link, rtt_s=rtt_s, seed=1, bin_s=0.05)
    stats = sim.add_flow(cc)
    sim.run(cut_at)
    sim.link.set_rate(after_bps)
    backoff = math.inf
    step, t = 0.01, cut_at
    queue_ok_since: float | None = None
    max_queue = 0.0
    while t < duration - 1e-9:
        t += step
        sim.run(t)
        if backoff == math.inf and pacing_rate() * 8 <= 1.5 * after_bps:
            backoff = t - cut_at
        q = sim.link.queue_bytes(t) * 8 / after_bps
        max_queue = max(max_queue, q)
        if q < rtt_s:
            queue_ok_since = t if queue_ok_since is None else queue_ok_since
        else:
            queue_ok_since = None
    drained = (queue_ok_since - cut_at) if queue_ok_since is not None else math.inf
    return RateCut(
        backoff_s=backoff,
        drained_s=drained,
        goodput_after_bps=stats.rate_bps(duration - 1.0, duration),
        max_queue_ms=1000 * max_queue,
    )
