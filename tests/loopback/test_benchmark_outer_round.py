"""benchmarks/outer_round.py at a tiny size on loopback: both carriers complete checked rounds
in member processes of their own, the gather refuses a payload over its cap, and the last
line is the JSON object of the documented shape.

Loopback tier: two member processes, each with a hivemind DHT (and its libp2p daemon) and a
QUIC endpoint on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.benchmark_loader import load_benchmark

bench = load_benchmark("outer_round.py", "bench_outer_round")

CELL_KEYS = {"carrier", "size_mib", "rounds", "failed", "refused", "p50_s", "max_s"}


@pytest.mark.timeout(240)
def test_both_carriers_complete_checked_rounds_and_the_gather_refuses_its_overflow(
    capsys: Any,
) -> None:
    pytest.importorskip("hivemind")
    # 0.05 MiB fits the gather; 1 MiB is over its 768 KiB and crosses QUIC as FEC datagrams
    rc = bench.main(["--sizes", "0.05", "1", "--repeats", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert rc == 0, report
    assert report["replicas"] == 2 and report["lab_rate_mbit"] is None
    assert report["fetches_at_once"] == 7  # the node's default
    assert report["gather_cap_bytes"] == 768 * 1024
    cells = {(c["carrier"], c["size_mib"]): c for c in report["results"]}
    assert set(cells) == {("gather", 0.05), ("gather", 1.0), ("quic", 0.05), ("quic", 1.0)}
    for cell in cells.values():
        assert set(cell) == CELL_KEYS and cell["failed"] == 0
    assert cells[("gather", 1.0)]["refused"] and cells[("gather", 1.0)]["rounds"] == 0
    for key in (("gather", 0.05), ("quic", 0.05), ("quic", 1.0)):
        cell = cells[key]
        assert not cell["refused"] and cell["rounds"] == 1
        assert 0 < cell["p50_s"] == cell["max_s"] < 60
