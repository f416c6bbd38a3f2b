"""The sans-I/O core of the WAN emulator: loss models, serializer, drop-tail queue, delay."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from wanswarm.transport.errors import ConfigError
from wanswarm.transport.wan import PROFILES, WanProfile
from wanswarm.transport.wan_link import (
    BernoulliLoss,
    GilbertElliottLoss,
    LinkEmulator,
    LinkProfile,
    Verdict,
    make_loss_model,
)


def _drain(link: LinkEmulator[int]) -> list[tuple[float, int]]:
    return link.pop_due(math.inf)


def test_bernoulli_loss_rate_matches() -> None:
    n, p = 50_000, 0.03
    model = make_loss_model(BernoulliLoss(rate=p))
    rng = random.Random(1)
    lost = sum(model.lose(rng) for _ in range(n))
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 4 * sigma, (lost, n * p)


def test_zero_loss_never_drops_and_draws_nothing() -> None:
    model = make_loss_model(BernoulliLoss(rate=0.0))
    rng = random.Random(2)
    state = rng.getstate()
    assert not any(model.lose(rng) for _ in range(1000))
    assert rng.getstate() == state


def _runs(flags: list[bool]) -> list[int]:
    runs, current = [], 0
    for lost in flags:
        if lost:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


def test_gilbert_elliott_rate_and_burst_length() -> None:
    spec = GilbertElliottLoss.from_mean(0.03, mean_burst=3.0)
    assert spec.mean_loss_rate == pytest.approx(0.03)
    model = make_loss_model(spec)
    rng = random.Random(3)
    flags = [model.lose(rng) for _ in range(300_000)]
    rate = sum(flags) / len(flags)
    runs = _runs(flags)
    mean_burst = sum(runs) / len(runs)
    # ~3000 bursts: the burst-length mean has a standard error of about 0.045
    assert rate == pytest.approx(0.03, rel=0.08)
    assert mean_burst == pytest.approx(3.0, rel=0.06)
    # and it really is bursty: independent loss at 3% has mean run length ~1.03
    bern = make_loss_model(BernoulliLoss(rate=0.03))
    bern_runs = _runs([bern.lose(rng) for _ in range(100_000)])
    assert sum(bern_runs) / len(bern_runs) < 1.1


def test_gilbert_elliott_partial_loss_in_states() -> None:
    spec = GilbertElliottLoss(p_good_to_bad=0.02, p_bad_to_good=0.2, loss_good=0.01, loss_bad=0.5)
    model = make_loss_model(spec)
    rng = random.Random(4)
    n = 200_000
    rate = sum(model.lose(rng) for _ in range(n)) / n
    # pi_bad = 0.02 / 0.22; mean = pi_bad * 0.5 + (1 - pi_bad) * 0.01
    assert spec.mean_loss_rate == pytest.approx(0.02 / 0.22 * 0.5 + 0.2 / 0.22 * 0.01)
    assert rate == pytest.approx(spec.mean_loss_rate, rel=0.08)


def test_serialization_at_link_rate() -> None:
    # 10 Mb/s, 1250-byte packets: exactly 1 ms per packet on the wire
    profile = LinkProfile(rate_bps=10e6, delay_s=0.02, queue_packets=1000)
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(0))
    for i in range(100):
        assert link.submit(i, 1250, 5.0) is Verdict.QUEUED
    delivered = _drain(link)
    assert [p for _, p in delivered] == list(range(100))
    for k, (due, _) in enumerate(delivered):
        assert due == pytest.approx(5.0 + 0.001 * (k + 1) + 0.02, abs=1e-9)
    # the mean added delay of a back-to-back burst of 100: propagation + mean wait
    assert link.counters.mean_delay_s == pytest.approx(0.02 + 0.001 * 50.5, abs=1e-9)
    assert link.counters.queue_hwm_packets == 100


def test_paced_arrivals_below_rate_see_no_queue() -> None:
    profile = LinkProfile(rate_bps=10e6, delay_s=0.01, queue_packets=4)
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(0))
    for i in range(50):
        now = i * 0.002  # 5 Mb/s of 1250-byte packets into a 10 Mb/s link
        link.submit(i, 1250, now)
        assert link.queue_packets(now) == 1
    assert link.counters.overflow_packets == 0
    for due, i in _drain(link):
        assert due == pytest.approx(i * 0.002 + 0.001 + 0.01, abs=1e-9)


def test_queue_overflow_drops_tail() -> None:
    profile = LinkProfile(rate_bps=8e6, delay_s=0.0, queue_packets=20)
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(0))
    verdicts = [link.submit(i, 1000, 0.0) for i in range(100)]
    assert verdicts[:20] == [Verdict.QUEUED] * 20
    assert verdicts[20:] == [Verdict.OVERFLOW] * 80
    c = link.counters
    assert (c.overflow_packets, c.overflow_bytes, c.queue_hwm_packets) == (80, 80_000, 20)
    # one packet's serialization (1 ms) later, there is room for exactly one more
    assert link.submit(100, 1000, 0.001) is Verdict.QUEUED
    assert link.submit(101, 1000, 0.001) is Verdict.OVERFLOW
    assert [p for _, p in _drain(link)] == [*range(20), 100]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    queue_bytes=st.integers(1500, 60_000),
    queue_packets=st.one_of(st.none(), st.integers(1, 50)),
    arrivals=st.lists(
        st.tuples(st.floats(0.0, 0.003), st.integers(40, 1500)), min_size=1, max_size=300
    ),
)
def test_queue_bound_and_accounting_hold_for_any_arrivals(
    seed: int,
    queue_bytes: int,
    queue_packets: int | None,
    arrivals: list[tuple[float, int]],
) -> None:
    profile = LinkProfile(
        rate_bps=4e6,
        delay_s=0.005,
        jitter_s=0.002,
        loss=BernoulliLoss(rate=0.05),
        queue_bytes=queue_bytes,
        queue_packets=queue_packets,
    )
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(seed))
    now, delivered = 0.0, []
    for i, (gap, size) in enumerate(arrivals):
        now += gap
        delivered += link.pop_due(now)
        link.submit(i, size, now)
        assert link.queue_bytes(now) <= queue_bytes
        if queue_packets is not None:
            assert link.queue_packets(now) <= queue_packets
    delivered += _drain(link)
    c = link.counters
    assert c.queue_hwm_bytes <= queue_bytes
    assert c.pending_packets == 0
    assert c.offered_packets == (
        c.delivered_packets + c.lost_packets + c.overflow_packets + c.too_big_packets
    )
    assert c.offered_bytes == (
        c.delivered_bytes + c.lost_bytes + c.overflow_bytes + c.too_big_bytes
    )
    assert c.too_big_packets == sum(1 for _, size in arrivals if size > 1472)
    assert c.delivered_packets == len(delivered)
    # FIFO: without ``reorder`` jitter never reorders
    order = [p for _, p in delivered]
    assert order == sorted(order)


def test_a_datagram_beyond_the_links_mtu_is_dropped() -> None:
    """A 1500-byte MTU carries 1472 bytes of UDP payload over IPv4 (28 bytes of headers);
    a larger datagram is dropped and counted, never lost at random or queued; a byte
    stream's chunks are not datagrams and pass whatever their size."""
    link: LinkEmulator[int] = LinkEmulator(LinkProfile(), random.Random(0))
    assert link.submit(1, 1472, 0.0) is Verdict.QUEUED
    assert link.submit(2, 1473, 0.0) is Verdict.TOO_BIG
    assert link.submit(3, 16448, 0.0) is Verdict.TOO_BIG
    assert link.submit(4, 65536, 0.0, stream=True) is Verdict.QUEUED
    c = link.counters
    assert (c.too_big_packets, c.too_big_bytes, c.lost_packets) == (2, 1473 + 16448, 0)
    assert [p for _, p in _drain(link)] == [1, 4]
    jumbo: LinkEmulator[int] = LinkEmulator(LinkProfile(mtu_bytes=9000), random.Random(0))
    assert jumbo.submit(1, 8972, 0.0) is Verdict.QUEUED
    assert jumbo.submit(2, 8973, 0.0) is Verdict.TOO_BIG


def test_a_links_mtu_can_shrink_while_it_runs() -> None:
    """A route change onto a path with a smaller MTU (set_mtu): what no longer fits is
    dropped from then on, silently; what was queued before is delivered."""
    link: LinkEmulator[int] = LinkEmulator(LinkProfile(mtu_bytes=65535), random.Random(0))
    assert link.submit(1, 16448, 0.0) is Verdict.QUEUED
    link.set_mtu(1500)
    assert link.mtu_bytes == 1500
    assert link.submit(2, 16448, 0.0) is Verdict.TOO_BIG
    assert link.submit(3, 1452, 0.0) is Verdict.QUEUED
    assert [p for _, p in _drain(link)] == [1, 3]
    with pytest.raises(ValueError):
        link.set_mtu(576)


def test_delay_and_jitter_added() -> None:
    profile = LinkProfile(delay_s=0.05, jitter_s=0.01)
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(7))
    n = 5000
    for i in range(n):
        link.submit(i, 100, i * 0.02)  # wider apart than the jitter: FIFO never binds
    delays = [due - p * 0.02 for due, p in _drain(link)]
    assert min(delays) >= 0.04 - 1e-9
    assert max(delays) <= 0.06 + 1e-9
    assert sum(delays) / n == pytest.approx(0.05, abs=0.0005)
    assert link.counters.mean_delay_s == pytest.approx(sum(delays) / n)
    assert link.counters.max_delay_s == pytest.approx(max(delays))


def test_jitter_reorders_only_when_asked() -> None:
    for reorder in (False, True):
        profile = LinkProfile(delay_s=0.05, jitter_s=0.01, reorder=reorder)
        link: LinkEmulator[int] = LinkEmulator(profile, random.Random(8))
        for i in range(1000):
            link.submit(i, 100, i * 0.001)
        order = [p for _, p in _drain(link)]
        assert sorted(order) == list(range(1000))
        assert (order != sorted(order)) == reorder


def test_unlimited_link_has_no_queue() -> None:
    link: LinkEmulator[int] = LinkEmulator(LinkProfile(delay_s=0.001), random.Random(0))
    for i in range(10_000):
        assert link.submit(i, 1400, 0.0) is Verdict.QUEUED
    assert link.queue_bytes(0.0) == 0
    assert link.next_deadline() == pytest.approx(0.001)
    assert link.pop_due(0.0009) == []
    assert len(link.pop_due(0.001)) == 10_000
    assert link.next_deadline() is None


def test_named_profiles() -> None:
    expected = {  # rate, RTT, per-direction loss
        "lan": (1e9, 0.001, 0.0),
        "home": (50e6, 0.040, 0.001),
        "wan": (100e6, 0.100, 0.01),
        "bad": (20e6, 0.200, 0.03),
    }
    assert set(PROFILES) == set(expected)
    for name, (rate, rtt, loss) in expected.items():
        profile = WanProfile.parse(name)
        assert profile.name == name
        assert profile.rtt_s == pytest.approx(rtt)
        for link in (profile.uplink, profile.downlink):
            assert link.rate_bps == rate
            assert link.delay_s == pytest.approx(rtt / 2)
            assert link.loss.mean_loss_rate == pytest.approx(loss)
            assert link.queue_bytes == pytest.approx(rate / 8 * rtt, rel=0.01)  # one BDP
    assert isinstance(PROFILES["bad"].uplink.loss, GilbertElliottLoss)


def test_custom_profiles_parse_and_validate() -> None:
    custom = WanProfile.symmetric(
        "x", rate_bps=10e6, rtt_s=0.03, loss=BernoulliLoss(rate=0.02), queue_ms=5.0
    )
    assert custom.uplink.queue_bytes == 6250
    assert WanProfile.parse(custom.model_dump_json()) == custom
    with pytest.raises(ConfigError, match="unknown WAN profile"):
        WanProfile.parse("dialup")
    with pytest.raises(ConfigError, match="invalid WAN profile"):
        WanProfile.parse('{"name": "x"}')
    with pytest.raises(ValidationError, match="queue bound"):
        LinkProfile(rate_bps=1e6)
    with pytest.raises(ValidationError):
        LinkProfile.model_validate({"delay_s": 0.01, "surprise": 1})
    with pytest.raises(ValidationError):  # frozen
        setattr(PROFILES["wan"].uplink, "delay_s", 1.0)  # noqa: B010


def test_stream_chunks_are_never_lost_dropped_or_reordered() -> None:
    # a lossy, jittery, reordering link with a small queue: datagrams suffer all of it,
    # stream chunks none, and the link tells their sender how long to wait for room
    profile = LinkProfile(
        rate_bps=8e6,  # 1 byte per microsecond
        delay_s=0.010,
        jitter_s=0.005,
        reorder=True,
        loss=BernoulliLoss(rate=0.5),
        queue_bytes=10_000,
    )
    link: LinkEmulator[int] = LinkEmulator(profile, random.Random(1))
    verdicts = [link.submit(i, 1000, 0.0, stream=True) for i in range(50)]
    assert verdicts == [Verdict.QUEUED] * 50  # past the queue bound: the caller waits instead
    assert link.counters.lost_packets == link.counters.overflow_packets == 0
    # 50 kB queued against a 10 kB bound at 1 kB/ms: room again 40 ms from now
    assert link.room(0.0) == pytest.approx(0.040)
    assert link.room(0.041) == 0.0
    assert [p for _, p in _drain(link)] == list(range(50))  # in order despite the jitter
    unlimited: LinkEmulator[int] = LinkEmulator(LinkProfile(delay_s=0.01), random.Random(0))
    assert unlimited.room(0.0) == 0.0
