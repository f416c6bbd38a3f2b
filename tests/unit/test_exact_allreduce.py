"""The hivemind internals node/stage/exact_allreduce.py overrides or reads, by name.

hivemind is pinned exactly (pyproject.toml); this test fails first, and says what moved,
when an upgrade renames or removes one of them. The behaviour (two replicas bit-identical
after a round, with fp16 and 8-bit compression) is tests/loopback/test_averaging.py's.
"""

from __future__ import annotations

import inspect

import hivemind
import pytest
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
