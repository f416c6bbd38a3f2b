"""RTT estimator (RFC 6298) and windowed minimum (Nichols' filter): exact values and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.node.membership.rtt import RttEstimator, WindowedMin


def test_rfc6298_first_and_second_sample() -> None:
    est = RttEstimator()
    assert est.srtt is None and est.rto() == 1.0  # RFC 6298 (2.1)
    est.on_sample(0.100, now=0.0)
    assert (est.srtt, est.rttvar) == (0.100, 0.050)  # (2.2)
    assert math.isclose(est.rto(), 0.100 + 4 * 0.050)
    est.on_sample(0.200, now=1.0)
    assert math.isclose(est.rttvar, 0.75 * 0.050 + 0.25 * 0.100)  # (2.3): beta = 1/4
    assert math.isclose(est.srtt, 0.875 * 0.100 + 0.125 * 0.200)  # alpha = 1/8
    assert math.isclose(est.rto(), 0.1125 + 4 * 0.0625)
    assert est.samples == 2 and est.latest == 0.200 and est.last_sample_at == 1.0


def test_rto_is_clamped_and_failures_are_counted() -> None:
    est = RttEstimator()
    est.on_sample(0.001, now=0.0)
    assert est.rto() == 0.2  # lower bound
    est.on_sample(100.0, now=1.0)
    assert est.rto() == 60.0  # upper bound
    est.on_failure()
    est.on_failure()
    assert est.consecutive_failures == 2
    est.on_sample(0.05, now=2.0)
    assert est.consecutive_failures == 0


@pytest.mark.parametrize("bad", [-0.001, math.inf, math.nan])
def test_bad_samples_are_refused(bad: float) -> None:
    with pytest.raises(ValueError):
        RttEstimator().on_sample(bad, now=0.0)


def test_windowed_min_tracks_and_expires() -> None:
    win = WindowedMin(window=10.0)
    assert win.get(0.0) is None
    assert win.update(0.050, 0.0) == 0.050
    assert win.update(0.080, 1.0) == 0.050
    assert win.update(0.030, 2.0) == 0.030  # a new minimum replaces everything
    assert win.update(0.060, 5.0) == 0.030
    # the minimum ages out at t = 12: the best later sample takes over
    assert win.update(0.070, 12.5) == 0.060
    assert win.get(12.5) == 0.060
    assert win.get(100.0) is None  # nothing inside the window any more
    assert win.update(0.090, 100.0) == 0.090  # restart from scratch


def test_min_rtt_of_the_estimator_uses_its_window() -> None:
    est = RttEstimator(min_window=5.0)
    est.on_sample(0.020, now=0.0)
    est.on_sample(0.040, now=3.0)
    assert est.min_rtt(4.0) == 0.020
    est.on_sample(0.045, now=6.0)
    assert est.min_rtt(6.0) == 0.040


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=5.0), st.floats(min_value=0.0, max_value=1.0)),
        min_size=1,
        max_size=60,
    )
)
def test_windowed_min_is_a_recent_sample_between_true_min_and_latest(
    steps: list[tuple[float, float]],
) -> None:
    window = 10.0
    win = WindowedMin(window)
    now, history = 0.0, []
    for dt, value in steps:
        now += dt
        history.append((now, value))
        estimate = win.update(value, now)
        in_window = [v for t, v in history if now - t <= window]
        assert estimate <= value  # never above the newest sample
        assert estimate >= min(in_window)  # never below the true minimum of the window
        assert estimate in in_window  # always a sample still inside the window
