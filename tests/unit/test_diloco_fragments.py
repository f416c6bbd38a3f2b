"""Streaming DiLoCo in the daemon's optimizer (``[averaging] fragments``): each round carries
one fragment of the stage, in turn, every H / F inner steps. Two replicas on an in-memory
carrier whose gather ends once both posted their data for the round: no DHT, no sockets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.stage.averaging import AveragingConfig, AveragingError
from wanswarm.node.stage.diloco import DilocoOptimizer, anchor_digest
from wanswarm.node.stage.outer import split_fragments
from wanswarm.node.training.model import build_stage

from tests.unit.test_diloco_rounds import SPEC, STAGE, B, C, T

H, F = 2, 2
STREAMED = SPEC.model_copy(update={"averaging": AveragingSpec(
    mode="diloco", inner_steps=H, fragments=F, compression="sign", block_size=16,
    round_timeout_s=1.0,
)})


class _Pending:
    def __init__(self, slot: dict[str, Any]) -> None:
        self.slot = slot

    def done(self) -> bool:
        return len(self.slot) == 2

    def result(self) -> dict[str, Any] | None:
        return dict(self.slot)


class _Side:
    """One replica's carrier of a pair: a round's gather ends once both posted for it."""

    def __init__(self, posted: dict[int, dict[str, Any]], name: str) -> None:
        self.posted, self.name = posted, name

    def start_gather(self, data: dict[str, Any], timeout: float) -> _Pending:
        slot = self.posted.setdefault(data["round"], {})
        slot[self.name] = data
        return _Pending(slot)

    def gather(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        raise AssertionError("the optimizer gathers in the background when it can")

    def newer_state(self, timeout: float) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _pair() -> tuple[list[torch.nn.Module], list[DilocoOptimizer]]:
    posted: dict[int, dict[str, Any]] = {}
    modules, opts = [], []
    for name in ("peer-a", "peer-b"):
        module = build_stage(STREAMED, STAGE)
        side = _Side(posted, name)
        modules.append(module)
        opts.append(
            DilocoOptimizer(module, STREAMED, STAGE, AveragingConfig(), lambda _, __, s=side: s)
        )
    return modules, opts


def _one_step(module: torch.nn.Module, opt: DilocoOptimizer, gen: torch.Generator) -> None:
    x = torch.randn(B, T, C, generator=gen)
    y = torch.randint(0, 256, (B, T), generator=gen)
    module.forward_loss(x, y).backward()  # type: ignore[operator]
    opt.step(B)


def test_rounds_take_the_fragments_in_turn_and_the_replicas_meet_after_all_of_them() -> None:
    modules, (a, b) = _pair()
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert a.round_every == H // F == 1 and len(a._fragments) == F
    names = a._fragments
    assert sorted(names[0] + names[1]) == sorted(n for n, _ in modules[0].named_parameters())
    full = sum(a._fragment_nbytes)
    for round_ in range(F):
        # one inner step each starts the round on fragment round % F; b's start completes it
        for module, opt, gen in zip(modules, (a, b), gens, strict=True):
            _one_step(module, opt, gen)
        a._poll_round()
        for opt in (a, b):
            assert opt.outer.round == round_ + 1 and opt.last_round["ok"], opt.last_round
            assert opt.last_round["participants"] == 2
        sent = a._carrier.posted[round_]["peer-a"]["payload"]
        assert len(sent) == a._fragment_nbytes[round_ % F] < full
        averaged = set(names[round_ % F])
        pa = dict(modules[0].named_parameters())
        pb = dict(modules[1].named_parameters())
        for name in averaged:  # the round's fragment: equal bit for bit
            assert torch.equal(pa[name], pb[name]), name
        if round_ == 0:  # the other fragment trained apart and is not yet averaged
            assert any(not torch.equal(pa[n], pb[n]) for n in names[1])
    # every fragment averaged once: the outer states are identical (the parameters of
    # fragment 0 have taken an inner step each since its round, apart)
    assert anchor_digest(a.outer) == anchor_digest(b.outer)
    assert all(torch.equal(a.outer.momentum[n], b.outer.momentum[n]) for n in a._names)
    epoch, tensors, meta = a.export_state()
    assert meta == {"outer_round": F} and epoch == F * a.round_every
    status = a.averaging_status()
    assert status["fragments"] == F and status["next_fragment"] == 0
    assert status["payload_bytes"] == max(a._fragment_nbytes)


def test_a_round_weighs_the_samples_since_its_fragments_last_round() -> None:
    modules, (a, b) = _pair()
    gen = torch.Generator().manual_seed(3)
    _one_step(modules[0], a, gen)  # round 0 (fragment 0) starts with B samples
    assert a._round is not None and a._round.samples == B and a._round.fragment == 0
    _one_step(modules[1], b, torch.Generator().manual_seed(4))
    a._poll_round()
    # fragment 0's count restarted; fragment 1 still holds the step before its round
    assert a._samples == [0.0, float(B)]


def test_the_spec_refuses_fragments_it_cannot_stream() -> None:
    with pytest.raises(ValidationError, match="multiple of averaging.fragments"):
        AveragingSpec(mode="diloco", inner_steps=3, fragments=2)
    with pytest.raises(ValidationError, match="streams DiLoCo's outer rounds"):
        AveragingSpec(mode="gossip", inner_steps=2, fragments=2)
    too_many = SPEC.model_copy(update={"averaging": AveragingSpec(
        mode="diloco", inner_steps=64, fragments=64, compression="sign", block_size=16,
    )})
    module = build_stage(too_many, STAGE)
    with pytest.raises(AveragingError, match="lower averaging.fragments"):
        DilocoOptimizer(module, too_many, STAGE, AveragingConfig(), lambda *_: None)  # type: ignore[arg-type,return-value]


def test_one_fragment_keeps_a_diloco_runs_id() -> None:
    assert '"fragments"' not in SPEC.canonical_json()
    assert '"fragments":2' in STREAMED.canonical_json()
    assert STREAMED.run_id != SPEC.run_id


def test_the_split_is_balanced_deterministic_and_complete() -> None:
    sizes = {"w1": 100, "w2": 60, "b1": 10, "b2": 10, "w3": 50}
    frags = split_fragments(sizes, 2)
    assert frags == split_fragments(dict(reversed(sizes.items())), 2)
    assert sorted(sum(frags, [])) == sorted(sizes)
    loads = [sum(sizes[n] for n in f) for f in frags]
    assert max(loads) - min(loads) <= 100
    assert split_fragments(sizes, 1) == [sorted(sizes)]
    assert len(split_fragments({"only": 5}, 3)) == 1
    with pytest.raises(ValueError):
        split_fragments(sizes, 0)
