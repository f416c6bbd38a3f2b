"""Stage server: handlers called directly with Request objects (no sockets).

Gradients through the three stages equal autograd on the full model; retried hops never
accumulate twice; a full queue answers busy; a dropped cache entry answers cache_miss;
wrong run/stage, joining and draining servers refuse with their codes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import pytest
import torch
from torch import nn
from wanswarm.node.config.runspec import BatchSpec, CodecsSpec, ModelSpec, RunSpec, StagesSpec
from wanswarm.node.protocol import (
    BackwardRequest,
    ErrorCode,
    EvalLossRequest,
    ForwardLossRequest,
    ForwardRequest,
    HopId,
    InfoRequest,
    Kind,
    to_header,
)
from wanswarm.node.stage.checkpoint import list_checkpoints
from wanswarm.node.stage.memory import AppliedLog, InputCache
from wanswarm.node.stage.optimizer import CatchUpFetch, LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.stage.throughput import THROUGHPUT_CACHE
from wanswarm.node.training.model import build_full_model
from wanswarm.transport.codecs import decode
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.tensors import ReceivedTensor, Sendable

from tests.waiting import async_wait_for

T_ = TypeVar("T_")


def _spec(codec: str = "none") -> RunSpec:
    return RunSpec(
        name="stagetest",
        model=ModelSpec(d_model=16, n_heads=2, n_layers=3, seq_len=8),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=2, target_batch_size=1024),
        codecs=CodecsSpec(forward_activations=codec, backward_gradients=codec),
    )


TRAINER = "trainerA"


class Registry:
    """What the server registers on: kind -> handler (the endpoint's role, minus sockets)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        assert not allow_nonfinite
        self.handlers[kind] = handler

    async def call(
        self, kind: str, header: Any, tensors: list[torch.Tensor], peer: str = TRAINER
    ) -> Response:
        return await self.handlers[kind](Request(peer, kind, to_header(header), tensors))


class RecordingOptimizer:
    """A StageOptimizer that sums the gradients it is handed, optionally held at a gate."""

    def __init__(self, module: nn.Module, gate: threading.Event | None = None) -> None:
        self.params = dict(module.named_parameters())
        self.grads = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.steps: list[int] = []
        self.gate = gate
        self.entered = threading.Event()
        self.checks = 0
        self.check_threads: set[str] = set()
        self.due = False  # the next step_if_due reports a step taken

    def step(self, batch_size: int) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        for name, p in self.params.items():
            if p.grad is not None:
                self.grads[name] += p.grad
                p.grad = None
        self.steps.append(batch_size)

    def step_if_due(self) -> bool:
        self.checks += 1
        self.check_threads.add(threading.current_thread().name)
        due, self.due = self.due, False
        return due

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        self.catch_up = fetch

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        return epoch > self.local_epoch

    def load_state_from_peers(self) -> bool:
        return False

    @property
    def local_epoch(self) -> int:
        return 0

    def params_version(self) -> int | None:
        return 0  # never steps: the same parameters throughout

    @property
    def samples_accumulated(self) -> int:
        return sum(self.steps)

    def is_synchronized(self) -> bool:
        return True

    def flush(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _servers(
    spec: RunSpec, registries: list[Registry], config: StageServerConfig | None = None, **kw: Any
) -> list[StageServer]:
    cfg = config or StageServerConfig(device="cpu", benchmark_iterations=1)
    return [
        StageServer(spec, s, cfg, endpoint=r, make_optimizer=RecordingOptimizer, **kw)
        for s, r in enumerate(registries)
    ]


def _run(coro: Coroutine[Any, Any, T_]) -> T_:
    return asyncio.run(coro)


def _hop(spec: RunSpec, stage: int, mb: int = 0, attempt: int = 0) -> HopId:
    return HopId(run_id=spec.run_id, trainer=TRAINER, micro_batch=mb, stage=stage, attempt=attempt)


def _tensor(t: Sendable) -> torch.Tensor:
    """What the trainer's side gets for a reply tensor (the servers reply encoded)."""
    if isinstance(t, torch.Tensor):
        return t
    return t.tensor() if isinstance(t, ReceivedTensor) else decode(t)


def _batch(spec: RunSpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    B, T = spec.batch.micro_batch_size, spec.model.seq_len
    inputs = torch.randint(0, 256, (B, T), generator=gen)
    return inputs, torch.randint(0, 256, (B, T), generator=gen)


async def _through_pipeline(
    spec: RunSpec, regs: list[Registry], idx: torch.Tensor, targets: torch.Tensor, mb: int = 0
) -> tuple[float, list[torch.Tensor]]:
    """One micro-batch: forward 0, 1; forward_loss 2; backward 1, 0 (by reference)."""
    r0 = await regs[0].call(Kind.FORWARD, ForwardRequest(hop=_hop(spec, 0, mb), budget_s=30), [idx])
    y0 = _tensor(r0.tensors[0])
    r1 = await regs[1].call(Kind.FORWARD, ForwardRequest(hop=_hop(spec, 1, mb), budget_s=30), [y0])
    y1 = _tensor(r1.tensors[0])
    r2 = await regs[2].call(
        Kind.FORWARD_LOSS, ForwardLossRequest(hop=_hop(spec, 2, mb), budget_s=30), [y1, targets]
    )
    g1 = _tensor(r2.tensors[0])
    b1 = await regs[1].call(
        Kind.BACKWARD,
        BackwardRequest(hop=_hop(spec, 1, mb), budget_s=30, input_carried=False),
        [g1],
    )
    g0 = _tensor(b1.tensors[0])
    b0 = await regs[0].call(
        Kind.BACKWARD,
        BackwardRequest(hop=_hop(spec, 0, mb), budget_s=30, input_carried=False),
        [g0],
    )
    assert b0.tensors == []
    return float(r2.header["loss"]), [y0, y1, g1, g0]


def _full_grads(
    spec: RunSpec, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    full = build_full_model(spec)
    for idx, targets in batches:
        full.forward_loss(idx, targets).backward()
    return [{n: p.grad for n, p in stage.named_parameters()} for stage in full.stages]  # type: ignore[misc]


def _opt(server: StageServer) -> RecordingOptimizer:
    assert isinstance(server.optimizer, RecordingOptimizer)
    return server.optimizer


async def _open(servers: list[StageServer]) -> None:
    for s in servers:
        await s.open()


async def _close(servers: list[StageServer]) -> None:
    for s in servers:
        await s.close()


def _with_servers(
    spec: RunSpec, body: Callable[[list[Registry], list[StageServer]], Awaitable[None]], **kw: Any
) -> list[StageServer]:
    regs = [Registry() for _ in range(spec.n_stages)]
    servers = _servers(spec, regs, **kw)

    async def main() -> None:
        await _open(servers)
        try:
            await body(regs, servers)
        finally:
            await _close(servers)

    _run(main())
    return servers


def test_pipeline_gradients_equal_autograd_on_the_full_model() -> None:
    spec = _spec("none")
    batches = [_batch(spec, 0), _batch(spec, 1)]
    full_model = build_full_model(spec)
    losses: list[float] = []

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        for mb, (idx, targets) in enumerate(batches):
            loss, _ = await _through_pipeline(spec, regs, idx, targets, mb)
            losses.append(loss)

    servers = _with_servers(spec, body)
    expected = _full_grads(spec, batches)
    with torch.no_grad():
        for (idx, targets), loss in zip(batches, losses, strict=False):
            assert loss == pytest.approx(float(full_model.forward_loss(idx, targets)), rel=1e-6)
    for stage, server in enumerate(servers):
        opt = _opt(server)
        assert opt.steps == [2, 2]
        for name, grad in expected[stage].items():
            torch.testing.assert_close(opt.grads[name], grad, rtol=1e-5, atol=1e-7)
        assert server.counters.applied == 2 and server.counters.samples_accumulated == 4
        assert server.counters.duplicates == 0 and server.counters.cache_misses == 0


def test_int8_codecs_keep_gradients_close() -> None:
    spec = _spec("int8")
    batch = _batch(spec, 3)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        await _through_pipeline(spec, regs, *batch)

    servers = _with_servers(spec, body)
    expected = _full_grads(spec, [batch])
    for stage, server in enumerate(servers):
        for name, grad in expected[stage].items():
            got = _opt(server).grads[name]
            rel = float((got - grad).norm() / grad.norm().clamp_min(1e-12))
            assert rel < 0.05, (stage, name, rel)


def test_retried_hops_never_accumulate_twice() -> None:
    spec = _spec("int8")
    idx, targets = _batch(spec, 4)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        _, (y0, y1, g1, g0) = await _through_pipeline(spec, regs, idx, targets)
        before = [{n: g.clone() for n, g in _opt(s).grads.items()} for s in servers]
        # the trainer lost the replies and retries every hop (attempt 1), inputs carried
        r2 = await regs[2].call(
            Kind.FORWARD_LOSS,
            ForwardLossRequest(hop=_hop(spec, 2, attempt=1), budget_s=30),
            [y1, targets],
        )
        assert r2.header["duplicate"] is True
        torch.testing.assert_close(_tensor(r2.tensors[0]), g1, rtol=0, atol=0)  # the cached reply
        b1 = await regs[1].call(
            Kind.BACKWARD,
            BackwardRequest(hop=_hop(spec, 1, attempt=1), budget_s=30, input_carried=True),
            [y0, g1],
        )
        assert b1.header["duplicate"] is True
        torch.testing.assert_close(_tensor(b1.tensors[0]), g0, rtol=0, atol=0)
        b0 = await regs[0].call(
            Kind.BACKWARD,
            BackwardRequest(hop=_hop(spec, 0, attempt=1), budget_s=30, input_carried=True),
            [idx, g0],
        )
        assert b0.header["duplicate"] is True and b0.tensors == []
        for server, grads in zip(servers, before, strict=False):
            assert _opt(server).steps == [2]
            for name, grad in grads.items():
                assert torch.equal(_opt(server).grads[name], grad)
            assert server.counters.duplicates == 1 and server.counters.applied == 1

    _with_servers(spec, body)


def test_a_duplicate_whose_reply_was_evicted_is_recomputed_without_accumulating() -> None:
    spec = _spec("none")
    idx, targets = _batch(spec, 5)
    config = StageServerConfig(device="cpu", benchmark_iterations=1, reply_cache_entries=0)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        _, (y0, _y1, g1, g0) = await _through_pipeline(spec, regs, idx, targets)
        grads = {n: g.clone() for n, g in _opt(servers[1]).grads.items()}
        b1 = await regs[1].call(
            Kind.BACKWARD,
            BackwardRequest(hop=_hop(spec, 1, attempt=2), budget_s=30, input_carried=True),
            [y0, g1],
        )
        assert b1.header["duplicate"] is True
        torch.testing.assert_close(_tensor(b1.tensors[0]), g0, rtol=1e-6, atol=1e-8)
        for name, grad in grads.items():
            assert torch.equal(_opt(servers[1]).grads[name], grad)
        assert _opt(servers[1]).steps == [2]

    _with_servers(spec, body, config=config)


def test_spot_checks_answer_the_same_values_and_keep_nothing() -> None:
    """``backward`` and ``forward_loss`` with ``check`` (spot_checks.py): the dL/dx (and
    loss) the training hops sent, with no gradient accumulated, no cache entry taken or
    left, nothing counted as applied; the same hop's training backward then still
    accumulates. A backward check without its input is refused as malformed."""
    spec = _spec("none")
    idx, targets = _batch(spec, 7)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        loss, (y0, y1, g1, g0) = await _through_pipeline(spec, regs, idx, targets)
        last = servers[2]
        last_grads = {n: g.clone() for n, g in _opt(last).grads.items()}
        last_applied = last.counters.applied
        fl = ForwardLossRequest(hop=_hop(spec, 2, mb=1), budget_s=30, check=True)
        checked = await regs[2].call(Kind.FORWARD_LOSS, fl, [y1, targets])
        assert checked.header["loss"] == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(_tensor(checked.tensors[0]), g1, rtol=1e-6, atol=1e-7)
        assert last.counters.forward_loss_checks == 1
        assert last.counters.applied == last_applied
        for name, grad in last_grads.items():
            assert torch.equal(_opt(last).grads[name], grad)
        middle = servers[1]
        grads = {n: g.clone() for n, g in _opt(middle).grads.items()}
        applied, cached = middle.counters.applied, middle._jobs.cached_inputs
        check = BackwardRequest(hop=_hop(spec, 1, mb=1), budget_s=30, input_carried=True,
                                check=True)
        reply = await regs[1].call(Kind.BACKWARD, check, [y0, g1])
        assert reply.header["duplicate"] is False
        torch.testing.assert_close(_tensor(reply.tensors[0]), g0, rtol=1e-6, atol=1e-7)
        assert middle.counters.backward_checks == 1 and middle.counters.applied == applied
        assert middle._jobs.cached_inputs == cached
        for name, grad in grads.items():
            assert torch.equal(_opt(middle).grads[name], grad)
        # the same micro-batch's training backward is not taken for a duplicate
        train = BackwardRequest(hop=_hop(spec, 1, mb=1), budget_s=30, input_carried=True)
        assert (await regs[1].call(Kind.BACKWARD, train, [y0, g1])).header["duplicate"] is False
        assert middle.counters.applied == applied + 1
    with pytest.raises(pydantic.ValidationError, match="carries its input"):
        BackwardRequest(hop=_hop(spec, 1), budget_s=30, input_carried=False, check=True)

    _with_servers(spec, body)


def test_cache_miss_then_carried_input() -> None:
    spec = _spec("none")
    clock = FakeClock()
    config = StageServerConfig(device="cpu", benchmark_iterations=1, cache_ttl_s=10.0)
    idx, _targets = _batch(spec, 6)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        r0 = await regs[0].call(Kind.FORWARD, ForwardRequest(hop=_hop(spec, 0), budget_s=30), [idx])
        assert r0.header["cached"] is True
        y0 = _tensor(r0.tensors[0])
        r1 = await regs[1].call(
            Kind.FORWARD, ForwardRequest(hop=_hop(spec, 1), budget_s=30, keep_input=False), [y0]
        )
        assert r1.header["cached"] is False
        g = torch.randn(*y0.shape)
        with pytest.raises(RemoteError) as exc:  # never cached
            await regs[1].call(
                Kind.BACKWARD,
                BackwardRequest(hop=_hop(spec, 1), budget_s=30, input_carried=False),
                [g],
            )
        assert exc.value.code == ErrorCode.CACHE_MISS
        clock.now += 10.0  # stage 0's entry expires
        with pytest.raises(RemoteError) as exc:
            await regs[0].call(
                Kind.BACKWARD,
                BackwardRequest(hop=_hop(spec, 0), budget_s=30, input_carried=False),
                [g],
            )
        assert exc.value.code == ErrorCode.CACHE_MISS
        assert servers[0].counters.cache_misses == 1 and _opt(servers[0]).steps == []
        reply = await regs[0].call(
            Kind.BACKWARD,
            BackwardRequest(hop=_hop(spec, 0, attempt=1), budget_s=30, input_carried=True),
            [idx, g],
        )
        assert reply.header["duplicate"] is False and _opt(servers[0]).steps == [2]

    _with_servers(spec, body, config=config, clock=clock)


def test_a_full_queue_answers_busy_and_a_late_job_expires_unrun() -> None:
    spec = _spec("none")
    clock = FakeClock()
    gate = threading.Event()
    reg = Registry()
    config = StageServerConfig(device="cpu", benchmark_iterations=1, queue_size=2)
    server = StageServer(
        spec,
        0,
        config,
        endpoint=reg,
        make_optimizer=lambda m: RecordingOptimizer(m, gate),
        clock=clock,
    )
    idx, _ = _batch(spec, 7)
    g = torch.randn(2, spec.model.seq_len, spec.model.d_model)

    async def main() -> None:
        await server.open()
        opt = _opt(server)
        first = asyncio.create_task(
            reg.call(
                Kind.BACKWARD,
                BackwardRequest(hop=_hop(spec, 0, mb=1), budget_s=30, input_carried=True),
                [idx, g],
            )
        )
        assert await asyncio.to_thread(opt.entered.wait, 30)  # the device thread is held
        # from another trainer: one peer holds at most half the queue (its fair share)
        other = "other-trainer"
        hop2 = HopId(run_id=spec.run_id, trainer=other, micro_batch=2, stage=0)
        second = asyncio.create_task(
            reg.call(
                Kind.BACKWARD,
                BackwardRequest(hop=hop2, budget_s=5, input_carried=True),
                [idx, g],
                peer=other,
            )
        )
        await asyncio.sleep(0)  # let it queue (one loop iteration, not a timing assumption)
        assert server.queue_len == 2
        with pytest.raises(RemoteError) as exc:
            await reg.call(
                Kind.FORWARD, ForwardRequest(hop=_hop(spec, 0, mb=3), budget_s=30), [idx]
            )
        assert exc.value.code == ErrorCode.BUSY
        assert server.counters.busy == 1
        clock.now += 6.0  # the second job's budget runs out while it waits
        gate.set()
        assert (await first).header["duplicate"] is False
        with pytest.raises(RemoteError) as exc:
            await second
        assert exc.value.code == ErrorCode.EXPIRED
        assert opt.steps == [2] and server.counters.expired == 1 and server.queue_len == 0
        await server.close()

    _run(main())


def test_an_online_server_checks_for_a_due_step_on_its_device_thread_until_closed() -> None:
    spec = _spec("none")
    reg = Registry()
    config = StageServerConfig(device="cpu", benchmark_iterations=1, step_check_period_s=0.05)
    server = StageServer(spec, 1, config, endpoint=reg, make_optimizer=RecordingOptimizer)

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(30):
            while not condition():
                await asyncio.sleep(0.01)

    async def main() -> None:
        opt = _opt(server)
        await server.open()
        await until(lambda: opt.checks >= 2)
        assert server.counters.idle_steps == 0
        opt.due = True  # the collaboration's epoch is due: the next check steps
        await until(lambda: server.counters.idle_steps == 1)
        assert opt.check_threads == {"stage1-device_0"}  # never the event loop
        await server.close()
        checks = opt.checks
        await asyncio.sleep(0.2)
        assert opt.checks == checks  # no check after close

    _run(main())


def test_an_abandoned_request_is_dropped_before_it_runs() -> None:
    spec = _spec("none")
    gate = threading.Event()
    reg = Registry()
    server = StageServer(
        spec, 0, StageServerConfig(device="cpu", benchmark_iterations=1), endpoint=reg,
        make_optimizer=lambda m: RecordingOptimizer(m, gate),
    )
    idx, _ = _batch(spec, 8)
    g = torch.randn(2, spec.model.seq_len, spec.model.d_model)

    async def main() -> None:
        await server.open()
        opt = _opt(server)
        first = asyncio.create_task(
            reg.call(
                Kind.BACKWARD,
                BackwardRequest(hop=_hop(spec, 0, mb=1), budget_s=30, input_carried=True),
                [idx, g],
            )
        )
        assert await asyncio.to_thread(opt.entered.wait, 30)
        second = asyncio.create_task(
            reg.call(
                Kind.BACKWARD,
                BackwardRequest(hop=_hop(spec, 0, mb=2), budget_s=30, input_carried=True),
                [idx, g],
            )
        )
        await asyncio.sleep(0)
        second.cancel()  # what the endpoint does when the requester resets the stream
        with pytest.raises(asyncio.CancelledError):
            await second
        assert server.queue_len == 2  # the slot stays taken until the device thread drops it
        gate.set()
        await first
        async with asyncio.timeout(30):
            await server.drain(asyncio.get_running_loop().time() + 30)
        assert server.queue_len == 0 and opt.steps == [2] and server.counters.expired == 1
        await server.close()

    _run(main())


def test_wrong_run_stage_joining_and_draining_are_refused() -> None:
    spec = _spec("none")
    reg = Registry()
    server = StageServer(
        spec,
        1,
        StageServerConfig(device="cpu", benchmark_iterations=1),
        endpoint=reg,
        make_optimizer=RecordingOptimizer,
    )
    x = torch.zeros(2, spec.model.seq_len, spec.model.d_model)

    async def code(kind: str, header: Any, tensors: list[torch.Tensor], peer: str = TRAINER) -> str:
        with pytest.raises(RemoteError) as exc:
            await reg.call(kind, header, tensors, peer)
        return exc.value.code

    async def main() -> None:
        fwd = ForwardRequest(hop=_hop(spec, 1), budget_s=30)
        assert await code(Kind.FORWARD, fwd, [x]) == ErrorCode.NOT_READY
        await server.open()
        other = HopId(run_id="0000000000000000", trainer=TRAINER, micro_batch=0, stage=1)
        assert (
            await code(Kind.FORWARD, ForwardRequest(hop=other, budget_s=30), [x])
            == ErrorCode.WRONG_RUN
        )
        assert (
            await code(Kind.FORWARD, ForwardRequest(hop=_hop(spec, 2), budget_s=30), [x])
            == ErrorCode.WRONG_STAGE
        )
        assert await code(Kind.FORWARD, fwd, [x], peer="impostor") == ErrorCode.BAD_REQUEST
        assert await code(Kind.FORWARD, fwd, [x, x]) == ErrorCode.BAD_REQUEST
        assert await code(Kind.FORWARD, fwd, [torch.zeros(2, 8)]) == ErrorCode.BAD_REQUEST
        assert (
            await code(Kind.FORWARD, fwd, [torch.full_like(x, float("nan"))])
            == ErrorCode.BAD_REQUEST
        )
        assert await code(
            Kind.FORWARD_LOSS, ForwardLossRequest(hop=_hop(spec, 1), budget_s=30), [x, x]
        ) == (ErrorCode.BAD_REQUEST)
        with pytest.raises(RemoteError) as exc:
            await reg.handlers[Kind.FORWARD](
                Request(TRAINER, Kind.FORWARD, {"hop": "garbage"}, [x])
            )
        assert exc.value.code == ErrorCode.BAD_REQUEST
        reply = await reg.call(Kind.FORWARD, fwd, [x])  # still serving after all that
        assert reply.tensors and server.counters.forward == 1
        info = await reg.call(Kind.STAGE_INFO, InfoRequest(run_id=spec.run_id), [])
        assert info.header["stage"] == 1 and info.header["state"] == "online"
        await server.drain(asyncio.get_running_loop().time() + 30)
        assert await code(Kind.FORWARD, fwd, [x]) == ErrorCode.DRAINING
        await server.close()

    _run(main())


def test_eval_loss_matches_the_full_model_and_accumulates_nothing() -> None:
    spec = _spec("none")
    idx, targets = _batch(spec, 9)
    full = build_full_model(spec)

    async def body(regs: list[Registry], servers: list[StageServer]) -> None:
        h = idx
        for stage in (0, 1):
            reply = await regs[stage].call(
                Kind.FORWARD,
                ForwardRequest(hop=_hop(spec, stage), budget_s=30, keep_input=False),
                [h],
            )
            h = _tensor(reply.tensors[0])
        reply = await regs[2].call(
            Kind.EVAL_LOSS, EvalLossRequest(hop=_hop(spec, 2), budget_s=30), [h, targets]
        )
        with torch.no_grad():
            assert reply.header["loss"] == pytest.approx(
                float(full.forward_loss(idx, targets)), rel=1e-6
            )
        assert all(_opt(s).steps == [] for s in servers)
        assert all(p.grad is None for s in servers for p in s.module.parameters())

    _with_servers(spec, body)


def test_throughput_is_measured_once_and_cached_in_the_state_dir(tmp_path: Path) -> None:
    spec = _spec("none")
    (tmp_path / THROUGHPUT_CACHE).write_text("not json")  # a damaged cache is ignored

    async def measure() -> float:
        server = StageServer(
            spec,
            2,
            StageServerConfig(device="cpu", benchmark_iterations=1),
            endpoint=Registry(),
            make_optimizer=RecordingOptimizer,
            state_dir=tmp_path,
        )
        await server.open()
        await server.close()
        assert all(
            p.grad is None for p in server.module.parameters()
        )  # the benchmark left no grads
        return server.throughput

    first = _run(measure())
    assert first > 0
    cached = (tmp_path / THROUGHPUT_CACHE).read_text()
    assert f"{spec.run_id}/2/cpu" in cached
    assert _run(measure()) == first


def test_input_cache_is_bounded_by_entries_bytes_and_age() -> None:
    t = torch.zeros(4)  # 16 bytes
    cache = InputCache(max_entries=2, max_bytes=40, ttl=10.0)
    assert cache.put("a", t, now=0.0) and cache.put("b", t, now=1.0)
    assert cache.get("a", now=2.0) is t  # refreshes a's recency, not its age
    cache.put("c", t, now=3.0)  # over 2 entries: evicts the least recently used, b
    assert cache.get("b", now=3.0) is None and len(cache) == 2 and cache.nbytes == 32
    assert cache.get("a", now=9.999) is t
    assert cache.get("a", now=10.0) is None  # expired at put time + ttl
    assert not cache.put("big", torch.zeros(11), now=11.0)  # 44 bytes never fit
    cache.put("d", torch.zeros(6), now=11.0)  # 24 bytes: with c (16) that is 40, fits
    assert cache.nbytes == 40
    cache.put("e", t, now=11.0)  # 56 bytes: c goes
    assert cache.get("c", now=11.0) is None and cache.nbytes == 40
    assert not InputCache(0, 100, 1.0).put("x", t, now=0.0)


def test_applied_log_forgets_oldest_keys_and_keeps_few_replies() -> None:
    log = AppliedLog(max_keys=3, max_replies=1)
    replies = [Response({"i": i}) for i in range(4)]
    for i, reply in enumerate(replies):
        log.add(("t", i, 0), reply)
    assert ("t", 0, 0) not in log and all(("t", i, 0) in log for i in (1, 2, 3))
    assert log.reply(("t", 3, 0)) is replies[3] and log.reply(("t", 2, 0)) is None
    assert len(log) == 3


# ---------------------------------------------------------------------------- checkpoints

CKPT_SPEC = RunSpec(
    name="ckptserver",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=4),  # an epoch every 2 micro-batches
)


def _last_stage(
    state_dir: Path, config: StageServerConfig, make_optimizer: Any = None, **kw: Any
) -> tuple[Registry, StageServer]:
    reg = Registry()
    make = make_optimizer or (lambda m: LocalOptimizer(m, CKPT_SPEC))
    return reg, StageServer(
        CKPT_SPEC, 1, config, endpoint=reg, make_optimizer=make, state_dir=state_dir, **kw
    )


async def _train_last_stage(reg: Registry, micro_batches: range, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    B, T, C = CKPT_SPEC.batch.micro_batch_size, CKPT_SPEC.model.seq_len, CKPT_SPEC.model.d_model
    for mb in micro_batches:
        x, targets = (
            torch.randn(B, T, C, generator=gen),
            torch.randint(0, 256, (B, T), generator=gen),
        )
        await reg.call(
            Kind.FORWARD_LOSS,
            ForwardLossRequest(hop=_hop(CKPT_SPEC, 1, mb), budget_s=30),
            [x, targets],
        )


def test_a_restarted_server_resumes_from_the_checkpoint_it_saved_on_drain(tmp_path: Path) -> None:
    config = StageServerConfig(device="cpu", benchmark_iterations=1, checkpoint_period_s=0)

    async def first_life() -> tuple[dict[str, Any], str]:
        reg, server = _last_stage(tmp_path, config)
        await server.open()
        assert server.status()["resumed_from"] == "fresh"
        await _train_last_stage(reg, range(5))  # 2 epochs and half of a third
        await server.drain(asyncio.get_running_loop().time() + 30)
        status, digest = server.status(), server.param_digest()
        await server.close()
        return status, digest

    status, digest = _run(first_life())
    assert (
        status["epoch"] == 2
        and status["checkpoint_epoch"] == 2
        and status["checkpoints_written"] == 1
    )
    assert [e for e, _ in list_checkpoints(tmp_path, CKPT_SPEC.run_id, 1)] == [2]

    async def second_life() -> tuple[dict[str, Any], str]:
        reg, server = _last_stage(tmp_path, config)
        assert server.param_digest() != digest  # a freshly built stage
        await server.open()
        status, resumed = server.status(), server.param_digest()
        await _train_last_stage(reg, range(100, 102), seed=1)  # and it trains on from there
        assert server.optimizer.local_epoch == 3
        await server.close()
        return status, resumed

    status, resumed = _run(second_life())
    assert (
        status["resumed_from"] == "checkpoint"
        and status["epoch"] == 2
        and status["checkpoint_epoch"] == 2
    )
    assert resumed == digest


def test_a_periodic_checkpoint_is_taken_after_a_step_once_the_period_has_passed(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    config = StageServerConfig(
        device="cpu", benchmark_iterations=1, checkpoint_period_s=60, checkpoint_keep=1
    )

    async def body() -> None:
        reg, server = _last_stage(tmp_path, config, clock=clock)
        await server.open()
        await _train_last_stage(reg, range(0, 2))  # epoch 1, but the period has not passed
        clock.now += 61
        await _train_last_stage(reg, range(2, 4))  # a step after the period: epoch 1 is saved
        # The write runs on the checkpoint thread, and a checkpoint is due only once the one
        # before it is written: wait for it, so that the step below finds the writer idle.
        await async_wait_for(
            lambda: server.status()["checkpoints_written"] == 1, 30, "the first checkpoint"
        )
        clock.now += 30
        await _train_last_stage(reg, range(4, 6))  # within the period: nothing
        clock.now += 31
        await _train_last_stage(reg, range(6, 8))  # its first step (at epoch 3) saves; then epoch 4
        await server.close()  # waits for the write in flight; no drain, so no final checkpoint
        assert server.status()["checkpoints_written"] == 2

    _run(body())
    assert [e for e, _ in list_checkpoints(tmp_path, CKPT_SPEC.run_id, 1)] == [
        3
    ]  # keep=1 pruned epoch 1


def test_a_server_that_never_opened_saves_no_checkpoint_on_drain(tmp_path: Path) -> None:
    config = StageServerConfig(device="cpu", benchmark_iterations=1)

    async def body() -> None:
        _, server = _last_stage(tmp_path, config)  # open() failed or was never reached
        await server.drain(asyncio.get_running_loop().time() + 30)
        await server.close()
        assert server.status()["checkpoints_written"] == 0

    _run(body())
    assert list_checkpoints(tmp_path, CKPT_SPEC.run_id, 1) == []


class PeersAt(LocalOptimizer):
    """A LocalOptimizer whose 'peers' answer with a given state (as load_state_from_peers would)."""

    def __init__(
        self,
        module: nn.Module,
        spec: RunSpec,
        peer_state: tuple[int, dict[str, torch.Tensor], dict[str, Any]],
    ) -> None:
        super().__init__(module, spec)
        self.peer_state = peer_state

    def load_state_from_peers(self) -> bool:
        self.import_state(*self.peer_state)
        return True


@pytest.mark.parametrize(
    ("peer_epoch", "winner", "epoch"), [(1, "checkpoint", 2), (2, "peers", 2), (3, "peers", 3)]
)
def test_resume_takes_the_checkpoint_only_when_it_is_newer_than_the_peers(
    tmp_path: Path, peer_epoch: int, winner: str, epoch: int
) -> None:
    config = StageServerConfig(device="cpu", benchmark_iterations=1, checkpoint_period_s=0)

    async def save_epoch_2() -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        reg, server = _last_stage(tmp_path, config)
        await server.open()
        await _train_last_stage(reg, range(4))
        await server.drain(asyncio.get_running_loop().time() + 30)
        await server.close()
        return server.optimizer.export_state()

    _, tensors, meta = _run(save_epoch_2())
    peers = {name: t + 0.5 if name.startswith("model.") else t for name, t in tensors.items()}

    async def restart() -> tuple[dict[str, Any], torch.Tensor]:
        _, server = _last_stage(
            tmp_path,
            config,
            make_optimizer=lambda m: PeersAt(m, CKPT_SPEC, (peer_epoch, peers, meta)),
        )
        await server.open()
        status, weights = server.status(), next(iter(server.module.state_dict().values())).clone()
        await server.close()
        return status, weights

    status, weights = _run(restart())
    assert status["resumed_from"] == winner and status["epoch"] == epoch
    first = next(iter(tensors))
    assert torch.equal(weights, tensors[first] if winner == "checkpoint" else peers[first])
