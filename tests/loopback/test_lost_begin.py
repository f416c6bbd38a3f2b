"""A round whose group formed on one side only is looked for again, not half-averaged.

hivemind's matchmaking ends with the leader sending ``BEGIN_ALLREDUCE`` to each follower. In
the demo a follower stopped waiting for it a moment before it arrived (the leader was late
to assemble); the leader ran the all-reduce with a member that never came, stalled
``sender_timeout`` plus ``reducer_timeout`` (20 s), kept its own values ("received 50.0% of
input tensors"), and the follower, still looking for the round, stepped alone once the
leader had moved on. Here the leader's first ``BEGIN_ALLREDUCE`` never leaves it (the
stream ends first, which the follower sees exactly as it saw the late one): both members
must still end the step with the same, complete average (stage/exact_allreduce.py).

Loopback tier: two hivemind DHTs on 127.0.0.1, each averager in its own forked process.
"""

from __future__ import annotations

import multiprocessing
import time
import typing
from typing import Any

import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from wanswarm.node.stage.exact_allreduce import (
    EpochKeyedStateAverager,
    ExactGradientAverager,
    Gathered,
    _ParameterRoundHook,
)

from tests.loopback.hivemind_dhts import hivemind_dhts

# BEGIN_ALLREDUCE messages the averagers' processes held back (inherited across the fork)
_BEGINS_LOST = multiprocessing.get_context("fork").Value("i", 0)


class _DropsFirstBegin:
    """Ends the averagers' first stream to a follower before ``BEGIN_ALLREDUCE`` (in the
    averager's own process): the follower sees exactly what it saw when its wait ran out
    a moment before the message came."""

    # typing's AsyncIterator: hivemind's servicer tells a streaming handler by the hint
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in super().rpc_join_group(request, context):  # type: ignore[misc]
            if message.code == averaging_pb2.BEGIN_ALLREDUCE:
                with _BEGINS_LOST.get_lock():
                    if _BEGINS_LOST.value == 0:
                        _BEGINS_LOST.value += 1
                        return
            yield message


class _LosesItsFirstBegin(_DropsFirstBegin, ExactGradientAverager):
    """The gradient averager of a stage, losing the first BEGIN_ALLREDUCE it leads."""


class _StateAverager(_DropsFirstBegin, EpochKeyedStateAverager):
    """The parameter averager of a stage, losing the first BEGIN_ALLREDUCE it leads."""


def _two_gradient_averagers(
    dhts: Any, cls: type[ExactGradientAverager], prefix: str, epoch: int, chunk_s: float
) -> list[Any]:
    """Two gradient averagers of one stage at ``epoch``, holding gradients of 1 and 3 (their
    mean: 2), on the test's two DHTs."""
    averagers: list[Any] = []
    for value, dht in enumerate(dhts.dhts):
        parameter = torch.nn.Parameter(torch.zeros(64))
        averager = dhts.own(cls(
            [parameter], dht=dht, prefix=prefix, start=True, target_group_size=2,
            min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=chunk_s,
        ))
        averager.round_epoch = lambda: epoch
        parameter.grad = torch.full_like(parameter, float(2 * value + 1))
        averager.accumulate_grads_(batch_size=1)
        averagers.append(averager)
    return averagers


@pytest.mark.timeout(120)
def test_a_group_that_formed_on_one_side_only_is_found_again() -> None:
    with _BEGINS_LOST.get_lock():
        _BEGINS_LOST.value = 0
    with hivemind_dhts(2) as dhts:
        averagers = _two_gradient_averagers(dhts, _LosesItsFirstBegin, "lostbegin", 7, 3.0)
        started = time.monotonic()
        controls = [a.step(timeout=20.0, wait=False) for a in averagers]
        results = [control.result(timeout=60) for control in controls]
        took = time.monotonic() - started
        assert _BEGINS_LOST.value == 1  # the first group did form on the leader's side only
        for result in results:
            assert isinstance(result, Gathered)
            assert len(result) == 2 and result.complete, result
        with averagers[0].get_tensors() as a, averagers[1].get_tensors() as b:
            assert torch.equal(a[0], b[0])
            assert torch.equal(a[0], torch.full((64,), 2.0))
        # found again at once: the leader's round failed as soon as the follower refused
        # its parts (not after next_chunk_timeout plus twice that for the results)
        # (the follower looked under the epoch's key all along: the two met there again),
        # and each member closed its streams once it had every part: a reducer waits for
        # that close, up to reducer_timeout (2 x next_chunk_timeout), before closing its side
        assert took < 2 * 3.0, took


@pytest.mark.timeout(120)
def test_a_parameter_round_that_formed_on_one_side_only_is_found_again() -> None:
    """The same for the parameter rounds (hivemind's delta all-reduce): both members end with
    the mean of their parameters, and a member's own part is not rounded by the codec."""
    with _BEGINS_LOST.get_lock():
        _BEGINS_LOST.value = 0
    with hivemind_dhts(2) as dhts:
        averagers: list[Any] = []
        for value, dht in enumerate(dhts.dhts):
            parameter = torch.nn.Parameter(torch.full((64,), float(2 * value + 1)))
            averagers.append(dhts.own(_StateAverager(
                dht=dht, prefix="lostbeginstate", start=True, target_group_size=2,
                min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=3.0,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), params=[parameter],
            )))
        # how TrainingStateAverager._do starts a parameter round (the hook sets its key)
        controls = [
            _ParameterRoundHook.step(a, wait=False, timeout=20.0, gather=7) for a in averagers
        ]
        results = [control.result(timeout=60) for control in controls]
        assert _BEGINS_LOST.value == 1
        for result in results:
            assert isinstance(result, Gathered) and len(result) == 2 and result.complete
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert torch.allclose(tensors[0], torch.full((64,), 2.0))


@pytest.mark.timeout(120)
def test_a_round_formed_early_waits_for_a_partner_that_triggers_later(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The common case the refusal must not break: a round formed early (the group is
    assembled, each member waits for its own trigger) whose members trigger seconds apart.
    The first one's parts reach the other before it has registered the group: they wait
    for it (up to ``sender_timeout``), the round completes as one round, and nobody looks
    for a group again."""
    with hivemind_dhts(2) as dhts:
        averagers = _two_gradient_averagers(dhts, ExactGradientAverager, "latetrigger", 9, 6.0)
        controls = [a.schedule_step(timeout=30.0) for a in averagers]
        from hivemind.averaging.control import AveragingStage

        deadline = time.monotonic() + 30
        while any(c.stage != AveragingStage.AWAITING_TRIGGER for c in controls):
            assert time.monotonic() < deadline, [c.stage for c in controls]
            time.sleep(0.05)
        for control, averager in zip(controls, averagers, strict=True):
            averager.step(control=control, wait=False)  # loads the gradients, triggers
            time.sleep(3.0)  # three times unknown_group_wait_s, half of sender_timeout
        results = [control.result(timeout=60) for control in controls]
        for result in results:
            assert isinstance(result, Gathered) and len(result) == 2 and result.complete
        with averagers[0].get_tensors() as a, averagers[1].get_tensors() as b:
            assert torch.equal(a[0], b[0]) and torch.equal(a[0], torch.full((64,), 2.0))
    assert "no other member" not in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_parts_for_a_made_up_group_are_refused() -> None:
    """A peer that streams parts for a group nobody assembled gets ``BAD_GROUP_ID`` within
    :func:`unknown_group_wait_s` (hivemind held the handler until some group registered)."""
    import asyncio

    from hivemind.utils.asyncio import aiter_with_timeout, as_aiter
    from wanswarm.node.stage.exact_allreduce import unknown_group_wait_s

    with hivemind_dhts(2) as dhts:
        victim = dhts.own(ExactGradientAverager(
            [torch.nn.Parameter(torch.zeros(8))], dht=dhts[0], prefix="madeup", start=True,
            min_matchmaking_time=1.0, request_timeout=0.5,
        ))

        async def attack() -> tuple[int, float]:
            p2p = await dhts[1].replicate_p2p()
            stub = ExactGradientAverager.get_stub(p2p, victim.peer_id, namespace="madeup")
            started = time.monotonic()
            part = averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"made-up group", weight=1.0
            )
            stream = await stub.rpc_aggregate_part(as_aiter(part))
            async for reply in aiter_with_timeout(stream, 30.0):
                return reply.code, time.monotonic() - started
            raise AssertionError("the stream ended without a reply")

        code, took = asyncio.run(attack())
        assert code == averaging_pb2.BAD_GROUP_ID
        assert took < unknown_group_wait_s(0.5) + 2.0, took
