"""Smoke test of benchmarks/hostile.py at a tiny size: the JSON line and its fields."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_loader import load_benchmark

hostile = load_benchmark("hostile.py", "hostile_bench_for_smoke")


def test_a_tiny_run_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    result = hostile.main([
        "--json", "--micro-batches", "6", "--replicas", "1,3,1", "--spot-fraction", "1",
        "--wrong-fraction", "1", "--huge-fraction", "0", "--d-model", "32", "--seq-len", "16",
    ])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == json.loads(json.dumps(result, sort_keys=True))
    for key in ("caught_after_micro_batches", "false_positives", "extra_compute_fraction",
                "val_loss_honest", "val_loss_attacked"):
        assert key in result
    # whether the router sends the liar any of 6 micro-batches depends on measured timings;
    # once it served a hop it is caught (every hop spot-checked, every reply wrong)
    if result["liar_share_before_conviction"]:
        assert result["caught_after_micro_batches"] is not None
    assert result["false_positives"] == 0
    assert result["extra_compute_fraction"] > 0.0
    assert result["micro_batches"]["attacked"] == {"completed": 6, "failed": 0}
