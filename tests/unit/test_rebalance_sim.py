"""The churn simulator: its optimum bound is a true bound, and rebalancing helps."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from wanswarm.node.stage.selection import RebalancePolicy

from tests.benchmark_loader import load_benchmark

sim = load_benchmark("rebalance_sim.py", "rebalance_sim")


def brute_force_optimum(throughputs: list[float], n_stages: int) -> float:
    best = 0.0
    for assignment in itertools.product(range(n_stages), repeat=len(throughputs)):
        totals = [0.0] * n_stages
        for t, s in zip(throughputs, assignment, strict=True):
            totals[s] += t
        best = max(best, min(totals))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_bound_brackets_the_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n_stages = rng.choice([2, 3])
    throughputs = [rng.lognormvariate(0.0, 1.0) for _ in range(rng.randint(n_stages, 7))]
    optimum = brute_force_optimum(throughputs, n_stages)
    assert sim.lpt_bottleneck(throughputs, n_stages) <= optimum + 1e-12
    assert optimum <= sim.upper_bound(throughputs, n_stages) + 1e-12


def test_bound_handles_a_giant() -> None:
    # One server larger than the mean stage: U ignores it and splits the rest.
    assert sim.upper_bound([100.0, 1.0, 1.0, 1.0, 1.0], 3) == 2.0
    assert sim.upper_bound([1.0], 2) == 0.0


def test_trace_is_seeded_and_balanced() -> None:
    a = sim.make_trace(peers=200, hours=2.0, churn=0.5, sigma=0.7, seed=1)
    assert a == sim.make_trace(peers=200, hours=2.0, churn=0.5, sigma=0.7, seed=1)
    joins = sum(e.joins for e in a.events)
    assert 150 < joins < 250 and 150 < len(a.events) - joins < 250  # ~0.5 * 200 * 2 each


def test_rebalancing_beats_joins_alone_on_a_small_swarm() -> None:
    trace = sim.make_trace(peers=100, hours=1.0, churn=0.5, sigma=1.0, seed=0)
    policy = RebalancePolicy(period_s=60.0, load_s=20.0, min_gain=0.01)
    with_rb = sim.simulate(trace, 4, policy, rebalance=True, seed=0)
    without = sim.simulate(trace, 4, policy, rebalance=False, seed=0)
    randomly = sim.simulate(trace, 4, policy, rebalance=False, seed=0, random_joins=True)
    assert with_rb.mean_fraction > without.mean_fraction > randomly.mean_fraction
    assert with_rb.mean_fraction > 0.95
    assert with_rb.moves > 0 and without.moves == 0
    assert 0.0 < randomly.mean_fraction <= 1.0


def test_main_ends_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--peers", "40", "--stages", "4", "--hours", "0.25", "--seed", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert {"with_rebalancing", "without_rebalancing"} <= result.keys()
    assert 0.0 < result["without_rebalancing"] <= 1.0 and 0.0 < result["with_rebalancing"] <= 1.0
