"""Forward+backward tokens/s of a stage through the stage server's own path, against plain
PyTorch training the same module in one process on the same device.

The stage is the middle one of a three-stage run (``--d-model``, default 384, with a head
per 64 channels; ``--blocks`` per stage, default 2; micro-batches of ``--batch`` x
``--seq-len``, default 8 x 128 as in the tiny run; a step every 8 micro-batches; the run
spec's ``[precision] compute`` from ``--precision``).
Each micro-batch goes through the path a request takes on a stage server, minus the
sockets:

- the input activation arrives as a payload encoded with the run's forward codec (by the
  stage before: encoded here, untimed, once per distinct input) and is decoded and checked
  as the endpoint does it for a server (``ReceivedTensor`` -> ``decode_all``);
- the ``forward`` handler admits it and queues the job on the stage's device thread
  (``DeviceQueue``), which checks it, computes under the run's precision, keeps the input
  and the forward's graph in their caches (``max_in_flight``) and encodes the output;
- the gradient arrives the same way (backward codec) and the ``backward`` handler's job
  runs the backward by reference to the cached input, checks it, encodes dL/dx through
  error feedback and hands the gradients to the stage's optimizer (``LocalOptimizer``,
  the solo AdamW with accumulation to ``target_batch_size``).

``--in-flight N`` keeps N micro-batches under way at once on the server's path, as a
server of a swarm holds several trainers' micro-batches (the default, 1, sends each
request once the previous one is answered). With more than one, the device thread has the
next job queued when a forward returns: on a GPU the forward's output then crosses to the
host while the next job computes (its reply finishes on the queue's finishing thread,
device_queue.Deferred), and the figures with 1 and with 2 in flight measure that overlap.

The reference trains a bit-identical copy of the module: ``y = module(x)`` under the same
autocast, ``y.backward(grad_y)``, the same AdamW (torch's, clipped as the spec says) every
``target_batch_size / micro_batch_size`` micro-batches, on device tensors it already
holds (no codec, no queue, no checks). Both see the same inputs and output gradients.

The machine may be loaded by other work, so the two are measured in alternating rounds
(server, reference, server, ...; ``--rounds`` each, ``--micro-batches`` per round, after
one warm-up round each) and the figures are the medians: load affects both alike.

What a second is (``--clock``): on CUDA the wall clock, with the device synchronized at the
end of each round. On the CPU, by default, the process's CPU time (every thread: the
event loop, the device thread, codec workers, torch's), because on a shared machine the
wall clock of a round mostly measures how long the scheduler kept the process off its
cores (rounds of the same work vary several-fold under load) while the CPU time is the
work itself. On the CPU torch runs one intra-op thread by default (``--threads``), as
benchmarks/trainer_cpu.py does, so that OpenMP workers spinning at their barriers (which
a loaded machine prolongs) are not counted as work. The JSON line carries the wall-clock
figures too (``wall_*``).
``peak_memory_mb`` is CUDA's peak allocated memory during the server's rounds, or on the
CPU the process's peak resident set size (both paths included: they share the process).

``--profile DIR`` (after the timed rounds, untimed): one more round of the server's path
under ``cProfile`` (the event loop's thread and the device thread's jobs, each its own
table), one with CUDA's synchronization debug mode counting every synchronizing call by
the line that made it, and one under ``torch.profiler`` (host ops and, on CUDA, kernels;
its trace gzipped for a trace viewer), written to ``DIR/stage_profile.txt`` and
``DIR/stage_trace.json.gz``.

Prints both figures side by side, then one JSON line (``--json``: only the JSON line) with
``tokens_per_s``, ``reference_tokens_per_s``, ``ratio`` and ``peak_memory_mb``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import gzip
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from wanswarm.node.config.runspec import (
    BatchSpec,
    CodecsSpec,
    ModelSpec,
    PrecisionSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.protocol import BackwardRequest, ForwardRequest, HopId, Kind, to_header
from wanswarm.node.stage.device_queue import DeviceQueue
from wanswarm.node.stage.optimizer import LocalOptimizer, make_adamw
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.training.model import build_stage, param_groups
from wanswarm.transport.codecs import encode, parse_codec
from wanswarm.transport.endpoint import Handler, Request, Response
from wanswarm.transport.tensors import ReceivedTensor, decode_all

TRAINER = "bench-trainer"
STAGE = 1  # the middle stage: activations in, activations out, gradients both ways


class _Handlers:
    """The endpoint's role for the server: its handlers by kind (no sockets)."""

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

    async def call(
        self, kind: str, header: dict[str, Any], received: list[ReceivedTensor]
    ) -> Response:
        # as the endpoint does before a server's handler: on the device it registered with
        tensors = await decode_all(received, self.devices[kind])
        request = Request(TRAINER, kind, header, tensors, received=list(received))
        return await self.handlers[kind](request)


def _spec(args: argparse.Namespace) -> RunSpec:
    heads = max(1, args.d_model // 64)
    return RunSpec(
        name="stagebench",
        model=ModelSpec(
            d_model=args.d_model, n_heads=heads, n_layers=3 * args.blocks, seq_len=args.seq_len
        ),
        stages=StagesSpec(blocks_per_stage=(args.blocks,) * 3),
        batch=BatchSpec(micro_batch_size=args.batch, target_batch_size=args.batch * 8),
        codecs=CodecsSpec(forward_activations=args.codec, backward_gradients=args.codec),
        precision=PrecisionSpec(compute=args.precision),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ServerPath:
    def __init__(self, spec: RunSpec, device: torch.device, inputs: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        self.spec, self.device = spec, device
        self.handlers = _Handlers()
        config = StageServerConfig(device=str(device), benchmark_iterations=1)
        self.server = StageServer(
            spec, STAGE, config, endpoint=self.handlers,
            make_optimizer=lambda module: LocalOptimizer(module, spec),
        )
        fwd = parse_codec(spec.codecs.forward_activations)
        bwd = parse_codec(spec.codecs.backward_gradients)
        # what the stage before sends (its output) and what the trainer relays (the next
        # stage's dL/dx): payloads, encoded once here (untimed)
        self.inputs = [encode(x, fwd, dtype=torch.float32) for x in inputs]
        self.grads = [encode(g, bwd, dtype=torch.float32) for g in grads]
        self.micro_batch = 0

    async def round(self, n: int, in_flight: int = 1) -> tuple[float, float]:
        """``n`` micro-batches (forward, then backward by reference), ``in_flight`` of them
        under way at once; (wall seconds, CPU seconds)."""
        started, cpu = time.perf_counter(), time.process_time()
        first = self.micro_batch
        self.micro_batch += n
        numbers = iter(range(first, first + n))

        async def lane() -> None:
            for mb in numbers:  # one shared iterator: each micro-batch once
                await self._one(mb)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(in_flight, n)):
                group.create_task(lane())
        _sync(self.device)
        return time.perf_counter() - started, time.process_time() - cpu

    async def _one(self, mb: int) -> None:
        i = mb % len(self.inputs)
        hop = HopId(run_id=self.spec.run_id, trainer=TRAINER, micro_batch=mb, stage=STAGE,
                    attempt=0)
        fwd = ForwardRequest(hop=hop, keep_input=True, budget_s=60.0)
        reply = await self.handlers.call(
            str(Kind.FORWARD), to_header(fwd), [ReceivedTensor.of(self.inputs[i])]
        )
        assert reply.tensors, "the forward returns the stage's output"
        bwd = BackwardRequest(hop=hop, input_carried=False, budget_s=60.0)
        reply = await self.handlers.call(
            str(Kind.BACKWARD), to_header(bwd), [ReceivedTensor.of(self.grads[i])]
        )
        assert reply.tensors, "the backward returns dL/dx"


class _ReferencePath:
    def __init__(self, spec: RunSpec, device: torch.device, inputs: list[torch.Tensor],
                 grads: list[torch.Tensor], server: StageServer) -> None:
        self.module = build_stage(spec, STAGE).to(device)
        groups = param_groups(self.module, spec.optimizer.weight_decay)
        self.opt = make_adamw(spec.optimizer, groups)
        self.every = spec.batch.micro_batches_per_step
        self.precision = server.precision  # the same autocast as the server's
        self.device = device
        # a middle stage of a model trained in one process: dL/dx flows on to the stage
        # before, so it is computed here too, as the server computes it for its reply
        self.inputs = [x.to(device).requires_grad_(True) for x in inputs]
        self.grads = [g.to(device) for g in grads]
        self.micro_batch = 0

    def round(self, n: int) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            i = self.micro_batch % len(self.inputs)
            self.micro_batch += 1
            self.inputs[i].grad = None
            with self.precision.autocast():
                y = self.module(self.inputs[i])  # (B, T, C)
            y.backward(self.grads[i].to(y.dtype))
            if self.micro_batch % self.every == 0:
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - started, time.process_time() - cpu


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _stats(prof: cProfile.Profile, title: str, top: int = 45) -> str:
    out = io.StringIO()
    out.write(f"\n===== {title}: cProfile, by own time =====\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    out.write(f"\n===== {title}: cProfile, by cumulative time =====\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


async def _profile(server_path: _ServerPath, n: int, in_flight: int, folder: str) -> None:
    """The server's path profiled three ways (see the module docstring); untimed."""
    os.makedirs(folder, exist_ok=True)
    device = server_path.device
    parts: list[str] = []
    # 1. cProfile: before Python 3.12 a profiler sees only the thread that enabled it, so
    # the device thread's jobs get one of their own; from 3.12 (sys.monitoring) one
    # profiler sees every thread and a second cannot be enabled
    per_thread = sys.version_info < (3, 12)
    device_prof = cProfile.Profile()
    original = DeviceQueue._device

    def profiled(self: DeviceQueue, job: Any) -> Any:
        device_prof.enable()
        try:
            return original(self, job)
        finally:
            device_prof.disable()

    loop_prof = cProfile.Profile()
    if per_thread:
        DeviceQueue._device = profiled  # type: ignore[method-assign]
    try:
        loop_prof.enable()
        took, _ = await server_path.round(n, in_flight)
        loop_prof.disable()
    finally:
        DeviceQueue._device = original  # type: ignore[method-assign]
    parts.append(f"{n} micro-batches (forward + backward) in {took * 1e3:.1f} ms under cProfile")
    if per_thread:
        parts.append(_stats(device_prof, "device thread (jobs)"))
        parts.append(_stats(loop_prof, "event loop thread"))
    else:
        parts.append(_stats(loop_prof, "every thread"))
    # 2. every synchronizing CUDA call, by the line of ours (or a library's) that made it
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                await server_path.round(n, in_flight)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(
            f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)
        )
        parts.append(f"\n===== synchronizing CUDA calls in {n} micro-batches: "
                     f"{sum(where.values())} =====")
        parts.extend(f"{count:6d}  {line}" for line, count in where.most_common(40))
    # 3. torch.profiler: host ops and kernels
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        await server_path.round(n, in_flight)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    parts.append("\n===== torch.profiler, by own host time =====")
    parts.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    parts.append(f"\n===== torch.profiler, by {sort} =====")
    parts.append(prof.key_averages().table(sort_by=sort, row_limit=30))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(
            os.path.join(folder, "stage_trace.json.gz"), "wb"
        ) as dst:
            shutil.copyfileobj(src, dst)
    with open(os.path.join(folder, "stage_profile.txt"), "w") as f:
        f.write("\n".join(parts))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    spec = _spec(args)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq_len, args.d_model)
    inputs = [torch.randn(shape, generator=gen) for _ in range(4)]
    grads = [torch.randn(shape, generator=gen) * 1e-3 for _ in range(4)]
    server_path = _ServerPath(spec, device, inputs, grads)
    await server_path.server.open()
    reference = _ReferencePath(spec, device, inputs, grads, server_path.server)
    try:
        # warm-up: allocator, caches, kernels
        await server_path.round(args.micro_batches, args.in_flight)
        reference.round(args.micro_batches)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        server_s: list[tuple[float, float]] = []
        reference_s: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            server_s.append(await server_path.round(args.micro_batches, args.in_flight))
            reference_s.append(reference.round(args.micro_batches))
        peak = _peak_memory_mb(device)
        if args.profile:
            await _profile(server_path, args.micro_batches, args.in_flight, args.profile)
    finally:
        await server_path.server.close()
    tokens = args.micro_batches * args.batch * args.seq_len
    clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    k = 1 if clock == "cpu" else 0
    tps = tokens / statistics.median(s[k] for s in server_s)
    ref_tps = tokens / statistics.median(s[k] for s in reference_s)
    wall = tokens / statistics.median(s[0] for s in server_s)
    ref_wall = tokens / statistics.median(s[0] for s in reference_s)
    return {
        "clock": clock,
        "device": str(device),
        "precision": server_path.server.precision.describe(),
        "codec": args.codec,
        "d_model": args.d_model,
        "blocks": args.blocks,
        "seq_len": args.seq_len,
        "micro_batch_size": args.batch,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "micro_batches_per_round": args.micro_batches,
        "in_flight": args.in_flight,
        "tokens_per_s": round(tps, 1),
        "reference_tokens_per_s": round(ref_tps, 1),
        "ratio": round(tps / ref_tps, 3),
        "peak_memory_mb": round(peak, 1),
        "wall_tokens_per_s": round(wall, 1),
        "wall_reference_tokens_per_s": round(ref_wall, 1),
        "wall_ratio": round(wall / ref_wall, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--codec", default="int8", help="forward and backward codec")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4, help="per round")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="micro-batches under way at once on the server's path (default 1: each "
        "request sent once the last is answered); the reference is one process's loop",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None,
        help="what tokens/s divide by: wall-clock seconds, or the process's CPU seconds "
        "(default: cpu on the CPU, wall on CUDA)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on the CPU, torch's choice on CUDA)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="after the timed rounds, profile the server's path (cProfile per thread, CUDA "
        "synchronizations by line, torch.profiler) into DIR/stage_profile.txt",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    if args.in_flight < 1:
        parser.error("--in-flight: at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    result = asyncio.run(run(args))
    if not args.json:
        print(f"stage server path: {result['tokens_per_s']:.0f} tokens/s   "
              f"plain PyTorch: {result['reference_tokens_per_s']:.0f} tokens/s   "
              f"ratio {result['ratio']:.3f}   peak memory {result['peak_memory_mb']:.0f} MB "
              f"({result['precision']}, {result['codec']})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
