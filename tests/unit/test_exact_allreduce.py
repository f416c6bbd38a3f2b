"""The hivemind internals node/stage/exact_allreduce.py overrides or reads, by name.

hivemind is pinned exactly (pyproject.toml); this test fails first, and says what moved,
when an upgrade renames or removes one of them. The behaviour (two replicas bit-identical
after a round, with fp16 and 8-bit compression) is tests/loopback/test_averaging.py's.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

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
    "should_delay_results", "finalize",
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
        _MissingResults,
        _ParameterRoundHook,
    )

    mro = EpochKeyedStateAverager.__mro__
    assert mro[1:5] == (TrainingStateAverager, _ParameterRoundHook, _MissingResults,
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

    from wanswarm.node.stage.exact_allreduce import Gathered, _MissingResults

    aggregate = inspect.getsource(DecentralizedAverager._aggregate_with_group)
    assert "await self._run_allreduce_inplace_(" in aggregate
    assert "return user_gathered" in aggregate
    register = inspect.getsource(DecentralizedAverager._register_allreduce_group)
    assert "self._running_groups.pop(" in register  # after aggregation: still there inside
    failed = inspect.getsource(TensorPartContainer.register_failed_reducer)
    assert "self.failed_size +=" in failed
    assert "self.failed_size = 0" in inspect.getsource(TensorPartContainer.__init__)
    assert issubclass(ExactGradientAverager, _MissingResults)

    gathered = pickle.loads(pickle.dumps(Gathered({"a": 3, "b": 4}, complete=False)))
    assert gathered == {"a": 3, "b": 4} and gathered.complete is False
    assert len(gathered) == 2 and max(gathered.values()) == 4
    assert pickle.loads(pickle.dumps(Gathered({"a": 1}))).complete is True


def test_the_mark_counts_what_the_runner_missed() -> None:
    """``_MissingResults`` reads the runner's container after the all-reduce (a runner that
    never registered counts as missing everything)."""
    from types import SimpleNamespace

    from wanswarm.node.stage.exact_allreduce import Gathered, _MissingResults

    class Probe(_MissingResults):
        def __del__(self) -> None:  # never started: nothing to shut down
            pass

    averager = Probe.__new__(Probe)
    runner = SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=0))
    averager._record_missing(b"g1", runner)  # type: ignore[arg-type]
    partial = SimpleNamespace(tensor_part_container=SimpleNamespace(failed_size=1234))
    averager._record_missing(b"g2", partial)  # type: ignore[arg-type]
    averager._record_missing(b"g3", None)
    assert averager._missing == {b"g1": 0, b"g2": 1234, b"g3": -1}

    async def aggregate(group_id: bytes) -> Gathered:
        # DecentralizedAverager's, with the all-reduce replaced: it returns the metadata
        async def base(self: object, group_info: object, min_vector_size: int,
                       **kwargs: object) -> dict[str, int]:
            return {"a": 1, "b": 2}

        original = DecentralizedAverager._aggregate_with_group
        DecentralizedAverager._aggregate_with_group = base  # type: ignore[method-assign]
        try:
            return await averager._aggregate_with_group(  # type: ignore[no-any-return]
                SimpleNamespace(group_id=group_id), 0)
        finally:
            DecentralizedAverager._aggregate_with_group = original  # type: ignore[method-assign]

    assert asyncio.run(aggregate(b"g1")).complete is True
    assert asyncio.run(aggregate(b"g2")).complete is False
    assert asyncio.run(aggregate(b"g3")).complete is False
    assert asyncio.run(aggregate(b"never-ran")).complete is False
    assert averager._missing == {}  # each round's mark taken once
