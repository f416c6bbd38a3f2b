"""transport.redundancy: the binomial repair budget and the path loss estimator."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from wanswarm.transport.config import FecConfig
from wanswarm.transport.errors import FecError
from wanswarm.transport.redundancy import (
    LossEstimator,
    LossSample,
    block_target,
    budget_loss_rate,
    repair_count,
    symbols_needed,
)


def _exact_success(n: int, need: int, loss: str) -> Fraction:
    """P(Binomial(n, 1 - loss) >= need), in exact rational arithmetic."""
    p = Fraction(loss)
    return sum(
        (math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(n - need + 1)),
        Fraction(0),
    )


@pytest.mark.parametrize(
    ("need", "loss", "target"),
    [
        (1, "0.01", 0.99),
        (2, "0.0015", 0.99),
        (25, "0.1", 0.999),
        (60, "0.3", 0.9),
        (300, "0.03", 0.99),
        (1025, "0.015", 0.99916),
        (5, "0.5", 0.5),
    ],
)
def test_symbols_needed_is_the_smallest_n_meeting_the_target(
    need: int, loss: str, target: float
) -> None:
    n = symbols_needed(need, float(loss), target)
    assert _exact_success(n, need, loss) >= Fraction(target)
    assert _exact_success(n - 1, need, loss) < Fraction(target)


def test_symbols_needed_edges_and_bad_arguments() -> None:
    assert symbols_needed(0, 0.2, 0.99) == 0
    assert symbols_needed(100, 0.0, 0.99) == 100
    for args in [(-1, 0.1, 0.9), (10, 1.0, 0.9), (10, -0.1, 0.9), (10, 0.1, 1.0)]:
        with pytest.raises(FecError):
            symbols_needed(*args)
    with pytest.raises(FecError):
        block_target(0.99, 0)


def test_symbols_needed_grows_with_loss_and_target() -> None:
    previous = 0
    for loss in (0.001, 0.01, 0.05, 0.2, 0.4):
        n = symbols_needed(1000, loss, 0.99)
        assert n > previous
        previous = n
    assert symbols_needed(1000, 0.01, 0.999999) > symbols_needed(1000, 0.01, 0.99)


def test_block_budget_meets_the_transfer_target_in_simulation() -> None:
    """Monte Carlo check of the whole rule: 8 blocks of 256 symbols at 2% Bernoulli loss,
    budgeted for 2% (no margin): the transfer should fail without repair in about
    1 - 0.99 of trials, and not much more."""
    rng = random.Random(11)
    k, blocks, loss, target = 256, 8, 0.02, 0.99
    repairs = repair_count(k, loss, block_target(target, blocks), 0)
    trials, failures = 2000, 0
    for _ in range(trials):
        for _ in range(blocks):
            arrived = sum(rng.random() >= loss for _ in range(k + repairs))
            if arrived < k:
                failures += 1
                break
    assert failures / trials <= 0.02  # expected <= 0.01; 2x leaves room for sampling noise


def test_budget_loss_rate_applies_margin_and_clamps() -> None:
    config = FecConfig(loss_margin=1.5, min_loss_rate=0.002, max_loss_rate=0.3)
    assert budget_loss_rate(0.0, config) == 0.002
    assert budget_loss_rate(0.01, config) == pytest.approx(0.015)
    assert budget_loss_rate(0.5, config) == 0.3


def test_loss_estimator_averages_first_samples_then_smooths() -> None:
    config = FecConfig(initial_loss_rate=0.01, loss_ewma_weight=0.25, loss_sample_symbols=1000)
    estimator = LossEstimator(config)
    assert estimator.loss_rate == 0.01
    estimator.add(LossSample(sent=1000, lost=30))  # prior and sample, equally weighted
    assert estimator.loss_rate == pytest.approx(0.02)
    estimator.add(LossSample(sent=0, lost=0))  # nothing sent: ignored
    assert estimator.samples == 1
    for _ in range(40):
        estimator.add(LossSample(sent=5000, lost=5))
    assert estimator.loss_rate == pytest.approx(0.001, rel=0.01)


def test_loss_estimator_weighs_small_transfers_less() -> None:
    config = FecConfig(initial_loss_rate=0.01, loss_sample_symbols=1000)
    small, large = LossEstimator(config), LossEstimator(config)
    small.add(LossSample(sent=10, lost=5))
    large.add(LossSample(sent=1000, lost=500))
    assert 0.01 < small.loss_rate < 0.02 < large.loss_rate
