"""Value bounds: the pure checks, the run spec's ``[limits]``, and the stage's accumulation
guard (handlers called directly, no sockets).

A tensor beyond the bounds is refused with ``out_of_range`` before anything is computed on
it; a micro-batch whose loss, dL/dx or parameter-gradient norm is not finite or beyond its
bound is refused with nothing added to ``.grad``; the server serves honest requests right
after. Over real sockets: tests/loopback/test_hostile_values.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import pydantic
import pytest
import torch
from torch import nn
from wanswarm.node.config.runspec import (
    BatchSpec,
    CodecsSpec,
    LimitsSpec,
    ModelSpec,
    RunSpec,
    StagesSpec,
    differing_fields,
)
from wanswarm.node.protocol import (
    BackwardRequest,
    ErrorCode,
    EvalLossRequest,
    ForwardLossRequest,
    ForwardRequest,
    HopId,
    Kind,
    StageContract,
    check_result,
    describe_excess,
    max_abs,
    to_header,
    within,
)
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.transport import codecs, staging
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, encode, parse_codec
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.tensors import ReceivedTensor

T_ = TypeVar("T_")
TRAINER = "trainerA"
B, T, C = 2, 8, 16


def _spec(codec: str = "none", /, **limits: float) -> RunSpec:
    return RunSpec(
        name="boundstest",
        model=ModelSpec(d_model=C, n_heads=2, n_layers=3, seq_len=T),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=B, target_batch_size=1024),
        codecs=CodecsSpec(forward_activations=codec, backward_gradients=codec),
        limits=LimitsSpec(**limits),
    )


# ---- pure checks ------------------------------------------------------------------------


def test_max_abs_sees_nan_inf_and_the_largest_magnitude() -> None:
    assert max_abs(torch.tensor([1.0, -7.5, 3.0])) == 7.5
    assert math.isnan(max_abs(torch.tensor([1.0, math.nan, 3e38])))
    assert max_abs(torch.tensor([-math.inf, 2.0])) == math.inf
    assert max_abs(torch.zeros(0)) == 0.0
    assert max_abs(torch.tensor([5, -900])) == 0.0  # token ids: range-checked elsewhere


def test_within_and_check_result() -> None:
    assert within(1e3, 1e3) and within(-1e3, 1e3) and within(0.0, 1e-9)
    assert not within(1e3 * (1 + 1e-6), 1e3)
    assert not within(math.nan, 1e30) and not within(math.inf, 1e30)
    check_result(5.0, 10.0, "the loss")
    for bad in (11.0, math.nan, -math.inf):
        with pytest.raises(RemoteError) as err:
            check_result(bad, 10.0, "the loss")
        assert err.value.code == ErrorCode.OUT_OF_RANGE and "the loss" in str(err.value)
    assert "not finite" in describe_excess(math.nan, 1.0, "x")
    assert "1e+38" in describe_excess(1e38, 1e3, "x")


def _code(call: Any) -> str:
    with pytest.raises(RemoteError) as err:
        call()
    return err.value.code


def test_contract_bounds_activations_and_gradients() -> None:
    contract = StageContract.from_spec(_spec(), 1)
    x = torch.randn(B, T, C)
    contract.check_input(x)
    contract.check_input(torch.full((B, T, C), 1e4))  # the bound itself is allowed
    assert _code(lambda: contract.check_input(torch.full((B, T, C), 1.01e4))) == "out_of_range"
    assert _code(lambda: contract.check_input(torch.full((B, T, C), -3e38))) == "out_of_range"
    nan = x.clone()
    nan[0, 0, 0] = math.nan
    assert _code(lambda: contract.check_input(nan)) == "bad_request"
    contract.check_output_grad(torch.full((B, T, C), -1e3), B, T)
    grad = torch.zeros(B, T, C)
    grad[1, 2, 3] = 1e38
    assert _code(lambda: contract.check_output_grad(grad, B, T)) == "out_of_range"
    # stage 0 takes token ids: no float bound applies
    StageContract.from_spec(_spec(), 0).check_input(torch.randint(0, 256, (B, T)))


def test_contract_bounds_follow_the_spec() -> None:
    contract = StageContract.from_spec(_spec(max_activation=10.0, max_gradient=0.5), 2)
    assert _code(lambda: contract.check_input(torch.full((B, T, C), 11.0))) == "out_of_range"
    assert _code(lambda: contract.check_output_grad(torch.full((B, T, C), 0.6), B, T)) == (
        "out_of_range"
    )


# ---- the run spec -----------------------------------------------------------------------


def test_default_limits_leave_the_run_id_unchanged() -> None:
    spec = RunSpec(name="pinned")
    assert spec.limits == LimitsSpec()
    assert "limits" not in spec.canonical_json()
    assert spec.run_id == "f862dc87ae4433db"  # as pinned in test_runspec.py
    explicit = RunSpec.model_validate({"name": "pinned", "limits": {"max_activation": 1e4}})
    assert explicit.run_id == spec.run_id


def test_other_limits_are_part_of_the_run() -> None:
    base = RunSpec(name="a")
    other = RunSpec.model_validate({"name": "a", "limits": {"max_grad_norm": 50.0}})
    assert other.run_id != base.run_id and '"limits"' in other.canonical_json()
    assert differing_fields(base, other) == ["limits.max_grad_norm"]
    # a peer that reads our canonical JSON back gets the same spec
    assert RunSpec.model_validate(json.loads(other.canonical_json())["spec"]) == other


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, 1e31])
def test_limits_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(pydantic.ValidationError):
        LimitsSpec(max_gradient=value)


# ---- the accumulation guard -------------------------------------------------------------


class HoldingOptimizer(LocalOptimizer):
    """Leaves ``.grad`` as the jobs left it (accumulating across micro-batches) and counts
    the micro-batches it was handed."""

    def __init__(self, module: nn.Module, spec: RunSpec) -> None:
        super().__init__(module, spec)
        self.handed: list[int] = []

    def step(self, batch_size: int) -> None:
        self.handed.append(batch_size)


class Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        self.handlers[kind] = handler

    async def call(self, kind: str, header: Any, tensors: list[torch.Tensor]) -> Response:
        return await self.handlers[kind](Request(TRAINER, kind, to_header(header), tensors))

    async def call_encoded(
        self, kind: str, header: Any, tensors: list[torch.Tensor | EncodedTensor]
    ) -> Response:
        """As the endpoint hands a request over: every tensor through its payload (floats
        as int8), decoded and checked, with the payloads beside them (Request.peaks)."""
        received = [
            ReceivedTensor.of(t if isinstance(t, EncodedTensor) else encode(t, _wire_codec(t)))
            for t in tensors
        ]
        decoded = [r.tensor() for r in received]
        request = Request(TRAINER, kind, to_header(header), decoded, received=received)
        return await self.handlers[kind](request)


def _wire_codec(t: torch.Tensor) -> CodecSpec:
    return parse_codec("int8") if t.is_floating_point() else CodecSpec("none")


def _run(coro: Coroutine[Any, Any, T_]) -> T_:
    async def bounded() -> T_:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


def _hop(spec: RunSpec, stage: int, mb: int) -> HopId:
    return HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=stage)


def _snapshot(server: StageServer) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for p in server.module.parameters():
        out.append(p.detach().clone())
        out.append(None if p.grad is None else p.grad.detach().clone())
    return out


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _finite(server: StageServer) -> bool:
    return all(
        bool(torch.isfinite(p).all()) and (p.grad is None or bool(torch.isfinite(p.grad).all()))
        for p in server.module.parameters()
    )


class _Stage:
    """One stage server on a Registry, opened."""

    def __init__(self, spec: RunSpec, stage: int) -> None:
        self.spec, self.stage = spec, stage
        self.reg = Registry()
        self.optimizers: list[HoldingOptimizer] = []

        def make(module: nn.Module) -> HoldingOptimizer:
            self.optimizers.append(HoldingOptimizer(module, spec))
            return self.optimizers[-1]

        cfg = StageServerConfig(device="cpu", benchmark_iterations=1)
        self.server = StageServer(spec, stage, cfg, endpoint=self.reg, make_optimizer=make)
        self.mb = 0
        self.refusals: list[RemoteError] = []

    async def refused(self, kind: Kind, header: Any, tensors: list[torch.Tensor]) -> str:
        """The code of a request that must be refused, checking that it left no trace."""
        before = _snapshot(self.server)
        applied, handed = self.server.counters.applied, len(self.optimizers[0].handed)
        with pytest.raises(RemoteError) as err:
            await self.reg.call(kind, header, tensors)
        assert _same(before, _snapshot(self.server)), "parameters or .grad changed"
        assert _finite(self.server)
        assert self.server.counters.applied == applied
        assert len(self.optimizers[0].handed) == handed
        self.refusals.append(err.value)
        return err.value.code

    def hop(self) -> HopId:
        self.mb += 1
        return _hop(self.spec, self.stage, self.mb)


@contextlib.asynccontextmanager
async def _opened(spec: RunSpec, *stages: int) -> AsyncIterator[list[_Stage]]:
    """One opened stage server per stage in ``stages``; closed on the way out."""
    opened: list[_Stage] = []
    try:
        for stage in stages:
            opened.append(_Stage(spec, stage))
            await opened[-1].server.open()
        yield opened
    finally:
        for s in opened:
            await s.server.close()


def _targets() -> torch.Tensor:
    return torch.randint(0, 256, (B, T))


def test_hostile_gradient_and_activation_leave_no_trace() -> None:
    spec = _spec()

    async def main() -> None:
        async with _opened(spec, 1, 2) as (middle, last):
            x = torch.randn(B, T, C)
            # an honest micro-batch first, so that .grad holds something to protect
            await middle.reg.call(
                Kind.BACKWARD, BackwardRequest(hop=middle.hop(), budget_s=30, input_carried=True),
                [x, torch.randn(B, T, C) * 1e-3],
            )
            assert next(iter(middle.server.module.parameters())).grad is not None
            code = await middle.refused(
                Kind.BACKWARD,
                BackwardRequest(hop=middle.hop(), budget_s=30, input_carried=True),
                [x, torch.full((B, T, C), 1e38)],
            )
            assert code == ErrorCode.OUT_OF_RANGE
            huge = 3e38 * torch.sign(torch.randn(B, T, C))
            for kind, request in (
                (Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30)),
                (Kind.EVAL_LOSS, EvalLossRequest(hop=last.hop(), budget_s=30)),
            ):
                assert await last.refused(kind, request, [huge, _targets()]) == "out_of_range"
            assert await middle.refused(
                Kind.FORWARD, ForwardRequest(hop=middle.hop(), budget_s=30), [huge]
            ) == "out_of_range"
            assert middle.server.status()["cache"] == 0  # refused before the cache, too
            # and both serve honestly right after
            reply = await last.reg.call(
                Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30),
                [x, _targets()],
            )
            assert 4.0 < reply.header["loss"] < 7.0 and _finite(last.server)
            assert last.server.counters.applied == 1
            assert middle.server.counters.out_of_range == 2
            assert last.server.counters.out_of_range == 2

    _run(main())


@pytest.mark.parametrize(
    ("limits", "what"),
    [
        ({"max_grad_norm": 1e-9}, "parameter-gradient norm"),
        ({"max_loss": 1.0}, "the loss"),
        ({"max_gradient": 1e-12}, "dL/dx"),
    ],
)
def test_a_result_beyond_its_bound_is_refused_before_accumulating(
    limits: dict[str, float], what: str
) -> None:
    """Honest inputs, a bound the result exceeds: the check runs on the result, before
    anything reaches .grad (the last stage: loss, dL/dx and dL/dtheta in one job)."""
    spec = _spec(**limits)

    async def main() -> None:
        async with _opened(spec, 2) as (last,):
            x = torch.randn(B, T, C)
            request = ForwardLossRequest(hop=last.hop(), budget_s=30)
            with pytest.raises(RemoteError) as err:
                await last.reg.call(Kind.FORWARD_LOSS, request, [x, _targets()])
            assert err.value.code == "out_of_range" and what in str(err.value)
            assert all(p.grad is None for p in last.server.module.parameters())
            assert last.server.counters.applied == 0 and last.optimizers[0].handed == []

    _run(main())


def test_a_non_finite_gradient_norm_is_refused_never_clipped() -> None:
    """Bounds wide enough to let float32 overflow inside the backward: the parameter
    gradients turn Inf/NaN from finite inputs, and the micro-batch is refused."""
    spec = _spec(max_activation=1e30, max_gradient=1e30, max_grad_norm=1e30)

    async def main() -> None:
        async with _opened(spec, 1) as (middle,):
            x = torch.randn(B, T, C) * 1e20
            code = await middle.refused(
                Kind.BACKWARD,
                BackwardRequest(hop=middle.hop(), budget_s=30, input_carried=True),
                [x, torch.full((B, T, C), 1e30)],
            )
            assert code == "out_of_range"
            assert all(p.grad is None for p in middle.server.module.parameters())
            # the same stage accumulates an honest micro-batch right after
            await middle.reg.call(
                Kind.BACKWARD, BackwardRequest(hop=middle.hop(), budget_s=30, input_carried=True),
                [torch.randn(B, T, C), torch.randn(B, T, C) * 1e-3],
            )
            assert middle.server.counters.applied == 1 and _finite(middle.server)

    _run(main())


def test_values_are_checked_from_the_payloads_never_by_reducing_a_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests as the endpoint hands them over (int8 payloads): every bound is checked from
    the payloads' scales on the host, the requests' and the replies' alike. On a GPU, each
    max |value| of a tensor would be a synchronization; here, none is taken at all."""
    spec = _spec("int8")

    def no_reduction(t: torch.Tensor) -> float:
        raise AssertionError("max_abs of a tensor: a device synchronization on a GPU")

    monkeypatch.setattr("wanswarm.node.protocol.max_abs", no_reduction)

    async def main() -> None:
        async with _opened(spec, 1, 2) as (middle, last):
            x = torch.randn(B, T, C)
            hop = middle.hop()
            reply = await middle.reg.call_encoded(
                Kind.FORWARD, ForwardRequest(hop=hop, budget_s=30, keep_input=True), [x]
            )
            y = reply.tensors[0]
            assert isinstance(y, EncodedTensor)
            loss = await last.reg.call_encoded(
                Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30),
                [ReceivedTensor.of(y).tensor(), _targets()],
            )
            assert 4.0 < loss.header["loss"] < 7.0
            grad = loss.tensors[0]
            assert isinstance(grad, EncodedTensor)
            await middle.reg.call_encoded(
                Kind.BACKWARD, BackwardRequest(hop=hop, budget_s=30, input_carried=False),
                [grad],
            )
            await last.reg.call_encoded(
                Kind.EVAL_LOSS, EvalLossRequest(hop=last.hop(), budget_s=30), [x, _targets()]
            )
            assert middle.server.counters.applied == 1 and last.server.counters.applied == 1
            # a payload beyond the bound is refused from its scales alone
            huge = torch.full((B, T, C), 1e6)
            with pytest.raises(RemoteError) as err:
                await middle.reg.call_encoded(
                    Kind.FORWARD, ForwardRequest(hop=middle.hop(), budget_s=30), [huge]
                )
            assert err.value.code == "out_of_range" and "input reaches" in err.value.message

    _run(main())


@pytest.mark.parametrize(
    ("limit", "what"),
    [("max_gradient", "dL/dx"), ("max_grad_norm", "parameter-gradient norm"),
     ("max_loss", "the loss")],
)
def test_a_refused_gradient_leaves_its_error_feedback_residual(limit: str, what: str) -> None:
    """dL/dx, the norm or the loss beyond its bound: refused, nothing accumulated, and the
    error-feedback residual for that trainer exactly as the last micro-batch sent left it.
    The loss and the norm are read with dL/dx's payload, after it was encoded through
    error feedback: their refusal must leave the residual too."""
    spec = _spec("int8")

    async def main() -> None:
        async with _opened(spec, 2) as (last,):
            await last.reg.call(
                Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30),
                [torch.randn(B, T, C), _targets()],
            )
            jobs = last.server._jobs
            key = (TRAINER, 2, "grad_input")
            residual = jobs._ef.residual(key)
            assert residual is not None
            kept = residual.clone()
            jobs.limits = spec.limits.model_copy(update={limit: 1e-12})
            code = await last.refused(
                Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30),
                [torch.randn(B, T, C), _targets()],
            )
            assert code == "out_of_range" and what in last.refusals[-1].message
            assert jobs._ef.residual(key) is residual and torch.equal(residual, kept)

    _run(main())


def test_the_loss_and_the_norm_reach_the_host_in_one_copy_read_after_dl_dx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last stage's loss and parameter-gradient norm are launched to the host as one
    copy and read only once dL/dx's payload is there: on a GPU the micro-batch waits for
    the device once (docs/gpu.md). On the CPU the order of the reads shows it."""
    spec = _spec("int8")
    log: list[str] = []
    start, result = staging.start_to_host, codecs.PendingEncode.result

    class Logged(staging.HostCopy):
        def wait(self) -> torch.Tensor:
            log.append(f"scalars {tuple(self.host.shape)}")
            return super().wait()

    def logged_start(t: torch.Tensor) -> staging.HostCopy:
        copy = start(t)
        return Logged(copy.host, copy.done)

    def logged_result(self: codecs.PendingEncode) -> EncodedTensor:
        log.append("payload")
        return result(self)

    monkeypatch.setattr(staging, "start_to_host", logged_start)
    monkeypatch.setattr(codecs.PendingEncode, "result", logged_result)

    async def main() -> None:
        async with _opened(spec, 2) as (last,):
            reply = await last.reg.call(
                Kind.FORWARD_LOSS, ForwardLossRequest(hop=last.hop(), budget_s=30),
                [torch.randn(B, T, C), _targets()],
            )
            assert 4.0 < reply.header["loss"] < 7.0 and last.server.counters.applied == 1

    _run(main())
    assert log == ["payload", "scalars (2,)"]  # dL/dx's payload, then the loss and the norm
