"""Figures of the congestion controller in the bottleneck simulator, against Reno.

The scenarios of tests/unit/test_congestion.py, printed instead of asserted, over
several seeds where the outcome depends on them. One JSON line per scenario::

    python benchmarks/congestion_sim.py
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))

from netsim import RenoController, bottleneck, rate_cut, run_flows
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.congestion import CongestionController
from wanswarm.transport.wan_link import BernoulliLoss, GilbertElliottLoss

MSS = 1200


def _cc(seed: int) -> CongestionController:
    return CongestionController(CongestionConfig(), max_datagram_size=MSS, rng=random.Random(seed))


def _emit(name: str, **figures: Any) -> None:
    print(json.dumps({"scenario": name, **figures}), flush=True)


def main() -> int:
    t0 = time.process_time()
    link = bottleneck(100e6, 0.1, queue_bdp=1.0, loss=BernoulliLoss(rate=0.01))
    for name, cc in (("ours", _cc(1)), ("reno", RenoController())):
        _, fig = run_flows(link, [cc], rtt_s=0.1, starts=[0.0], duration=3.5, measure_from=2.0)
        _emit(
            f"100Mb/s 100ms 1% random loss, 1 BDP buffer, {name}",
            goodput_mbps=round(fig.goodput_bps[0] / 1e6, 2),
            utilization=round(fig.utilization, 3),
            queue_p95_ms=round(fig.queue_p95_ms, 1),
        )

    link = bottleneck(20e6, 0.04, queue_bdp=4.0, loss=BernoulliLoss(rate=0.01))
    runs = []
    for seed in range(6):
        _, fig = run_flows(
            link,
            [_cc(2 * seed + 1), _cc(2 * seed + 2)],
            rtt_s=0.04,
            starts=[0.0, 1.0],
            duration=10.0,
            measure_from=4.0,
            seed=seed,
        )
        runs.append(fig)
    _emit(
        "two flows, 20Mb/s 40ms 1% loss, 160 ms buffer, 2nd joins at 1 s, seconds 4-10",
        share_ratio=[round(f.share_ratio, 2) for f in runs],
        utilization=[round(f.utilization, 3) for f in runs],
        queue_p95_ms=[round(f.queue_p95_ms, 1) for f in runs],
        queue_max_ms=[round(f.queue_max_ms, 1) for f in runs],
    )

    cc = _cc(1)
    cut = rate_cut(
        cc,
        before_bps=100e6,
        after_bps=20e6,
        rtt_s=0.1,
        cut_at=2.0,
        duration=4.5,
        loss=BernoulliLoss(rate=0.01),
        pacing_rate=lambda: cc.pacing_rate,
    )
    _emit(
        "rate cut 100->20Mb/s at 100ms, 1% loss, 1 BDP (old rate) buffer",
        backoff_s=round(cut.backoff_s, 2),
        queue_drained_s=round(cut.drained_s, 2),
        goodput_last_second_mbps=round(cut.goodput_after_bps / 1e6, 2),
        max_queue_ms=round(cut.max_queue_ms, 1),
    )

    loss = GilbertElliottLoss.from_mean(0.03, mean_burst=3.0)
    link = bottleneck(20e6, 0.2, queue_bdp=1.0, loss=loss)
    for name, cc2 in (("ours", _cc(1)), ("reno", RenoController())):
        _, fig = run_flows(link, [cc2], rtt_s=0.2, starts=[0.0], duration=7.0, measure_from=4.0)
        _emit(
            f"20Mb/s 200ms 3% bursty loss (mean burst 3), seconds 4-7, {name}",
            utilization=round(fig.utilization, 3),
            queue_p95_ms=round(fig.queue_p95_ms, 1),
        )
    _emit("cpu", seconds=round(time.process_time() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
