"""The hivemind internals node/stage/exact_allreduce.py overrides or reads, by name.

hivemind is pinned exactly (pyproject.toml); this test fails first, and says what moved,
when an upgrade renames or removes one of them. The behaviour (two replicas bit-identical
after a round, with fp16 and 8-bit compression) is tests/loopback/test_averaging.py's.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import TensorPartContainer
from hivemind.optim.grad_averager import GradientAverager
from wanswarm.node.stage.exact_allreduce import ExactAllReduceRunner, ExactGradientAverager


def test_hivemind_is_the_pinned_version() -> None:
    assert hivemind.__version__ == "1.1.12"


@pytest.mark.parametrize("name", [
    "_communicate_with_peer", "_accumulate_parts_streaming", "_ban_sender",
    "should_delay_results", "finalize", "_generate_input_for_peer", "_get_peer_stub",
])
def test_all_reduce_runner_has_what_we_override_or_call(name: str) -> None:
    assert callable(getattr(AllReduceRunner, name))


def test_the_runner_source_uses_the_attributes_we_replace() -> None:
    source = inspect.getsource(AllReduceRunner)
    for attribute in ("self.tensor_part_container", "self.parts_for_local_averaging",
                      "self.tensor_part_reducer", "self.sender_peer_ids", "self.peer_fractions",
                      "return_deltas=True"):
        assert attribute in source, attribute


def test_tensor_part_container_returns_values_when_asked() -> None:
    parameters = inspect.signature(TensorPartContainer).parameters
    assert {"return_deltas", "compression", "part_size_bytes", "tensor_infos",
            "prefetch"} <= set(parameters)
    assert "_input_parts_by_peer" in inspect.getsource(TensorPartContainer.__init__)


def test_the_averager_runs_all_reduce_where_we_override_it() -> None:
    source = inspect.getsource(DecentralizedAverager._run_allreduce_inplace_)
    assert "tensor.add_(update, alpha=self._averaging_alpha)" in source
    for attribute in ("self._running_groups", "self._state_updated", "self.last_updated"):
        assert attribute in source, attribute
    assert issubclass(ExactGradientAverager, GradientAverager)
    assert issubclass(ExactAllReduceRunner, AllReduceRunner)


def test_hivemind_optimizer_takes_a_gradient_averager_factory() -> None:
    assert "grad_averager_factory" in inspect.signature(hivemind.Optimizer).parameters


def test_a_cancelled_caller_leaves_the_shared_mean_to_the_other() -> None:
    """Our own path and the stream serving a member wait for the same compressed mean: the
    first one cancelled (the runner failing, the member's stream closing) must not end the
    other, or that member's stream closes one part short."""

    class _P2P:
        peer_id = "self"

    gate = threading.Event()

    async def scenario() -> None:
        runner = ExactAllReduceRunner(
            p2p=_P2P(),
            servicer_type=ExactAllReduceRunner, prefix=None, group_id=b"g",
            tensors=[torch.arange(4.0)], ordered_peer_ids=["self"], peer_fractions=(1.0,),
        )
        compress = runner.tensor_part_container.compression.compress

        def slow_compress(*args: object, **kwargs: object) -> object:
            gate.wait(5)  # held until the first caller is cancelled
            return compress(*args, **kwargs)

        runner.tensor_part_container.compression.compress = slow_compress
        mean = torch.full((4,), 1.5)
        first = asyncio.create_task(runner._mean_of(0, mean))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(runner._mean_of(0, mean))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        _, received = await asyncio.wait_for(second, 5)
        assert torch.equal(received, mean)
        assert first.cancelled()

    asyncio.run(scenario())


def test_the_state_averager_starts_its_rounds_through_the_hook() -> None:
    """EpochKeyedStateAverager relies on hivemind's state averager starting a parameter
    round through ``super().step`` with the epoch as ``gather``, on the hook sitting right
    after it in the method order, and on hivemind building its state averager with the
    arguments TidyOptimizer._make_state_averager repeats (membership/dht.py)."""
    from hivemind.optim.state_averager import TrainingStateAverager
    from wanswarm.node.stage.exact_allreduce import (
        EpochKeyedStateAverager,
        _GuardedRounds,
        _ParameterRoundHook,
    )

    mro = EpochKeyedStateAverager.__mro__
    assert mro[1:5] == (TrainingStateAverager, _ParameterRoundHook, _GuardedRounds,
                        DecentralizedAverager)
    source = inspect.getsource(TrainingStateAverager._do)
    assert "super().step(" in source and "gather=self.local_epoch" in source
    assert "super().step(" in inspect.getsource(TrainingStateAverager.schedule_step)
    made = inspect.getsource(hivemind.Optimizer._make_state_averager)
    for argument in ('prefix=f"{self.run_id}_state_averager"', "min_matchmaking_time=",
                     "allreduce_timeout=", "shutdown_timeout=", "offload_optimizer=",
                     "custom_gradients=", "status_loglevel=", "next_chunk_timeout=",
                     "client_mode=", "auxiliary=", "start=True", "**kwargs"):
        assert argument in made, argument


def test_a_round_result_says_whether_every_part_arrived() -> None:
    """hivemind's averager returns the gathered metadata from ``_aggregate_with_group``,
    which runs ``_run_allreduce_inplace_`` while the group's runner is registered in
    ``_running_groups``; a part whose reducer failed is counted in the container's
    ``failed_size`` (and the member keeps its own values there). The mark survives the pipe
    to the caller (pickle), and hivemind's uses of the result (its length, its values) see
    the plain mapping."""
    import pickle

    from wanswarm.node.stage.exact_allreduce import Gathered, _GuardedRounds

    aggregate = inspect.getsource(DecentralizedAverager._aggregate_with_group)
    assert "await self._run_allreduce_inplace_(" in aggregate
    assert "return user_gathered" in aggregate
    register = inspect.getsource(DecentralizedAverager._register_allreduce_group)
    assert "self._running_groups.pop(" in register  # after aggregation: still there inside
    failed = inspect.getsource(TensorPartContainer.register_failed_reducer)
    assert "self.failed_size +=" in failed
    assert "self.failed_size = 0" in inspect.getsource(TensorPartContainer.__init__)
    assert issubclass(ExactGradientAverager, _GuardedRounds)

    gathered = pickle.loads(pickle.dumps(Gathered({"a": 3, "b": 4}, complete=False)))
    assert gathered == {"a": 3, "b": 4} and gathered.complete is False
    assert len(gathered) == 2 and max(gathered.values()) == 4
    assert pickle.loads(pickle.dumps(Gathered({"a": 1}))).complete is True


def _probe() -> Any:
    """A _GuardedRounds that was never started (no process, nothing to shut down)."""
    from wanswarm.node.stage.exact_allreduce import _GuardedRounds

    class Probe(_GuardedRounds):
        def __del__(self) -> None:
            pass

    return Probe.__new__(Probe)


async def _aggregate(averager: Any, group_id: bytes, peers: int = 2) -> Any:
    """``averager._aggregate_with_group`` with hivemind's own (the all-reduce) replaced by
    one that returns the gathered metadata."""
    from types import SimpleNamespace

    async def base(self: object, group_info: object, min_vector_size: int,
                   **kwargs: object) -> dict[str, int]:
        return {"a": 1, "b": 2}

    original = DecentralizedAverager._aggregate_with_group
    DecentralizedAverager._aggregate_with_group = base  # type: ignore[method-assign]
    try:
        return await averager._aggregate_with_group(
            SimpleNamespace(group_id=group_id, peer_ids=["p"] * peers), 0)
    finally:
        DecentralizedAverager._aggregate_with_group = original  # type: ignore[method-assign]


def test_the_mark_counts_what_the_runner_missed() -> None:
    """``_GuardedRounds`` reads the runner's container after the all-reduce (a runner that
    never registered counts as missing everything)."""
    from types import SimpleNamespace

    averager = _probe()
    runner = SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=0))
    averager._record_outcome(b"g1", runner)
    partial = SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=1234))
    averager._record_outcome(b"g2", partial)
    averager._record_outcome(b"g3", None)
    assert averager._outcomes == {b"g1": (0, False), b"g2": (1234, False), b"g3": (-1, False)}

    assert asyncio.run(_aggregate(averager, b"g1")).complete is True
    assert asyncio.run(_aggregate(averager, b"g2")).complete is False
    assert asyncio.run(_aggregate(averager, b"g3")).complete is False
    assert asyncio.run(_aggregate(averager, b"never-ran")).complete is False
    assert averager._outcomes == {}  # each round's mark taken once


def test_a_round_nobody_else_took_part_in_is_looked_for_again_under_its_key() -> None:
    """A round in which no other member delivered anything raises hivemind's
    ``MatchmakingException`` (its step loop then looks for a group again) and puts back the
    group bits the round began with: hivemind's key manager had moved them on assembly."""
    from hivemind.averaging.matchmaking import MatchmakingException

    averager = _probe()
    key_manager = SimpleNamespace(group_bits="01001111")
    averager._matchmaking = SimpleNamespace(group_key_manager=key_manager,
                                            look_for_group=None)
    future = SimpleNamespace(set_result=lambda value: None)

    async def begin() -> None:
        original = DecentralizedAverager._set_group_bits

        async def base(self: Any, group_bits: str, future: Any) -> None:
            self._matchmaking.group_key_manager.group_bits = group_bits

        DecentralizedAverager._set_group_bits = base  # type: ignore[method-assign]
        try:
            await averager._set_group_bits(group_bits="00100111", future=future)
        finally:
            DecentralizedAverager._set_group_bits = original  # type: ignore[method-assign]

    asyncio.run(begin())
    key_manager.group_bits = "01001111"  # what update_key_on_group_assembled left
    averager._outcomes[b"lonely"] = (4096, True)
    with pytest.raises(MatchmakingException, match="no other member"):
        asyncio.run(_aggregate(averager, b"lonely"))
    assert key_manager.group_bits == "00100111"
    assert averager._outcomes == {}


def test_hivemind_retries_a_round_that_raises_matchmaking_exception() -> None:
    """What the retry relies on: hivemind's step loop catches ``MatchmakingException`` from
    the aggregation and looks for a group again while the step allows retries and its
    deadline has not passed; its key manager rewrites the group bits when a group
    assembles; its handler for members' parts waited for any group to register."""
    from hivemind.averaging.key_manager import GroupKeyManager

    step = inspect.getsource(DecentralizedAverager._step)
    assert "MatchmakingException," in step and "retrying" in step
    assert "while not step.done():" in step
    assert "step.allow_retries" in step and "step.deadline" in step
    assert "self.group_bits =" in inspect.getsource(GroupKeyManager.update_key_on_group_assembled)
    assert "self._matchmaking.group_key_manager.group_bits = group_bits" in inspect.getsource(
        DecentralizedAverager._set_group_bits)
    handler = inspect.getsource(DecentralizedAverager.rpc_aggregate_part)
    assert "await self._pending_groups_registered.wait()" in handler
    assert "group.rpc_aggregate_part(" in handler


def test_the_runner_reads_the_counts_it_relies_on() -> None:
    """GuardedAllReduceRunner reads the reducer's per-sender counts and the container's
    per-peer output counts."""
    from hivemind.averaging.partition import TensorPartReducer

    reducer = inspect.getsource(TensorPartReducer.__init__)
    assert "self.num_parts_received" in reducer and "self.sender_failed_after" in reducer
    assert "self._outputs_registered_by_peer" in inspect.getsource(TensorPartContainer.__init__)
    assert "self.num_parts_by_peer" in inspect.getsource(TensorPartContainer.__init__)


@pytest.mark.parametrize("name", ["ExactGradientAverager", "EpochKeyedStateAverager"])
def test_the_parts_handler_is_registered_as_streaming(name: str) -> None:
    """hivemind's servicer reads a handler's streaming from its hints (typing's
    ``AsyncIterator``): collected on our averagers, the overridden handler for members'
    parts must still stream both ways, or no all-reduce could run."""
    from wanswarm.node.stage import exact_allreduce

    cls = getattr(exact_allreduce, name)
    saved = cls.__dict__.get("_rpc_handlers"), cls.__dict__.get("_stub_type")
    cls._rpc_handlers = None
    try:
        cls._collect_rpc_handlers()
        (handler,) = (h for h in cls._rpc_handlers if h.method_name == "rpc_aggregate_part")
        assert handler.stream_input and handler.stream_output
    finally:
        cls._rpc_handlers, cls._stub_type = saved


def test_a_closed_member_stream_ends_the_reducers_wait() -> None:
    """A reducer that has sent every part waits for the member to close the stream first
    (exact_allreduce.py); what ends that wait is hivemind's stream handler, which cancels
    the handler's task when the member's side of the stream closes."""
    from hivemind.p2p.p2p_daemon import P2P

    handler = inspect.getsource(P2P._add_protobuf_stream_handler)
    assert "except asyncio.IncompleteReadError" in handler
    assert "processing_task.cancel()" in handler
    assert "with closing(writer):" in inspect.getsource(P2P._iterate_protobuf_stream_handler)
    assert "self.reducer_timeout" in inspect.getsource(AllReduceRunner.__init__)
