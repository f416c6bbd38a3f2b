"""A subspace run (run spec ``[subspace]``) through real stage servers over real QUIC.

Three stages, one server each, and one trainer, as tests/loopback/test_pipeline.py builds
them, with ``d_model`` 32 compressed to ``k`` = 8 coefficients per token at each boundary
and int8 codecs on top. What the issue asks of the swarm (docs/compression.md):

- stage servers and trainers send coefficients plus token ids forward and coefficients
  backward: the wire bytes per token per boundary are what the codec of ``k`` values plus
  one byte of id per token weigh, and the model learns;
- the projection runs after every optimizer step: the residual writers of stages 0 and 1
  stay inside the subspace, so the boundary's reconstruction is exact;
- a replica that joins by state transfer holds weights inside the subspace;
- the token-id side channel is bounds-checked like every other input: wrong dtype, shape,
  values or a missing id tensor get a clear refusal and change nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from wanswarm.node.config.runspec import RunSpec
from wanswarm.node.protocol import ForwardRequest, HopId, Kind, to_header
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.stage.state import StageStateSharing
from wanswarm.node.training.data import TrainStream, validation_set
from wanswarm.node.training.model import build_stage
from wanswarm.node.training.servers import ServerInfo
from wanswarm.node.training.subspace import Subspace
from wanswarm.node.training.trainer import Trainer
from wanswarm.node.training.trainer_config import TrainerConfig
from wanswarm.transport.codecs import encode, parse_codec
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.identity import Identity

from tests.loopback.test_state_transfer import _config, _swarm

K = 8
MICRO_BATCHES = 24


def _spec() -> RunSpec:
    stdlib = Path(sys.modules["os"].__file__ or "").parent
    corpus = [str(stdlib / name) for name in ("typing.py", "argparse.py", "dataclasses.py")]
    return RunSpec.model_validate({
        "name": "subspace-loopback",
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 3, "seq_len": 32},
        "stages": {"blocks_per_stage": [1, 1, 1]},
        "batch": {"micro_batch_size": 4, "target_batch_size": 8},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant",
                      "weight_decay": 0.1},
        "codecs": {"forward_activations": "int8", "backward_gradients": "int8"},
        "subspace": {"k": K},
        "data": {"corpus": corpus, "validation_fraction": 0.25, "validation_windows": 16},
    })


def _transport() -> TransportConfig:
    return TransportConfig(host="127.0.0.1", congestion={"algorithm": "reno"})


@pytest.mark.timeout(180)
def test_a_subspace_run_trains_through_stage_servers_with_k_coefficients_on_the_wire() -> None:
    spec = _spec()
    subspace = Subspace.for_run(spec)
    assert subspace is not None and subspace.k_at(0) == subspace.k_at(1) == K

    async def scenario() -> None:
        server_cfg = StageServerConfig(device="cpu", benchmark_iterations=1, queue_size=8)
        endpoints = [Endpoint(Identity.generate(), _transport()) for _ in range(3)]
        trainer_ep = Endpoint(Identity.generate(), _transport())
        for ep in [*endpoints, trainer_ep]:
            await ep.start("127.0.0.1", 0)
        servers = [
            StageServer(spec, stage, server_cfg, endpoint=ep,
                        make_optimizer=lambda m: LocalOptimizer(m, spec))
            for stage, ep in enumerate(endpoints)
        ]
        for server in servers:
            await server.open()

        def view() -> dict[int, list[ServerInfo]]:
            return {
                server.stage: [ServerInfo(ep.peer_id, *ep.address, 20.0, server.queue_len,
                                          "online", None)]
                for server, ep in zip(servers, endpoints, strict=True)
            }

        stream = TrainStream(spec, seed=1)

        def data() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for _ in range(MICRO_BATCHES):
                yield next(stream)

        trainer = Trainer(spec, TrainerConfig(max_in_flight=2, request_timeout_s=20.0),
                          endpoint=trainer_ep, servers=view, rng=random.Random(0), data=data())
        windows = validation_set(spec)
        try:
            async with asyncio.timeout(150):
                before = await trainer.evaluate(windows)
                await trainer.run(max_micro_batches=MICRO_BATCHES)
                after = await trainer.evaluate(windows)
                await _hostile_ids(spec, trainer_ep, endpoints[1], servers[1])
        finally:
            for ep in [trainer_ep, *endpoints]:
                await ep.close()
            for server in servers:
                await server.close()

        c = trainer.counters
        assert (c.completed, c.failed) == (MICRO_BATCHES, 0)
        assert after < before - 0.3, (before, after)
        # the optimizer stepped (24 micro-batches of 4 = 12 steps of 8 samples) and every
        # step ended inside the subspace on the stages whose output crosses a boundary
        for server in servers[:2]:
            assert server.optimizer is not None and server.optimizer.local_epoch >= 10
            assert subspace.constraint_error(server.module) < 1e-5
        assert subspace.constraint_error(servers[2].module) == 0.0  # the last stage is free
        # on the wire: k int8 codes plus the codec's scales plus one id byte per token
        tokens_per_mb = spec.batch.micro_batch_size * spec.model.seq_len
        probe = torch.randn(spec.batch.micro_batch_size, spec.model.seq_len, K)
        coded = len(encode(probe, parse_codec("int8")).payload) / tokens_per_mb
        full = len(encode(torch.randn(*probe.shape[:2], 32), parse_codec("int8")).payload)
        wire = trainer.status()["wire_bytes_per_token"]
        assert len(wire) == 2
        for boundary in wire:
            assert boundary["forward"] == pytest.approx(coded + 1.0, abs=0.01), wire
            assert boundary["backward"] == pytest.approx(coded, abs=0.01), wire
            assert boundary["forward"] < full / tokens_per_mb / 2.5  # vs int8 of d_model

    asyncio.run(scenario())


async def _hostile_ids(
    spec: RunSpec, client: Endpoint, target: Endpoint, server: StageServer
) -> None:
    """Bad token ids to stage 1: refused before any compute, nothing cached or applied."""
    peer = PeerAddress(target.peer_id, *target.address)
    x = encode(torch.randn(2, 16, K), parse_codec("int8"))
    good_ids = torch.randint(0, 256, (2, 16), dtype=torch.int64).to(torch.uint8)
    cases = {
        "missing ids": [x],
        "int64 ids": [x, good_ids.to(torch.int64)],
        "wrong shape": [x, good_ids[:, :8].contiguous()],
        "too many tensors": [x, good_ids, good_ids],
    }
    forwards, cached = server.counters.forward, server.status()["cache"]
    for i, (what, tensors) in enumerate(cases.items()):
        hop = HopId(run_id=spec.run_id, trainer=client.peer_id, micro_batch=10_000 + i, stage=1,
                    attempt=0)
        header = to_header(ForwardRequest(hop=hop, budget_s=5.0, keep_input=True))
        with pytest.raises(RemoteError) as refused:
            await client.request(peer, Kind.FORWARD, header, tensors, timeout=10.0)
        assert refused.value.code == "bad_request", (what, refused.value)
    assert server.counters.forward == forwards and server.status()["cache"] == cached


def test_ids_out_of_the_vocabulary_are_refused_by_the_contract() -> None:
    from wanswarm.node.protocol import StageContract

    spec = _spec()
    contract = StageContract.from_spec(spec, 1)
    contract = dataclasses.replace(contract, vocab_size=200)  # a tokenizer of 200 ids
    assert contract.ids_dtype == torch.uint8 and contract.in_width == K
    with pytest.raises(RemoteError) as refused:
        contract.check_ids(torch.full((2, 4), 255, dtype=torch.uint8), 2, 4)
    assert refused.value.code == "bad_request" and "[0, 200)" in str(refused.value)
    contract.check_ids(torch.full((2, 4), 199, dtype=torch.uint8), 2, 4)
    assert StageContract.from_spec(spec, 0).ids_dtype is None  # stage 0 takes the tokens


@pytest.mark.timeout(90)
def test_a_replica_that_joins_by_state_transfer_holds_weights_inside_the_subspace() -> None:
    spec = _spec()
    subspace = Subspace.for_run(spec)
    assert subspace is not None
    trained, joiner = build_stage(spec, 0), build_stage(spec, 0)
    donor_opt, our_opt = LocalOptimizer(trained, spec), LocalOptimizer(joiner, spec)
    stream = TrainStream(spec, seed=3)
    for _ in range(6):  # three optimizer steps of the donor, each ending projected
        tokens, _ = next(stream)
        h = trained(tokens)
        subspace.to_wire(h, tokens, 0).square().mean().backward()
        donor_opt.step(spec.batch.micro_batch_size)
    assert donor_opt.local_epoch == 3 and subspace.constraint_error(trained) < 1e-5
    pools = [ThreadPoolExecutor(1, thread_name_prefix=f"d{i}-device") for i in (0, 1)]

    async def main() -> bool:
        async with _swarm(1) as (donors, client):
            donor = StageStateSharing(donors[0], 0, donor_opt, pools[0], _config(),
                                      donors=None, serving=lambda: True)
            address = PeerAddress(donors[0].peer_id, *donors[0].address)
            ours = StageStateSharing(client, 0, our_opt, pools[1], _config(),
                                     donors=lambda: [address], serving=lambda: True)
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(pools[1], ours.resync, loop, 25.0)
            finally:
                donor.close()
                ours.close()

    try:
        caught_up = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        for pool in pools:
            pool.shutdown()
    assert caught_up and our_opt.local_epoch == 3
    assert subspace.constraint_error(joiner) < 1e-5
    tokens, _ = next(stream)
    with torch.no_grad():
        h = joiner(tokens)  # (B, T, C): E_fixed[tokens] + something in span(U)
        rebuilt = subspace.from_wire(subspace.to_wire(h, tokens, 0), tokens, 0)
    torch.testing.assert_close(rebuilt, h, rtol=1e-4, atol=1e-4)
