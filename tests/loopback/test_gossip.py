"""Gossip rounds over real hivemind averagers on local DHTs (gossip_optimizer.py).

Two replicas that start from different parameters train apart for H inner steps, then
average their parameters through hivemind's DecentralizedAverager in a group of two: both
end holding the pair's mean (to float32 rounding: hivemind's butterfly hands each member
``x + (mean - x)``), and the mean over the two is what it was before the round. A newcomer
whose donors disagree (as gossip replicas do between rounds) adopts one replica's parameters
from the stage's gossip averagers.

Loopback tier: hivemind DHTs on 127.0.0.1, each forking its DHT process and a libp2p
daemon, inside this test process.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.stage.averaging import AveragingConfig
from wanswarm.node.stage.diloco import make_stage_optimizer
from wanswarm.node.stage.gossip_optimizer import GossipOptimizer
from wanswarm.node.training.model import build_stage

from tests.loopback.hivemind_dhts import hivemind_dhts
from tests.loopback.test_averaging import (
    HIVEMIND_PATH_WARNING,
    HIVEMIND_UNRAISABLE_WARNING,
    SPEC,
    STAGE,
    B,
    _accumulate,
    _daemon_sigint,
)
from tests.loopback.test_diloco import _finish_round, _Host

H = 2
GOSSIP = SPEC.model_copy(update={"averaging": AveragingSpec(
    mode="gossip", inner_steps=H, round_timeout_s=20.0,
)})
CONFIG = AveragingConfig(matchmaking_time=2.0, averaging_timeout=20.0, load_state_timeout=10.0)
PER_STEP = SPEC.batch.micro_batches_per_step


def _build(dht: Any, seed: int) -> tuple[torch.nn.Module, GossipOptimizer]:
    torch.manual_seed(seed)  # replicas that start apart, as gossip replicas are
    module = build_stage(GOSSIP, STAGE)
    previous = signal.signal(signal.SIGINT, _daemon_sigint)
    try:
        opt = make_stage_optimizer(module, GOSSIP, STAGE, _Host(dht), CONFIG)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(opt, GossipOptimizer)
    return module, opt


def _inner_steps(module: torch.nn.Module, opt: GossipOptimizer, gen: torch.Generator,
                 steps: int) -> None:
    for _ in range(steps * PER_STEP):
        _accumulate(module, gen)
        opt.step(B)


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_two_replicas_average_their_parameters_and_a_newcomer_adopts_one() -> None:
    with hivemind_dhts(2) as dhts:
        built = [(m, dhts.own(opt)) for m, opt in
                 (_build(d, seed) for seed, d in enumerate(dhts.dhts))]
        sent: list[list[torch.Tensor]] = [[], []]
        barrier = threading.Barrier(2, timeout=30.0)

        def device_thread(i: int, module: torch.nn.Module, opt: GossipOptimizer) -> None:
            gen = torch.Generator().manual_seed(10 + i)
            _inner_steps(module, opt, gen, H - 1)
            for _ in range(PER_STEP - 1):
                _accumulate(module, gen)
                opt.step(B)
            barrier.wait()  # both enter the round together, as replicas at network pace would
            _accumulate(module, gen)
            opt.step(B)  # the H-th inner step starts the round (matchmaking takes seconds)
            assert opt._current is not None
            sent[i] = [p.clone() for p in opt._current.params.values()]
            _finish_round(opt)

        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="device") as pool:
            runs = [pool.submit(device_thread, i, m, o) for i, (m, o) in enumerate(built)]
            for run in runs:
                run.result(timeout=90)
        (m_a, a), (m_b, b) = built
        assert a.last_round["ok"] and b.last_round["ok"], (a.last_round, b.last_round)
        assert a.round == b.round == 1 and a.last_round["participants"] == 2
        for p, q, x, y in zip(m_a.parameters(), m_b.parameters(), sent[0], sent[1],
                              strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
            torch.testing.assert_close(p.detach(), (x + y) / 2, rtol=0, atol=1e-6)
            assert not torch.equal(x, y)
        numel = sum(p.numel() for p in m_a.parameters())
        status = a.averaging_status()
        assert status["mode"] == "gossip" and status["last_round"] == 1
        assert status["participants"] == 2 and status["bytes_sent"] == 4 * numel

        # a newcomer asks the stage's gossip averagers and adopts one replica's parameters
        asker_module, asker = _build(dhts.add(), seed=7)
        dhts.own(asker)
        assert asker.load_state_from_peers()
        assert asker.round == 1 and asker.local_epoch == H and asker.rounds_adopted == 1
        donor = [p.detach() for p in asker_module.parameters()]
        assert any(
            all(torch.equal(d, p.detach()) for d, p in zip(donor, m.parameters(), strict=True))
            for m in (m_a, m_b)
        )
