"""The training components of a daemon: the QUIC endpoint, a stage server, a trainer.

``wanswarm join`` builds them with :func:`build_components` and hands them to the daemon, which
starts them in order after the DHT join (component.py)::

    EndpointComponent   binds QUIC (transport.host/port), announces its address and the run
                        id, refuses to join a run whose peers hold another spec, answers
                        ``run_spec`` requests; the prober's RTT source (QUIC PING) and the
                        traffic counters
    ServerComponent     claims a stage: node.stage when pinned, else the stage it held before a
                        restart (<state_dir>/stage.json, same run id), else, after a random
                        back-off and a fresh read of the records, the stage with the least
                        total throughput (stage_selection.choose_stage); builds the StageServer
                        and its collaborative optimizer (on the main thread, which runs the
                        daemon's loop), loads the stage's state, serves; every
                        rebalance.period_s (jittered) moves to another stage when the swarm's
                        rebalance plan names it (docs/stage_selection.md)
    TrainerComponent    drives micro-batches through every stage (our own server included:
                        the peer table lists only the others)

Run-spec consistency: every server record carries the spec's ``run_id``. A joining node that
sees a peer of the same run name with another ``run_id`` asks that peer for its spec
(``run_spec`` request over QUIC) and exits 1 with the differing fields (runspec.describe_mismatch).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from ..transport.endpoint import Endpoint, PeerAddress, Request, Response
from ..transport.errors import TransportError
from .component import Component, ComponentContext
from .config.node_config import NodeConfig
from .config.runspec import (
    RunSpec,
    RunSpecError,
    default_run_spec,
    describe_mismatch,
    load_run_spec,
)
from .errors import DhtError, JoinError, ProbeError, RecordError
from .logs import get_logger
from .membership.records import QuicAddress
from .membership.records import ServerState as ServerRecordState
from .stage.averaging import CollaborativeOptimizer
from .stage.selection import (
    MAX_STAGE_CLAIM_BYTES,
    Move,
    RebalancePlan,
    choose_stage,
    encode_stage_claim,
    join_backoff,
    next_rebalance_delay,
    plan_move,
    plan_rebalance,
    resume_stage,
)
from .stage.selection import ServerInfo as SelectionInfo
from .stage.selection import ServerState as SelectionState
from .stage.server import StageServer
from .training.trainer import ServerInfo, Trainer, servers_from_peers

log = get_logger(__name__)

RUN_SPEC_KIND = "run_spec"
# the stage this server last claimed in its run, so that a restart claims it again
STAGE_CLAIM_FILE = "stage.json"
# Throughput announced between claiming a stage and measuring it, so that servers choosing
# meanwhile count this one (stage_selection ignores servers announcing 0).
_PLACEHOLDER_THROUGHPUT = 1.0


def read_stage_claim(state_dir: Path) -> bytes | None:
    """The stored stage claim's bytes (``<state_dir>/stage.json``), None when absent or unreadable."""
    try:
        with open(state_dir / STAGE_CLAIM_FILE, "rb") as f:
            return f.read(MAX_STAGE_CLAIM_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s; choosing a stage anew", state_dir / STAGE_CLAIM_FILE, exc)
        return None


def write_stage_claim(state_dir: Path, run_id: str, stage: int) -> None:
    """Store the claim atomically (a temporary file, fsync, rename): a crash leaves the old
    claim or the new one. A failed write is logged, not fatal (a restart then chooses anew)."""
    path = state_dir / STAGE_CLAIM_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(encode_stage_claim(run_id, stage))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot remember stage %d in %s: %s", stage, path, exc)
        tmp.unlink(missing_ok=True)


def run_spec_of(config: NodeConfig) -> RunSpec:
    """The run spec the config names (node.run_spec), or the embedded default."""
    if config.node.run_spec is None:
        return default_run_spec()
    try:
        return load_run_spec(config.node.run_spec)
    except (OSError, RunSpecError) as exc:
        raise JoinError(f"node.run_spec: {exc}") from None


class EndpointComponent:
    """The node's QUIC endpoint as a daemon component (see the module docstring)."""

    name = "endpoint"

    def __init__(self, config: NodeConfig, spec: RunSpec) -> None:
        self.config = config
        self.spec = spec
        self.endpoint: Endpoint | None = None
        self.announced: QuicAddress | None = None
        self._peers: Any = None

    async def start(self, ctx: ComponentContext) -> None:
        endpoint = Endpoint(ctx.identity, self.config.transport)
        endpoint.register(RUN_SPEC_KIND, self._on_run_spec)
        await endpoint.start(self.config.transport.host, self.config.transport.port)
        self.endpoint = endpoint
        self._peers = ctx.peers
        host, port = endpoint.address
        node = self.config.node
        if node.announce_host:
            host = node.announce_host
        elif host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        self.announced = QuicAddress(host=host, port=node.announce_port or port)
        log.info("QUIC on %s:%d, announced as %s:%d", *endpoint.address, self.announced.host, self.announced.port)
        await self._check_run_spec(ctx)
        ctx.membership.update(quic=self.announced, run_id=self.spec.run_id)

    async def _on_run_spec(self, request: Request) -> Response:
        return Response({"spec": json.loads(self.spec.canonical_json())["spec"]})

    async def _check_run_spec(self, ctx: ComponentContext) -> None:
        """JoinError when a peer of this run announces another run_id (naming the differences)."""
        for peer in ctx.peers.peers():
            record = peer.record
            if not record.run_id or record.run_id == self.spec.run_id:
                continue
            detail = f"peer {record.peer_id} runs spec {record.run_id}, ours is {self.spec.run_id}"
            if record.quic is not None and self.endpoint is not None:
                try:
                    reply = await self.endpoint.request(
                        PeerAddress(record.peer_id, record.quic.host, record.quic.port),
                        RUN_SPEC_KIND, {}, timeout=self.config.trainer.request_timeout_s,
                    )
                    theirs = RunSpec.model_validate(reply.header["spec"])
                    detail = describe_mismatch(self.spec, theirs)
                except (TransportError, KeyError, ValueError) as exc:
                    detail += f" (its spec could not be fetched: {exc})"
            raise JoinError(
                f"refusing to join run {ctx.run!r}: {detail}. Use the same run spec as the swarm "
                f"(node.run_spec) or another run name (node.run)"
            )

    async def ping(self, peer_id: str, timeout: float) -> float:
        """RttSource: a QUIC PING to the peer's announced address."""
        if self.endpoint is None or self._peers is None:
            raise ProbeError("QUIC endpoint not started")
        peer = self._peers.get(peer_id) if hasattr(self._peers, "get") else None
        record = None if peer is None else peer.record
        if record is None or record.quic is None:
            raise ProbeError(f"no QUIC address known for {peer_id}")
        try:
            return await self.endpoint.ping(PeerAddress(peer_id, record.quic.host, record.quic.port), timeout=timeout)
        except TransportError as exc:
            raise ProbeError(str(exc)) from None

    def traffic(self) -> tuple[int, int]:
        if self.endpoint is None:
            return 0, 0
        totals = self.endpoint.totals()
        return totals["bytes_in"], totals["bytes_out"]

    async def drain(self, deadline: float) -> None:
        pass  # the server and the trainer finish their work; requests keep flowing until close

    async def close(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    def status(self) -> dict[str, Any]:
        if self.endpoint is None:
            return {}
        totals = self.endpoint.totals()
        return {
            "address": f"{self.announced.host}:{self.announced.port}" if self.announced else None,
            "run_id": self.spec.run_id,
            "bytes_in": totals["bytes_in"],
            "bytes_out": totals["bytes_out"],
            "requests_sent": totals["requests_sent"],
            "requests_served": totals["requests_served"],
        }


class ServerComponent:
    """Claims a stage, serves it, and moves when the swarm's rebalance plan names it.

    A move (``_move``): announce ``draining``, drain the old stage's server (at most
    ``rebalance.drain_timeout_s``), close it (it leaves that stage's collaboration), remember
    and announce the new stage as ``joining`` (with the throughput the plan counted for us),
    build the new stage's server, which loads the stage's state from its peers and
    benchmarks, then announce ``online``. A leave during a move cancels the move's remaining
    steps and closes whichever server is held; the daemon's own ``draining`` is never
    overwritten. The trainer sees no server of ours (``own_info`` is None) until the new one
    is online.
    """

    name = "stage_server"

    def __init__(self, config: NodeConfig, spec: RunSpec, endpoint: EndpointComponent, rng: random.Random) -> None:
        self.config = config
        self.spec = spec
        self.endpoint = endpoint
        self.rng = rng
        self.server: StageServer | None = None
        self.moves = 0
        self.last_move: dict[str, Any] | None = None
        self.checks = 0
        self._target: int | None = None  # the stage claimed (the one being loaded during a move)
        self._leaving = False
        self._moving = False
        self._rebalancer: asyncio.Task[None] | None = None
        self._retiring: asyncio.Task[None] | None = None  # the old server's close, during a move

    async def start(self, ctx: ComponentContext) -> None:
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"
        stage = await self._claim(ctx)
        self._remember(ctx, stage)
        ctx.membership.update(stage=stage, throughput=_PLACEHOLDER_THROUGHPUT, queue=0)
        await ctx.membership.announce()
        await self._serve(ctx, stage)
        if self._rebalances():
            self._rebalancer = ctx.spawn(self._rebalance_loop(ctx), "rebalance")

    async def _serve(self, ctx: ComponentContext, stage: int) -> None:
        """Build the stage's server and start it: load its state from peers, benchmark, serve."""
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"
        dht = ctx.dht.hivemind_dht
        averaging = self.config.averaging
        # hivemind's Optimizer installs signal handlers: this runs on the main thread (the loop's).
        # Registering the request kinds on the endpoint replaces a previous server's handlers.
        self.server = StageServer(
            self.spec, stage, self.config.stage_server,
            endpoint=self.endpoint.endpoint,
            make_optimizer=lambda module: CollaborativeOptimizer(module, self.spec, stage, dht, averaging),
            state_dir=Path(ctx.state_dir),
            donors=lambda: self._replicas(ctx, stage),
        )
        await self.server.start(ctx)

    def _replicas(self, ctx: ComponentContext, stage: int) -> list[PeerAddress]:
        """The online servers of ``stage`` in this run (state donors for a server opening there)."""
        out = []
        for peer in ctx.peers.peers():
            r = peer.record
            if r.server and r.stage == stage and r.state == "online" and r.quic is not None \
                    and r.run_id == self.spec.run_id:
                out.append(PeerAddress(r.peer_id, r.quic.host, r.quic.port))
        return out

    async def _claim(self, ctx: ComponentContext) -> int:
        """The stage to serve: ``node.stage`` when set, else the stage this server held in this run
        before a restart (``stage.json``), else the least-served after a back-off."""
        n_stages = self.spec.n_stages
        pinned = self.config.node.stage
        if pinned is not None:
            if pinned >= n_stages:
                raise JoinError(f"node.stage: run {self.spec.name!r} has {n_stages} stages (0..{n_stages - 1}), got {pinned}")
            log.info("serving stage %d of %d (node.stage)", pinned, n_stages)
            return pinned
        resumed = resume_stage(read_stage_claim(Path(ctx.state_dir)), self.spec.run_id, n_stages)
        if resumed is not None:
            log.info("serving stage %d of %d again (held before the restart, %s)", resumed, n_stages, STAGE_CLAIM_FILE)
            return resumed
        delay = join_backoff(self.rng, self.config.node.join_backoff)
        log.info("choosing a stage in %.1fs", delay)
        await asyncio.sleep(delay)  # a deliberate spread of simultaneous joins, not a synchronisation
        try:
            await ctx.membership.refresh()
        except Exception as exc:  # a failed read leaves the table as it was: choose from it
            log.warning("could not re-read the records before choosing a stage: %s", exc)
        stage = choose_stage(self._selection_view(ctx), n_stages, _PLACEHOLDER_THROUGHPUT, self.rng)
        log.info("claiming stage %d of %d", stage, n_stages)
        return stage

    def _remember(self, ctx: ComponentContext, stage: int) -> None:
        self._target = stage
        write_stage_claim(Path(ctx.state_dir), self.spec.run_id, stage)

    def _selection_view(self, ctx: ComponentContext) -> list[SelectionInfo]:
        out = []
        for peer in ctx.peers.peers():
            record = peer.record
            if not record.server or record.stage is None or record.state not in ("joining", "online"):
                continue
            out.append(SelectionInfo(record.peer_id, record.stage, record.throughput, SelectionState(record.state)))
        return out

    # ---- rebalancing ----------------------------------------------------------------

    def _rebalances(self) -> bool:
        cfg = self.config.rebalance
        return cfg.enabled and (self.config.node.stage is None or cfg.move_pinned)

    async def _rebalance_loop(self, ctx: ComponentContext) -> None:
        """Every ``rebalance.period_s`` (jittered): compute the plan, make our move if it names us."""
        policy = self.config.rebalance
        while not self._leaving:
            await asyncio.sleep(next_rebalance_delay(self.rng, policy))  # the check's period, jittered
            decision = self._decide(ctx)
            if decision is not None:
                await self._move(ctx, *decision)

    def _decide(self, ctx: ComponentContext) -> tuple[Move, RebalancePlan] | None:
        """Our move in the plan computed from the records and our own measured throughput."""
        server = self.server
        if self._leaving or server is None or server.state != "online" or ctx.membership.state != "online":
            return None  # only a serving node moves: never while joining, moving or leaving
        self.checks += 1
        me = ctx.identity.peer_id
        view = [s for s in self._selection_view(ctx) if s.peer_id != me]
        view.append(SelectionInfo(me, server.stage, server.throughput, SelectionState.ONLINE))
        plan = plan_rebalance(view, self.spec.n_stages, self.config.rebalance)
        move = plan_move(plan, me)
        if plan.moves and move is None:
            log.debug("rebalance plan moves %d other server(s): bottleneck %.2f -> %.2f",
                      len(plan.moves), plan.bottleneck_before, plan.bottleneck_after)
        return None if move is None else (move, plan)

    async def _move(self, ctx: ComponentContext, move: Move, plan: RebalancePlan) -> None:
        old = self.server
        assert old is not None and old.stage == move.from_stage
        loop = asyncio.get_running_loop()
        began, began_unix = loop.time(), time.time()
        log.info(
            "moving from stage %d to stage %d: swarm bottleneck %.2f -> %.2f samples/s (%.2f over a "
            "period counting the load)", move.from_stage, move.to_stage,
            plan.bottleneck_before, plan.bottleneck_after, plan.bottleneck_amortized,
        )
        self._moving = True
        try:
            if not await self._announce_state(ctx, "online", "draining"):
                return
            await old.drain(loop.time() + self.config.rebalance.drain_timeout_s)
            drained = loop.time()
            # the old server leaves its collaboration; shielded so that a leave arriving now
            # lets the close finish (close() awaits the same task)
            self.server = None
            self._retiring = asyncio.ensure_future(old.close())
            await asyncio.shield(self._retiring)
            self._retiring = None
            self._remember(ctx, move.to_stage)
            # until measured at the new stage, announce what the plan counted for us there
            ctx.membership.update(stage=move.to_stage, throughput=move.throughput, queue=0)
            if not await self._announce_state(ctx, "draining", "joining"):
                return
            closed = loop.time()
            await self._serve(ctx, move.to_stage)
            if not await self._announce_state(ctx, "joining", "online"):
                return
            online = loop.time()
        finally:
            self._moving = False
        self.moves += 1
        self.last_move = {
            "from": move.from_stage,
            "to": move.to_stage,
            "at_unix": round(began_unix, 3),
            "throughput": round(move.throughput, 3),
            "bottleneck_before": round(plan.bottleneck_before, 3),
            "bottleneck_after": round(plan.bottleneck_after, 3),
            "bottleneck_amortized": round(plan.bottleneck_amortized, 3),
            "drain_s": round(drained - began, 3),
            "close_s": round(closed - drained, 3),
            "load_s": round(online - closed, 3),
            "total_s": round(online - began, 3),
        }
        log.info("moved to stage %d in %.1fs (drain %.1fs, close %.1fs, load %.1fs)", move.to_stage,
                 online - began, drained - began, closed - drained, online - closed)

    async def _announce_state(self, ctx: ComponentContext, expected: str, state: ServerRecordState) -> bool:
        """Set our announced state and publish it, unless the node left ``expected`` meanwhile
        (the daemon announced ``draining`` for a leave): then the move stops here (False)."""
        if self._leaving or ctx.membership.state != expected:
            log.info("stage move stopped before announcing %s: the node is leaving", state)
            return False
        ctx.membership.set_state(state)
        try:
            await ctx.membership.announce()
        except (DhtError, RecordError) as exc:  # the announce loop retries on its own period
            log.warning("announcing %s failed: %s", state, exc)
        return True

    # ---- component seam -------------------------------------------------------------

    def own_info(self) -> ServerInfo | None:
        """Our server as the trainer sees a server (the peer table lists only the others);
        None while we serve no stage (starting, or between stages during a move)."""
        server, address = self.server, self.endpoint.announced
        if server is None or address is None or server.state != "online":
            return None
        return ServerInfo(
            peer_id=self.endpoint.endpoint.peer_id if self.endpoint.endpoint else "",
            host=address.host, port=address.port,
            throughput=server.throughput, queue_len=server.queue_len, state=server.state, rtt=0.0,
        )

    async def drain(self, deadline: float) -> None:
        self._leaving = True
        task = self._rebalancer
        if task is not None and not task.done():
            task.cancel()  # a move in progress stops at its next step; what it holds is closed below
            await asyncio.wait({task}, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        server = self.server
        if server is not None and server.state != "joining":  # a joining server has served nothing
            await server.drain(deadline)

    async def close(self) -> None:
        if self._retiring is not None:
            await self._retiring
        if self.server is not None:
            await self.server.close()

    def status(self) -> dict[str, Any]:
        if self.server is not None:
            out = self.server.status()
        else:  # between stages (or not started): the fields readers of a server's status expect
            out = {"stage": self._target, "state": "joining", "queue": 0, "throughput": 0.0}
        out.update(
            moves=self.moves,
            last_move=self.last_move,
            rebalance={"enabled": self._rebalances(), "checks": self.checks, "moving": self._moving},
        )
        return out


class TrainerComponent:
    """The trainer over the node's endpoint; sees the peers' servers and our own."""

    name = "trainer"

    def __init__(
        self, config: NodeConfig, spec: RunSpec, endpoint: EndpointComponent,
        server: ServerComponent | None, rng: random.Random,
    ) -> None:
        self.config = config
        self.spec = spec
        self.endpoint = endpoint
        self.server = server
        self.rng = rng
        self.trainer: Trainer | None = None
        self._ratios: dict[str, float] = {}

    async def start(self, ctx: ComponentContext) -> None:
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"

        def servers() -> dict[int, list[ServerInfo]]:
            view = servers_from_peers(ctx.peers)
            own = None if self.server is None else self.server.own_info()
            if own is not None and self.server is not None and self.server.server is not None:
                view.setdefault(self.server.server.stage, []).append(own)
            return view

        self.trainer = Trainer(self.spec, self.config.trainer, endpoint=self.endpoint.endpoint, servers=servers, rng=self.rng)
        self._ratios = await asyncio.to_thread(codec_ratios, self.spec)
        await self.trainer.start(ctx)

    async def drain(self, deadline: float) -> None:
        if self.trainer is not None:
            await self.trainer.drain(deadline)

    async def close(self) -> None:
        if self.trainer is not None:
            await self.trainer.close()

    def status(self) -> dict[str, Any]:
        if self.trainer is None:
            return {}
        return {**self.trainer.status(), "wire_compression": self._ratios}


def codec_ratios(spec: RunSpec) -> dict[str, float]:
    """float32 bytes / encoded bytes of one micro-batch's activation under the run's codecs."""
    import torch

    from ..transport.codecs import encode, parse_codec

    x = torch.randn(spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model)  # (B, T, C)
    raw = x.numel() * x.element_size()
    return {
        "forward": round(raw / len(encode(x, parse_codec(spec.codecs.forward_activations)).payload), 2),
        "backward": round(raw / len(encode(x, parse_codec(spec.codecs.backward_gradients)).payload), 2),
    }


def build_components(config: NodeConfig) -> list[Component]:
    """The endpoint, then the stage server and the trainer as node.server / node.trainer say."""
    spec = run_spec_of(config)
    rng = random.Random()
    endpoint = EndpointComponent(config, spec)
    out: list[Component] = [endpoint]
    server = None
    if config.node.server:
        server = ServerComponent(config, spec, endpoint, rng)
        out.append(server)
    if config.node.trainer:
        out.append(TrainerComponent(config, spec, endpoint, server, rng))
    return out


__all__ = [
    "RUN_SPEC_KIND",
    "STAGE_CLAIM_FILE",
    "EndpointComponent",
    "ServerComponent",
    "TrainerComponent",
    "build_components",
    "read_stage_claim",
    "run_spec_of",
    "write_stage_claim",
]
