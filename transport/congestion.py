"""Loss-tolerant, rate-based congestion control in the manner of BBR, without I/O.

Why not aioquic's Reno or CUBIC: they halve the window on every loss event, so random
loss caps a flow whatever the link offers. By the Mathis bound, 1% loss at 100 ms RTT
allows about 1.2 Mb/s with 1200-byte packets. Our bulk payloads travel as FEC-protected
datagrams that shrug off such loss; the controller must not throttle them for it.

So the controller models the path instead of reacting to each loss (BBR v1, with the
loss response of v2 in spirit; see draft-cardwell-iccrg-bbr-congestion-control and
draft-cheng-iccrg-delivery-rate-estimation):

- a delivery rate sample from every acknowledged packet: bytes delivered between the
  packet's send and its ACK over the longer of the send and ACK intervals;
- ``btl_bw``: the max of those samples over the last ``bw_window_rounds`` round trips;
  ``min_rtt``: the min RTT over ``min_rtt_window_s``; their product is the BDP;
- states: STARTUP (pacing gain 2.885 until the bandwidth stops growing by 25% for 3
  rounds), DRAIN (drain the queue STARTUP built), PROBE_BW (gain cycle 1.25, 0.75, 1 x 6,
  one phase per min RTT) and PROBE_RTT (every ``min_rtt_window_s``, hold a half-BDP window
  for 200 ms and a round so a standing queue cannot hide the propagation delay);
- outputs: ``pacing_rate = gain x btl_bw`` and ``congestion_window = cwnd_gain x BDP``
  plus a few packets, a cap on data in flight for when ACKs stall.

Congestion is read from signals random loss cannot produce:

- a standing queue: while PROBE_BW cruises, every RTT sample for a whole min RTT above
  ``(1 + standing_queue_fraction) x min_rtt`` (a rate cut, a new competitor, flows that
  together overestimate);
- heavy loss: a round trip that loses ``loss_threshold`` (15%) of its packets, or
  ``inflated_loss_threshold`` (5%) while its smallest RTT shows a queue, and whose
  delivery rate did not grow.

The response: with a queue, the bandwidth estimate falls to what the path delivered
to us lately (our share; every flow on the path scales by the same factor) and the flow
drains for a min RTT; without one (shallow buffer, heavy random loss) it falls by
``random_loss_backoff`` at most. Random loss at the 1-3% that FEC repairs changes
nothing. Persistent congestion (RFC 9002 §7.6) restarts the model: minimum window,
bandwidth forgotten, STARTUP.

The interface is aioquic's window-based one, with plain numbers: the caller names each
packet with a hashable ``key`` of its choosing (the adapter uses ``(epoch,
packet_number)``) and reports sends, ACKs, losses and expiries by key. The controller
keeps the per-packet state that rate sampling needs and is the authority on
``bytes_in_flight``. See congestion_adapter.py for the adapter and congestion_control.py for
how aioquic runs and paces it.

The controller stays one module, past 600 lines, because the model, the congestion signals
and the state machine read and write one set of per-packet and per-round state on every ACK:
split apart, that state would become an interface between them.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .config import CongestionConfig

__all__ = ["CongestionController", "CongestionState", "WindowedMax"]

# The smallest RTT sample we believe (RFC 9002 §6.1.2's kGranularity, which aioquic uses
# too): event-loop clocks tick in whole milliseconds, so a loopback sample can read 0.0,
# and a zero min RTT would make every "per min RTT" interval empty.
RTT_FLOOR_S = 0.001

logger = logging.getLogger(__name__)


class CongestionState(enum.Enum):
    """The controller's mode (BBR's state machine)."""

    STARTUP = "startup"
    DRAIN = "drain"
    PROBE_BW = "probe_bw"
    PROBE_RTT = "probe_rtt"


class WindowedMax:
    """Max of values over the last ``window`` rounds, kept as one max per round.

    Exact, and cheap because rounds are few: at most ``window`` entries, and the max is
    recomputed only when a round enters or leaves the window. Old rounds leave only
    when a new value comes in (as in Linux BBR's minmax filter): while the sender is
    application-limited, and its samples are not recorded, the estimate stands.
    """

    def __init__(self, window: int) -> None:
        self._window = window
        self._rounds: deque[tuple[int, float]] = deque()  # (round, max in it), oldest first
        self._best = 0.0

    def update(self, value: float, round_count: int) -> float:
        """Record ``value`` as seen in round ``round_count`` (non-decreasing); returns
        the max over the window ending at that round."""
        rounds = self._rounds
        if rounds and rounds[-1][0] == round_count:
            if value > rounds[-1][1]:
                rounds[-1] = (round_count, value)
                self._best = max(self._best, value)
            return self._best
        rounds.append((round_count, value))
        self._expire(round_count)
        return self._best

    def reset(self, value: float | None, round_count: int) -> None:
        """Forget everything; start over from ``value`` (or from nothing)."""
        self._rounds.clear()
        self._best = 0.0
        if value is not None:
            self._rounds.append((round_count, value))
            self._best = value

    def get(self, round_count: int) -> float:
        """The max over the window ending at ``round_count``; 0.0 when empty."""
        self._expire(round_count)
        return self._best

    def _expire(self, round_count: int) -> None:
        rounds = self._rounds
        while rounds and rounds[0][0] <= round_count - self._window:
            rounds.popleft()
        self._best = max((v for _, v in rounds), default=0.0)


@dataclass(slots=True)
class _Sent:
    """What the controller remembers of a packet in flight (delivery-rate draft §3.2)."""

    size: int
    sent_time: float
    delivered: int  # C.delivered when sent
    delivered_time: float  # C.delivered_time when sent
    first_sent_time: float  # C.first_sent_time when sent
    app_limited: bool


class CongestionController:
    """A loss-tolerant, rate-based congestion controller (sans-I/O; times in seconds,
    sizes in bytes, rates in bytes per second).

    ``rng`` only chooses the phase PROBE_BW starts in, so that flows do not probe in
    lockstep.
    """

    def __init__(
        self, config: CongestionConfig, *, max_datagram_size: int, rng: random.Random
    ) -> None:
        self._cfg = config
        self._mss = max_datagram_size
        self._rng = rng
        self._min_cwnd = config.min_window_packets * max_datagram_size
        self._initial_cwnd = config.initial_window_packets * max_datagram_size

        # packets in flight and delivery-rate state (draft-cheng-iccrg-delivery-rate-estimation)
        self._sent: dict[Hashable, _Sent] = {}
        self._in_flight = 0
        self._delivered = 0
        self._lost_total = 0  # bytes declared lost, ever
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        self._app_limited_until = 0  # C.app_limited: delivered count that ends it; 0 = not
        self._last_send_time: float | None = None
        self._room_since: float | None = None  # since when the window had room for a packet
        self.last_delivery_rate = 0.0  # the latest valid rate sample, bytes/s

        # model
        self._bw_filter = WindowedMax(config.bw_window_rounds)
        self._btl_bw = 0.0
        self._min_rtt = math.inf
        self._min_rtt_stamp = 0.0

        # round trips
        self._round_count = 0
        self._next_round_delivered = 0
        self._round_lost_bytes = 0
        self._round_lost_packets = 0
        self._round_acked_bytes = 0
        self._round_max_rate = 0.0
        self._round_min_rtt = math.inf
        self._round_start = 0.0
        self._queue_since: float | None = None  # since when every RTT sample showed a queue
        self._queue_resolved = 0
        self._queue_app_limited = False
        self._round_start_bw = 0.0
        self.loss_rate = 0.0  # per-round loss fraction, smoothed (EWMA 1/4)
        self.congestion_events = 0

        # state machine
        self.state = CongestionState.STARTUP
        self._filled_pipe = False
        self._full_bw = 0.0
        self._full_bw_count = 0
        self._pacing_gain = config.startup_gain
        self._cwnd_gain = config.startup_cwnd_gain
        self._cycle_index = 0
        self._cycle_stamp = 0.0
        self._phase_lost = False
        self._probe_rtt_done_stamp: float | None = None
        self._probe_rtt_round_done = False
        self._prior_cwnd = 0

        self._cwnd = self._initial_cwnd
        self._pacing_rate = config.startup_gain * self._initial_cwnd / config.initial_rtt_s

    # -- outputs -----------------------------------------------------------------------

    @property
    def congestion_window(self) -> int:
        """Most bytes allowed in flight."""
        return self._cwnd

    @property
    def pacing_rate(self) -> float:
        """Rate to pace packets at, bytes per second."""
        return self._pacing_rate

    @property
    def bytes_in_flight(self) -> int:
        """Bytes sent and neither acknowledged, lost nor expired."""
        return self._in_flight

    @property
    def btl_bw(self) -> float:
        """Estimated bottleneck bandwidth, bytes per second (0 before any sample)."""
        return self._btl_bw

    @property
    def min_rtt(self) -> float:
        """Estimated propagation RTT, seconds (inf before any sample)."""
        return self._min_rtt

    @property
    def round_count(self) -> int:
        """Round trips completed so far."""
        return self._round_count

    def bdp(self, gain: float = 1.0) -> float:
        """``gain`` times the estimated bandwidth-delay product, bytes (0 if unknown)."""
        if self._btl_bw == 0.0 or math.isinf(self._min_rtt):
            return 0.0
        return gain * self._btl_bw * self._min_rtt

    def log_data(self) -> dict[str, float | int | str]:
        """The controller's state for qlog's ``metrics_updated`` and for logs."""
        return {
            "cwnd": self._cwnd,
            "bytes_in_flight": self._in_flight,
            "pacing_rate": int(self._pacing_rate),
            "btl_bw": int(self._btl_bw),
            "min_rtt": self._min_rtt if math.isfinite(self._min_rtt) else -1.0,
            "state": self.state.value,
            "loss_rate": round(self.loss_rate, 4),
        }

    # -- events ------------------------------------------------------------------------

    def on_packet_sent(self, key: Hashable, sent_bytes: int, now: float) -> None:
        """A packet that counts in flight was sent at ``now``."""
        if self._in_flight == 0:
            # restart the send/ACK intervals after idle (delivery-rate draft §3.2)
            self._first_sent_time = now
            self._delivered_time = now
        if self._was_app_limited(sent_bytes, now):
            self.on_app_limited()
        self._sent[key] = _Sent(
            sent_bytes,
            now,
            self._delivered,
            self._delivered_time,
            self._first_sent_time,
            self._app_limited_until != 0,
        )
        self._in_flight += sent_bytes
        self._last_send_time = now
        self._room_since = now if self._cwnd - self._in_flight >= self._mss else None

    def on_app_limited(self) -> None:
        """The sender had nothing to send while the window and pacer allowed it.

        Rate samples of packets sent from now until the data in flight is delivered
        then only raise the bandwidth estimate, never lower it (they measure the
        application, not the path). An adapter that knows its send queue ran dry may
        call this; the controller also infers it from gaps between sends.
        """
        self._app_limited_until = max(self._delivered + self._in_flight, 1)

    def on_packet_acked(self, key: Hashable, now: float) -> None:
        """The packet ``key`` was acknowledged at ``now``."""
        p = self._sent.pop(key, None)
        if p is None:
            return
        self._in_flight -= p.size
        self._delivered += p.size
        self._delivered_time = now
        self._round_acked_bytes += p.size
        if self._app_limited_until and self._delivered > self._app_limited_until:
            self._app_limited_until = 0

        # round trips: a round ends when a packet sent after it began is acknowledged
        round_start = p.delivered >= self._next_round_delivered
        if round_start:
            self._next_round_delivered = self._delivered
            self._round_count += 1
            self._end_round(now)
        rtt = max(now - p.sent_time, RTT_FLOOR_S)
        min_rtt_expired = self._update_min_rtt(rtt, now)
        self._round_min_rtt = min(self._round_min_rtt, rtt)
        self._check_standing_queue(rtt, p.app_limited, now)

        # delivery rate sample (draft §3.3): delivered over max(send, ACK interval)
        send_elapsed = p.sent_time - p.first_sent_time
        ack_elapsed = now - p.delivered_time
        self._first_sent_time = p.sent_time
        interval = max(send_elapsed, ack_elapsed)
        delivered = self._delivered - p.delivered
        if interval > 0.0 and interval >= self._min_rtt * 0.999:
            rate = delivered / interval
            self.last_delivery_rate = rate
            if not p.app_limited or rate >= self._btl_bw:
                self._btl_bw = self._bw_filter.update(rate, self._round_count)
                self._round_max_rate = max(self._round_max_rate, rate)

        if round_start and not self._filled_pipe and not p.app_limited:
            self._check_full_pipe()
        self._update_state(now, round_start, min_rtt_expired)
        self._set_pacing_rate()
        self._set_cwnd(p.size)
        self._note_room(now)

    def on_packets_lost(self, keys: Iterable[Hashable], now: float) -> None:
        """Packets declared lost at ``now`` (RFC 9002 §6.1)."""
        for key in keys:
            p = self._sent.pop(key, None)
            if p is None:
                continue
            self._in_flight -= p.size
            self._round_lost_bytes += p.size
            self._lost_total += p.size
            self._round_lost_packets += 1
            self._phase_lost = True
        self._note_room(now)

    def on_packets_expired(self, keys: Iterable[Hashable]) -> None:
        """Packets that stop counting in flight without a verdict (their packet number
        space was discarded): no congestion signal."""
        for key in keys:
            p = self._sent.pop(key, None)
            if p is not None:
                self._in_flight -= p.size

    def on_rtt_measurement(self, latest_rtt: float, now: float) -> None:
        """An RTT sample from the transport's own estimator (the newest ACKed packet)."""
        latest_rtt = max(latest_rtt, RTT_FLOOR_S)
        first = math.isinf(self._min_rtt)
        if latest_rtt <= self._min_rtt:  # expiry is the ACK path's business (PROBE_RTT)
            self._min_rtt = latest_rtt
            self._min_rtt_stamp = now
        self._round_min_rtt = min(self._round_min_rtt, latest_rtt)
        if first and self._btl_bw == 0.0:
            # BBR's initial pacing rate: startup gain x initial window / first RTT
            self._pacing_rate = max(self._pacing_rate, self._pacing_gain * self._cwnd / latest_rtt)

    def on_persistent_congestion(self, now: float) -> None:
        """Every packet over several PTOs was lost (RFC 9002 §7.6): the path may have
        changed beyond recognition. Keep the min RTT, forget the bandwidth, restart
        from the minimum window in STARTUP."""
        logger.info(
            "persistent congestion: restarting (btl_bw was %.0f B/s, cwnd %d)",
            self._btl_bw,
            self._cwnd,
        )
        self.congestion_events += 1
        self._bw_filter.reset(None, self._round_count)
        self._btl_bw = 0.0
        self._enter_startup()
        self._cwnd = self._min_cwnd
        rtt = self._min_rtt if math.isfinite(self._min_rtt) else self._cfg.initial_rtt_s
        self._pacing_rate = self._pacing_gain * self._min_cwnd / rtt
        self._reset_round_stats(now)
        self._room_since = now if self._cwnd - self._in_flight >= self._mss else None

    # -- model -------------------------------------------------------------------------

    def _update_min_rtt(self, rtt: float, now: float) -> bool:
        """Feed the min-RTT filter; True when its window had expired (time for PROBE_RTT:
        the sample taken instead may include a standing queue)."""
        expired = (
            math.isfinite(self._min_rtt) and now > self._min_rtt_stamp + self._cfg.min_rtt_window_s
        )
        if rtt <= self._min_rtt or (expired and self.state is not CongestionState.PROBE_RTT):
            self._min_rtt = rtt
            self._min_rtt_stamp = now
        return expired

    def _end_round(self, now: float) -> None:
        """Judge the round trip that just ended: did it show congestion?

        Heavy loss counts (``loss_threshold``, or ``inflated_loss_threshold`` when the
        round's smallest RTT shows a queue), unless the delivery rate is still growing;
        random loss at the rates FEC repairs does not.
        """
        cfg = self._cfg
        lost, acked = self._round_lost_bytes, self._round_acked_bytes
        if lost + acked > 0:
            loss_rate = lost / (lost + acked)
            self.loss_rate += 0.25 * (loss_rate - self.loss_rate)
            growing = self._round_max_rate >= cfg.full_bw_growth * self._round_start_bw > 0.0
            queued = self._round_min_rtt > cfg.rtt_inflation * self._min_rtt
            if (
                not growing
                and self._round_lost_packets >= cfg.min_lost_packets
                and (
                    loss_rate >= cfg.loss_threshold
                    or (queued and loss_rate >= cfg.inflated_loss_threshold)
                )
            ):
                duration = now - self._round_start
                goodput = acked / duration if duration > 0.0 else 0.0
                self._on_congestion(f"loss {100 * loss_rate:.1f}%", queued, goodput, now)
        self._reset_round_stats(now)

    def _reset_round_stats(self, now: float) -> None:
        self._round_start = now
        self._round_lost_bytes = 0
        self._round_lost_packets = 0
        self._round_acked_bytes = 0
        self._round_max_rate = 0.0
        self._round_min_rtt = math.inf
        self._round_start_bw = self._btl_bw

    def _check_standing_queue(self, rtt: float, app_limited: bool, now: float) -> None:
        """While PROBE_BW cruises (gain 1), every RTT sample for a whole min RTT above
        (1 + fraction) x min RTT means a queue that did not drain: together the flows on
        the path send more than it delivers. Random loss cannot cause this; a rate cut,
        a new competitor or flows that overestimate together do. Not while probing:
        the probe's own queue would undo the probe, and probing is what lets small
        flows grow faster than large ones. Our share counts the packets lost on the way
        as well as those delivered, so that random loss does not shrink it."""
        cfg = self._cfg
        if (
            self._pacing_gain != 1.0
            or self.state is not CongestionState.PROBE_BW
            or rtt
            <= (self._min_rtt * (1.0 + cfg.standing_queue_fraction) + cfg.standing_queue_min_s)
        ):
            self._queue_since = None
            return
        if self._queue_since is None:
            self._queue_since = now
            self._queue_resolved = self._delivered + self._lost_total
            self._queue_app_limited = app_limited
            return
        self._queue_app_limited |= app_limited
        elapsed = now - self._queue_since
        if elapsed >= self._min_rtt:
            if not self._queue_app_limited:  # an idle sender's goodput says nothing
                share = (self._delivered + self._lost_total - self._queue_resolved) / elapsed
                self._on_congestion("standing queue", True, share, now)
            self._queue_since = None

    def _on_congestion(self, reason: str, queue: bool, goodput: float, now: float) -> None:
        """Congestion: bring the bandwidth estimate down (the window follows it).

        With a queue, the path delivers less than the flows on it send, and what we got
        through lately is our share of it now: a rate cut, a new competitor, or flows
        that together overestimate (the max filter is biased upwards). Every flow that
        sees the queue scales down by the same factor (capacity over total sending
        rate, which keeps their ratio) and drains for a min RTT, so the queue goes and
        the flows probe again on an empty path, where probing grows small flows faster
        than large ones: shares converge. Without a queue (a shallow buffer, or heavy
        random loss) the delivered rate is no measure of capacity: back off by
        ``random_loss_backoff`` at most.
        """
        self.congestion_events += 1
        if queue:
            bw = goodput
        else:
            bw = max(self._round_max_rate, self._cfg.random_loss_backoff * self._btl_bw)
        bw = min(bw, self._btl_bw)
        logger.debug(
            "congestion (%s, queue %s): btl_bw %.0f -> %.0f B/s", reason, queue, self._btl_bw, bw
        )
        if bw > 0.0:
            self._bw_filter.reset(bw, self._round_count)
            self._btl_bw = bw
        if self.state is CongestionState.STARTUP:
            self._filled_pipe = True
            self._enter_drain()
        elif self.state is CongestionState.PROBE_BW and queue:
            # and drain the queue at once: the cycle's lowest gain for a min RTT
            gains = self._cfg.probe_bw_gains
            self._cycle_index = gains.index(min(gains))
            self._pacing_gain = gains[self._cycle_index]
            self._cycle_stamp = now
            self._phase_lost = False

    def _check_full_pipe(self) -> None:
        """STARTUP ends when the bandwidth stops growing by 25% for 3 rounds."""
        if self._btl_bw >= self._full_bw * self._cfg.full_bw_growth:
            self._full_bw = self._btl_bw
            self._full_bw_count = 0
            return
        self._full_bw_count += 1
        if self._full_bw_count >= self._cfg.full_bw_rounds:
            self._filled_pipe = True

    # -- state machine -----------------------------------------------------------------

    def _update_state(self, now: float, round_start: bool, min_rtt_expired: bool) -> None:
        if self.state is CongestionState.STARTUP and self._filled_pipe:
            self._enter_drain()
        if self.state is CongestionState.DRAIN and self._in_flight <= self.bdp():
            self._enter_probe_bw(now)
        if self.state is CongestionState.PROBE_BW and self._phase_done(now):
            self._advance_cycle(now)
        self._check_probe_rtt(now, round_start, min_rtt_expired)

    def _enter_startup(self) -> None:
        self.state = CongestionState.STARTUP
        self._filled_pipe = False
        self._full_bw = 0.0
        self._full_bw_count = 0
        self._pacing_gain = self._cfg.startup_gain
        self._cwnd_gain = self._cfg.startup_cwnd_gain

    def _enter_drain(self) -> None:
        self.state = CongestionState.DRAIN
        self._pacing_gain = self._cfg.drain_gain
        self._cwnd_gain = self._cfg.startup_cwnd_gain

    def _enter_probe_bw(self, now: float) -> None:
        self.state = CongestionState.PROBE_BW
        self._cwnd_gain = self._cfg.cwnd_gain
        # start in a random phase, but not a draining one (BBR v1)
        gains = self._cfg.probe_bw_gains
        self._cycle_index = self._rng.choice([i for i, g in enumerate(gains) if g >= 1.0])
        self._pacing_gain = gains[self._cycle_index]
        self._cycle_stamp = now
        self._phase_lost = False

    def _phase_done(self, now: float) -> bool:
        full_length = now - self._cycle_stamp > self._min_rtt
        gain = self._pacing_gain
        if gain > 1.0:
            # probe until the extra data is in flight, or loss says there is no room
            return full_length and (self._phase_lost or self._in_flight >= self.bdp(gain))
        if gain < 1.0:
            return full_length or self._in_flight <= self.bdp()
        return full_length

    def _advance_cycle(self, now: float) -> None:
        gains = self._cfg.probe_bw_gains
        self._cycle_index = (self._cycle_index + 1) % len(gains)
        self._pacing_gain = gains[self._cycle_index]
        self._cycle_stamp = now
        self._phase_lost = False

    def _check_probe_rtt(self, now: float, round_start: bool, min_rtt_expired: bool) -> None:
        cfg = self._cfg
        if self.state is not CongestionState.PROBE_RTT and min_rtt_expired:
            self.state = CongestionState.PROBE_RTT
            self._pacing_gain = 1.0
            self._prior_cwnd = max(self._prior_cwnd, self._cwnd)
            self._probe_rtt_done_stamp = None
            self._probe_rtt_round_done = False
        if self.state is not CongestionState.PROBE_RTT:
            return
        if self._probe_rtt_done_stamp is None:
            if self._in_flight <= self._probe_rtt_cwnd():
                # hold the small window for a while and a full round from now
                self._probe_rtt_done_stamp = now + cfg.probe_rtt_duration_s
                self._probe_rtt_round_done = False
                self._next_round_delivered = self._delivered
            return
        if round_start:
            self._probe_rtt_round_done = True
        if self._probe_rtt_round_done and now >= self._probe_rtt_done_stamp:
            self._min_rtt_stamp = now
            self._cwnd = max(self._cwnd, self._prior_cwnd)
            self._prior_cwnd = 0
            if self._filled_pipe:
                self._enter_probe_bw(now)
            else:
                self._enter_startup()

    def _probe_rtt_cwnd(self) -> int:
        return max(self._min_cwnd, int(self.bdp(self._cfg.probe_rtt_cwnd_gain)))

    # -- outputs -----------------------------------------------------------------------

    def _set_pacing_rate(self) -> None:
        if self._btl_bw == 0.0:
            return
        rate = self._pacing_gain * self._btl_bw * (1.0 - self._cfg.pacing_margin)
        # in STARTUP the rate only grows (BBR): early samples underestimate
        if self._filled_pipe or rate > self._pacing_rate:
            self._pacing_rate = rate

    def set_max_datagram_size(self, size: int) -> None:
        """Packets of up to ``size`` bytes from now on (path_mtu.py: a larger path MTU was
        found, or the one in use stopped crossing the path): the bounds counted in packets
        follow; the window in bytes is kept (no lower than the new floor)."""
        if size == self._mss:
            return
        self._mss = size
        self._min_cwnd = self._cfg.min_window_packets * size
        self._cwnd = max(self._cwnd, self._min_cwnd)

    def _set_cwnd(self, acked: int) -> None:
        if self.state is CongestionState.PROBE_RTT:
            self._cwnd = min(self._cwnd, self._probe_rtt_cwnd())
            return
        target = int(self.bdp(self._cwnd_gain)) + self._cfg.cwnd_extra_packets * self._mss
        if self._filled_pipe:
            self._cwnd = min(self._cwnd + acked, target)
        elif self._cwnd < target or self._delivered < self._initial_cwnd:
            self._cwnd += acked
        self._cwnd = max(self._cwnd, self._min_cwnd)

    def _note_room(self, now: float) -> None:
        if self._room_since is None and self._cwnd - self._in_flight >= self._mss:
            self._room_since = now

    def _was_app_limited(self, size: int, now: float) -> bool:
        """Did the window and the pacer allow sending for a while before ``now``,
        without the sender using it? Then it had nothing to send."""
        if self._room_since is None or self._last_send_time is None:
            return False
        idle_from = max(self._room_since, self._last_send_time)
        packet_time = size / self._pacing_rate if self._pacing_rate > 0 else 0.0
        return now - idle_from > max(self._cfg.app_limited_gap_s, 4 * packet_time)
