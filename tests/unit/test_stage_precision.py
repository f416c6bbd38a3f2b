"""Mixed precision on a stage server (CPU autocast), the kept forward graphs, the memory check.

The server's handlers are called directly (no sockets), with tensors as the endpoint
hands them over: decoded from payloads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch
from wanswarm.node.config.runspec import (
    BatchSpec,
    CodecsSpec,
    ModelSpec,
    OptimizerSpec,
    PrecisionSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.protocol import (
    BackwardRequest,
    ForwardLossRequest,
    ForwardRequest,
    HopId,
    Kind,
    to_header,
)
from wanswarm.node.stage.memory import GraphCache, StageMemoryError, check_fits, stage_footprint
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.precision import LossScaler, resolve_precision
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.transport.codecs import EncodedTensor, decode
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.tensors import ReceivedTensor

T_ = TypeVar("T_")
TRAINER = "trainerP"
CPU = torch.device("cpu")


def _spec(
    compute: str = "bf16", codec: str = "int8", micro: int = 2, target: int = 1024
) -> RunSpec:
    return RunSpec(
        name="precisiontest",
        model=ModelSpec(d_model=32, n_heads=2, n_layers=3, seq_len=8),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=micro, target_batch_size=target),
        optimizer=OptimizerSpec(lr=3e-3, warmup_steps=0, schedule="constant"),
        codecs=CodecsSpec(forward_activations=codec, backward_gradients=codec),
        precision=PrecisionSpec.model_validate({"compute": compute}),
    )


class Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        self.handlers[kind] = handler

    async def call(self, kind: str, header: Any, tensors: list[Any]) -> Response:
        decoded = [
            ReceivedTensor.of(t).tensor() if isinstance(t, EncodedTensor) else t for t in tensors
        ]
        return await self.handlers[kind](Request(TRAINER, kind, to_header(header), decoded))


def _run(coro: Coroutine[Any, Any, T_]) -> T_:
    return asyncio.run(coro)


def _server(spec: RunSpec, stage: int, **config: Any) -> tuple[StageServer, Registry]:
    registry = Registry()
    cfg = StageServerConfig(device="cpu", benchmark_iterations=1, **config)
    server = StageServer(
        spec, stage, cfg, endpoint=registry, make_optimizer=lambda m: LocalOptimizer(m, spec)
    )
    return server, registry


def _hop(spec: RunSpec, stage: int, mb: int) -> HopId:
    return HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=stage)


# ---- the run spec and the resolution ----------------------------------------------------


def test_default_precision_keeps_run_ids() -> None:
    plain = RunSpec(name="x")
    assert "precision" not in plain.canonical_json()
    bf16 = RunSpec(name="x", precision=PrecisionSpec.model_validate({"compute": "bf16"}))
    assert bf16.run_id != plain.run_id and '"precision"' in bf16.canonical_json()
    with pytest.raises(ValueError):
        PrecisionSpec.model_validate({"compute": "fp8"})


def test_resolution_per_device() -> None:
    assert resolve_precision("auto", CPU).mode == "fp32"  # the CPU keeps fp32 unless asked
    bf16 = resolve_precision("bf16", CPU)
    assert bf16.dtype == torch.bfloat16 and bf16.scaler is None
    fp16 = resolve_precision("fp16", CPU)
    assert fp16.dtype == torch.float16 and fp16.scaler is not None
    assert resolve_precision("fp32", CPU).autocast_enabled is False


def test_loss_scaler_policy() -> None:
    s = LossScaler(init_scale=8.0, growth_interval=3, min_scale=1.0, max_scale=16.0)
    s.update(True)
    assert s.scale == 4.0 and s.overflows == 1
    for _ in range(3):
        s.update(False)
    assert s.scale == 8.0
    for _ in range(9):
        s.update(False)
    assert s.scale == 16.0  # capped
    for _ in range(10):
        s.update(True)
    assert s.scale == 1.0 and s.exhausted


# ---- a bf16 stage on the CPU ----------------------------------------------------------


def test_bf16_stages_train_and_send_float32_payloads_quantized_from_bf16() -> None:
    """Three bf16 stages, one micro-batch repeated: the loss falls; every activation and
    gradient payload is float32 on the wire and was encoded from bf16 values."""
    spec = _spec("bf16", target=2)  # a step after every micro-batch
    servers = [_server(spec, s) for s in range(3)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 8), generator=gen)
    targets = torch.randint(0, 256, (2, 8), generator=gen)

    async def step(mb: int) -> float:
        y0 = (
            await servers[0][1].call(
                str(Kind.FORWARD), ForwardRequest(budget_s=30.0, hop=_hop(spec, 0, mb)), [ids]
            )
        ).tensors[0]
        y1 = (
            await servers[1][1].call(
                str(Kind.FORWARD), ForwardRequest(budget_s=30.0, hop=_hop(spec, 1, mb)), [y0]
            )
        ).tensors[0]
        for y in (y0, y1):
            assert isinstance(y, EncodedTensor) and y.dtype == torch.float32
        reply = await servers[2][1].call(
            str(Kind.FORWARD_LOSS),
            ForwardLossRequest(budget_s=30.0, hop=_hop(spec, 2, mb)),
            [y1, targets],
        )
        g2 = reply.tensors[0]
        g1 = (
            await servers[1][1].call(
                str(Kind.BACKWARD),
                BackwardRequest(budget_s=30.0, hop=_hop(spec, 1, mb), input_carried=False),
                [g2],
            )
        ).tensors[0]
        assert isinstance(g2, EncodedTensor) and g2.dtype == torch.float32
        assert isinstance(g1, EncodedTensor) and g1.dtype == torch.float32
        await servers[0][1].call(
            str(Kind.BACKWARD),
            BackwardRequest(budget_s=30.0, hop=_hop(spec, 0, mb), input_carried=False),
            [g1],
        )
        return float(reply.header["loss"])

    async def main() -> list[float]:
        for server, _ in servers:
            await server.open()
        try:
            return [await step(mb) for mb in range(6)]
        finally:
            for server, _ in servers:
                await server.close()

    losses = _run(main())
    assert losses[-1] < losses[0] - 0.5, losses
    for server, _ in servers:
        assert server.precision.mode == "bf16"
        assert all(p.dtype == torch.float32 for p in server.module.parameters())  # master
        assert server.counters.applied == 6


def test_bf16_output_is_quantized_from_bf16_activations() -> None:
    """The forward's payload is what encoding the bf16 output gives (no float32 round trip
    changes it), and equals a bf16 autocast forward of the same module."""
    spec = _spec("bf16", codec="none")
    server, registry = _server(spec, 1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))

    async def main() -> Response:
        await server.open()
        try:
            return await registry.call(
                str(Kind.FORWARD), ForwardRequest(budget_s=30.0, hop=_hop(spec, 1, 0)), [x]
            )
        finally:
            await server.close()

    out = _run(main()).tensors[0]
    assert isinstance(out, EncodedTensor)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = server.module(x)
    assert expected.dtype == torch.bfloat16
    assert torch.equal(decode(out), expected.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_inputs_of_any_float_dtype_are_accepted(dtype: torch.dtype) -> None:
    spec = _spec("fp32", codec="none")
    server, registry = _server(spec, 1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))

    async def main() -> tuple[Response, Response]:
        await server.open()
        try:
            a = await registry.call(
                str(Kind.FORWARD),
                ForwardRequest(budget_s=30.0, hop=_hop(spec, 1, 0)),
                [x.to(dtype)],
            )
            b = await registry.call(
                str(Kind.FORWARD),
                ForwardRequest(budget_s=30.0, hop=_hop(spec, 1, 1)),
                [x.to(dtype).float()],
            )
            return a, b
        finally:
            await server.close()

    a, b = _run(main())
    assert isinstance(a.tensors[0], EncodedTensor) and isinstance(b.tensors[0], EncodedTensor)
    assert torch.equal(decode(a.tensors[0]), decode(b.tensors[0]))


def test_fp16_loss_scaler_recovers_from_an_overflowing_scale() -> None:
    """A scale that overflows fp16 is halved and the backward redone: the gradients that
    come out are finite and match an unscaled float32 backward closely."""
    spec = _spec("fp16", codec="none")
    server, registry = _server(spec, 1)
    scaler = server.precision.scaler
    assert scaler is not None
    scaler.scale = 2.0**40  # far beyond fp16's range: the first tries overflow
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 32, generator=gen)
    g = torch.randn(2, 8, 32, generator=gen) * 1e-2

    async def main() -> Response:
        await server.open()
        try:
            hop = _hop(spec, 1, 0)
            await registry.call(str(Kind.FORWARD), ForwardRequest(budget_s=30.0, hop=hop), [x])
            return await registry.call(
                str(Kind.BACKWARD),
                BackwardRequest(budget_s=30.0, hop=hop, input_carried=False),
                [g],
            )
        finally:
            await server.close()

    grad_x = decode(_run(main()).tensors[0])
    assert scaler.overflows > 0 and scaler.scale < 2.0**40
    assert bool(torch.isfinite(grad_x).all())
    leaf = x.clone().requires_grad_(True)
    server.module(leaf).backward(g)  # float32, no autocast
    assert leaf.grad is not None
    err = (grad_x - leaf.grad).norm() / leaf.grad.norm()
    assert float(err) < 0.05


# ---- kept forward graphs -----------------------------------------------------------------


def test_graph_cache_bounds_and_epochs() -> None:
    cache = GraphCache(max_entries=2, ttl=10.0)
    t = torch.zeros(1)
    assert cache.put("a", t, t, epoch=0, now=0.0)
    cache.put("b", t, t, epoch=0, now=0.0)
    cache.put("c", t, t, epoch=0, now=0.0)
    assert len(cache) == 2 and cache.take("a", 0, 1.0) is None  # evicted, oldest first
    assert cache.take("b", 1, 1.0) is None  # computed at another epoch
    assert cache.take("c", 0, 11.0) is None  # expired
    cache.put("d", t, t, epoch=0, now=0.0)
    assert cache.take("d", 0, 1.0) is not None and len(cache) == 0  # one backward each
    assert not GraphCache(0, 1.0).put("x", t, t, epoch=0, now=0.0)


def _one_backward(
    spec: RunSpec, x: torch.Tensor, g: torch.Tensor, in_flight: int, perturb: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """dL/dx and the parameter gradients the optimizer is handed, for one micro-batch."""
    server, registry = _server(spec, 1, max_in_flight=in_flight)
    grads: dict[str, torch.Tensor] = {}
    module = server.module

    class Capture(LocalOptimizer):
        def step(self, batch_size: int) -> None:
            for name, p in module.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad.clone()

    server.optimizer = server._jobs.optimizer = Capture(module, spec)

    async def main() -> Response:
        await server.open()
        try:
            hop = _hop(spec, 1, 0)
            await registry.call(str(Kind.FORWARD), ForwardRequest(budget_s=30.0, hop=hop), [x])
            assert server._jobs.kept_graphs == (1 if in_flight else 0)
            if perturb:  # an in-place update the epoch does not show yet (a background step)
                with torch.no_grad():
                    next(module.parameters()).mul_(1.0)
            return await registry.call(
                str(Kind.BACKWARD),
                BackwardRequest(budget_s=30.0, hop=hop, input_carried=False),
                [g],
            )
        finally:
            await server.close()

    return decode(_run(main()).tensors[0]), grads


def test_backward_from_the_kept_graph_equals_a_recompute() -> None:
    """The same micro-batch's backward by a server that kept the graph and by one that
    recomputes (max_in_flight = 0) accumulates the same gradients and returns the same
    dL/dx; parameters changed in place since the forward make the server recompute."""
    spec = _spec("fp32", codec="none")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 32, generator=gen)
    g = torch.randn(2, 8, 32, generator=gen)
    base_x, base_g = _one_backward(spec, x, g, 4, False)
    for in_flight, perturb in ((0, False), (4, True)):
        other_x, other_g = _one_backward(spec, x, g, in_flight, perturb)
        assert torch.equal(base_x, other_x)
        assert base_g.keys() == other_g.keys() and base_g
        for name in base_g:
            assert torch.allclose(base_g[name], other_g[name], rtol=1e-5, atol=1e-7), name


# ---- the memory check ---------------------------------------------------------------------


def test_memory_check_refuses_and_names_what_fits() -> None:
    spec = _spec("fp32", micro=2)
    config = StageServerConfig(device="cpu", max_in_flight=8)
    sizes = [stage_footprint(spec, s, config, CPU).total for s in range(3)]
    budget = (min(sizes) + max(sizes)) // 2
    biggest = sizes.index(max(sizes))
    assert max(sizes) > budget >= min(sizes)
    with pytest.raises(StageMemoryError) as info:
        check_fits(spec, biggest, config, CPU, free=budget)
    text = str(info.value)
    assert f"stage {biggest}:" in text and "does not fit" in text
    assert "stages of this run that fit: " + str(sizes.index(min(sizes))) in text
    assert "stage_server.max_in_flight = " in text
    assert check_fits(spec, biggest, config, CPU, free=max(sizes)).total == max(sizes)


def test_device_memory_limit_caps_the_budget_and_shows_in_status() -> None:
    spec = _spec("fp32")
    with pytest.raises(StageMemoryError, match="max_device_memory_mb = 1"):
        _server(spec, 1, max_device_memory_mb=1)
    server, _ = _server(spec, 1, max_device_memory_mb=4096)
    status = server.status()
    assert status["memory_limit_mb"] == 4096
    assert 0 < status["memory_estimate_mb"] == round(server.footprint.total / 2**20, 1)
    assert status["precision"] == "fp32 on cpu"


def test_a_stage_that_does_not_fit_is_refused_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wanswarm.node.stage import server as server_module

    def build(*args: object) -> None:
        raise AssertionError("the stage was built before the memory check")

    monkeypatch.setattr(server_module, "build_stage", build)
    with pytest.raises(StageMemoryError, match="does not fit the 1.0 MiB available on cpu"):
        _server(_spec("fp32"), 1, max_device_memory_mb=1)
