"""The trainer's CPU time per micro-batch and its training loss, through a real pipeline.

Three stage servers (the tiny run spec: 3 stages of 2 blocks, micro-batches of 8 x 128
bytes) and one trainer train ``--micro-batches`` micro-batches over real QUIC endpoints on
127.0.0.1, with the activation and gradient codec given by ``--codec`` (``int8`` is the
tiny run's own). The servers, their endpoints and their optimizers (the solo
LocalOptimizer) run in a child process; the trainer and its endpoint run in this one.

What is measured, and why it is honest:

- CPU: user + system time of this process (``resource.getrusage(RUSAGE_SELF)``, every
  thread: the event loop, the codec worker threads, torch's own), from the end of the
  warm-up micro-batches (``--warmup``, connection set-up included there) to the last one,
  divided by the micro-batches in that span. Everything this process does is the
  trainer's work: its hops, its endpoint's QUIC, framing and payload codec work. Nothing
  of the servers counts (their process is a child, and RUSAGE_SELF excludes children).
  Both processes run torch with one intra-op thread, so that idle OpenMP workers
  spinning do not count as work and the two processes do not oversubscribe the cores.
- Loss: the training loss (nats per byte) the last stage reports for each micro-batch;
  the figure is the mean of the last ``--last`` micro-batches. One micro-batch is in
  flight at a time, so a run is deterministic for a given code tree (same data stream,
  same order of gradient accumulation and optimizer steps).

It runs against whichever ``wanswarm`` Python imports, so one script compares two trees::

    python benchmarks/trainer_cpu.py
    PYTHONPATH=/path/to/other/tree python benchmarks/trainer_cpu.py

and prints the two figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import resource
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import uvloop
from wanswarm.node.config.runspec import CodecsSpec, RunSpec, default_run_spec
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.training import trainer as trainer_module
from wanswarm.node.training.data import TrainStream
from wanswarm.node.training.servers import ServerInfo
from wanswarm.node.training.trainer import Trainer
from wanswarm.node.training.trainer_config import TrainerConfig
from wanswarm.transport.config import CongestionConfig, TransportConfig
from wanswarm.transport.endpoint import Endpoint
from wanswarm.transport.identity import Identity

TIMEOUT_S = 60.0


def _transport() -> TransportConfig:
    # aioquic's reno: the figure is about the trainer's tensor work, not congestion control
    return TransportConfig(host="127.0.0.1", congestion=CongestionConfig(algorithm="reno"))


def _spec(codec: str) -> RunSpec:
    spec = default_run_spec()
    return spec.model_copy(
        update={"codecs": CodecsSpec(forward_activations=codec, backward_gradients=codec)}
    )


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the servers (child process) ---------------------------------------------------------


def _serve(spec_json: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    uvloop.run(_servers(RunSpec.model_validate_json(spec_json), conn))


async def _servers(spec: RunSpec, conn: Connection) -> None:
    config = StageServerConfig(device="cpu", benchmark_iterations=1)
    endpoints = [Endpoint(Identity.generate(), _transport()) for _ in range(spec.n_stages)]
    servers: list[StageServer] = []
    try:
        for ep in endpoints:
            await ep.start("127.0.0.1", 0)
        for stage, ep in enumerate(endpoints):
            servers.append(StageServer(
                spec, stage, config, endpoint=ep,
                make_optimizer=lambda m: LocalOptimizer(m, spec),
            ))
        for server in servers:
            await server.open()
        conn.send([(stage, ep.peer_id, *ep.address) for stage, ep in enumerate(endpoints)])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        conn.send({f"stage{s.stage}": s.counters.applied for s in servers})
    finally:
        for ep in endpoints:
            await ep.close()
        for server in servers:
            await server.close()


# ---- the trainer (this process) ----------------------------------------------------------


async def _train(args: argparse.Namespace, spec: RunSpec, addresses: list[Any]) -> dict[str, Any]:
    view: dict[int, list[ServerInfo]] = {}
    for stage, peer_id, host, port in addresses:
        view.setdefault(stage, []).append(ServerInfo(peer_id, host, port, 20.0, 0, "online", None))
    endpoint = Endpoint(Identity.generate(), _transport())
    await endpoint.start("127.0.0.1", 0)
    data = TrainStream(spec, seed=1)
    trainer = Trainer(
        spec,
        TrainerConfig(max_in_flight=1, request_timeout_s=TIMEOUT_S, max_attempts=1),
        endpoint=endpoint,
        servers=lambda: view,
        rng=random.Random(0),
        data=data,
    )
    losses: list[float] = []
    try:
        cpu0 = wall0 = 0.0
        for i in range(args.micro_batches):
            if i == args.warmup:
                cpu0, wall0 = _cpu_s(), time.perf_counter()
            # one micro-batch per call: run() returns once `started` reaches the bound
            await trainer.run(max_micro_batches=i + 1)
            if trainer.counters.completed != i + 1 or trainer.counters.last_loss is None:
                raise RuntimeError(f"micro-batch {i} failed: {trainer.status()['errors']}")
            losses.append(trainer.counters.last_loss)
        cpu, wall = _cpu_s() - cpu0, time.perf_counter() - wall0
    finally:
        await endpoint.close()
    measured = args.micro_batches - args.warmup
    last = losses[-args.last :]
    return {
        "codec": args.codec,
        "micro_batches": args.micro_batches,
        "measured_micro_batches": measured,
        "trainer_cpu_s_per_micro_batch": round(cpu / measured, 5),
        "wall_s_per_micro_batch": round(wall / measured, 4),
        "last": len(last),
        "mean_loss_last": round(sum(last) / len(last), 5),
        "first_loss": round(losses[0], 5),
        "payload_bytes": trainer.status()["payload_bytes"],
        "trainer_module": trainer_module.__file__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2, help="micro-batches before CPU counts")
    parser.add_argument("--last", type=int, default=16, help="micro-batches in the loss mean")
    parser.add_argument("--codec", default="int8", help="activation and gradient codec")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.micro_batches or args.last < 1:
        parser.error("need 0 <= --warmup < --micro-batches and --last >= 1")
    torch.set_num_threads(1)
    spec = _spec(args.codec)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_serve, args=(spec.model_dump_json(), theirs), daemon=True)
    child.start()
    try:
        if not ours.poll(120.0):
            raise RuntimeError("the stage servers did not start within 120 s")
        addresses = ours.recv()
        result = uvloop.run(_train(args, spec, addresses))
        ours.send("stop")
        if ours.poll(30.0):
            result["server_applied"] = ours.recv()
    finally:
        child.join(timeout=30.0)
        if child.is_alive():
            child.terminate()
    print(f"trainer CPU per micro-batch: {result['trainer_cpu_s_per_micro_batch'] * 1e3:.2f} ms "
          f"({result['measured_micro_batches']} micro-batches, codec {args.codec})")
    print(f"mean training loss of the last {result['last']} micro-batches: "
          f"{result['mean_loss_last']:.4f} nats/byte (first {result['first_loss']:.4f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
