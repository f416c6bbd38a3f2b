"""GossipOptimizer's rounds against scripted carriers: no DHT, no sockets.

Two replicas that meet in a round both take the pair's mean (the stage's mean is kept),
inner steps taken while a round runs are kept on top of the mean, a partner's NaN or
far-away parameters are refused and the round counts as missed (retried after one inner
step), a replica that knows no partner skips its round, a newcomer adopts one replica's
checked parameters, and the state round-trips through ``import_state``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, OptimizerSpec, RunSpec, StagesSpec
from wanswarm.node.stage.averaging import AveragingConfig, AveragingError
from wanswarm.node.stage.checkpoint import CheckpointError
from wanswarm.node.stage.gossip_optimizer import GossipOptimizer
from wanswarm.node.stage.optimizer import AccumAdamW
from wanswarm.node.training.model import build_stage

H = 2
SPEC = RunSpec(
    name="gossipunit",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=2),
    optimizer=OptimizerSpec(lr=1e-2, warmup_steps=0, schedule="constant"),
    averaging=AveragingSpec(mode="gossip", inner_steps=H, round_timeout_s=1.0),
)
STAGE = 1
B, T, C = 2, 8, 16


class Pending:
    def __init__(self) -> None:
        self.outcome: tuple[list[torch.Tensor], dict[str, Any]] | None = None
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def result(self) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        return self.outcome


class Meeting:
    """Pairs the next two replicas that start a round: both get the exact mean."""

    def __init__(self) -> None:
        self.waiting: tuple[str, list[torch.Tensor], dict[str, Any], Pending] | None = None
        self.started = 0

    def carrier(self, name: str) -> Carrier:
        return Carrier(self, name)


class Carrier:
    def __init__(self, meeting: Meeting | None, name: str, *,
                 tamper: Any = None, newer: Any = None) -> None:
        self.meeting, self.name, self.tamper, self.newer = meeting, name, tamper, newer
        self.calls = 0

    def start_average(self, tensors: list[torch.Tensor], meta: dict[str, Any],
                      timeout: float) -> Pending:
        self.calls += 1
        pending = Pending()
        if self.meeting is None:  # nobody comes
            pending.finished = True
            return pending
        if self.meeting.waiting is None:
            self.meeting.waiting = (self.name, tensors, meta, pending)
            return pending
        other_name, other, other_meta, other_pending = self.meeting.waiting
        self.meeting.waiting = None
        mean = [(a + b) / 2 for a, b in zip(tensors, other, strict=True)]
        members = {self.name: meta, other_name: other_meta}
        for p in (pending, other_pending):
            result = [m.clone() for m in mean]
            p.outcome = (self.tamper(result) if self.tamper else result, members)
            p.finished = True
        return pending

    def newer_state(self, timeout: float) -> Any:
        return self.newer

    def shutdown(self) -> None:
        return None


def _replica(carrier: Any, others: int | None = None) -> tuple[torch.nn.Module, GossipOptimizer]:
    module = build_stage(SPEC, STAGE)
    count = None if others is None else (lambda: others)
    return module, GossipOptimizer(module, SPEC, STAGE, AveragingConfig(), lambda _: carrier,
                                   count)


def _train(module: torch.nn.Module, opt: GossipOptimizer, seed: int, steps: int = H) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(B, T, C, generator=gen)
        y = torch.randint(0, 256, (B, T), generator=gen)
        module.forward_loss(x, y).backward()  # type: ignore[operator]
        opt.step(B)


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_two_replicas_that_meet_take_the_mean_and_keep_the_stage_mean() -> None:
    meeting = Meeting()
    m_a, a = _replica(meeting.carrier("a"))
    m_b, b = _replica(meeting.carrier("b"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m_b.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # replicas that differ
    _train(m_a, a, seed=1)  # a's round starts and waits for a partner
    assert a.round_in_progress and a.round == 0
    before_a, before_b = _params(m_a), None
    _train(m_b, b, seed=2, steps=H - 1)
    before_b = _params(m_b)
    _train(m_b, b, seed=3, steps=1)  # b's H-th inner step: the pair meets, b finishes at once
    assert not b.round_in_progress and b.last_round["ok"] and b.round == 1
    # b's parameters at its round's start were taken after its inner step (not before_b)
    assert not all(torch.equal(p, q) for p, q in zip(m_b.parameters(), before_b, strict=True))
    a.step_if_due()  # the server's periodic check finishes a's round
    assert a.last_round["ok"] and a.round == 1 and a.last_round["participants"] == 2
    for p, q in zip(m_a.parameters(), m_b.parameters(), strict=True):
        assert torch.equal(p, q)  # the pair's mean, neither trained meanwhile
    assert a.last_round["parameter_digest"] == b.last_round["parameter_digest"]
    assert a.averaging_status()["mode"] == "gossip"
    assert a.averaging_status()["bytes_sent"] == int(4 * a.numel)  # half sent, half returned
    assert before_a  # a's parameters moved toward b's
    assert not all(torch.equal(p, q) for p, q in zip(m_a.parameters(), before_a, strict=True))


def test_inner_steps_taken_while_the_round_runs_are_kept_on_top_of_the_mean() -> None:
    meeting = Meeting()
    m_a, a = _replica(meeting.carrier("a"))
    m_b, b = _replica(meeting.carrier("b"))
    _train(m_a, a, seed=1)  # a starts its round
    sent_a = {n: t.clone() for n, t in a._current.params.items()}  # type: ignore[union-attr]
    _train(m_a, a, seed=4, steps=1)  # an inner step while waiting
    moved = {n: p.detach() - sent_a[n] for n, p in m_a.named_parameters()}
    _train(m_b, b, seed=2)  # b meets a and, idle meanwhile, holds the pair's mean
    mean = {n: p.detach().clone() for n, p in m_b.named_parameters()}
    a.step_if_due()
    assert a.last_round["ok"]
    for name, p in m_a.named_parameters():
        assert not torch.allclose(mean[name], sent_a[name])
        assert torch.allclose(p, mean[name] + moved[name], atol=1e-6)


@pytest.mark.parametrize("tamper,reason", [
    (lambda mean: [torch.full_like(mean[0], math.nan), *mean[1:]], "NaN"),
    (lambda mean: [m + 1e6 for m in mean], "away from our parameters"),
    (lambda mean: mean[:-1], "tensors, expected"),
    (lambda mean: [mean[0].double(), *mean[1:]], "float32"),
])
def test_a_hostile_mean_is_refused_and_the_round_retried(
    tamper: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    meeting = Meeting()
    honest = Carrier(meeting, "honest")
    m_a, a = _replica(Carrier(meeting, "a", tamper=tamper))
    m_b, b = _replica(honest)
    _train(m_b, b, seed=2)
    before = _params(m_a)
    _train(m_a, a, seed=1)  # meets b; a's result is tampered with
    assert not a.last_round["ok"] and a.rounds_refused == 1 and a.round == 0
    assert reason in caplog.text
    # the parameters are a's own after its inner steps: nothing from the round was taken
    assert not any(torch.isnan(p).any() for p in m_a.parameters())
    assert all(float((p.detach() - q).abs().max()) < 1.0
               for p, q in zip(m_a.parameters(), before, strict=True))
    calls = a._carrier.calls  # type: ignore[attr-defined]
    _train(m_a, a, seed=5, steps=1)  # retried after one inner step, not H
    assert a._carrier.calls == calls + 1  # type: ignore[attr-defined]


def test_a_missed_round_is_retried_after_one_step_three_times_then_after_h() -> None:
    carrier = Carrier(None, "alone")
    m, opt = _replica(carrier)
    _train(m, opt, seed=1)
    assert carrier.calls == 1 and opt.rounds_missed == 1
    _train(m, opt, seed=2, steps=2)
    assert carrier.calls == 3 and opt.rounds_missed == 3
    _train(m, opt, seed=3, steps=H - 1)
    assert carrier.calls == 3  # back to every H
    _train(m, opt, seed=4, steps=1)
    assert carrier.calls == 4


def test_a_replica_that_knows_no_partner_skips_its_round_without_the_carrier() -> None:
    carrier = Carrier(Meeting(), "alone")
    m, opt = _replica(carrier, others=0)
    _train(m, opt, seed=1, steps=3 * H)
    assert carrier.calls == 0 and opt.local_epoch == 3 * H and not opt.round_in_progress
    assert opt.rounds_alone == 3 and opt.averaging_status()["rounds_alone"] == 3


def test_a_newcomer_adopts_one_replica_checked_parameters() -> None:
    m_src, src = _replica(Carrier(None, "src"))
    _train(m_src, src, seed=1, steps=5)
    src.round = 3
    meta, tensors = src._shared_state()
    assert meta == {"round": 3, "epoch": 5}
    m, opt = _replica(Carrier(None, "new", newer=(meta, tensors)))
    assert opt.load_state_from_peers()
    assert opt.round == 3 and opt.local_epoch == 5 and opt.rounds_adopted == 1
    for p, q in zip(m.parameters(), m_src.parameters(), strict=True):
        assert torch.equal(p, q)
    _, other = _replica(Carrier(None, "x"))
    nan = [t.clone() for t in tensors]
    nan[0].view(-1)[0] = math.nan
    assert not other._adopt(meta, nan)
    assert not other._adopt(meta, tensors[:-1])
    assert not other._adopt({"round": True, "epoch": 1}, tensors)
    assert not other._adopt({"round": 1, "epoch": -1}, tensors)
    assert not other._adopt({"round": 10**12, "epoch": 1}, tensors)
    assert other.round == 0 and other.rounds_adopted == 0


def test_state_round_trips_and_bad_rounds_are_refused() -> None:
    m, opt = _replica(Carrier(None, "a"))
    _train(m, opt, seed=1, steps=3)
    opt.round = 7
    epoch, tensors, meta = opt.export_state()
    assert epoch == 3 and meta["gossip_round"] == 7
    m2, fresh = _replica(Carrier(None, "b"))
    fresh.import_state(epoch, tensors, meta)
    assert fresh.round == 7 and fresh.local_epoch == 3
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
    for bad in (-1, True, "3", 10**12):
        with pytest.raises(CheckpointError, match="gossip_round"):
            fresh.import_state(epoch, tensors, meta | {"gossip_round": bad})
    assert fresh.round == 7


def test_the_spec_refuses_compression_with_gossip() -> None:
    with pytest.raises(ValidationError, match="float32 parameters"):
        AveragingSpec(mode="gossip", compression="int8")
    spec = SPEC.model_copy(update={"averaging": SPEC.averaging.model_copy(
        update={"compression": "sign"})})  # model_copy skips validation: the optimizer refuses
    with pytest.raises(AveragingError, match="compression"):
        GossipOptimizer(build_stage(spec, STAGE), spec, STAGE, AveragingConfig(),
                        lambda _: Carrier(None, "x"))


def test_accum_adamw_is_the_inner_optimizer_when_the_spec_says_so() -> None:
    spec = SPEC.model_copy(update={"averaging": SPEC.averaging.model_copy(
        update={"inner_optimizer": "accum_adamw", "accum_steps": 2})})
    module = build_stage(spec, STAGE)
    meeting = Meeting()
    opt = GossipOptimizer(module, spec, STAGE, AveragingConfig(), lambda _: meeting.carrier("a"))
    assert isinstance(opt._inner._opt, AccumAdamW)
    _train(module, opt, seed=3, steps=2)
    epoch, tensors, _ = opt.export_state()
    assert [n for n in tensors if n.endswith(".accum")]  # its accumulator travels with the state
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
