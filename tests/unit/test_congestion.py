"""The loss-tolerant congestion controller: its estimators driven by hand, then whole
flows through a simulated bottleneck (``netsim``), against aioquic's Reno for contrast."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.congestion import CongestionController, CongestionState, WindowedMax
from wanswarm.transport.wan_link import BernoulliLoss, GilbertElliottLoss

from .netsim import MSS, RenoController, bottleneck, rate_cut, run_flows

Mbps = 1e6


def _cc(seed: int = 1, **config: object) -> CongestionController:
    return CongestionController(
        CongestionConfig.model_validate(config), max_datagram_size=MSS, rng=random.Random(seed)
    )


def _drive(
    cc: CongestionController,
    *,
    start: float,
    seconds: float,
    gap: float,
    rtt: float,
    lose: set[int] | None = None,
    first_key: int = 0,
) -> int:
    """An ideal path by hand: a packet every ``gap`` seconds, each ACKed ``rtt`` later
    (or declared lost then, if its index is in ``lose``). Returns the next key."""
    lose = lose or set()
    events: list[tuple[float, int, str]] = []
    n = int(seconds / gap)
    for i in range(n):
        t = start + i * gap
        events.append((t, i, "send"))
        events.append((t + rtt, i, "lost" if i in lose else "ack"))
    events.sort(key=lambda e: (e[0], e[2] != "send"))
    for t, i, kind in events:
        key = first_key + i
        if kind == "send":
            cc.on_packet_sent(key, MSS, t)
        elif kind == "ack":
            cc.on_packet_acked(key, t)
            cc.on_rtt_measurement(rtt, t)
        else:
            cc.on_packets_lost([key], t)
    return first_key + n


# -- estimators ----------------------------------------------------------------------


def test_windowed_max_keeps_the_max_of_the_last_rounds() -> None:
    f = WindowedMax(3)
    assert f.get(0) == 0.0
    assert f.update(5.0, 1) == 5.0
    assert f.update(2.0, 2) == 5.0
    assert f.update(3.0, 3) == 5.0
    assert f.update(1.0, 4) == 3.0  # round 1 left the window
    assert f.get(6) == 1.0
    assert f.get(7) == 0.0
    f.reset(9.0, 7)
    assert f.get(8) == 9.0


def test_delivery_rate_and_min_rtt_of_a_steady_flow() -> None:
    cc = _cc()
    # 1200 bytes every ms = 1.2 MB/s (9.6 Mb/s), 50 ms RTT, no queue
    _drive(cc, start=0.0, seconds=2.0, gap=0.001, rtt=0.05)
    assert cc.min_rtt == pytest.approx(0.05)
    assert cc.btl_bw == pytest.approx(1.2e6, rel=0.01)
    assert cc.last_delivery_rate == pytest.approx(1.2e6, rel=0.01)
    assert cc.bdp() == pytest.approx(60_000, rel=0.01)
    assert cc.round_count == pytest.approx(2.0 / 0.05, abs=2)
    assert cc.bytes_in_flight == 0


def test_random_loss_leaves_the_estimate_alone_heavy_loss_does_not() -> None:
    rng = random.Random(5)
    cc = _cc()
    key = _drive(cc, start=0.0, seconds=2.0, gap=0.001, rtt=0.05)
    bw = cc.btl_bw
    # 3% random loss for 2 s (40 rounds of 50 packets): no congestion, same estimate
    lose = {i for i in range(2000) if rng.random() < 0.03}
    key = _drive(cc, start=2.0, seconds=2.0, gap=0.001, rtt=0.05, lose=lose, first_key=key)
    assert cc.congestion_events == 0
    assert cc.btl_bw == pytest.approx(bw, rel=0.01)
    assert cc.loss_rate == pytest.approx(0.03, abs=0.02)
    # 30% loss, no queue, no growth: congestion, but a bounded back-off per round
    lose = {i for i in range(1000) if rng.random() < 0.3}
    _drive(cc, start=4.0, seconds=1.0, gap=0.001, rtt=0.05, lose=lose, first_key=key)
    assert cc.congestion_events > 0
    assert cc.btl_bw < bw
    assert cc.btl_bw >= 0.5 * bw


def test_application_limited_samples_do_not_lower_the_estimate() -> None:
    cc = _cc()
    key = _drive(cc, start=0.0, seconds=2.0, gap=0.001, rtt=0.05)
    bw = cc.btl_bw
    # then the application sends a packet every 20 ms for 3 s (60 rounds, far more
    # than the 10-round window): those samples measure the application, not the path
    _drive(cc, start=2.5, seconds=3.0, gap=0.02, rtt=0.05, first_key=key)
    assert cc.btl_bw == pytest.approx(bw, rel=0.01)


def test_persistent_congestion_restarts_the_model() -> None:
    cc = _cc()
    _drive(cc, start=0.0, seconds=2.0, gap=0.001, rtt=0.05)
    assert cc.state is CongestionState.PROBE_BW
    cc.on_persistent_congestion(2.1)
    assert cc.state is CongestionState.STARTUP
    assert cc.congestion_window == 4 * MSS
    assert cc.btl_bw == 0.0
    assert cc.min_rtt == pytest.approx(0.05)  # the path's length did not change
    assert cc.pacing_rate == pytest.approx(2.885 * 4 * MSS / 0.05)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["send", "ack", "lose", "expire", "rtt", "persistent"]),
            st.integers(0, 40),
            st.integers(1, MSS),
            st.floats(0.0, 0.02),
        ),
        max_size=300,
    )
)
def test_accounting_holds_for_any_event_sequence(ops: list[tuple[str, int, int, float]]) -> None:
    """Whatever the transport reports (in any order, twice, for unknown packets),
    bytes in flight is exactly what was sent and not resolved, and the outputs stay sane."""
    cc = _cc()
    outstanding: dict[int, int] = {}
    now = 0.0
    for kind, key, size, dt in ops:
        now += dt
        if kind == "send":
            if key in outstanding:
                continue  # a key names one packet at a time
            cc.on_packet_sent(key, size, now)
            outstanding[key] = size
        elif kind == "ack":
            cc.on_packet_acked(key, now)
            outstanding.pop(key, None)
        elif kind == "lose":
            cc.on_packets_lost([key, key + 1], now)
            outstanding.pop(key, None)
            outstanding.pop(key + 1, None)
        elif kind == "expire":
            cc.on_packets_expired([key])
            outstanding.pop(key, None)
        elif kind == "rtt":
            cc.on_rtt_measurement(0.001 + dt, now)
        else:
            cc.on_persistent_congestion(now)
        assert cc.bytes_in_flight == sum(outstanding.values())
        assert cc.congestion_window >= 4 * MSS
        assert 0.0 < cc.pacing_rate < math.inf


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="probe_bw_gains"):
        CongestionConfig(probe_bw_gains=(1.0, 0.75))
    with pytest.raises(ValidationError, match="inflated_loss_threshold"):
        CongestionConfig(loss_threshold=0.05, inflated_loss_threshold=0.1)
    with pytest.raises(ValidationError):
        CongestionConfig(loss_threshold=0.0)
    with pytest.raises(ValidationError):
        CongestionConfig.model_validate({"surprise": 1})


# -- whole flows through a simulated bottleneck ----------------------------------------


def test_one_percent_random_loss_keeps_the_link_full_where_reno_collapses() -> None:
    link = bottleneck(100 * Mbps, 0.1, queue_bdp=1.0, loss=BernoulliLoss(rate=0.01))
    cc = _cc()
    _, ours = run_flows(link, [cc], rtt_s=0.1, starts=[0.0], duration=3.5, measure_from=2.0)
    _, reno = run_flows(
        link, [RenoController()], rtt_s=0.1, starts=[0.0], duration=3.5, measure_from=2.0
    )
    # steady state measures ~98% (the 1% lost never reaches the bottleneck's queue)
    assert ours.utilization >= 0.8
    assert cc.congestion_events == 0
    assert cc.state is CongestionState.PROBE_BW
    # the Mathis bound: ~1.2 Mb/s for 1200-byte packets at 1% loss and 100 ms
    assert reno.utilization < 0.05
    assert ours.utilization > 20 * reno.utilization


def test_two_flows_share_the_bottleneck_and_keep_its_queue_short() -> None:
    # a deep buffer (4 BDP = 160 ms), so that a short queue is the controllers' doing;
    # the second flow joins a second later, into a path the first one fills
    link = bottleneck(20 * Mbps, 0.04, queue_bdp=4.0, loss=BernoulliLoss(rate=0.01))
    flows: list[CongestionController] = [_cc(seed=1), _cc(seed=2)]
    _, fig = run_flows(
        link, list(flows), rtt_s=0.04, starts=[0.0, 1.0], duration=10.0, measure_from=4.0
    )
    assert fig.share_ratio < 2.0  # measured 1.05-1.4 over seeds
    assert fig.utilization > 0.9
    assert fig.queue_p95_ms < 20.0  # half a min RTT, an eighth of the buffer
    assert fig.queue_max_ms < 40.0


def test_a_rate_cut_makes_the_flow_back_off_within_a_few_round_trips() -> None:
    cc = _cc()
    cut = rate_cut(
        cc,
        before_bps=100 * Mbps,
        after_bps=20 * Mbps,
        rtt_s=0.1,
        cut_at=2.0,
        duration=4.5,
        loss=BernoulliLoss(rate=0.01),
        pacing_rate=lambda: cc.pacing_rate,
    )
    # the buffer, one BDP at 100 Mb/s, is 500 ms deep at 20 Mb/s: the first RTTs
    # after the cut stretch to 0.6 s, so "a few round trips" is about a second
    assert cut.backoff_s < 1.2
    assert cut.drained_s < 1.5
    assert cut.goodput_after_bps > 0.8 * 20 * Mbps


def test_three_percent_bursty_loss_at_200ms() -> None:
    loss = GilbertElliottLoss.from_mean(0.03, mean_burst=3.0)
    link = bottleneck(20 * Mbps, 0.2, queue_bdp=1.0, loss=loss)
    cc = _cc()
    _, fig = run_flows(link, [cc], rtt_s=0.2, starts=[0.0], duration=6.0, measure_from=3.0)
    assert fig.utilization >= 0.6  # measures ~0.96


def test_probe_rtt_drains_and_returns() -> None:
    # with RTT jitter the floor is seldom seen again, so the min-RTT window expires
    cc = _cc(min_rtt_window_s=1.0)
    link = bottleneck(10 * Mbps, 0.04, queue_bdp=2.0).model_copy(update={"jitter_s": 0.002})
    sim, _ = run_flows(link, [cc], rtt_s=0.04, starts=[0.0], duration=0.5, measure_from=0.0)
    spans: list[tuple[float, float]] = []
    smallest_window = math.inf
    t = 0.5
    while t < 4.0:
        t += 0.005
        sim.run(t)
        if cc.state is CongestionState.PROBE_RTT:
            # half the estimated BDP (BBRv2), not more
            assert cc.congestion_window <= max(4 * MSS, int(cc.bdp(0.5)))
            smallest_window = min(smallest_window, cc.congestion_window)
            if spans and spans[-1][1] >= t - 0.0051:
                spans[-1] = (spans[-1][0], t)
            else:
                spans.append((t, t))
    assert len(spans) >= 2  # every min_rtt_window_s
    assert smallest_window <= 0.55 * 10 * Mbps / 8 * 0.04
    for start, end in spans:
        if end >= t - 0.005:
            continue  # still going when the run ended
        # 200 ms at the small window plus about a round trip to get there and back
        assert 0.2 <= end - start < 0.2 + 4 * 0.04
    assert 0.038 <= cc.min_rtt <= 0.041
    stats = sim.flows[0].stats
    assert stats.rate_bps(1.0, 4.0) > 0.85 * 10 * Mbps


def test_zero_rtt_samples_from_a_millisecond_clock_do_not_break_the_controller() -> None:
    """uvloop's clock ticks in whole milliseconds: on loopback a packet can be sent and
    acknowledged at the same reading. Such samples are floored at 1 ms (RFC 9002
    kGranularity) rather than making the min RTT zero."""
    from wanswarm.transport.config import CongestionConfig
    from wanswarm.transport.congestion import RTT_FLOOR_S, CongestionController

    cc = CongestionController(CongestionConfig(), max_datagram_size=1452, rng=random.Random(1))
    now = 1.0
    for n in range(20_000):
        cc.on_packet_sent(n, 1452, now)
        cc.on_rtt_measurement(0.0, now)
        cc.on_packet_acked(n, now)  # same clock reading: a zero RTT
        if n % 4 == 0:
            now += 0.001
    assert cc.min_rtt == RTT_FLOOR_S
    assert cc.pacing_rate > 0 and cc.congestion_window > 0
