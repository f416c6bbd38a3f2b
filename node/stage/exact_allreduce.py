"""hivemind's gradient all-reduce, made to hand every member the same bits.

hivemind 1.1.12's butterfly all-reduce (``hivemind.averaging.allreduce.AllReduceRunner``)
returns deltas: the peer that reduces part ``p`` sends each member ``mean_p - x_p`` (compressed
with that member's own compression), and the member adds it to its own ``x_p``. The result
``x_p + (mean_p - x_p)`` differs from ``mean_p`` in the last bits, differently on every member,
and by the compression's error (fp16: about 1e-3 relative) when the delta is compressed. The
replicas of a stage then step with averaged gradients that are not quite equal, and their
parameters drift apart by rounding: their digests never agree after a round (issue #12's
acceptance asks that they do), and tests can only compare them within a tolerance.

:class:`ExactAllReduceRunner` sends the mean itself: the reducer of part ``p`` compresses
``mean_p`` once, with its own compression and the part's compression info, sends those same
bytes to every member and keeps their decompression for itself; every member *assigns* the
decompressed part (``TensorPartContainer(return_deltas=False)``). Every member of the round
then holds the same averaged gradients bit for bit, and replicas that start from the same
parameters stay bit-identical after every round they all take part in (a part whose reducer
failed keeps the member's own values, as hivemind does). The wire carries the same amount:
one compressed part per member and part.

:class:`ExactGradientAverager` is hivemind's ``GradientAverager`` with this runner (the
``grad_averager_factory`` of ``hivemind.Optimizer``, averaging.py). It overrides hivemind
internals, which is why hivemind is pinned exactly (pyproject.toml) and
tests/unit/test_exact_allreduce.py checks the names this module relies on.

Rounds of one epoch only. hivemind's matchmaking key is the averager's prefix and group
bits, nothing about the epoch: a replica one epoch ahead of another forms its next round
with the other's round of the epoch before, so each waits inside its step for the other's
epoch to end, the one ahead gathers the samples while the other waits, and the two average
gradients of different parameters. Once there (a replica that stepped alone while the
other started, in the demo), the pair stays one epoch apart for the rest of the run: steps
took 2-5 s instead of 0.1-0.3 s in the stalled stage. Given ``round_epoch`` (the stage's
optimizer sets it), every round this averager starts first sets its group bits to the
epoch's low :data:`EPOCH_KEY_BITS` bits, so only rounds of the same epoch meet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from functools import cached_property
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

# the TensorPartContainer arguments AllReduceRunner passes on from its **kwargs
_CONTAINER_ARGS = ("compression", "part_size_bytes", "tensor_infos", "prefetch")


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose members all receive the same compressed mean of each part."""

    def __init__(self, *, tensors: Sequence[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(tensors=tensors, **kwargs)
        container_args = {k: kwargs[k] for k in _CONTAINER_ARGS if k in kwargs}
        self.tensor_part_container = TensorPartContainer(
            tensors, self.peer_fractions, return_deltas=False, **container_args
        )
        own = self.ordered_peer_ids.index(self.peer_id)
        self._own_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[own]]
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(own)
        # part index -> (its mean as sent, as every member decompresses it)
        self._means: dict[int, asyncio.Future[tuple[runtime_pb2.Tensor, torch.Tensor]]] = {}

    async def _mean_of(
        self, part_index: int, averaged: torch.Tensor
    ) -> tuple[runtime_pb2.Tensor, torch.Tensor]:
        """Part ``part_index``'s mean compressed once (our compression, the part's info), and
        its decompression: the same bits for every member, ourselves included.

        The compression runs on its own, shielded from its callers: our own path and the stream
        that serves the other member both wait for it, and either may be cancelled (this
        runner failing, or the member closing its stream) while the other still needs it. A
        cancellation that reached the shared result would end the other caller too: our own
        outputs would never complete, or the member's stream would close one part short (a
        clean end of stream, which that member takes as a failed reducer and finishes the
        round with its own values for the missing parts)."""
        future = self._means.get(part_index)
        if future is None:
            compression = self.tensor_part_container.compression
            info = self._own_infos[part_index]

            def run() -> tuple[runtime_pb2.Tensor, torch.Tensor]:
                sent = compression.compress(averaged, info)
                return sent, deserialize_torch_tensor(sent)

            future = asyncio.get_running_loop().run_in_executor(None, run)
            self._means[part_index] = future
        return await asyncio.shield(future)

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            await super()._communicate_with_peer(peer_id)
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            _, mean = await self._mean_of(part_index, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, mean)

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        try:
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    break  # the sender was banned: it gets nothing more
                sent, _ = await self._mean_of(part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=sent
                )
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


EPOCH_KEY_BITS = 8  # of the epoch, in a round's group key: 256 epochs apart collide
ROUNDS_KEPT = 16  # parameter rounds' controls kept by the epoch they average


class Gathered(dict[Any, Any]):
    """What a round returns (hivemind's gathered metadata: each member's, by peer id), and
    whether this member received every part's average (``complete``). hivemind reports a
    round whose reducer of some part failed mid-way as a success; the member keeps its own
    values for that part, so two members of one "successful" round can end up apart
    (``Averaging: received 53.7% results`` in its log)."""

    def __init__(self, gathered: Any = (), *, complete: bool = True) -> None:
        super().__init__(gathered)
        self.complete = complete


class _MissingResults(DecentralizedAverager):
    """Marks each round's result with whether every part's average arrived (``Gathered``).
    Runs in the averager's process; the mark travels with the result to the caller."""

    @cached_property
    def _missing(self) -> dict[Any, int]:
        """Group id -> elements whose average did not arrive, per round (this process)."""
        return {}

    def _record_missing(self, group_id: Any, runner: AllReduceRunner | None) -> None:
        container = getattr(runner, "tensor_part_container", None)
        failed = getattr(container, "failed_size", None)
        self._missing[group_id] = int(failed) if isinstance(failed, int) else -1

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        finally:
            future = self._running_groups.get(group_id)
            runner = (
                future.result()
                if future is not None and future.done() and not future.cancelled()
                and future.exception() is None else None
            )
            self._record_missing(group_id, runner)

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int,
                                    **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        missing = self._missing.pop(group_info.group_id, -1)
        return Gathered(gathered, complete=missing == 0)


class _ParameterRoundHook(_MissingResults):
    """Between hivemind's ``TrainingStateAverager`` and ``DecentralizedAverager`` in
    :class:`EpochKeyedStateAverager`'s method order, so that the ``super().step`` through
    which the state averager starts a parameter round (pre-scheduled or not) comes here: the
    round's group key gets the epoch the round gathers (hivemind passes it as ``gather``),
    and the round's control is kept as ``last_round`` for whoever waits on it, and in
    ``rounds`` by that epoch (the epoch the step that uses it moves to)."""

    last_round: Any = None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        gather = kwargs.get("gather")
        epoch = gather if isinstance(gather, int) and not isinstance(gather, bool) else None
        if epoch is not None:
            self.set_group_bits(epoch_group_bits(epoch), wait=False)
        control = super().step(*args, **kwargs)
        if kwargs.get("wait") is False:
            self.last_round = control
            if epoch is not None:
                rounds = self.rounds
                rounds.pop(epoch, None)
                rounds[epoch] = control  # a later round for the epoch replaces an unused one
                while len(rounds) > ROUNDS_KEPT:
                    rounds.pop(next(iter(rounds)))
        return control

    @cached_property
    def rounds(self) -> dict[int, Any]:
        """The last ``ROUNDS_KEPT`` parameter rounds' controls, by the epoch they gather."""
        return {}


class EpochKeyedStateAverager(TrainingStateAverager, _ParameterRoundHook):
    """hivemind's ``TrainingStateAverager`` whose parameter rounds meet only rounds of the
    same epoch, which keeps its rounds' controls (``last_round``, ``rounds``), and whose
    rounds say whether every part's average arrived (``Gathered.complete``)."""


def epoch_group_bits(epoch: int) -> str:
    """The group bits of a round averaging epoch ``epoch``'s gradients."""
    return format(epoch % (1 << EPOCH_KEY_BITS), f"0{EPOCH_KEY_BITS}b")


class ExactGradientAverager(GradientAverager, _MissingResults):
    """hivemind's GradientAverager whose rounds leave every member the same averaged bits,
    whose rounds meet only rounds of the same epoch (given ``round_epoch``), and whose
    rounds say whether every part's average arrived (``Gathered.complete``)."""

    # the epoch whose gradients the next round averages; None: hivemind's key alone
    round_epoch: Callable[[], int] | None = None

    def schedule_step(self, *args: Any, **kwargs: Any) -> Any:
        # every round starts here (hivemind's step without a control calls it too)
        round_epoch = self.round_epoch
        if round_epoch is not None:
            # through the averager's pipe, ahead of the step's own message: its matchmaking
            # (in the averager's process) reads the bits after they are set
            self.set_group_bits(epoch_group_bits(round_epoch()), wait=False)
        return super().schedule_step(*args, **kwargs)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        if self._averaging_alpha != 1.0:
            raise ValueError("the exact all-reduce assigns the mean: averaging_alpha must be 1")
        group_id = group_info.group_id if group_id is None else group_id
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, mean in azip(as_aiter(*tensors), runner):
                    tensor.copy_(mean)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            self._record_missing(group_id, runner)
