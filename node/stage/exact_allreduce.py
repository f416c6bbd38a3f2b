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

A group that formed on one side only. hivemind's matchmaking ends with the leader sending
``BEGIN_ALLREDUCE`` to each follower; a follower that stops waiting a moment before it
arrives (its ``request_timeout`` past its own expiration: the leader was late to assemble
the group, its lock held by its own join request) goes on looking for a group, while the
leader runs the all-reduce with it. In hivemind that round could not fail fast: the
follower's handler for the leader's parts waited for *any* group to register
(``_pending_groups_registered``) before refusing, the leader's reducer waited
``sender_timeout`` for the follower's parts and its results ``reducer_timeout`` more, and
the round then "succeeded" with the leader's own values (``Reducer: received 50.0% of
input tensors``, ``Averaging: received 46.0% results``). The follower, still looking under
the epoch's key, gave up once the leader had moved on: each replica stepped on its own
gradients after a 20 s stall (the demo's ``next_chunk_timeout`` of 10 s), and their
optimizer moments stayed apart for the rest of the run. Here (:class:`_GuardedRounds`,
:class:`GuardedAllReduceRunner`, used by both the gradient and the parameter averager):

- a member refuses parts for a group it does not know (``BAD_GROUP_ID``) after
  :func:`unknown_group_wait_s` (twice the matchmaking ``request_timeout``, at least 1 s: a
  ``BEGIN_ALLREDUCE`` still in flight), not once some group registers here: a peer can no
  longer hold handlers open with made-up group ids either. A group this member did
  assemble but has not registered (formed early, it waits for this member's own trigger)
  is waited for up to ``sender_timeout``, as long as the sender's reducer waits for us;
- a member whose reducer refused or failed without delivering a part is also dropped as a
  sender (it sends nothing to a group it does not know), so our own parts finish at once;
- a part that only our own input reached is left as it was (no codec rounding), and a
  round in which no other member delivered anything is not a round: the averager raises
  ``MatchmakingException``, which hivemind's step loop answers by looking for a group again
  (until the step's deadline), under the key the round began with (hivemind's key manager
  had moved it when the group assembled). The follower is still looking under that key:
  the two meet within a second or two and average for real.

The tail of a reducer's results. A member reads a reducer's results until the stream ends,
and the reducer closed its side as soon as it had written the last one. hivemind's libp2p
daemon pipes each stream through a Unix socket; a close there closes the libp2p stream, the
daemon's other pipe then fails to read and resets the stream, and a reset drops what was
still queued to send. The member saw a clean end one or two parts short ("peer ... sent 11
parts, but we expected 12", "Averaging: received 84.7% results") while the reducer, which
had yielded every part, called its round complete: one to three such rounds in every demo
run, three in 99 s over the ``wan`` profile, each leaving the replicas apart. A member now
reads exactly the parts it expects and closes the stream from its side first
(:meth:`GuardedAllReduceRunner._exchange_with`); a reducer that has sent every part waits
for that close (hivemind's handler cancels the wait when it comes) before its side closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from functools import cached_property
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    anext,
    as_aiter,
    attach_event_on_finished,
    azip,
)
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)

# the TensorPartContainer arguments AllReduceRunner passes on from its **kwargs
_CONTAINER_ARGS = ("compression", "part_size_bytes", "tensor_infos", "prefetch")
# how long a member waits for a group it does not know before refusing its parts, at least
MIN_UNKNOWN_GROUP_WAIT_S = 1.0
# a registered group's runner is set up at once, unless the averager's tensors are locked
# (the trainer reading them): how long a member's parts wait for it, when hivemind has no
# reducer_timeout to go by
RUNNER_WAIT_S = 60.0
GROUP_POLL_S = 0.05  # while a member's parts wait for their group to register here
ASSEMBLED_KEPT = 8  # group ids a member remembers having assembled


def unknown_group_wait_s(request_timeout: float | None) -> float:
    """How long a member waits for a group it does not know yet (the leader's
    ``BEGIN_ALLREDUCE`` may still be in flight while its parts arrive) before refusing it."""
    return max(2.0 * (request_timeout or 0.0), MIN_UNKNOWN_GROUP_WAIT_S)


class _GuardedContainer(TensorPartContainer):
    """hivemind's container, noting how many parts each failed reducer had delivered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delivered_before_failure: dict[int, int] = {}

    def register_failed_reducer(self, peer_index: int) -> None:
        self.delivered_before_failure.setdefault(
            peer_index, self._outputs_registered_by_peer[peer_index]
        )
        super().register_failed_reducer(peer_index)


class GuardedAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce (deltas, as its averagers apply them) that drops a member which
    delivered nothing as a reducer from its senders too, leaves a part only our own input
    reached exactly as it was, and says whether any other member took part at all
    (:meth:`heard_from_nobody`; module docstring)."""

    RETURN_DELTAS = True

    def __init__(self, *, tensors: Sequence[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(tensors=tensors, **kwargs)
        container_args = {k: kwargs[k] for k in _CONTAINER_ARGS if k in kwargs}
        self.tensor_part_container = _GuardedContainer(
            tensors, self.peer_fractions, return_deltas=self.RETURN_DELTAS, **container_args
        )
        self._own_index = self.ordered_peer_ids.index(self.peer_id)
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(
            self._own_index
        )
        # the other senders' indices in the reducer (an auxiliary member sends nothing)
        self._other_senders = [
            index for index, peer in enumerate(self.sender_peer_ids) if peer != self.peer_id
        ]

    def _alone_in(self, part_index: int) -> bool:
        """No other sender's input reached our part ``part_index``."""
        reducer = self.tensor_part_reducer
        return all(
            min(reducer.num_parts_received[sender], reducer.sender_failed_after[sender])
            <= part_index
            for sender in self._other_senders
        )

    def heard_from_nobody(self) -> bool:
        """No other member of the group delivered anything: no part averaged by another
        reached us and no other sender's input reached our parts. The round averaged
        nothing; hivemind would call it a success."""
        if self.group_size < 2:
            return False
        container = self.tensor_part_container
        for index in range(self.group_size):
            if index == self._own_index or container.num_parts_by_peer[index] == 0:
                continue
            if container.delivered_before_failure.get(index) != 0:
                return False  # that reducer delivered some or all of its parts
        received = self.tensor_part_reducer.num_parts_received
        return all(received[sender] == 0 for sender in self._other_senders)

    async def _own_result(
        self, part_index: int, part: torch.Tensor, averaged: torch.Tensor
    ) -> torch.Tensor:
        """What this member keeps for its own part: hivemind's delta."""
        return averaged - part

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, part, weight=self.weight
                )
                if self._alone_in(part_index):  # nobody else's input: nothing to average
                    result = torch.zeros_like(part) if self.RETURN_DELTAS else part
                else:
                    result = await self._own_result(part_index, part, averaged)
                self.tensor_part_container.register_processed_part(
                    self._own_index, part_index, result
                )
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            await self._exchange_with(peer_id, peer_index)
        except BaseException as exc:
            if isinstance(exc, Exception):
                logger.debug("%s: exchanging parts with %s failed: %r", self, peer_id, exc)
            self.tensor_part_container.register_failed_reducer(peer_index)
            # refused (BAD_GROUP_ID: not in this group) or failed before its first part: it
            # will not send us its parts either, and ours need not wait sender_timeout for it
            delivered = self.tensor_part_container.delivered_before_failure.get(peer_index)
            if isinstance(exc, Exception) and delivered == 0 and peer_id in self.sender_peer_ids:
                await self._ban_sender(peer_id)
            raise

    async def _exchange_with(self, peer_id: Any, peer_index: int) -> None:
        """hivemind's exchange with the reducer of another member's part: our inputs out,
        that part's results in, but read up to the count of parts expected and then closed
        from our side (module docstring: the reducer closing first lost the stream's tail)."""
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
        received = 0
        try:
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def parse(message: averaging_pb2.AveragingData) -> torch.Tensor:
                if message.code != averaging_pb2.AVERAGED_PART:
                    code = averaging_pb2.MessageCode.Name(message.code)
                    raise AllreduceException(f"{peer_id} sent {code}")
                return deserialize_torch_tensor(message.tensor_part)

            replies = aiter_with_timeout(stream, self.reducer_timeout)
            while received < expected:
                try:
                    message = await anext(replies)
                except StopAsyncIteration:
                    break
                result = await asyncio.get_running_loop().run_in_executor(None, parse, message)
                self.tensor_part_container.register_processed_part(peer_index, received, result)
                received += 1
        finally:
            # every part in (or a failure): our side closes the stream, the reducer's after
            with contextlib.suppress(Exception):
                await stream.aclose()
        if received != expected:
            raise AllreduceException(
                f"peer {peer_id} sent {received} parts, but we expected {expected}"
            )


class ExactAllReduceRunner(GuardedAllReduceRunner):
    """An all-reduce whose members all receive the same compressed mean of each part."""

    RETURN_DELTAS = False

    def __init__(self, *, tensors: Sequence[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(tensors=tensors, **kwargs)
        own = self._own_index
        self._own_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[own]]
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

    async def _own_result(
        self, part_index: int, part: torch.Tensor, averaged: torch.Tensor
    ) -> torch.Tensor:
        _, mean = await self._mean_of(part_index, averaged)
        return mean

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        ended: str | None = None  # why, when not because the sender's parts ended
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
                    ended = "it was banned"
                    break  # the sender was banned: it gets nothing more
                sent, _ = await self._mean_of(part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=sent
                )
        except BaseException as exc:
            ended = repr(exc)
            raise
        finally:
            short = part_index != self.tensor_part_reducer.num_parts
            if short or ended is not None:
                logger.debug(
                    "%s: the stream of %s ended after %d of %d parts (%s)", self,
                    self.sender_peer_ids[sender_index], part_index,
                    self.tensor_part_reducer.num_parts, ended or "its parts ended",
                )
            if short:
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


class _GuardedRounds(DecentralizedAverager):
    """An averager whose rounds run :attr:`runner_class`, are marked with whether every
    part's average arrived (``Gathered``), are looked for again when no other member took
    part, and whose handler for other members' parts waits for a group this member
    assembled and refuses one it does not know after :func:`unknown_group_wait_s` (module
    docstring). Runs in the averager's process; the mark travels with the result to the
    caller."""

    runner_class: type[GuardedAllReduceRunner] = GuardedAllReduceRunner
    # the group bits the last round began with (set_group_bits), restored for a retry
    _round_bits: str | None = None

    @cached_property
    def _outcomes(self) -> dict[Any, tuple[int, bool]]:
        """Group id -> (elements whose average did not arrive, whether no other member took
        part), per round (this process)."""
        return {}

    def _record_outcome(self, group_id: Any, runner: AllReduceRunner | None) -> None:
        container = getattr(runner, "tensor_part_container", None)
        failed = getattr(container, "failed_size", None)
        nobody = isinstance(runner, GuardedAllReduceRunner) and runner.heard_from_nobody()
        self._outcomes[group_id] = (int(failed) if isinstance(failed, int) else -1, nobody)

    def _apply(self, tensor: torch.Tensor, result: torch.Tensor) -> None:
        """hivemind's: the runner's delta, scaled by ``averaging_alpha``."""
        tensor.add_(result, alpha=self._averaging_alpha)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        runner: GuardedAllReduceRunner | None = None
        try:
            runner = self.runner_class(
                p2p=self._p2p,
                servicer_type=type(self),
                prefix=self.prefix,
                tensors=tensors,
                group_id=group_id,
                ordered_peer_ids=group_info.peer_ids,
                **kwargs,
            )
            self._running_groups[group_id].set_result(runner)
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, result in azip(as_aiter(*tensors), runner):
                    self._apply(tensor, result)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            self._record_outcome(group_id, runner)

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int,
                                    **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        missing, nobody = self._outcomes.pop(group_info.group_id, (-1, False))
        if nobody:
            # the group formed on our side only: hivemind's step loop looks for it again
            # (until the step's deadline), under the key the round began with
            if self._round_bits is not None:
                self._matchmaking.group_key_manager.group_bits = self._round_bits
            raise MatchmakingException(
                f"no other member of group {bytes(group_info.group_id).hex()[:12]} took part "
                f"({len(group_info.peer_ids) - 1} expected: the group formed on our side "
                "only); looking for a group again"
            )
        return Gathered(gathered, complete=missing == 0)

    async def _set_group_bits(self, group_bits: str, future: Any) -> None:
        self._round_bits = group_bits
        await super()._set_group_bits(group_bits=group_bits, future=future)

    @property
    def _matchmaking(self) -> Any:
        try:
            return self.__dict__["_guarded_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Any) -> None:
        """hivemind's Matchmaking, created in the averager's process, whose groups are
        noted as they assemble (:attr:`_assembled`): a member whose group waits for its
        trigger has not registered it yet, and its partner's parts must wait for it."""
        look_for_group = matchmaking.look_for_group

        async def noting_look_for_group(step: Any) -> Any:
            group_info = await look_for_group(step)
            if group_info is not None:
                assembled = self._assembled
                assembled[group_info.group_id] = None
                while len(assembled) > ASSEMBLED_KEPT:
                    assembled.pop(next(iter(assembled)))
            return group_info

        matchmaking.look_for_group = noting_look_for_group
        self.__dict__["_guarded_matchmaking"] = matchmaking

    @cached_property
    def _assembled(self) -> dict[Any, None]:
        """The ids of the last groups this member's matchmaking assembled (this process)."""
        return {}

    # typing's AsyncIterator, not collections.abc's: hivemind's servicer tells a streaming
    # handler by the hint's ``_name``, which only typing's aliases have
    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler for a member's parts, with every wait bounded. A group this
        member assembled but has not registered yet (it waits for its own trigger: a round
        formed early) is waited for up to ``sender_timeout``, as the sender's reducer waits
        for our parts; a group it does not know is refused after
        :func:`unknown_group_wait_s` (hivemind waited until any group registered here,
        forever if none did)."""
        wait_s = unknown_group_wait_s(self.matchmaking_kwargs.get("request_timeout"))
        sender_timeout = self.allreduce_kwargs.get("sender_timeout")
        patience_s = sender_timeout or RUNNER_WAIT_S
        try:
            request = await asyncio.wait_for(anext(stream), max(wait_s, patience_s))
        except (TimeoutError, StopAsyncIteration):
            return  # nothing sent: nothing to refuse
        group_id = request.group_id
        loop = asyncio.get_running_loop()
        started = loop.time()
        while group_id not in self._running_groups:
            waited = loop.time() - started
            if waited >= (patience_s if group_id in self._assembled else wait_s):
                break
            await asyncio.sleep(GROUP_POLL_S)  # the leader's BEGIN_ALLREDUCE, or our trigger
        future = self._running_groups.get(group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        reducer_timeout = self.allreduce_kwargs.get("reducer_timeout")
        try:
            group = await asyncio.wait_for(asyncio.shield(future), reducer_timeout or RUNNER_WAIT_S)
        except TimeoutError:
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        sent, parts = 0, group.tensor_part_reducer.num_parts
        try:
            async for message in group.rpc_aggregate_part(
                achain(as_aiter(request), stream), context
            ):
                yield message
                sent += 1
            if sent == parts:
                # every result is on its way: the member closes the stream once it has them
                # all, and only then does this side (module docstring); hivemind's handler
                # cancels this wait when the member's side closes
                await asyncio.sleep(reducer_timeout or RUNNER_WAIT_S)
        except BaseException as exc:
            if not (sent == parts and isinstance(exc, asyncio.CancelledError)):  # not its close
                logger.debug("%s: serving %s ended after %d replies: %r", self,
                             context.remote_id, sent, exc)
            raise


class _ParameterRoundHook(_GuardedRounds):
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


class ExactGradientAverager(GradientAverager, _GuardedRounds):
    """hivemind's GradientAverager whose rounds leave every member the same averaged bits,
    whose rounds meet only rounds of the same epoch (given ``round_epoch``), and whose
    rounds are guarded as :class:`_GuardedRounds` says (``Gathered.complete``, a group that
    formed on our side only looked for again)."""

    runner_class = ExactAllReduceRunner
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

    def _apply(self, tensor: torch.Tensor, result: torch.Tensor) -> None:
        tensor.copy_(result)  # the mean itself, the same bits on every member

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        if self._averaging_alpha != 1.0:
            raise ValueError("the exact all-reduce assigns the mean: averaging_alpha must be 1")
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
