"""A stage on a GPU: mixed precision, codecs at both ends on the device, pinned staging on
a copy stream, the Triton fallback, the memory limit, the selftest. Skipped without CUDA.

Run this tier in its own process with the interpreter off (tests that compare compiled
Triton kernels skip under it):

    TRITON_INTERPRET=0 python -m pytest tests/gpu -q
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from wanswarm.kernels import ops, quant_triton
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
from wanswarm.node.stage.device_queue import Deferred
from wanswarm.node.stage.memory import StageMemoryError, free_device_memory
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.tools import selftest
from wanswarm.transport import staging
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.tensors import ReceivedTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda", 0)
TRAINER = "gputrainer"
compiled = pytest.mark.skipif(
    ops.triton_interpreted(), reason="run with TRITON_INTERPRET=0: compiled kernels"
)


@pytest.fixture(autouse=True)
def _fresh_failures() -> Iterator[None]:
    ops.reset_triton_failures()
    yield
    ops.reset_triton_failures()


def _activation(dtype: torch.dtype, shape: tuple[int, ...] = (4, 64, 96)) -> torch.Tensor:
    g = torch.Generator().manual_seed(21)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    return x.to(dtype)


# ---- codecs at both ends ---------------------------------------------------------------------


@compiled
@pytest.mark.parametrize(
    "spec",
    [CodecSpec("int8"), CodecSpec("fp8"), CodecSpec("int4", block_size=32)],
    ids=lambda s: s.to_wire(),
)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32])
def test_device_encoding_from_bf16_equals_the_cpu_reference(
    spec: CodecSpec, source: torch.dtype
) -> None:
    """A bf16/fp16 activation on the GPU, quantized there by Triton into a float32 payload,
    gives the bytes the reference gives on the CPU; decoding on the GPU gives the CPU's
    decoded values bit for bit."""
    x = _activation(source)
    on_gpu = encode(x.to(CUDA), spec, dtype=torch.float32)
    on_cpu = encode(x, spec, dtype=torch.float32)
    assert on_gpu.payload == on_cpu.payload
    received = ReceivedTensor.of(on_gpu)
    decoded = received.tensor(device=CUDA)
    assert decoded.device.type == "cuda" and decoded.dtype == torch.float32
    assert torch.equal(decoded.cpu().view(torch.int32), decode(on_cpu).view(torch.int32))
    assert ops.triton_failures() == {}


@pytest.mark.parametrize("spec", [CodecSpec("none"), CodecSpec("bf16"), CodecSpec("int8")])
def test_every_codec_decodes_on_the_device_it_targets(spec: CodecSpec) -> None:
    x = _activation(torch.float32)
    enc = encode(x, spec)
    assert decode(enc, device=CUDA).device.type == "cuda"
    assert decode(enc).device.type == "cpu"


def test_a_failing_launch_falls_back_to_the_reference_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> Any:
        raise RuntimeError("PTX compilation failed: unsupported GPU architecture")

    monkeypatch.setattr(quant_triton, "quantize", broken)
    monkeypatch.setattr(quant_triton, "dequantize", broken)
    x = _activation(torch.bfloat16).flatten().to(CUDA)
    codes, scales = ops.quantize(x, "int8", 64)
    assert codes.device.type == "cuda"  # the reference, on the same device
    out = ops.dequantize(codes, scales, "int8", 64, x.numel(), torch.bfloat16)
    assert out.device.type == "cuda"
    c_ref, s_ref = ops.quantize(x.cpu(), "int8", 64)
    assert torch.equal(codes.cpu(), c_ref) and torch.equal(scales.cpu(), s_ref)
    assert "cuda:0" in ops.triton_failures()


# ---- pinned staging on the copy stream -------------------------------------------------------


def test_copies_go_through_pinned_memory_on_their_own_stream() -> None:
    """A device-to-host copy of a tensor that a long kernel is still writing waits for that
    kernel (event order), lands in pinned memory, and leaves the compute stream free."""
    a = torch.randn(4096, 4096, device=CUDA)
    y = a @ a  # still running when the copy is queued
    host = staging.to_host(y)
    assert host.is_pinned() and torch.equal(host, y.cpu())
    out_stream = staging.copy_stream(CUDA, to_host=True)
    in_stream = staging.copy_stream(CUDA, to_host=False)
    assert len({out_stream, in_stream, torch.cuda.current_stream(CUDA)}) == 3
    back = staging.to_device(host, CUDA)
    assert torch.equal(back, y)


# ---- a stage on the GPU ----------------------------------------------------------------------


class _Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.devices: dict[str, str | None] = {}

    def register(
        self,
        kind: str,
        handler: Handler,
        *,
        allow_nonfinite: bool = False,
        device: str | None = None,
    ) -> None:
        self.handlers[kind] = handler
        self.devices[kind] = device

    async def call(self, kind: str, header: Any, tensors: list[Any]) -> Response:
        # as the endpoint does: float payloads decoded where the server asked (its GPU),
        # integer ones on the host, and the payloads handed over beside them
        device = self.devices[kind]
        received = [
            t if isinstance(t, ReceivedTensor) else ReceivedTensor.of(
                t if isinstance(t, EncodedTensor) else encode(t, CodecSpec("none"))
            )
            for t in tensors
        ]
        decoded = [r.tensor(device if r.dtype.is_floating_point else None) for r in received]
        request = Request(TRAINER, kind, to_header(header), decoded, received=received)
        return await self.handlers[kind](request)


def _spec(compute: str) -> RunSpec:
    return RunSpec(
        name="gputest",
        model=ModelSpec(d_model=128, n_heads=4, n_layers=2, seq_len=64),
        stages=StagesSpec(blocks_per_stage=(1, 1)),
        batch=BatchSpec(micro_batch_size=4, target_batch_size=4),
        optimizer=OptimizerSpec(lr=3e-3, warmup_steps=0, schedule="constant"),
        codecs=CodecsSpec(forward_activations="int8", backward_gradients="int8"),
        precision=PrecisionSpec.model_validate({"compute": compute}),
    )


@pytest.mark.parametrize("compute", ["auto", "fp16"])
def test_a_mixed_precision_pipeline_trains_on_the_gpu(compute: str) -> None:
    spec = _spec(compute)
    config = StageServerConfig(device="cuda", benchmark_iterations=1)
    registries = [_Registry(), _Registry()]
    servers = [
        StageServer(spec, s, config, endpoint=r, make_optimizer=lambda m: LocalOptimizer(m, spec))
        for s, r in enumerate(registries)
    ]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 64), generator=g)
    targets = torch.randint(0, 256, (4, 64), generator=g)

    def hop(stage: int, mb: int) -> HopId:
        return HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=stage)

    async def main() -> list[float]:
        losses = []
        for s in servers:
            await s.open()
        try:
            for mb in range(8):
                y = (
                    await registries[0].call(
                        str(Kind.FORWARD), ForwardRequest(budget_s=60.0, hop=hop(0, mb)), [ids]
                    )
                ).tensors[0]
                reply = await registries[1].call(
                    str(Kind.FORWARD_LOSS),
                    ForwardLossRequest(budget_s=60.0, hop=hop(1, mb)),
                    [y, targets],
                )
                await registries[0].call(
                    str(Kind.BACKWARD),
                    BackwardRequest(budget_s=60.0, hop=hop(0, mb), input_carried=False),
                    [reply.tensors[0]],
                )
                losses.append(float(reply.header["loss"]))
        finally:
            for s in servers:
                await s.close()
        return losses

    losses = asyncio.run(main())
    assert losses[-1] < losses[0] - 0.5, losses
    expected = (
        "fp16" if compute == "fp16" else ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    )
    assert servers[0].precision.mode == expected
    assert all(p.dtype == torch.float32 for p in servers[0].module.parameters())


@compiled
def test_a_middle_stage_synchronizes_once_a_forward_and_once_a_backward() -> None:
    """The value checks read the payloads' scales on the host, not the device: a forward
    waits for the device only for its reply's copy to the host, and a backward for its
    reply's copy too, which brings the parameter-gradient norm with it (docs/gpu.md,
    "Checks without synchronizing"). Counted with CUDA's synchronization debug mode, the
    request's decode included; at first, 6 and 7."""
    spec = RunSpec(
        name="gpusyncs",
        model=ModelSpec(d_model=128, n_heads=4, n_layers=3, seq_len=64),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=4, target_batch_size=4096),  # no step in between
        codecs=CodecsSpec(forward_activations="int8", backward_gradients="int8"),
    )
    config = StageServerConfig(device="cuda", benchmark_iterations=1)
    registry = _Registry()
    server = StageServer(
        spec, 1, config, endpoint=registry, make_optimizer=lambda m: LocalOptimizer(m, spec)
    )
    codec = CodecSpec("int8")
    g = torch.Generator().manual_seed(5)

    async def micro_batch(mb: int, counts: dict[str, list[str]] | None) -> None:
        hop = HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=1)
        x = encode(torch.randn(4, 64, 128, generator=g), codec)
        grad = encode(torch.randn(4, 64, 128, generator=g) * 1e-3, codec)
        for kind, header, tensors in (
            (Kind.FORWARD, ForwardRequest(budget_s=60.0, hop=hop, keep_input=True), [x]),
            (Kind.BACKWARD, BackwardRequest(budget_s=60.0, hop=hop, input_carried=False),
             [grad]),
        ):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    await registry.call(str(kind), header, tensors)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if counts is not None:
                counts[str(kind)].extend(
                    f"{w.filename}:{w.lineno}" for w in caught
                    if "called a synchronizing" in str(w.message)
                )

    async def main() -> dict[str, list[str]]:
        await server.open()
        try:
            await micro_batch(0, None)  # kernels compiled, cuBLAS and the allocator warm
            counts: dict[str, list[str]] = {str(Kind.FORWARD): [], str(Kind.BACKWARD): []}
            for mb in range(1, 4):
                await micro_batch(mb, counts)
            return counts
        finally:
            await server.close()

    counts = asyncio.run(main())
    assert server.counters.applied == 4
    forward, backward = counts[str(Kind.FORWARD)], counts[str(Kind.BACKWARD)]
    assert len(forward) <= 3 * 2, forward  # at most 2 a forward (1 by the count in the docs)
    assert len(backward) <= 3 * 2, backward  # at most 2 a backward (1 by the count)


def test_a_forward_on_the_gpu_leaves_its_reply_to_the_finishing_thread() -> None:
    """On CUDA a forward returns with its output's copy to the host under way (the device
    thread goes on to the next job); finished, its payload decodes to the stage's output."""
    spec = _spec("fp32")
    server = StageServer(
        spec, 0, StageServerConfig(device="cuda", benchmark_iterations=1),
        endpoint=_Registry(), make_optimizer=lambda m: LocalOptimizer(m, spec),
    )
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    hop = HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=0, stage=0)
    result = server._jobs.forward(ForwardRequest(budget_s=60.0, hop=hop), [ids])
    assert isinstance(result, Deferred)
    reply = result.finish()
    sent = reply.tensors[0]
    assert isinstance(sent, EncodedTensor)
    with torch.no_grad():
        y = server.module(ids.to(CUDA))
    got, want = decode(sent), y.float().cpu()
    assert got.shape == want.shape
    # int8 in blocks of 64: within half a step of each block's scale, the largest |value|/127
    assert float((got - want).abs().max()) <= float(want.abs().max()) / 127


def test_the_memory_check_counts_the_device_limit() -> None:
    spec = _spec("auto")
    assert free_device_memory(CUDA) > 0
    with pytest.raises(StageMemoryError, match="available on cuda"):
        StageServer(
            spec,
            0,
            StageServerConfig(device="cuda", max_device_memory_mb=1),
            endpoint=_Registry(),
            make_optimizer=lambda m: LocalOptimizer(m, spec),
        )
    limit = 4096
    server = StageServer(
        spec,
        0,
        StageServerConfig(device="cuda", max_device_memory_mb=limit),
        endpoint=_Registry(),
        make_optimizer=lambda m: LocalOptimizer(m, spec),
    )
    total = torch.cuda.get_device_properties(CUDA).total_memory
    with pytest.raises(torch.OutOfMemoryError):  # the allocator enforces the limit
        torch.empty(int(min(total, 2 * limit * 2**20)), dtype=torch.uint8, device=CUDA)
    assert server.status()["memory_limit_mb"] == limit
    torch.cuda.set_per_process_memory_fraction(1.0, CUDA)


@compiled
def test_selftest_passes_with_the_compiled_kernels() -> None:
    result = selftest.run_checks(None, "cuda", require_triton=True)
    assert result.passed, result.checks
