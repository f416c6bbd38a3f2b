"""benchmarks/averaging.py on a toy run: the JSON line's shape and the byte arithmetic.

A few optimizer steps of a 16-wide model, so it runs in seconds: every mode reports its
fields; DiLoCo replicas end bit-identical and gossip replicas do not; the byte counts follow
the carriers' formulas exactly (fp32 all-reduce every H steps vs fp16 every step: H/2 fewer
bytes; the compressed payloads are smaller still, in the codecs' order).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.benchmark_loader import load_benchmark

bench = load_benchmark("averaging.py", "bench_averaging")


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_json_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["averaging.py", "--json", "--replicas", "2", "--global-batch", "4",
            "--micro-batch", "2", "--steps", "4", "--warmup", "1", "--h", "2", "4",
            "--d-model", "16", "--seq-len", "16", "--val-windows", "4", "--outer", "1.0:0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = {r["mode"]: r for r in line["results"]}
    assert list(results) == [
        "allreduce", "diloco-H2", "diloco-H4", "diloco-H2-int4-ef", "diloco-H2-sign-ef",
        "diloco-H2-topk-ef", "diloco-H2-stream4-sign-ef", "gossip-H2", "gossip-H2-accum4",
        "diloco-H2-accum4",
    ]
    for r in results.values():
        assert {"mode", "averaging_bytes_per_token", "reduction_vs_allreduce", "val_loss",
                "gap_vs_allreduce", "replica_max_divergence"} <= set(r)
        assert r["tokens"] == 4 * 4 * 16 and r["optimizer_steps_per_replica"] == 4
    assert results["allreduce"]["reduction_vs_allreduce"] == 1.0
    assert results["diloco-H2"]["reduction_vs_allreduce"] == pytest.approx(1.0, abs=1e-3)
    assert results["diloco-H4"]["reduction_vs_allreduce"] == pytest.approx(2.0, abs=1e-3)
    bytes_of = {m: r["averaging_bytes_per_token"] for m, r in results.items()}
    assert bytes_of["diloco-H2-sign-ef"] < bytes_of["diloco-H2-int4-ef"] < bytes_of["diloco-H2"]
    for mode in ("diloco-H2", "diloco-H4", "diloco-H2-int4-ef", "diloco-H2-sign-ef"):
        assert results[mode]["replica_max_divergence"] == 0.0
        assert results[mode]["outer_rounds"] == 4 // int(mode.split("-")[1][1:])
    assert results["gossip-H2"]["replica_max_divergence"] == 0.0  # two replicas: exact mean
    # AccumAdam changes the inner steps, not what is sent
    assert bytes_of["gossip-H2-accum4"] == bytes_of["gossip-H2"]
    assert bytes_of["diloco-H2-accum4"] == bytes_of["diloco-H2"]
    assert results["gossip-H2-accum4"]["val_loss"] != results["gossip-H2"]["val_loss"]
    # streamed: every fragment of the stage synchronised as often as in diloco-H2-sign-ef
    # (sign payloads are per tensor, so the split changes no byte), on a stagger: offsets
    # 0, 0, 1, 1 for four fragments at H = 2, each fragment twice in four steps
    streamed = results["diloco-H2-stream4-sign-ef"]
    assert streamed["averaging_bytes_per_token"] == bytes_of["diloco-H2-sign-ef"]
    assert streamed["outer_rounds"] == 4 * 2

    model = line["runtime_model"]
    assert model["gamma"] > 0 and model["predicted_speedup_gossip"] > 0
    assert model["measured_speedup_gossip"] is None


def bench_args() -> argparse.Namespace:
    return argparse.Namespace(
        d_model=16, seq_len=16, micro_batch=2, global_batch=4, lr=1e-3, warmup=1, steps=4,
        val_windows=4,
    )


def test_fragments_split_the_stage_evenly_and_deterministically() -> None:
    module = bench.build_stage(bench.run_spec(bench_args()), 0)
    frags = bench.split_fragments(module, 4)
    names = [n for f in frags for n in f]
    assert sorted(names) == sorted(n for n, _ in module.named_parameters())
    assert len(frags) == 4 and frags == bench.split_fragments(module, 4)
    sizes = dict((n, p.numel()) for n, p in module.named_parameters())
    loads = [sum(sizes[n] for n in f) for f in frags]
    assert max(loads) - min(loads) <= max(sizes.values())
