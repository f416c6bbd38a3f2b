"""A bf16 pipeline over real QUIC endpoints on 127.0.0.1: three stage servers computing in
bf16 autocast (``[precision] compute = "bf16"``, which the CPU honours when asked) and one
trainer that knows nothing of it.

The stages' outputs and input gradients leave them as float32 payloads quantized (int8)
straight from bf16 tensors; the trainer relays them as they came (its error feedback
stays empty, nothing is re-encoded), the next stage accepts them, every micro-batch
completes and the validation loss falls.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
from wanswarm.node.config.runspec import (
    BatchSpec,
    DataSpec,
    ModelSpec,
    OptimizerSpec,
    PrecisionSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.training.data import TrainStream, validation_set
from wanswarm.node.training.servers import ServerInfo
from wanswarm.node.training.trainer import Trainer
from wanswarm.node.training.trainer_config import TrainerConfig
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint
from wanswarm.transport.identity import Identity

MICRO_BATCHES = 24


def _spec() -> RunSpec:
    stdlib = Path(sys.modules["os"].__file__ or "").parent
    corpus = tuple(str(stdlib / name) for name in ("typing.py", "argparse.py", "enum.py"))
    return RunSpec(
        name="bf16loopback",
        model=ModelSpec(d_model=32, n_heads=2, n_layers=3, seq_len=32),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=4, target_batch_size=8),
        optimizer=OptimizerSpec(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        data=DataSpec(corpus=corpus, validation_fraction=0.25, validation_windows=16),
        precision=PrecisionSpec.model_validate({"compute": "bf16"}),
    )


def _transport() -> TransportConfig:
    return TransportConfig(host="127.0.0.1", congestion={"algorithm": "reno"})


@pytest.mark.timeout(180)
def test_a_bf16_pipeline_trains_over_quic() -> None:
    asyncio.run(_scenario(_spec()))


async def _scenario(spec: RunSpec) -> None:
    config = StageServerConfig(device="cpu", benchmark_iterations=1)
    endpoints = [Endpoint(Identity.generate(), _transport()) for _ in range(3)]
    trainer_ep = Endpoint(Identity.generate(), _transport())
    for ep in [*endpoints, trainer_ep]:
        await ep.start("127.0.0.1", 0)
    servers = [
        StageServer(spec, s, config, endpoint=ep, make_optimizer=lambda m: LocalOptimizer(m, spec))
        for s, ep in enumerate(endpoints)
    ]

    def view() -> dict[int, list[ServerInfo]]:
        return {
            s.stage: [ServerInfo(ep.peer_id, *ep.address, 20.0, s.queue_len, "online", None)]
            for s, ep in zip(servers, endpoints, strict=True)
        }

    trainer = Trainer(
        spec,
        TrainerConfig(max_in_flight=2, request_timeout_s=20.0, max_attempts=2),
        endpoint=trainer_ep,
        servers=view,
        rng=random.Random(0),
        data=TrainStream(spec, seed=3),
    )
    windows = validation_set(spec)
    try:
        async with asyncio.timeout(150):
            for server in servers:
                await server.open()
            before = await trainer.evaluate(windows)
            await trainer.run(max_micro_batches=MICRO_BATCHES)
            after = await trainer.evaluate(windows)
    finally:
        for ep in [trainer_ep, *endpoints]:
            await ep.close()
        for server in servers:
            await server.close()
    c = trainer.counters
    assert (c.completed, c.failed) == (MICRO_BATCHES, 0)
    assert len(trainer._ef) == 0  # every payload relayed as the bf16 stage encoded it
    assert after < before - 0.3, (before, after)
    for server in servers:
        assert server.precision.mode == "bf16"
        assert server.status()["precision"] == "bf16 on cpu"
        assert server.counters.applied == MICRO_BATCHES
        assert server.counters.failed == 0
