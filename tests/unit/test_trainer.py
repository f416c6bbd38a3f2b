"""Trainer: micro-batches through real stage servers in this process (no sockets).

An in-memory swarm hands each request to the addressed server's handler, encoding and
decoding payloads as the endpoint does, and can inject faults (an error answer, a lost
connection) per server. Checks: hop and token accounting, re-routing around a busy or dead
server with bans, resending the input after a cache miss, a micro-batch that fails on every
attempt fails alone, and the validation loss through the swarm equals the full model's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any, Self

import pytest
import torch
from wanswarm.node.config.runspec import BatchSpec, CodecsSpec, ModelSpec, RunSpec, StagesSpec
from wanswarm.node.membership.peers import PeerTable
from wanswarm.node.membership.records import QuicAddress, ServerRecord
from wanswarm.node.stage.averaging import LocalOptimizer
from wanswarm.node.stage.server import StageServer, StageServerConfig
from wanswarm.node.training.model import build_full_model
from wanswarm.node.training.routing import RouterConfig
from wanswarm.node.training.trainer import ServerInfo, Trainer, TrainerConfig, servers_from_peers
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode
from wanswarm.transport.endpoint import Handler, PathStats, PeerAddress, Request, Response
from wanswarm.transport.errors import ConnectError, RemoteError, RequestTimeout
from wanswarm.transport.identity import Identity

TRAINER = "trainerA"


def _spec(codec: str = "int8") -> RunSpec:
    return RunSpec(
        name="trainertest",
        model=ModelSpec(d_model=16, n_heads=2, n_layers=3, seq_len=8),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=2, target_batch_size=4),
        codecs=CodecsSpec(forward_activations=codec, backward_gradients=codec),
    )


class Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None:
        self.handlers[kind] = handler


def _plain(tensors: Sequence[torch.Tensor | EncodedTensor], codec: CodecSpec | None) -> list[torch.Tensor]:
    """What the other side decodes: encoded tensors decoded, plain ones through ``codec``."""
    out = []
    for t in tensors:
        if isinstance(t, EncodedTensor):
            out.append(decode(t))
        elif codec is not None and codec.name != "none":
            out.append(decode(encode(t, codec)))
        else:
            out.append(t.clone())
    return out


class InMemorySwarm:
    """The trainer's RequestSender, delivering to StageServer handlers in this process."""

    peer_id = TRAINER

    def __init__(self) -> None:
        self.registries: dict[str, Registry] = {}
        self.faults: dict[str, list[Exception]] = {}  # per server: raised by its next requests
        self.dead: set[str] = set()
        self.sent: list[tuple[str, str]] = []  # (peer, kind) of every request

    async def request(
        self,
        peer: PeerAddress,
        kind: str,
        header: dict[str, Any],
        tensors: Sequence[torch.Tensor | EncodedTensor] = (),
        *,
        codec: CodecSpec | None = None,
        timeout: float,
        allow_nonfinite: bool = False,
    ) -> Response:
        self.sent.append((peer.peer_id, kind))
        if peer.peer_id in self.dead:
            raise ConnectError(f"{peer.peer_id} is unreachable")
        pending = self.faults.get(peer.peer_id)
        if pending:
            raise pending.pop(0)
        handler = self.registries[peer.peer_id].handlers[kind]
        try:
            async with asyncio.timeout(timeout):
                reply = await handler(Request(self.peer_id, kind, dict(header), _plain(tensors, codec)))
        except TimeoutError:
            raise RequestTimeout(f"{kind} to {peer.peer_id}") from None
        return Response(header=dict(reply.header), tensors=list(_plain(reply.tensors, reply.codec)))

    def path_stats(self, peer_id: str) -> PathStats | None:
        return None


class Swarm:
    """Servers per stage behind an InMemorySwarm, and the view the trainer reads."""

    def __init__(self, spec: RunSpec, replicas: Sequence[int], config: StageServerConfig | None = None, **kw: Any) -> None:
        self.spec = spec
        self.net = InMemorySwarm()
        cfg = config or StageServerConfig(device="cpu", benchmark_iterations=1)
        self.servers: dict[str, StageServer] = {}
        for stage, count in enumerate(replicas):
            for r in range(count):
                name = f"s{stage}r{r}"
                reg = Registry()
                self.net.registries[name] = reg
                self.servers[name] = StageServer(
                    spec, stage, cfg, endpoint=reg, make_optimizer=lambda m: LocalOptimizer(m, spec), **kw
                )

    def view(self) -> dict[int, list[ServerInfo]]:
        out: dict[int, list[ServerInfo]] = {}
        for name, server in self.servers.items():
            out.setdefault(server.stage, []).append(
                ServerInfo(name, "127.0.0.1", 1, throughput=100.0, queue_len=0, state=server.state, rtt=0.01)
            )
        return out

    def trainer(self, config: TrainerConfig | None = None, seed: int = 0) -> Trainer:
        gen = torch.Generator().manual_seed(seed)

        def data() -> Any:
            B, T = self.spec.batch.micro_batch_size, self.spec.model.seq_len
            while True:
                window = torch.randint(0, 256, (B, T + 1), generator=gen)
                yield window[:, :-1].contiguous(), window[:, 1:].contiguous()

        return Trainer(
            self.spec, config or TrainerConfig(max_in_flight=2, request_timeout_s=30.0),
            endpoint=self.net, servers=self.view, rng=random.Random(seed), data=data(),
        )

    async def __aenter__(self) -> Self:
        for server in self.servers.values():
            await server.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers.values():
            await server.close()


def test_micro_batches_walk_every_stage_forward_and_back() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])
    n = 5

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer()
            await trainer.run(max_micro_batches=n)
            return trainer

    trainer = asyncio.run(main())
    c = trainer.counters
    assert (c.started, c.completed, c.failed, c.retried_hops) == (n, n, 0, 0)
    assert dict(c.hops) == {0: 2 * n, 1: 2 * n, 2: n}
    assert c.tokens == n * 2 * 8
    assert c.loss_ewma is not None and 5.0 < c.loss_ewma < 6.0  # about ln(256) at init
    kinds = [k for _, k in swarm.net.sent]
    assert kinds.count("forward") == 2 * n and kinds.count("forward_loss") == n and kinds.count("backward") == 2 * n
    for server in swarm.servers.values():
        assert server.counters.applied == n and server.counters.cache_misses == 0
    # by reference: stage inputs travelled once (forward), not again with the backward
    assert swarm.servers["s1r0"].counters.backward == n
    assert c.payload_bytes_sent > 0 and c.payload_bytes_received > 0
    status = trainer.status()
    assert status["micro_batches"]["completed"] == n and status["hops"] == {"0": 2 * n, "1": 2 * n, "2": n}


def test_busy_and_dead_servers_are_banned_and_routed_around() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 3, 1])
    swarm.net.faults["s1r0"] = [RemoteError("busy", "queue full")]
    swarm.net.dead.add("s1r1")
    config = TrainerConfig(max_in_flight=1, request_timeout_s=30.0, router=RouterConfig(ban_base_s=600.0, ban_max_s=600.0))

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer(config)
            await trainer.run(max_micro_batches=6)
            return trainer

    trainer = asyncio.run(main())
    c = trainer.counters
    assert (c.completed, c.failed) == (6, 0)
    to_busy = [k for p, k in swarm.net.sent if p == "s1r0"]
    to_dead = [k for p, k in swarm.net.sent if p == "s1r1"]
    # with this seed both get picked once; one failure bans a server for the rest of the
    # run, so neither the dead one nor the (once) busy one is asked again
    assert len(to_dead) == 1 and len(to_busy) == 1
    assert c.errors["ConnectError"] == 1 and c.errors["busy"] == 1
    assert c.retried_hops == 2
    assert trainer.router.failures("s1r0") == trainer.router.failures("s1r1") == 1
    applied = sum(swarm.servers[f"s1r{r}"].counters.applied for r in range(3))
    assert applied == 6  # every micro-batch applied once at stage 1, wherever it went


def test_a_cache_miss_makes_the_trainer_resend_the_input() -> None:
    spec = _spec()

    class Leaping:
        """A clock that jumps 100 s per reading: every cached input has expired by its backward."""

        def __init__(self) -> None:
            self.t = 0.0

        def __call__(self) -> float:
            self.t += 100.0
            return self.t

    config = StageServerConfig(device="cpu", benchmark_iterations=1, cache_ttl_s=50.0)
    swarm = Swarm(spec, [1, 1, 1], config=config, clock=Leaping())
    trainer_cfg = TrainerConfig(max_in_flight=1, request_timeout_s=3000.0)

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer(trainer_cfg)
            await trainer.run(max_micro_batches=3)
            return trainer

    trainer = asyncio.run(main())
    c = trainer.counters
    assert (c.completed, c.failed) == (3, 0)
    assert c.cache_misses == c.errors["cache_miss"] == 6  # stages 0 and 1, each micro-batch
    for name in ("s0r0", "s1r0"):
        server = swarm.servers[name]
        assert server.counters.cache_misses == 3 and server.counters.applied == 3


def test_a_hop_failing_everywhere_fails_only_its_micro_batch() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])
    swarm.net.dead.add("s2r0")
    config = TrainerConfig(max_in_flight=2, request_timeout_s=30.0, max_attempts=2)

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer(config)
            await trainer.run(max_micro_batches=3)  # returns: failures are counted, not raised
            return trainer

    trainer = asyncio.run(main())
    c = trainer.counters
    assert (c.started, c.completed, c.failed) == (3, 0, 3)
    assert sum(s.counters.applied for s in swarm.servers.values()) == 0


def test_validation_loss_through_the_swarm_equals_the_full_model() -> None:
    spec = _spec("none")
    swarm = Swarm(spec, [1, 2, 1])
    gen = torch.Generator().manual_seed(11)
    windows = torch.randint(0, 256, (5, spec.model.seq_len + 1), generator=gen)  # 5: a short last chunk
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    async def main() -> float:
        async with swarm:
            return await swarm.trainer().evaluate((inputs, targets))

    loss = asyncio.run(main())
    full = build_full_model(spec)
    with torch.no_grad():
        expected = float(full.forward_loss(inputs, targets))
    assert loss == pytest.approx(expected, rel=1e-5)
    for server in swarm.servers.values():
        assert server.counters.applied == 0 and len(server.applied_keys()) == 0


def test_servers_from_the_peer_table() -> None:
    ids = [Identity.generate().peer_id for _ in range(3)]
    table = PeerTable(own_peer_id="me", rtt_window=60.0)
    records = {
        ids[0]: ServerRecord(peer_id=ids[0], state="online", stage=1, throughput=12.5, queue=3,
                             quic=QuicAddress(host="10.0.0.1", port=4000)),
        ids[1]: ServerRecord(peer_id=ids[1], state="joining", stage=0, quic=QuicAddress(host="10.0.0.2", port=4001)),
        ids[2]: ServerRecord(peer_id=ids[2], state="online", stage=None, server=False),
    }
    table.apply({k: (r, 1e12) for k, r in records.items()}, {}, now=0.0, wall_now=0.0)
    table.on_rtt_sample(ids[0], 0.05, now=1.0)
    view = servers_from_peers(table)
    assert set(view) == {0, 1}
    assert view[1] == [ServerInfo(ids[0], "10.0.0.1", 4000, 12.5, 3, "online", 0.05)]
    assert view[0][0].state == "joining" and view[0][0].rtt is None
