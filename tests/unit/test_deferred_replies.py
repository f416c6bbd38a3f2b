"""Deferred replies: on a GPU a forward's output is still being copied to the host when its
job returns, and the device thread goes on to the next job while the queue's finishing
thread waits for the copy, checks the payload and answers.

On the CPU the copy is done at once, so the copy is made "under way" here by a gate the test
opens: what is tested is the order of work across the two threads, the slots, the refusals
and what a refused output leaves behind (the queue's side: tests/unit/test_device_queue.py).
Whether the copy really overlaps the next job's compute on a GPU is measured by
benchmarks/stage.py (docs/gpu.md)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch
from torch import nn
from wanswarm.node.config.runspec import (
    BatchSpec,
    CodecsSpec,
    ModelSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.protocol import (
    BackwardRequest,
    ErrorCode,
    ForwardRequest,
    HopId,
    Kind,
    to_header,
)
from wanswarm.node.stage import jobs as jobs_module
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.transport.codecs import EncodedTensor, PendingEncode, decode, encode_start
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.errors import RemoteError

T_ = TypeVar("T_")
TRAINER = "trainerA"
B, T, C = 2, 8, 16
WAIT_S = 30.0


def _run(coro: Coroutine[Any, Any, T_]) -> T_:
    async def bounded() -> T_:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


# ---- a stage's forwards -----------------------------------------------------------------


class _GatedCopy:
    """A launched encoding whose copy to the host stays under way until ``gate`` opens,
    as a GPU's would while its kernels run."""

    def __init__(self, inner: PendingEncode, gate: threading.Event, log: list[str]) -> None:
        self.inner, self.gate, self.log = inner, gate, log
        self.copying = True

    def result(self) -> EncodedTensor:
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.log.append(threading.current_thread().name)
        return self.inner.result()


class _Gates:
    """``encode_start`` as the jobs call it, each launch held behind its own gate."""

    def __init__(self) -> None:
        self.gates: list[threading.Event] = []
        self.finished_on: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> _GatedCopy:
        gate = threading.Event()
        self.gates.append(gate)
        return _GatedCopy(encode_start(*args, **kwargs), gate, self.finished_on)


class _Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        self.handlers[kind] = handler

    async def call(self, kind: str, header: Any, tensors: list[torch.Tensor]) -> Response:
        return await self.handlers[kind](Request(TRAINER, kind, to_header(header), tensors))


def _spec() -> RunSpec:
    return RunSpec(
        name="deferredtest",
        model=ModelSpec(d_model=C, n_heads=2, n_layers=3, seq_len=T),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=B, target_batch_size=1024),
        codecs=CodecsSpec(forward_activations="int8", backward_gradients="int8"),
    )


def _server(spec: RunSpec, reg: _Registry) -> StageServer:
    def make(module: nn.Module) -> LocalOptimizer:
        return LocalOptimizer(module, spec)

    cfg = StageServerConfig(device="cpu", benchmark_iterations=1)
    return StageServer(spec, 1, cfg, endpoint=reg, make_optimizer=make)


def _hop(spec: RunSpec, mb: int) -> HopId:
    return HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=1)


def test_a_forward_answers_while_an_earlier_ones_output_is_still_copying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two forwards: the second is computed while the first's copy is under way; replies
    finish in order, each once its copy lands, and the first's is what an undeferred
    forward answers."""
    spec = _spec()
    gates = _Gates()
    torch.manual_seed(0)
    xs = [torch.randn(B, T, C) for _ in range(2)]

    async def main() -> None:
        reg = _Registry()
        server = _server(spec, reg)
        await server.open()
        try:
            expected = await reg.call(
                Kind.FORWARD, ForwardRequest(hop=_hop(spec, 0), budget_s=WAIT_S), [xs[0]]
            )
            monkeypatch.setattr(jobs_module, "encode_start", gates)
            first = asyncio.create_task(reg.call(
                Kind.FORWARD, ForwardRequest(hop=_hop(spec, 1), budget_s=WAIT_S), [xs[0]]
            ))
            second = asyncio.create_task(reg.call(
                Kind.FORWARD, ForwardRequest(hop=_hop(spec, 2), budget_s=WAIT_S), [xs[1]]
            ))
            while len(gates.gates) < 2:  # both launched: the device thread did not wait
                await asyncio.sleep(0.01)
            assert not first.done() and not second.done()
            assert server.status()["queue"] == 2  # their slots are held until they finish
            gates.gates[0].set()
            reply = await first
            assert not second.done() and server.status()["queue"] == 1
            gates.gates[1].set()
            await second
            assert reply.header["cached"] is True
            sent, want = reply.tensors[0], expected.tensors[0]
            assert isinstance(sent, EncodedTensor) and isinstance(want, EncodedTensor)
            assert bytes(sent.payload) == bytes(want.payload)
            assert torch.equal(decode(sent), decode(want))
            assert all(name.startswith("stage1-finish") for name in gates.finished_on)
            assert server.counters.forward == 3 and server.counters.failed == 0
        finally:
            await server.close()

    _run(main())


def test_a_deferred_output_beyond_its_bound_is_refused_and_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The output's payload, checked once its copy has landed, exceeds ``max_activation``:
    the forward is refused ``out_of_range``, and what it kept for its backward is gone
    before the device thread's next job (a backward by reference misses the cache)."""
    spec = _spec()
    gates = _Gates()

    async def main() -> None:
        reg = _Registry()
        server = _server(spec, reg)
        await server.open()
        try:
            # the outputs' bound only (the inputs' stays the contract's)
            server._jobs.limits = spec.limits.model_copy(update={"max_activation": 1e-3})
            monkeypatch.setattr(jobs_module, "encode_start", gates)
            hop = _hop(spec, 1)
            forward = asyncio.create_task(reg.call(
                Kind.FORWARD, ForwardRequest(hop=hop, budget_s=WAIT_S, keep_input=True),
                [torch.randn(B, T, C)],
            ))
            while not gates.gates:
                await asyncio.sleep(0.01)
            assert server.status()["cache"] == 1  # kept while its output was copying
            gates.gates[0].set()
            with pytest.raises(RemoteError) as refused:
                await forward
            assert refused.value.code == ErrorCode.OUT_OF_RANGE
            assert "stage 1's output" in refused.value.message
            assert server.counters.out_of_range == 1 and server.counters.failed == 1
            with pytest.raises(RemoteError) as missed:
                await reg.call(
                    Kind.BACKWARD,
                    BackwardRequest(hop=hop, budget_s=WAIT_S, input_carried=False),
                    [torch.randn(B, T, C) * 1e-3],
                )
            assert missed.value.code == ErrorCode.CACHE_MISS
            assert server.status()["cache"] == 0 and server.status()["graphs_kept"] == 0
            assert all(p.grad is None for p in server.module.parameters())
        finally:
            await server.close()

    _run(main())
