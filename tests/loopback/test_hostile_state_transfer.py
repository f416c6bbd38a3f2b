"""Hostile state donors over real QUIC on 127.0.0.1: a joining StageServer is not fooled.

Peers with valid identities serve a joining server's state download what issue #13
describes: a manifest naming a 60 GiB tensor, one with the wrong shapes, one at epoch
2^63 - 1, and a real state whose hyperparameters say ``lr = 1e6``, ``maximize = True``,
``betas = (0, 0)`` at an absurd epoch. The joining server refuses each (never allocating
what a manifest names), opens anyway and serves; when honest replicas are reachable, their
quorum's state is installed with the run spec's hyperparameters, and the lone liar serves
nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import torch
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, OptimizerSpec, RunSpec, StagesSpec
from wanswarm.node.protocol import to_header
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.stage.state_donor import StateDonor
from wanswarm.node.stage.state_plan import (
    MAX_EPOCH,
    Manifest,
    ManifestReply,
    Snapshot,
    StateTransferConfig,
    TensorEntry,
    byte_view,
    chunk_digests,
    manifest_kind,
    plan_chunks,
    stage_kind_prefix,
    state_layout,
)
from wanswarm.node.stage.state_transfer import download_state
from wanswarm.node.training.model import build_stage
from wanswarm.transport.endpoint import Endpoint, Request, Response

from .quic_helpers import address, config, endpoint, run

SPEC = RunSpec(
    name="hostilestate",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=2),
    optimizer=OptimizerSpec(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=20),
)
STAGE = 1
PREFIX = stage_kind_prefix(STAGE)
# the largest chunk size: a manifest naming 60 GiB then needs only 960 digests, so it passes
# every schema and size check (the limit is 64 GiB) and only the layout check can refuse it
CHUNK = 64 << 20


def _transfer() -> StateTransferConfig:
    return StateTransferConfig(
        chunk_bytes=CHUNK, timeout_s=20.0, manifest_timeout_s=5.0, chunk_timeout_s=5.0
    )


def _trained(epochs: int) -> LocalOptimizer:
    gen = torch.Generator().manual_seed(0)
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    while opt.local_epoch < epochs:
        x = torch.randn(2, SPEC.model.seq_len, SPEC.model.d_model, generator=gen)
        targets = torch.randint(0, 256, (2, SPEC.model.seq_len), generator=gen)
        module.forward_loss(x, targets).backward()  # type: ignore[operator]
        opt.step(2)
    return opt


def _fixed(snap: Snapshot) -> Callable[[], Awaitable[Snapshot]]:
    async def take() -> Snapshot:
        return snap

    return take


def _manifest_json(tensors: dict[str, torch.Tensor], **changes: Any) -> bytes:
    """A well-formed manifest of ``tensors`` in CHUNK chunks, then edited as JSON (so that it
    can say what our own schema would not build)."""
    views = [byte_view(t.contiguous()) for t in tensors.values()]
    chunks = plan_chunks([t.nbytes for t in tensors.values()], CHUNK)
    m = Manifest(
        epoch=1, snapshot_id=1, chunk_bytes=CHUNK,
        total_bytes=sum(t.nbytes for t in tensors.values()),
        tensors=tuple(
            TensorEntry(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                        nbytes=t.nbytes)
            for k, t in tensors.items()
        ),
        digests=tuple(chunk_digests(views, chunks)), meta={},
    )
    raw = json.loads(m.model_dump_json())
    raw.update(changes)
    return json.dumps(raw).encode()


def _serve_manifest(ep: Endpoint, body: bytes) -> None:
    """``ep`` answers every manifest request with ``body`` (chunks: unknown kind)."""

    async def manifest(request: Request) -> Response:
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        return Response(header=to_header(ManifestReply(nbytes=len(body))), tensors=[payload])

    ep.register(manifest_kind(PREFIX), manifest)


def _hostile_meta(meta: dict[str, Any]) -> dict[str, Any]:
    hostile = json.loads(json.dumps(meta))
    for group in hostile["param_groups"]:
        group.update(lr=1e6, betas=[0.0, 0.0], maximize=True)
    return hostile


@asynccontextmanager
async def _endpoints(n: int) -> AsyncIterator[list[Endpoint]]:
    async with AsyncExitStack() as stack:
        cfg = config(connect_timeout_s=10.0, handshake_timeout_s=10.0)
        yield [await stack.enter_async_context(endpoint(cfg)) for _ in range(n)]


def _joiner(ep: Endpoint, donors: list[Endpoint]) -> StageServer:
    cfg = StageServerConfig(device="cpu", benchmark_iterations=1, state_transfer=_transfer())
    return StageServer(
        SPEC, STAGE, cfg, endpoint=ep, make_optimizer=lambda m: LocalOptimizer(m, SPEC),
        donors=lambda: [address(d) for d in donors],
    )


def test_a_joining_server_refuses_hostile_manifests_and_keeps_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = LocalOptimizer(build_stage(SPEC, STAGE), SPEC).export_state()[1]
    first = next(iter(own))
    n_huge = 60 * (1 << 30) // 4  # a 60 GiB float32 tensor under a real tensor's name
    huge = {**own, first: torch.empty(0)}
    huge_body = json.loads(_manifest_json(huge))
    huge_body["tensors"][0].update(shape=[n_huge], nbytes=n_huge * 4, dtype="float32")
    huge_body["total_bytes"] += n_huge * 4
    huge_body["digests"] = ["0" * 64] * -(-huge_body["total_bytes"] // CHUNK)

    async def main() -> None:
        async with _endpoints(5) as (oversize, wrong, absurd, forged, joining):
            _serve_manifest(oversize, json.dumps(huge_body).encode())
            # a consistent state (real digests) whose shapes are another model's
            shapes = {k: torch.zeros(*t.shape[:-1], t.shape[-1] + 1) if t.dim() else t
                      for k, t in own.items()}
            StateDonor(wrong, _fixed(Snapshot(3, shapes, {})), kind_prefix=PREFIX)
            _serve_manifest(absurd, _manifest_json(own, epoch=2**63 - 1))
            # this stage's layout, but NaN weights and hostile hyperparameters: the only
            # other replica that fits, so it is its own quorum, and still refused
            poisoned = {k: t.clone() for k, t in own.items()}
            poisoned[first].view(-1)[0] = float("nan")
            meta = _hostile_meta(LocalOptimizer(build_stage(SPEC, STAGE), SPEC).export_state()[2])
            forger = StateDonor(forged, _fixed(Snapshot(5, poisoned, meta)), kind_prefix=PREFIX)

            server = _joiner(joining, [oversize, wrong, absurd, forged])
            with caplog.at_level(logging.WARNING):
                await server.open()  # refuses all of it: never raises
            try:
                # the poisoned state, its own quorum, failed the checks: not fetched again
                # (nor does a stand-in replace a quorum's state): it opens with its own
                assert forger.counts["manifests"] == 1
                assert server.status()["state_stand_in"] is None
                assert server.status()["state_wait"] is None
                assert server.state == "online" and server.resumed_from == "fresh"
                assert server.optimizer.local_epoch == 0
                params = server.optimizer.export_state()[1]
                assert all(bool(torch.isfinite(t).all()) for t in params.values()
                           if t.is_floating_point())
                group = server.optimizer._opt.param_groups[0]  # type: ignore[attr-defined]
                assert group["maximize"] is False and group["lr"] < 1.0
                text = caplog.text
                assert "not this stage's layout" in text and "16106127360" in text
                assert "mismatched" in text and "epoch" in text
                assert "non-finite" in text
                # it keeps working: it donates its own (fresh) state to the next newcomer
                got = await download_state(
                    oversize, [address(joining)], kind_prefix=PREFIX, config=_transfer(),
                    expected=state_layout(own),
                )
                assert got.epoch == 0
            finally:
                await server.close()

    run(main(), timeout=60)


def test_honest_replicas_outvote_a_liar_and_hyperparameters_stay_the_run_specs() -> None:
    honest = _trained(epochs=2)
    epoch, tensors, meta = honest.export_state()
    # the liar: the honest tensors, an absurd epoch and hostile hyperparameters
    liar_state = Snapshot(MAX_EPOCH, tensors, _hostile_meta(meta))

    async def main() -> None:
        async with _endpoints(4) as (a, b, liar, joining):
            for ep in (a, b):
                StateDonor(ep, _fixed(Snapshot(epoch, tensors, meta)), kind_prefix=PREFIX)
            lying = StateDonor(liar, _fixed(liar_state), kind_prefix=PREFIX)
            server = _joiner(joining, [liar, a, b])
            await server.open()
            try:
                assert server.resumed_from == "peers" and server.optimizer.local_epoch == epoch
                assert lying.counts["chunks"] == 0  # outvoted: never served a byte
                got = server.optimizer.export_state()
                for name, t in tensors.items():
                    assert torch.equal(got[1][name], t), name
                opt = server.optimizer._opt  # type: ignore[attr-defined]
                for group in opt.param_groups:
                    assert group["maximize"] is False
                    assert tuple(group["betas"]) == SPEC.optimizer.betas
                    assert group["lr"] == group["initial_lr"] * SPEC.optimizer.lr_multiplier(epoch)
            finally:
                await server.close()

    run(main(), timeout=60)


def test_a_lone_replica_is_trusted_for_tensors_but_not_for_hyperparameters() -> None:
    honest = _trained(epochs=2)
    epoch, tensors, meta = honest.export_state()

    async def main() -> None:
        async with _endpoints(2) as (only, joining):
            StateDonor(only, _fixed(Snapshot(epoch, tensors, _hostile_meta(meta))),
                       kind_prefix=PREFIX)
            server = _joiner(joining, [only])
            await server.open()
            try:
                assert server.resumed_from == "peers" and server.optimizer.local_epoch == epoch
                opt = server.optimizer._opt  # type: ignore[attr-defined]
                assert all(g["maximize"] is False and g["lr"] < 1.0 for g in opt.param_groups)
            finally:
                await server.close()

    run(main(), timeout=60)
