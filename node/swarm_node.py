"""The training components of a daemon: the QUIC endpoint, a stage server, a trainer.

``wanswarm join`` builds them with :func:`build_components` and hands them to the daemon, which
starts them in order after the DHT join (component.py)::

    EndpointComponent   binds QUIC (transport.host/port), announces its address and the run
                        id, refuses to join a run whose peers hold another spec, answers
                        ``run_spec`` requests; the prober's RTT source (QUIC PING) and the
                        traffic counters
    ServerComponent     waits a random back-off, re-reads the records, claims the stage with
                        the least total throughput (stage_selection.choose_stage), builds the
                        StageServer and its collaborative optimizer (on the main thread, which
                        runs the daemon's loop), loads the stage's state, serves
    TrainerComponent    drives micro-batches through every stage (our own server included:
                        the peer table lists only the others)

Run-spec consistency: every server record carries the spec's ``run_id``. A joining node that
sees a peer of the same run name with another ``run_id`` asks that peer for its spec
(``run_spec`` request over QUIC) and exits 1 with the differing fields (runspec.describe_mismatch).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

from ..transport.endpoint import Endpoint, PeerAddress, Request, Response
from ..transport.errors import TransportError
from .averaging import CollaborativeOptimizer
from .component import Component, ComponentContext
from .config import NodeConfig
from .errors import JoinError, ProbeError
from .logs import get_logger
from .records import QuicAddress
from .runspec import RunSpec, RunSpecError, default_run_spec, describe_mismatch, load_run_spec
from .stage_selection import ServerInfo as SelectionInfo
from .stage_selection import ServerState as SelectionState
from .stage_selection import choose_stage, join_backoff
from .stage_server import StageServer
from .trainer import ServerInfo, Trainer, servers_from_peers

log = get_logger(__name__)

RUN_SPEC_KIND = "run_spec"
# Throughput announced between claiming a stage and measuring it, so that servers choosing
# meanwhile count this one (stage_selection ignores servers announcing 0).
_PLACEHOLDER_THROUGHPUT = 1.0


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
    """Claims a stage and serves it (see the module docstring)."""

    name = "stage_server"

    def __init__(self, config: NodeConfig, spec: RunSpec, endpoint: EndpointComponent, rng: random.Random) -> None:
        self.config = config
        self.spec = spec
        self.endpoint = endpoint
        self.rng = rng
        self.server: StageServer | None = None

    async def start(self, ctx: ComponentContext) -> None:
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"
        stage = await self._claim(ctx)
        ctx.membership.update(stage=stage, throughput=_PLACEHOLDER_THROUGHPUT, queue=0)
        await ctx.membership.announce()
        dht = ctx.dht.hivemind_dht
        averaging = self.config.averaging
        # hivemind's Optimizer installs signal handlers: this runs on the main thread (the loop's)
        self.server = StageServer(
            self.spec, stage, self.config.stage_server,
            endpoint=self.endpoint.endpoint,
            make_optimizer=lambda module: CollaborativeOptimizer(module, self.spec, stage, dht, averaging),
            state_dir=Path(ctx.state_dir),
        )
        await self.server.start(ctx)

    async def _claim(self, ctx: ComponentContext) -> int:
        """The stage to serve: ``node.stage`` when set, else the least-served after a back-off."""
        pinned = self.config.node.stage
        if pinned is not None:
            if pinned >= self.spec.n_stages:
                raise JoinError(f"node.stage: run {self.spec.name!r} has {self.spec.n_stages} stages (0..{self.spec.n_stages - 1}), got {pinned}")
            log.info("serving stage %d of %d (node.stage)", pinned, self.spec.n_stages)
            return pinned
        delay = join_backoff(self.rng, self.config.node.join_backoff)
        log.info("choosing a stage in %.1fs", delay)
        await asyncio.sleep(delay)  # a deliberate spread of simultaneous joins, not a synchronisation
        try:
            await ctx.membership.refresh()
        except Exception as exc:  # a failed read leaves the table as it was: choose from it
            log.warning("could not re-read the records before choosing a stage: %s", exc)
        stage = choose_stage(self._selection_view(ctx), self.spec.n_stages, _PLACEHOLDER_THROUGHPUT, self.rng)
        log.info("claiming stage %d of %d", stage, self.spec.n_stages)
        return stage

    def _selection_view(self, ctx: ComponentContext) -> list[SelectionInfo]:
        out = []
        for peer in ctx.peers.peers():
            record = peer.record
            if not record.server or record.stage is None or record.state not in ("joining", "online"):
                continue
            out.append(SelectionInfo(record.peer_id, record.stage, record.throughput, SelectionState(record.state)))
        return out

    def own_info(self) -> ServerInfo | None:
        """Our server as the trainer sees a server (the peer table lists only the others)."""
        server, address = self.server, self.endpoint.announced
        if server is None or address is None:
            return None
        return ServerInfo(
            peer_id=self.endpoint.endpoint.peer_id if self.endpoint.endpoint else "",
            host=address.host, port=address.port,
            throughput=server.throughput, queue_len=server.queue_len, state=server.state, rtt=0.0,
        )

    async def drain(self, deadline: float) -> None:
        if self.server is not None:
            await self.server.drain(deadline)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    def status(self) -> dict[str, Any]:
        return {} if self.server is None else self.server.status()


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
    "EndpointComponent",
    "ServerComponent",
    "TrainerComponent",
    "build_components",
    "run_spec_of",
]
