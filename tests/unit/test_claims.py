"""Claims checked against measurement (issue #13, point 6) and the spot checks' verdicts.

An absurd throughput claim neither attracts a trainer's hops (the router clamps it to a
prior from the stage's other servers until measured, then to the measurement) nor moves
stage selection (claims are capped relative to the view's median). Pure: no sockets.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch
from wanswarm.node.stage.selection import (
    RebalancePolicy,
    ServerLoad,
    choose_stage,
    clamp_claims,
    plan_rebalance,
)
from wanswarm.node.training.routing import Candidate, Router, RouterConfig
from wanswarm.node.training.spot_checks import Answer, judge, relative_error

LIAR = "liar"


def _shares(router: Router, candidates: list[Candidate], n: int = 3000) -> Counter[str]:
    rng = random.Random(5)
    picks: Counter[str] = Counter()
    for _ in range(n):
        pick = router.choose(candidates, payload_bytes=0, batch_size=4, now=0.0, rng=rng)
        assert pick is not None
        picks[pick.peer_id] += 1
    return picks


def test_an_absurd_claim_does_not_attract_the_hops_of_an_unmeasured_stage() -> None:
    router = Router(RouterConfig())
    honest = [Candidate(f"h{i}", 20.0, rtt_s=0.01) for i in range(2)]
    candidates = [Candidate(LIAR, 1e12, rtt_s=0.01), *honest]
    effective = router.effective_throughputs(candidates)
    # unmeasured: at most unmeasured_claim_ratio (4) times the median of the others
    assert effective[LIAR] == pytest.approx(4 * 20.0)
    assert effective["h0"] == effective["h1"] == 20.0
    # its first hop measures it: a server as fast as the others then gets a third of the
    # hops, not (as its claim would have it) all of them
    router.observe(LIAR, batch_size=4, service_s=0.2)  # 20 samples/s
    shares = _shares(router, candidates)
    assert all(800 < shares[p] < 1200 for p in (LIAR, "h0", "h1")), shares
    believed = Router(RouterConfig(unmeasured_claim_ratio=1e3))
    believed_shares = _shares(believed, candidates)
    assert believed_shares[LIAR] == 3000  # a claim taken at its word takes every hop


def test_a_claim_is_clamped_to_what_the_trainer_measured() -> None:
    router = Router(RouterConfig())
    candidates = [Candidate(LIAR, 1e12, rtt_s=0.01)] + [
        Candidate(f"h{i}", 20.0, rtt_s=0.01) for i in range(2)
    ]
    for peer in ("h0", "h1"):
        router.observe(peer, batch_size=4, service_s=0.2)  # 20 samples/s, as claimed
    for _ in range(3):
        router.observe(LIAR, batch_size=4, service_s=0.4)  # really 10 samples/s
    assert router.measured(LIAR) == pytest.approx(10.0)
    effective = router.effective_throughputs(candidates)
    assert effective[LIAR] == pytest.approx(10.0)  # min(claimed, measured)
    assert effective["h0"] == pytest.approx(20.0)
    shares = _shares(router, candidates)
    # the slower server gets fewer hops than either honest one, whatever it claims
    assert shares[LIAR] < shares["h0"] and shares[LIAR] < shares["h1"]
    # the measurement is the best of the last measure_window hops: one slow hop (queued
    # behind other work) does not make an honest server look slow
    router.observe("h0", batch_size=4, service_s=5.0)
    assert router.measured("h0") == pytest.approx(20.0)


def test_a_convicted_peer_is_never_chosen_even_when_every_other_is_banned() -> None:
    router = Router(RouterConfig())
    rng = random.Random(1)
    candidates = [Candidate(LIAR, 1e12), Candidate("h", 20.0)]
    router.convict(LIAR)
    router.ban("h", now=0.0, rng=rng)
    for _ in range(50):
        pick = router.choose(candidates, payload_bytes=0, batch_size=4, now=0.0, rng=rng)
        assert pick is not None and pick.peer_id == "h"
    assert router.choose([candidates[0]], payload_bytes=0, batch_size=4, now=0.0, rng=rng) is None
    router.clear_ban(LIAR)  # a stage change lifts bans, not a conviction
    assert router.is_convicted(LIAR)


def test_one_absurd_claim_moves_neither_joins_nor_rebalancing() -> None:
    honest = [ServerLoad(f"s{s}r{r}", s, 20.0) for s in range(3) for r in range(2)]
    liar = ServerLoad(LIAR, 1, 1e12)
    view = [*honest, liar]
    capped = clamp_claims(view, 3, max_ratio=RebalancePolicy().max_claim_ratio)
    assert [s.throughput for s in capped if s.peer_id == LIAR] == [2 * 20.0]
    assert all(s.throughput == 20.0 for s in capped if s.peer_id != LIAR)
    # the claim as announced pulls stage 1's honest servers away (leaving the stage to the
    # liar); capped, it counts as two typical servers, and no move pays
    policy = RebalancePolicy()
    moved = plan_rebalance(view, 3, policy).moves
    assert any(m.from_stage == 1 for m in moved)  # believed: stage 1's honest servers leave
    assert plan_rebalance(capped, 3, policy).moves == ()
    picks = {choose_stage(capped, 3, 20.0, random.Random(i)) for i in range(30)}
    assert picks == {0, 2}  # joiners still go to the stages with fewer servers
    # honest figures within the ratio are untouched
    mixed = [ServerLoad("fast", 0, 40.0), *honest]
    assert clamp_claims(mixed, 3, 2.0) == mixed


def test_spot_check_verdicts() -> None:
    y = torch.randn(2, 8, 16)
    a, b = Answer("p", 3, 3, y, "a"), Answer("q", 3, 3, y + 1e-4 * torch.randn_like(y), "b")
    assert relative_error(y, y) == 0.0
    assert judge(a, b, None, 0.05).kind == "agree"
    wrong = Answer("q", 3, 3, torch.roll(y, 1, dims=1), "w")
    assert relative_error(y, wrong.value) > 0.5
    assert judge(a, wrong, None, 0.05).kind == "unresolved"  # one word against another
    assert judge(a, wrong, Answer("r", 3, 3, y, "c"), 0.05).kind == "second_lied"
    assert judge(wrong, a, Answer("r", 3, 3, y, "c"), 0.05).kind == "first_lied"
    # a third with other parameters is no witness; answers with other parameters are not
    # compared
    assert judge(a, wrong, Answer("r", 4, 4, y, "c"), 0.05).kind == "unresolved"
    assert judge(a, Answer("q", 4, 4, torch.roll(y, 1, dims=1), "w"), None, 0.05).kind == "skipped"
    # losses
    assert judge(Answer("p", 0, 0, 2.0, "x"), Answer("q", 0, 0, 2.001, "y"), None, 0.01).kind == (
        "agree"
    )


def test_spot_checks_compare_only_answers_promising_the_same_parameters() -> None:
    """The parameters' version decides, not the epoch: two replicas at epoch 5 where one has
    copied epoch 4's delayed update in and the other not yet (params 5 and None) answer
    with parameters one optimizer step apart and are not compared; nor is a replica whose
    last step was local (None) with anyone, even with itself. Equal non-null versions are
    compared whatever the epochs say."""
    y = torch.randn(2, 8, 16)
    stepped = torch.roll(y, 1, dims=1)  # stands for parameters one step apart
    applied, pending = Answer("p", 5, 5, y, "a"), Answer("q", 5, None, stepped, "b")
    assert judge(applied, pending, None, 0.05).kind == "skipped"
    assert judge(pending, applied, None, 0.05).kind == "skipped"
    assert judge(pending, Answer("q", 5, None, stepped, "b"), None, 0.05).kind == "skipped"
    # a witness that promises nothing is absent
    liar = Answer("q", 5, 5, stepped, "w")
    assert judge(applied, liar, Answer("r", 5, None, y, "c"), 0.05).kind == "unresolved"
    assert judge(applied, liar, Answer("r", 5, 5, y, "c"), 0.05).kind == "second_lied"
    # the verdict reads the versions, not the epochs
    assert judge(Answer("p", 6, 5, y, "a"), liar, None, 0.05).kind == "unresolved"
    assert Answer("p", 6, 5, y, "a").summary()["params"] == 5
    assert relative_error(y, y[:1]) == float("inf")
    assert relative_error(torch.full((2,), float("nan")), torch.zeros(2)) == float("inf")


def test_a_skipped_spot_check_says_why() -> None:
    """No other replica answered, an answer promised no parameters, or both promised
    different ones: the checker counts each reason (the status's ``skipped_by``)."""
    import asyncio
    from types import SimpleNamespace

    from wanswarm.node.training.hops import HopFailed
    from wanswarm.node.training.spot_checks import Recompute, SpotCheckConfig, SpotChecker

    counters = SimpleNamespace(spot_checks=0, spot_checks_skipped=0,
                               spot_check_disagreements=0, convicted=0)
    # the same-epoch tier off (as in DiLoCo and gossip runs)
    checker = SpotChecker(SpotCheckConfig(fraction=1.0), router=None,  # type: ignore[arg-type]
                          counters=counters, rng=random.Random(0), clock=lambda: 0.0,
                          by_epoch=False)
    y = torch.randn(2, 8, 16)
    first = Answer("p", 5, 5, y, "a")

    def answering(answer: Answer | None) -> Recompute:
        async def recompute(_exclude: frozenset[str]) -> Answer:
            if answer is None:
                raise HopFailed("no other replica of stage 1")
            return answer
        return recompute

    async def run() -> list[str]:
        return [
            (await checker.check("forward", first, answering(a))).kind
            for a in (None, Answer("q", 5, None, y, "b"), Answer("q", 5, 4, y, "b"),
                      Answer("q", 5, 5, y, "a"))
        ]

    assert asyncio.run(run()) == ["skipped", "skipped", "skipped", "agree"]
    assert checker.skipped == {"no_other_replica": 1, "unpromised": 1, "other_params": 1,
                               "other_epoch": 0}
    assert (counters.spot_checks, counters.spot_checks_skipped) == (4, 3)
    assert checker.compared == {"params": 1, "epoch": 0}

    # on (the per-step all-reduce): answers at one epoch are compared whatever they promise
    checker = SpotChecker(SpotCheckConfig(fraction=1.0), router=None,  # type: ignore[arg-type]
                          counters=counters, rng=random.Random(0), clock=lambda: 0.0)

    async def run_by_epoch() -> list[str]:
        return [
            (await checker.check("forward", first, answering(a))).kind
            for a in (Answer("q", 5, None, y, "b"), Answer("q", 5, 4, y, "b"),
                      Answer("q", 6, None, y, "b"), Answer("q", 5, 5, y, "a"))
        ]

    assert asyncio.run(run_by_epoch()) == ["agree", "agree", "skipped", "agree"]
    assert checker.skipped["other_epoch"] == 1 and sum(checker.skipped.values()) == 1
    assert checker.compared == {"params": 1, "epoch": 2}


def test_answers_at_one_epoch_without_equal_parameters_are_held_to_a_looser_bound() -> None:
    """A server that promises no parameters (params null) cannot dodge every check: at the
    same epoch its answer is compared within ``max_epoch_error`` (0.5), which two honest
    replicas one optimizer step apart stay within (at most 0.25 in the tiny run) and a
    wrong answer does not (an output rolled along the sequence was 0.92-0.98 away)."""
    y = torch.randn(2, 8, 16)
    step_apart = y + 0.2 * y.norm() / y.numel() ** 0.5 * torch.randn_like(y)
    assert 0.1 < relative_error(y, step_apart) < 0.3
    honest, dodger = Answer("p", 5, 5, y, "a"), Answer("q", 5, None, step_apart, "b")
    verdict = judge(honest, dodger, None, 0.05, 0.5)
    assert (verdict.kind, verdict.tier, verdict.tolerance) == ("agree", "epoch", 0.5)
    assert judge(honest, dodger, None, 0.05).kind == "skipped"  # the tier off
    liar = Answer("q", 5, None, torch.roll(y, 1, dims=1), "w")
    assert judge(honest, liar, None, 0.05, 0.5).kind == "unresolved"
    # a third at the epoch decides; one at another epoch does not count
    third = Answer("r", 5, None, step_apart, "c")
    verdict = judge(honest, liar, third, 0.05, 0.5)
    assert (verdict.kind, verdict.tier) == ("second_lied", "epoch")
    assert judge(liar, honest, third, 0.05, 0.5).kind == "first_lied"
    assert judge(honest, liar, Answer("r", 6, None, y, "c"), 0.05, 0.5).kind == "unresolved"
    # equal promises keep the tight bound: a step apart is a disagreement there
    assert judge(honest, Answer("q", 5, 5, step_apart, "b"), None, 0.05, 0.5).kind == (
        "unresolved"
    )
    # another epoch: nothing compared
    assert judge(honest, Answer("q", 6, None, y, "b"), None, 0.05, 0.5).kind == "skipped"


def test_an_answer_outvoted_at_one_epoch_is_banned_not_convicted() -> None:
    """The same-epoch tier decides who lied the same way, but its bound rests on how far
    honest replicas drift: the answer both others contradict is banned for a while (the
    hop redone), not convicted for good; at equal promised parameters it is convicted."""
    import asyncio
    from types import SimpleNamespace

    from wanswarm.node.training.spot_checks import SpotCheckConfig, SpotChecker

    y = torch.randn(2, 8, 16)
    rolled = torch.roll(y, 1, dims=1)

    def checker() -> tuple[SpotChecker, Router, Any]:
        counters = SimpleNamespace(spot_checks=0, spot_checks_skipped=0,
                                   spot_check_disagreements=0, convicted=0)
        router = Router(RouterConfig())
        return (SpotChecker(SpotCheckConfig(fraction=1.0), router=router, counters=counters,
                            rng=random.Random(0), clock=lambda: 100.0), router, counters)

    def replicas(*answers: Answer) -> Any:
        async def recompute(exclude: frozenset[str]) -> Answer:
            return next(a for a in answers if a.peer not in exclude)
        return recompute

    spot, router, counters = checker()
    dodger = Answer("liar", 5, None, rolled, "w")  # promises nothing, answers wrong
    recompute = replicas(Answer("p", 5, 5, y, "a"), Answer("r", 5, 5, y, "a"))
    verdict = asyncio.run(spot.check("forward", dodger, recompute))
    assert (verdict.kind, verdict.tier) == ("first_lied", "epoch")
    assert router.is_banned("liar", 100.0) and not router.is_convicted("liar")
    assert (spot.outvoted, counters.convicted) == (1, 0)
    assert not router.is_banned("p", 100.0) and not router.is_banned("r", 100.0)
    # outvoted again by witnesses that agree closely, the second time as the recomputed
    # answer (the witnesses are then the first and the third): at the third time, convicted
    honest = Answer("p", 5, 5, y, "a")
    verdict = asyncio.run(spot.check("forward", honest,
                                     replicas(dodger, Answer("r", 5, 5, y, "a"))))
    assert verdict.kind == "second_lied" and not router.is_convicted("liar")
    asyncio.run(spot.check("forward", dodger, recompute))
    assert router.is_convicted("liar") and (spot.outvoted, counters.convicted) == (3, 1)
    # witnesses that agree only within the loose bound: bans, never a conviction
    spot, router, counters = checker()
    drifted = y + 0.2 * y.norm() / y.numel() ** 0.5 * torch.randn_like(y)
    loosely = replicas(Answer("p", 5, None, y, "a"), Answer("r", 5, None, drifted, "c"))
    for _ in range(5):
        assert asyncio.run(spot.check("forward", dodger, loosely)).kind == "first_lied"
    assert router.is_banned("liar", 100.0) and not router.is_convicted("liar")
    assert spot.outvoted == 5

    spot, router, counters = checker()
    promising = Answer("liar", 5, 5, rolled, "w")  # the same lie at a promise: convicted
    verdict = asyncio.run(spot.check("forward", promising, recompute))
    assert (verdict.kind, verdict.tier) == ("first_lied", "params")
    assert router.is_convicted("liar") and (spot.outvoted, counters.convicted) == (0, 1)
