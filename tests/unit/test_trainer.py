"""Trainer: micro-batches through real stage servers in this process (no sockets).

An in-memory swarm hands each request to the addressed server's handler, encoding and
decoding payloads as the endpoint does (ReceivedTensors, lazy replies), and can inject
faults (an error answer, a lost connection) per server. Checks: hop and token accounting,
stage outputs relayed undecoded, re-routing around a busy or dead server with bans,
resending the input after a cache miss, a micro-batch that fails on every attempt fails
alone, a non-finite stage output refused on receipt (its sender banned, the hop redone,
nothing relayed), a reply in another codec
re-encoded (gradients through error feedback), and the validation loss through the swarm
equals the full model's.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Self

import pytest
import torch
from wanswarm.node.config.runspec import BatchSpec, CodecsSpec, ModelSpec, RunSpec, StagesSpec
from wanswarm.node.membership.peers import PeerTable
from wanswarm.node.membership.records import QuicAddress, ServerRecord
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.server import StageServer
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.training.model import build_full_model
from wanswarm.node.training.routing import RouterConfig
from wanswarm.node.training.servers import ServerInfo, servers_from_peers
from wanswarm.node.training.trainer import Trainer
from wanswarm.node.training.trainer_config import TrainerConfig
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, encode
from wanswarm.transport.endpoint import Handler, PathStats, PeerAddress, Request, Response
from wanswarm.transport.errors import ConnectError, ProtocolError, RemoteError, RequestTimeout
from wanswarm.transport.identity import Identity
from wanswarm.transport.tensors import ReceivedTensor, Sendable

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


def _encoded(tensors: Sequence[Sendable], codec: CodecSpec | None) -> list[EncodedTensor]:
    """What goes on the wire: plain tensors through ``codec``, the others as they are."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.append(encode(t, codec or CodecSpec("none")))
        else:
            out.append(t.encoded if isinstance(t, ReceivedTensor) else t)
    return out


def _received(
    tensors: Sequence[Sendable], codec: CodecSpec | None, sender: str
) -> list[ReceivedTensor]:
    """What the other side receives (ProtocolError for a payload refused on receipt)."""
    return [ReceivedTensor.of(e, sender=sender) for e in _encoded(tensors, codec)]


class InMemorySwarm:
    """The trainer's RequestSender, delivering to StageServer handlers in this process."""

    peer_id = TRAINER

    def __init__(self) -> None:
        self.registries: dict[str, Registry] = {}
        self.faults: dict[str, list[Exception]] = {}  # per server: raised by its next requests
        self.dead: set[str] = set()
        self.sent: list[tuple[str, str]] = []  # (peer, kind) of every request
        self.requests: list[tuple[str, str, list[Sendable]]] = []  # and its tensors
        self.tamper: dict[str, Callable[[Response], Response]] = {}  # per server: its replies

    async def request(
        self,
        peer: PeerAddress,
        kind: str,
        header: dict[str, Any],
        tensors: Sequence[Sendable] = (),
        *,
        codec: CodecSpec | None = None,
        timeout: float,
        allow_nonfinite: bool = False,
        lazy: bool = False,
    ) -> Response:
        self.sent.append((peer.peer_id, kind))
        self.requests.append((peer.peer_id, kind, list(tensors)))
        if peer.peer_id in self.dead:
            raise ConnectError(f"{peer.peer_id} is unreachable")
        pending = self.faults.get(peer.peer_id)
        if pending:
            raise pending.pop(0)
        handler = self.registries[peer.peer_id].handlers[kind]
        try:  # the server's endpoint decodes and checks every tensor before the handler runs
            plain = [t.tensor() for t in _received(tensors, codec, self.peer_id)]
        except ProtocolError as exc:
            raise RemoteError(exc.code, str(exc)) from None
        try:
            async with asyncio.timeout(timeout):
                reply = await handler(Request(self.peer_id, kind, dict(header), plain))
        except TimeoutError:
            raise RequestTimeout(f"{kind} to {peer.peer_id}") from None
        reply = self.tamper.get(peer.peer_id, lambda r: r)(reply)
        received = _received(reply.tensors, reply.codec, peer.peer_id)
        out: list[Sendable] = list(received) if lazy else [t.tensor() for t in received]
        return Response(header=dict(reply.header), tensors=out)

    def path_stats(self, peer_id: str) -> PathStats | None:
        return None


class Swarm:
    """Servers per stage behind an InMemorySwarm, and the view the trainer reads."""

    def __init__(
        self,
        spec: RunSpec,
        replicas: Sequence[int],
        config: StageServerConfig | None = None,
        **kw: Any,
    ) -> None:
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
                    spec,
                    stage,
                    cfg,
                    endpoint=reg,
                    make_optimizer=lambda m: LocalOptimizer(m, spec),
                    **kw,
                )

    def view(self) -> dict[int, list[ServerInfo]]:
        out: dict[int, list[ServerInfo]] = {}
        for name, server in self.servers.items():
            out.setdefault(server.stage, []).append(
                ServerInfo(
                    name,
                    "127.0.0.1",
                    1,
                    throughput=100.0,
                    queue_len=0,
                    state=server.state,
                    rtt=0.01,
                )
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
            spot_rng=random.Random(seed),  # which hops are spot-checked: reproducible here
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
    assert (
        kinds.count("forward") == 2 * n
        and kinds.count("forward_loss") == n
        and kinds.count("backward") == 2 * n
    )
    for server in swarm.servers.values():
        assert server.counters.applied == n and server.counters.cache_misses == 0
    # by reference: stage inputs travelled once (forward), not again with the backward
    assert swarm.servers["s1r0"].counters.backward == n
    assert c.payload_bytes_sent > 0 and c.payload_bytes_received > 0
    status = trainer.status()
    assert status["micro_batches"]["completed"] == n
    assert status["hops"] == {"0": 2 * n, "1": 2 * n, "2": n}


def test_stage_outputs_are_relayed_as_they_came() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])
    n = 3

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer()
            await trainer.run(max_micro_batches=n)
            return trainer

    trainer = asyncio.run(main())
    assert (trainer.counters.completed, trainer.counters.failed) == (n, 0)
    int8 = CodecSpec.from_wire("int8/b64/f32")
    # (server, kind) -> the stage whose output it gets: forward activations, backward dL/dy
    relayed = {("s1r0", "forward"): "s0r0", ("s2r0", "forward_loss"): "s1r0",
               ("s1r0", "backward"): "s2r0", ("s0r0", "backward"): "s1r0"}
    seen = 0
    for peer, kind, tensors in swarm.net.requests:
        sender = relayed.get((peer, kind))
        if sender is None:
            continue
        t = tensors[-1] if kind == "backward" else tensors[0]
        assert isinstance(t, ReceivedTensor) and t.sender == sender and t.codec == int8
        assert not t.is_decoded  # the trainer never dequantized it, nor quantized it again
        seen += 1
    assert seen == 4 * n
    assert len(trainer._ef) == 0  # the servers' own error feedback is the only one


def test_a_reply_in_another_codec_is_reencoded_gradients_through_error_feedback() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])

    def plain(reply: Response) -> Response:  # the same tensors, sent in codec none
        tensors = [ReceivedTensor.of(t).tensor() for t in _encoded(reply.tensors, reply.codec)]
        return Response(reply.header, list(tensors))

    swarm.net.tamper = {"s0r0": plain, "s2r0": plain}

    async def main() -> Trainer:
        async with swarm:
            trainer = swarm.trainer()
            await trainer.run(max_micro_batches=2)
            return trainer

    trainer = asyncio.run(main())
    assert (trainer.counters.completed, trainer.counters.failed) == (2, 0)
    int8 = CodecSpec.from_wire("int8/b64/f32")
    to_s1 = [ts for p, k, ts in swarm.net.requests if p == "s1r0" and k in ("forward", "backward")]
    assert len(to_s1) == 4
    for tensors in to_s1:  # re-encoded by the trainer in the run's codec
        assert isinstance(tensors[-1], EncodedTensor) and tensors[-1].spec == int8
    assert (1, "grad_output") in trainer._ef and (0, "grad_output") not in trainer._ef


def test_a_non_finite_output_is_refused_on_receipt_and_never_relayed() -> None:
    spec = _spec("none")  # a raw payload can carry NaN past the header checks
    swarm = Swarm(spec, [1, 1, 1])
    poisoned: list[Response] = []

    def poison_once(reply: Response) -> Response:
        if poisoned or not reply.tensors:
            return reply
        y = _encoded(reply.tensors, reply.codec)[0]
        poisoned.append(reply)
        return Response(reply.header, [encode(torch.full(y.shape, math.nan), CodecSpec("none"))])

    swarm.net.tamper = {"s0r0": poison_once}
    config = TrainerConfig(max_in_flight=1, request_timeout_s=30.0)

    async def main() -> tuple[Trainer, tuple[bool, bool]]:
        async with swarm:
            trainer = swarm.trainer(config)
            await trainer.run(max_micro_batches=1)
            # (its retry succeeded on s0r0, which reset its failure count, not its ban)
            bans = tuple(trainer.router.banned_until(p) is not None for p in ("s0r0", "s1r0"))
            await trainer.run(max_micro_batches=3)  # s0r0 answers honestly from now on
            return trainer, (bans[0], bans[1])

    trainer, (sender_banned, next_banned) = asyncio.run(main())
    c = trainer.counters
    # the trainer checks a stage output's values on receipt: the NaN is refused there, the
    # hop is redone (on s0r0 again, the only stage-0 server, honest by then)
    assert (c.completed, c.failed) == (3, 0)
    assert c.errors["BadValues"] == 1 and c.retried_hops == 1
    # the sender of the NaN was banned; the next stage never saw it
    assert (sender_banned, next_banned) == (True, False)
    s1 = swarm.servers["s1r0"].counters
    assert (s1.forward, s1.failed, s1.refused) == (3, 0, 0)


def test_busy_and_dead_servers_are_banned_and_routed_around() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 3, 1])
    swarm.net.faults["s1r0"] = [RemoteError("busy", "queue full")]
    swarm.net.dead.add("s1r1")
    config = TrainerConfig(
        max_in_flight=1,
        request_timeout_s=30.0,
        router=RouterConfig(ban_base_s=600.0, ban_max_s=600.0),
    )

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


def _backing_off(**overrides: Any) -> TrainerConfig:
    """One micro-batch at a time, a 0.05 s first back-off, bans too short to matter."""
    fields: dict[str, Any] = {
        "max_in_flight": 1,
        "request_timeout_s": 30.0,
        "retry_backoff_s": 0.05,
        "router": RouterConfig(ban_base_s=0.01, ban_max_s=0.01),
    }
    fields.update(overrides)
    return TrainerConfig(**fields)


def _timed_run(swarm: Swarm, config: TrainerConfig, micro_batches: int) -> tuple[Trainer, float]:
    """Train ``micro_batches`` through ``swarm``; the trainer and the seconds it took."""

    async def main() -> tuple[Trainer, float]:
        async with swarm:
            trainer = swarm.trainer(config)
            started = asyncio.get_running_loop().time()
            await trainer.run(max_micro_batches=micro_batches)
            return trainer, asyncio.get_running_loop().time() - started

    return asyncio.run(main())


def test_a_stage_whose_only_server_is_busy_is_asked_again_after_a_back_off() -> None:
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])
    # the only server of stage 1 is busy three times (a replica stalled in an averaging
    # round), then serves again
    swarm.net.faults["s1r0"] = [RemoteError("busy", "queue full")] * 3
    trainer, took = _timed_run(swarm, _backing_off(), micro_batches=1)
    c = trainer.counters
    assert (c.completed, c.failed) == (1, 0)  # the fourth attempt found it serving
    assert c.errors["busy"] == 3 and c.backoffs == 3
    # 0.05 + 0.1 + 0.2 s (each jittered by at most 20%): spread out, not spent at once
    assert took >= 0.8 * (0.05 + 0.1 + 0.2)


def test_a_stage_whose_only_server_cannot_be_reached_is_retried_after_back_offs() -> None:
    """A connection that fails at once (a peer behind NAT whose rendezvous link is gone)
    must not make the trainer spin: every retry of a hop whose stage has no other server
    waits, so a micro-batch costs its attempts spread over seconds, not microseconds."""
    spec = _spec()
    swarm = Swarm(spec, [1, 1, 1])
    swarm.net.dead.add("s0r0")
    trainer, took = _timed_run(swarm, _backing_off(max_attempts=4), micro_batches=2)
    c = trainer.counters
    assert (c.completed, c.failed) == (0, 2)
    assert c.errors["ConnectError"] == 8 and c.backoffs == 6  # the last attempt does not wait
    assert [k for p, k in swarm.net.sent if p != "s0r0"] == []
    # per micro-batch 0.05 + 0.1 + 0.2 s, each jittered by at most 20%
    assert took >= 2 * 0.8 * (0.05 + 0.1 + 0.2)


def test_a_config_that_names_the_old_busy_backoff_still_loads() -> None:
    assert TrainerConfig.model_validate({"busy_backoff_s": 0.5}).retry_backoff_s == 0.5
    with pytest.raises(ValueError, match="greater than 0"):
        TrainerConfig.model_validate({"busy_backoff_s": 0.0})


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
    # 5 windows: a short last chunk
    windows = torch.randint(0, 256, (5, spec.model.seq_len + 1), generator=gen)
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
        ids[0]: ServerRecord(
            peer_id=ids[0],
            state="online",
            stage=1,
            throughput=12.5,
            queue=3,
            quic=QuicAddress(host="10.0.0.1", port=4000),
        ),
        ids[1]: ServerRecord(
            peer_id=ids[1], state="joining", stage=0, quic=QuicAddress(host="10.0.0.2", port=4001)
        ),
        ids[2]: ServerRecord(peer_id=ids[2], state="online", stage=None, server=False),
    }
    table.apply({k: (r, 1e12) for k, r in records.items()}, {}, now=0.0, wall_now=0.0)
    table.on_rtt_sample(ids[0], 0.05, now=1.0)
    view = servers_from_peers(table)
    assert set(view) == {0, 1}
    assert view[1] == [
        ServerInfo(
            ids[0], "10.0.0.1", 4000, 12.5, 3, "online", 0.05,
            address=PeerAddress(ids[0], "10.0.0.1", 4000),
        )
    ]
    assert view[0][0].state == "joining" and view[0][0].rtt is None
