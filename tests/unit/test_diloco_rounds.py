"""DilocoOptimizer's rounds against scripted carriers: no DHT, no sockets.

Two replicas whose carrier hands each the other's real gathered data end bit-identical;
hostile group members (junk payloads, absurd weights, another anchor) are left out of the
mean without raising; a group at a later round makes a replica adopt that round's state;
a state from peers that is too far ahead or does not fit is refused; the shared state and
the checkpoint round-trip through ``import_state``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, OptimizerSpec, RunSpec, StagesSpec
from wanswarm.node.stage.averager_carrier import AveragerCarrier
from wanswarm.node.stage.averaging import AveragingConfig, AveragingError
from wanswarm.node.stage.checkpoint import CheckpointError
from wanswarm.node.stage.diloco import (
    GROUP_PAYLOADS_BUDGET,
    MAX_GROUP,
    MAX_GROUP_QUIC,
    MAX_PAYLOAD_BYTES,
    DilocoOptimizer,
    quic_group_size,
)
from wanswarm.node.stage.optimizer import Caught
from wanswarm.node.stage.outer import MOMENTUM_PREFIX
from wanswarm.node.training.model import build_stage

H = 2
SPEC = RunSpec(
    name="dilocounit",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=2),
    optimizer=OptimizerSpec(lr=1e-2, warmup_steps=0, schedule="constant"),
    averaging=AveragingSpec(mode="diloco", inner_steps=H, compression="sign", block_size=16,
                            round_timeout_s=1.0),
)
STAGE = 1
B, T, C = 2, 8, 16


class Scripted:
    """A carrier whose group is whatever ``script(our_data)`` returns."""

    def __init__(self, script: Callable[[dict[str, Any]], dict[str, Any] | None],
                 newer: tuple[dict[str, Any], list[torch.Tensor]] | None = None) -> None:
        self.script, self.newer, self.sent = script, newer, []  # type: ignore[var-annotated]

    def gather(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        self.sent.append(data)
        return self.script(data)

    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        return self.newer

    def shutdown(self) -> None:
        return None


def _replica(carrier: Scripted, spec: RunSpec = SPEC) -> tuple[torch.nn.Module, DilocoOptimizer]:
    module = build_stage(spec, STAGE)
    return module, DilocoOptimizer(module, spec, STAGE, AveragingConfig(), lambda *_: carrier)


def _train(module: torch.nn.Module, opt: DilocoOptimizer, seed: int, steps: int = H) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(B, T, C, generator=gen)
        y = torch.randint(0, 256, (B, T), generator=gen)
        module.forward_loss(x, y).backward()  # type: ignore[operator]
        opt.step(B)


def test_two_replicas_end_identical_and_hostile_members_are_left_out() -> None:
    # replica a runs its round first and keeps its data; b's group is a, b and three liars
    seen: dict[str, dict[str, Any]] = {}

    def for_a(data: dict[str, Any]) -> dict[str, Any] | None:
        seen["a"] = data
        return None  # a's own round is run below, once b's data exists

    carrier_a = Scripted(for_a)
    m_a, a = _replica(carrier_a)
    _train(m_a, a, seed=1)
    carrier_a.script = lambda data: {"peer-a": data, "peer-b": seen["b"], **liars(data)}

    def liars(data: dict[str, Any]) -> dict[str, Any]:
        return {
            "peer-c": data | {"payload": b"\x00" * 3},  # wrong length
            "peer-d": data | {"weight": math.inf},
            "peer-e": data | {"anchor": "0" * 16},  # trained from another anchor
            "peer-f": "not a dict",
        }

    m_b, b = _replica(Scripted(lambda data: (seen.__setitem__("b", data), None)[1]))
    _train(m_b, b, seed=2)
    assert a.rounds_missed == b.rounds_missed == 1 and a.outer.round == 0
    b._carrier = Scripted(lambda data: {"peer-a": seen["a"], "peer-b": data, **liars(data)})
    # both retry after another H inner steps; a's stored data must be that round's
    carrier_a.script = lambda data: (seen.__setitem__("a", data), None)[1]
    _train(m_a, a, seed=3)
    carrier_a.script = lambda data: {"peer-a": data, "peer-b": seen["b"], **liars(data)}
    b._carrier = Scripted(lambda data: (seen.__setitem__("b", data), None)[1])
    _train(m_b, b, seed=4)
    # now each runs a round whose group holds the other's real data for the same round
    b._carrier = Scripted(lambda data: {"peer-a": seen["a"], "peer-b": data, **liars(data)})
    a._outer_round()
    b._outer_round()
    assert a.last_round["ok"] and b.last_round["ok"]
    assert a.last_round["participants"] == b.last_round["participants"] == 2
    assert a.outer.round == b.outer.round == 1
    for p, q in zip(m_a.parameters(), m_b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert a.export_state()[1].keys() == b.export_state()[1].keys()
    ea, eb = a.export_state(), b.export_state()
    assert all(torch.equal(ea[1][k], eb[1][k]) for k in ea[1])
    assert a.averaging_status()["bytes_sent"] == a.payload_nbytes * 5  # a group of six
    # peer-e, at our round from another anchor, is counted where the operator sees it
    assert a.averaging_status()["members_at_another_anchor"] == 1


def test_a_replica_behind_adopts_the_newer_round_and_refuses_what_does_not_fit() -> None:
    m_src, src = _replica(Scripted(lambda data: None))
    with torch.no_grad():
        for p in m_src.parameters():
            p.add_(1.0)
    src.outer.round = 1
    for name in src._names:
        src.outer.anchor[name].copy_(dict(m_src.named_parameters())[name])
    meta, tensors = src._shared_state()

    group = {"peer-x": {"round": 1, "anchor": "x", "weight": 1.0, "payload": b""}}
    m, opt = _replica(Scripted(lambda data: group | {"me": data}, newer=(meta, tensors)))
    _train(m, opt, seed=5)
    assert opt.outer.round == 1 and opt.rounds_adopted == 1 and opt.local_epoch == H
    for p, q in zip(m.parameters(), m_src.parameters(), strict=True):
        assert torch.equal(p, q)
    # too far ahead (a single donor's word), or a state that does not fit: refused
    _, other = _replica(Scripted(lambda data: None))
    assert not other._adopt({"round": 5}, tensors, any_round=False)
    assert not other._adopt({"round": 1}, tensors[:-1], any_round=True)
    assert not other._adopt({"round": True}, tensors, any_round=True)
    nan = [t.clone() for t in tensors]
    nan[0].view(-1)[0] = math.nan
    assert not other._adopt({"round": 1}, nan, any_round=True)
    assert other.outer.round == 0


def _poisoned(round_: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """An outer state of the right shapes and finite values, ``round_`` claimed: a liar's."""
    _, src = _replica(Scripted(lambda data: None))
    meta, tensors = src._shared_state()
    return meta | {"round": round_}, [torch.full_like(t, 1e3) for t in tensors]


class CountingScripted(Scripted):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0

    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        self.asked += 1
        return self.newer


class Fetches:
    """A stage server's catch-up, recorded: the donors each call asked for (``only``) and
    whether a state of round 0 would be taken meanwhile; ``install`` moves the replica to
    the next round, as an installed state would."""

    def __init__(self, opt: DilocoOptimizer, install: bool = False) -> None:
        self.opt, self.install = opt, install
        self.asked: list[Any] = []
        self.takes_round_0: list[bool] = []

    def __call__(self, only: Any = None) -> Caught:
        self.asked.append(only)
        self.takes_round_0.append(self.opt.is_behind(0, {"outer_round": 0}))
        if self.install:
            opt = self.opt
            opt._install_outer(opt.outer.round + 1, dict(opt.outer.anchor),
                               dict(opt.outer.momentum))
        return Caught.INSTALLED if self.install else Caught.NOT_BEHIND


def test_a_member_claiming_a_later_round_is_left_out_not_followed() -> None:
    # our group: ourselves, an honest member with our data, and a liar a round "ahead" who
    # also shares a poisoned outer state: the round is taken without it, nothing adopted
    carrier = CountingScripted(
        lambda data: {"me": data, "honest": dict(data), "liar": data | {"round": 1}},
        newer=_poisoned(1),
    )
    m, opt = _replica(carrier)
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=7)
    assert fetches.asked == []  # one member's claim: not even a manifest asked for
    assert opt.last_round["ok"] and opt.last_round["participants"] == 2
    assert opt.outer.round == 1 and opt.rounds_adopted == 0 and carrier.asked == 0
    assert opt.averaging_status()["members_ahead_left_out"] == 1
    assert all(p.abs().max() < 100 for p in m.parameters())


def test_a_replica_behind_catches_up_through_the_servers_quorum_not_one_averager() -> None:
    # most of the group is a round ahead; the averagers' download would hand us a poisoned
    # state, and the stage server's catch-up (a quorum of the stage's replicas) has none yet
    carrier = CountingScripted(lambda data: {"me": data, "ahead": data | {"round": 1}},
                               newer=_poisoned(1))
    m, opt = _replica(carrier)
    fetched: list[int] = []

    def nothing_newer(only: Any = None) -> Caught:
        fetched.append(opt.outer.round)
        return Caught.NOT_BEHIND

    opt.catch_up_with(nothing_newer)
    _train(m, opt, seed=8)
    assert fetched == [0] and carrier.asked == 0
    assert opt.outer.round == 0 and opt.rounds_adopted == 0 and not opt.last_round["ok"]
    assert all(p.abs().max() < 100 for p in m.parameters())  # not the poisoned state

    # the quorum's state arrives (state.py's resync installs it with import_state)
    m_src, src = _replica(Scripted(lambda data: {"me": data}))
    _train(m_src, src, seed=9)  # a round alone: round 1
    epoch, shared, meta = src.export_state()
    assert opt.is_behind(epoch, meta)

    def fetch(only: Any = None) -> Caught:
        opt.import_state(epoch, shared, meta)
        return Caught.INSTALLED

    opt.catch_up_with(fetch)
    _train(m, opt, seed=10)
    assert opt.outer.round == 1 and opt.rounds_adopted == 1 and carrier.asked == 0
    for p, q in zip(m.parameters(), m_src.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.local_epoch == 2 * H  # the inner steps it counted are kept (not set back)


def _group(data: dict[str, Any], ours: int, later: int, other_anchor: int = 0,
           ) -> dict[str, Any]:
    """Our data, ``ours`` more members at our outer state, ``later`` members at round + 1
    agreeing on its anchor, ``other_anchor`` at our round from another anchor."""
    def at(name: str, **what: Any) -> tuple[str, dict[str, Any]]:
        return name, data | what | {"transport_id": "t-" + name}

    return dict([at("me")] + [at(f"s{i}") for i in range(ours)]
                + [at(f"c{i}", round=data["round"] + 1, anchor="c" * 16) for i in range(later)]
                + [at(f"a{i}", anchor="a" * 16) for i in range(other_anchor)])


def test_a_state_most_of_the_group_holds_is_followed_a_minority_is_left_out() -> None:
    # three of five hold a later state: a strict majority; its members are the donors
    # asked; nothing installed (fetch found none), and no step of ours either
    m, opt = _replica(Scripted(lambda data: _group(data, 1, 3)))
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=12)
    assert fetches.asked == [{"t-c0", "t-c1", "t-c2"}] and fetches.takes_round_0 == [False]
    assert opt.outer.round == 0 and not opt.last_round["ok"]
    assert opt.is_behind(0, {"outer_round": 1}) and not opt.is_behind(0, {"outer_round": 0})

    # two of four hold it: no majority, but most of the others are ahead: the quorum of
    # all the stage's replicas is asked
    m, opt = _replica(Scripted(lambda data: _group(data, 1, 2)))
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=13)
    assert fetches.asked == [None] and not opt.last_round["ok"]

    # two of five: a minority (two liars, say): nothing asked, the round goes on without
    m, opt = _replica(Scripted(lambda data: _group(data, 2, 2)))
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=14)
    assert fetches.asked == []
    assert opt.last_round["ok"] and opt.outer.round == 1 and opt.last_round["participants"] == 3
    assert opt.members_ahead_left_out == 2

    # the majority's state is installed: no step of ours on top of it
    m, opt = _replica(Scripted(lambda data: _group(data, 0, 2)))
    opt.catch_up_with(fetches := Fetches(opt, install=True))
    _train(m, opt, seed=15)
    assert fetches.asked == [{"t-c0", "t-c1"}]
    assert opt.outer.round == 1 and opt.rounds_adopted == 1 and not opt.last_round["ok"]
    assert opt.last_round["adopted_newer_state"]


def test_the_smaller_part_of_a_split_at_our_round_takes_the_majoritys_state() -> None:
    # two groups took the same round apart (anchors differ): at the next round the part
    # holding fewer members follows the other, a state of its own round (or later)
    m, opt = _replica(Scripted(lambda data: _group(data, 0, 0, other_anchor=2)))
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=16)
    assert fetches.asked == [{"t-a0", "t-a1"}] and fetches.takes_round_0 == [True]
    assert not opt.last_round["ok"] and opt.outer.round == 0
    assert opt.averaging_status()["members_at_another_anchor"] == 0  # never averaged with
    # the larger part: its members leave the other anchor out and go on
    m, opt = _replica(Scripted(lambda data: _group(data, 1, 0, other_anchor=1)))
    opt.catch_up_with(fetches := Fetches(opt))
    _train(m, opt, seed=17)
    assert fetches.asked == [] and opt.last_round["ok"] and opt.outer.round == 1
    assert opt.members_at_another_anchor == 1


def test_behind_is_by_outer_round_not_by_epoch() -> None:
    m, opt = _replica(Scripted(lambda data: None))  # every round missed: no group
    _train(m, opt, seed=11, steps=3 * H)
    assert opt.outer.round == 0 and opt.local_epoch == 3 * H
    assert opt.is_behind(H, {"outer_round": 1})  # a round ahead, an epoch behind ours
    assert not opt.is_behind(100 * H, {"outer_round": 0})
    assert not opt.is_behind(H, {"outer_round": True})
    assert not opt.is_behind(H, {})


def test_shared_state_and_checkpoint_round_trip() -> None:
    m, opt = _replica(Scripted(lambda data: {"me": data}))
    _train(m, opt, seed=6, steps=2 * H + 1)  # two rounds (alone, a group of one), one step
    assert opt.outer.round == 2
    epoch, tensors, meta = opt.export_state()
    assert epoch == 2 * H and meta == {"outer_round": 2}
    assert {k.split(".")[0] for k in tensors} == {"model", "outer"}
    m2, fresh = _replica(Scripted(lambda data: None))
    fresh.import_state(epoch, tensors, meta)
    assert fresh.outer.round == 2 and fresh.local_epoch == 2 * H
    for name in fresh._names:
        assert torch.equal(fresh.outer.anchor[name], tensors["model." + name])
        assert torch.equal(fresh.outer.momentum[name], tensors[MOMENTUM_PREFIX + name])
    assert not fresh.feedback.residuals  # a newcomer owes nothing

    cp = opt.export_checkpoint()
    assert cp[0] == 2 * H + 1 and any(k.startswith("outer.residual.") for k in cp[1])
    fresh.import_state(*cp)
    again = fresh.export_checkpoint()
    assert again[0] == cp[0] and all(torch.equal(again[1][k], cp[1][k]) for k in cp[1])
    with pytest.raises(CheckpointError):
        fresh.import_state(epoch, {**tensors, "model.extra": torch.zeros(1)}, meta)
    with pytest.raises(CheckpointError, match="outer_round"):
        fresh.import_state(epoch, tensors, {"outer_round": -1})


def test_a_stage_too_big_for_a_round_is_refused_naming_the_field() -> None:
    big = SPEC.model_copy(update={
        "model": ModelSpec(d_model=256, n_heads=2, n_layers=2, seq_len=8),
        "averaging": SPEC.averaging.model_copy(update={"compression": "none"}),
    })
    assert 4 * sum(p.numel() for p in build_stage(big, STAGE).parameters()) > MAX_PAYLOAD_BYTES
    with pytest.raises(AveragingError, match="averaging.compression"):
        _replica(Scripted(lambda data: None), big)


def test_groups_over_quic_grow_to_eight_while_the_payloads_they_hold_fit() -> None:
    mib = 1 << 20
    assert (MAX_GROUP, MAX_GROUP_QUIC, GROUP_PAYLOADS_BUDGET) == (4, 8, 1 << 30)
    assert quic_group_size(1) == quic_group_size(21 * mib) == 8  # the small run's int8 stage
    assert quic_group_size(146 * mib) == 8  # 7 others: 1022 MiB
    assert quic_group_size(147 * mib) == 7
    assert quic_group_size(200 * mib) == 6
    # never fewer than the gather's four (a member then holds three payloads, as before)
    assert quic_group_size(600 * mib) == quic_group_size(1 << 40) == 4


def test_a_round_is_full_when_every_known_replica_joined_within_the_cap() -> None:
    class Averager:  # what hivemind's averager process reads at the next step
        group_target = 0

    class Host:
        def hivemind_averager(self, factory: Any, **options: Any) -> Averager:
            assert options["target_group_size"] == MAX_GROUP_QUIC  # hivemind's own, fixed
            return Averager()

    known = [0]
    carrier = AveragerCarrier(Host(), "p", [], lambda: ({}, []), AveragingConfig(),
                              group_size=MAX_GROUP_QUIC, round_timeout=10.0, what="outer",
                              others=lambda: known[0])
    sizes = []
    for known[0] in (0, 1, 3, 7, 8, 50):
        sizes.append(carrier.size_next_round())
        assert carrier._averager.group_target == sizes[-1]
    # alone it still asks for a pair (min_group_size); a crowd is capped at the group size
    assert sizes == [2, 2, 4, 8, 8, 8]
    unsized = AveragerCarrier(Host(), "p", [], lambda: ({}, []), AveragingConfig(),
                              group_size=MAX_GROUP_QUIC, round_timeout=10.0, what="outer")
    assert unsized.size_next_round() == MAX_GROUP_QUIC  # nobody counted: hivemind's wait


def test_a_checkpoint_file_carries_the_outer_state_and_residuals(tmp_path: Any) -> None:
    from wanswarm.node.stage.checkpoint import read_checkpoint, write_checkpoint

    m, opt = _replica(Scripted(lambda data: {"me": data}))
    _train(m, opt, seed=7, steps=H + 1)
    epoch, tensors, meta = opt.export_checkpoint()
    path = write_checkpoint(tmp_path, SPEC.run_id, STAGE, epoch, tensors, meta, keep=2)
    found = read_checkpoint(path, SPEC.run_id, STAGE)
    m2, restored = _replica(Scripted(lambda data: None))
    restored.import_state(found.epoch, dict(found.tensors), found.optimizer_meta)
    assert restored.outer.round == opt.outer.round == 1 and restored.local_epoch == epoch
    for name in opt._names:
        assert torch.equal(restored.feedback.residuals[name], opt.feedback.residuals[name])
        assert torch.equal(restored.outer.momentum[name], opt.outer.momentum[name])
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
