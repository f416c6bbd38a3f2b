"""benchmarks/transport.py on plain loopback (no emulator, no child processes): every
variant moves a small payload intact, the loopback measurement runs, and the report's
last line is the JSON object of the documented shape.

Loopback tier: the variants are real QUIC servers and clients on 127.0.0.1 in this
process. The cell statistics and target checks below need no network; they stay beside the
run whose report they judge."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from tests.benchmark_loader import load_benchmark

T = TypeVar("T")


bench = load_benchmark("transport.py", "bench_transport")

SIZE_MB = 0.125  # 128 KiB: above the FEC threshold, so the wanswarm variant uses datagrams
REPEATS = 2
RESULT_KEYS = {"profile", "size_mb", "variant", "link_mbps", "goodput_mbps", "p50_s", "p95_s",
               "completed", "attempted"}


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


async def _variants_on_loopback() -> list[Any]:
    config = bench.wanswarm_config()
    servers = await bench.start_servers([bench.MIB], config)
    payload = bench.Payload.random(int(SIZE_MB * bench.MIB), seed=3)
    cells = []
    try:
        for variant in bench.VARIANTS:
            cell = bench.Cell("lan", SIZE_MB, variant, payload.nbytes, 1e9, 0.001, timeout_s=15.0)
            target = (bench.HOST, servers.port(variant, bench.MIB))
            await bench.run_transfers(
                cell,
                lambda v=variant, t=target: bench.make_client(
                    v, t, servers.peer_id, bench.MIB, config
                ),
                payload,
                REPEATS,
                max_failures=1,
                gap_s=0.0,
                budget=bench.Budget(None),
            )
            cells.append(cell)
    finally:
        await servers.close()
    return cells


def test_every_variant_moves_the_payload_intact_and_the_report_is_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cells = run(_variants_on_loopback())
    for cell in cells:
        # a wrong count or CRC in the acknowledgement would count as not completed
        assert (cell.completed, cell.attempted) == (REPEATS, REPEATS), (cell.variant, cell.errors)
        assert cell.p50_s is not None and cell.p50_s > 0 and cell.goodput_mbps > 0
    wanswarm = cells[-1]
    assert wanswarm.diagnostics["totals"]["bytes_out"] > REPEATS * wanswarm.nbytes

    loopback = run(bench.run_loopback(
        SIZE_MB, REPEATS, 15.0, seed=4, budget=bench.Budget(None), config=bench.wanswarm_config()
    ))
    assert (loopback["completed"], loopback["attempted"]) == (REPEATS, REPEATS)
    assert loopback["goodput_mbps"] > 0 and loopback["cpu_s_per_gb"] > 0
    for key in ("reference_aioquic_tuned", "reference_wanswarm_1452"):
        reference = loopback[key]
        assert (reference["completed"], reference["attempted"]) == (REPEATS, REPEATS), key

    report = {
        "results": [c.result() for c in cells],
        "loopback": loopback,
        "targets": bench.evaluate_targets(cells, loopback),
        "diagnostics": [],
        "meta": {"loadavg_start": [0.0], "loadavg_end": [0.0], "cpus": 1, "layout": "test"},
    }
    bench.write_report(report, cells)
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("aioquic_tuned" in line for line in lines[:-1])  # the table
    parsed = json.loads(lines[-1])
    assert {"results", "loopback"} <= set(parsed)
    assert [r["variant"] for r in parsed["results"]] == list(bench.VARIANTS)
    for result in parsed["results"]:
        assert set(result) == RESULT_KEYS
        assert result["completed"] == result["attempted"] == REPEATS
    assert {"goodput_mbps", "cpu_s_per_gb"} <= set(parsed["loopback"])


def test_cell_statistics_count_a_timeout_as_infinitely_slow() -> None:
    cell = bench.Cell("wan", 1.0, "wanswarm", bench.MIB, 100e6, 0.1, timeout_s=10.0)
    cell.times = [1.0, 2.0, None]
    assert cell.p50_s == 2.0 and cell.p95_s is None and cell.completed == 2
    cell.times = [1.0, None]
    assert cell.p50_s is None and cell.goodput_mbps is None
    assert cell.goodput_bound_mbps == pytest.approx(bench.MIB * 8 / 10.0 / 1e6)


def test_a_wrong_acknowledgement_is_corruption() -> None:
    payload = bench.Payload.random(1000, seed=1)
    payload.check(1000, payload.crc)
    with pytest.raises(bench.Corrupt):
        payload.check(1000, payload.crc ^ 1)
    with pytest.raises(bench.Corrupt):
        payload.check(999, payload.crc)


def _cell(profile: str, variant: str, times: list[float | None], link: float, rtt: float,
          timeout: float = 60.0, skipped: int = 0) -> Any:
    cell = bench.Cell(profile, 16.0, variant, 16 * bench.MIB, link, rtt, timeout_s=timeout)
    cell.times, cell.skipped = times, skipped
    return cell


def _status(targets: list[dict[str, Any]], name: str) -> str:
    (status,) = [t["status"] for t in targets if t["target"].startswith(name)]
    return str(status)


def test_targets_are_judged_on_what_ran() -> None:
    bits = 16 * bench.MIB * 8
    fast = bits / 85e6  # 85 Mb/s on a 100 Mb/s link
    cells = [
        _cell("wan", "wanswarm", [fast] * 3, 100e6, 0.1),
        _cell("wan", "aioquic_tuned", [bits / 10e6] * 3, 100e6, 0.1),
        _cell("bad", "wanswarm", [bits / 13e6, bits / 13e6], 20e6, 0.2, skipped=1),
    ]
    targets = bench.evaluate_targets(cells, None)
    assert _status(targets, "wan 16 MB: wanswarm goodput >= 80%") == "PASS"
    assert _status(targets, "wan 16 MB: wanswarm goodput >= 5x") == "PASS"  # 8.5x
    assert _status(targets, "bad 16 MB: wanswarm completes") == "UNDECIDED"  # one skipped
    assert _status(targets, "bad 16 MB: wanswarm goodput") == "PASS"  # 65%
    assert _status(targets, "loopback") == "NOT RUN"

    # the tuned baseline's median timed out: only a bound, 5x above it or undecided
    cells[1] = _cell("wan", "aioquic_tuned", [None], 100e6, 0.1, timeout=60.0)
    assert _status(bench.evaluate_targets(cells, None), "wan 16 MB: wanswarm goodput >= 5x") \
        == "PASS"  # 85 >= 5 x 2.24
    cells[0] = _cell("wan", "wanswarm", [bits / 30e6] * 3, 100e6, 0.1)
    cells[1] = _cell("wan", "aioquic_tuned", [None], 100e6, 0.1, timeout=20.0)
    assert _status(bench.evaluate_targets(cells, None), "wan 16 MB: wanswarm goodput >= 5x") \
        == "UNDECIDED"  # 30 < 5 x 6.7
    cells[2] = _cell("bad", "wanswarm", [1.0, None], 20e6, 0.2)
    assert _status(bench.evaluate_targets(cells, None), "bad 16 MB: wanswarm completes") == "MISS"
