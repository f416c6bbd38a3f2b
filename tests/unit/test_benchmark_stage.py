"""Smoke test of benchmarks/stage.py at a tiny size, with micro-batches in flight: both paths
train every micro-batch and the JSON line carries the figures."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_loader import load_benchmark

stage = load_benchmark("stage.py", "stage_bench_for_smoke")


def test_a_tiny_run_with_two_in_flight_prints_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = stage.main([
        "--json", "--d-model", "32", "--blocks", "1", "--seq-len", "16", "--batch", "2",
        "--rounds", "1", "--micro-batches", "6", "--in-flight", "2", "--threads", "1",
    ])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == result
    assert result["in_flight"] == 2 and result["micro_batches_per_round"] == 6
    for key in ("tokens_per_s", "reference_tokens_per_s", "ratio", "peak_memory_mb"):
        assert result[key] > 0, key


def test_in_flight_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        stage.main(["--in-flight", "0"])
    assert "--in-flight: at least 1" in capsys.readouterr().err
