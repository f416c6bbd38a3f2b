"""The training components of a daemon, wired together: the QUIC endpoint, a stage server,
a trainer.

``wanswarm join`` builds them with :func:`build_components` and hands them to the daemon, which
starts them in order after the DHT join (component.py)::

    EndpointComponent   (endpoint.py) binds QUIC, announces its address and the run id,
                        refuses to join a run whose peers hold another spec; the prober's
                        RTT source and the traffic counters
    ServerComponent     (stage/placement.py) claims a stage, serves it, moves when the
                        swarm's rebalance plan names it
    TrainerComponent    drives micro-batches through every stage: the peer table's servers
                        and our own (the peer table lists only the others)

Each component receives its own config section and the few node-level values it needs.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from ..transport.errors import TransportError
from .component import Component, ComponentContext
from .config.node_config import NodeConfig
from .config.runspec import RunSpec, RunSpecError, default_run_spec, load_run_spec
from .endpoint import EndpointComponent
from .errors import JoinError, NodeError
from .logs import get_logger
from .stage.placement import ServerComponent
from .training.datasets import DataError, check_fingerprint
from .training.servers import ServerInfo, servers_from_peers
from .training.tokenizer import TokenizerError, load_tokenizer
from .training.trainer import Trainer
from .training.trainer_config import TrainerConfig

log = get_logger(__name__)


def run_spec_of(config: NodeConfig) -> RunSpec:
    """The run spec the config names (node.run_spec), or the embedded default."""
    if config.node.run_spec is None:
        return default_run_spec()
    try:
        return load_run_spec(config.node.run_spec)
    except (OSError, RunSpecError) as exc:
        raise JoinError(f"node.run_spec: {exc}") from None


def own_server_info(
    endpoint: EndpointComponent, server: ServerComponent | None
) -> tuple[int, ServerInfo] | None:
    """Our stage server as the trainer sees a server, with its stage; None while we serve no
    stage (no server role, starting, or between stages during a move)."""
    serving = None if server is None else server.online_server()
    quic = endpoint.endpoint
    if serving is None or quic is None:
        return None
    # our own server at the bound address: a NAT rarely lets a host reach its own public one
    host, port = quic.address
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return serving.stage, ServerInfo(
        peer_id=quic.peer_id, host=host, port=port,
        throughput=serving.throughput, queue_len=serving.queue_len, state=serving.state,
        rtt=0.0,
    )


def check_local_data(spec: RunSpec) -> None:
    """JoinError naming the difference when this node's data or tokenizer is not the run's
    (the run spec pins both by content: data.fingerprint, data.tokenizer_sha256). A trainer
    on other data would train the run's model on something else without anyone noticing."""
    try:
        check_fingerprint(spec.data)
        load_tokenizer(spec)
    except (DataError, TokenizerError) as exc:
        raise JoinError(f"this node's data is not the run's: {exc}") from None


class TrainerComponent:
    """The trainer over the node's endpoint; sees the peers' servers and our own."""

    name = "trainer"

    def __init__(
        self,
        config: TrainerConfig,
        spec: RunSpec,
        endpoint: EndpointComponent,
        server: ServerComponent | None,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.spec = spec
        self.endpoint = endpoint
        self.server = server
        self.rng = rng
        self.trainer: Trainer | None = None
        self._ratios: dict[str, float] = {}
        self.val_loss_first: float | None = None  # the first validation loss measured
        self._paused = False
        self.evaluations = 0

    def pause(self) -> None:
        """``wanswarm pause``: the trainer starts no new micro-batch (in-flight ones finish)."""
        self._paused = True
        if self.trainer is not None:
            self.trainer.pause()

    def resume(self) -> None:
        self._paused = False
        if self.trainer is not None:
            self.trainer.resume()

    async def start(self, ctx: ComponentContext) -> None:
        assert self.endpoint.endpoint is not None, "the endpoint component starts first"
        await asyncio.to_thread(check_local_data, self.spec)

        def servers() -> dict[int, list[ServerInfo]]:
            view = servers_from_peers(ctx.peers, self.spec.run_id)
            own = own_server_info(self.endpoint, self.server)
            if own is not None:
                stage, info = own
                view.setdefault(stage, []).append(info)
            return view

        self.trainer = Trainer(
            self.spec, self.config, endpoint=self.endpoint.endpoint, servers=servers, rng=self.rng
        )
        if self._paused:  # paused while the node was starting
            self.trainer.pause()
        self._ratios = await asyncio.to_thread(codec_ratios, self.spec)
        await self.trainer.start(ctx)
        if self.config.eval_period_s > 0:
            ctx.spawn(self._validate(self.trainer), "validation")

    async def _validate(self, trainer: Trainer) -> None:
        """Validation loss every ``trainer.eval_period_s`` (the first once every stage has an
        online server); a failed measurement is logged and tried again next period."""
        from .training.data import validation_set

        inputs, targets = await asyncio.to_thread(validation_set, self.spec)
        n = min(self.config.eval_windows, int(inputs.shape[0]))
        windows = (inputs[:n], targets[:n])
        while trainer.view.missing_stages(self.spec.n_stages):
            await asyncio.sleep(self.config.no_server_wait_s)
        while True:
            try:
                loss = await trainer.evaluate(windows)
            except (NodeError, TransportError, ExceptionGroup) as exc:
                log.info("validation failed: %s", exc)
            else:
                if self.val_loss_first is None:
                    self.val_loss_first = loss
                self.evaluations += 1
                log.info("validation loss %.4f (%d windows)", loss, n)
            await asyncio.sleep(self.config.eval_period_s)

    async def drain(self, deadline: float) -> None:
        if self.trainer is not None:
            await self.trainer.drain(deadline)

    async def close(self) -> None:
        if self.trainer is not None:
            await self.trainer.close()

    def status(self) -> dict[str, Any]:
        if self.trainer is None:
            return {}
        return {
            **self.trainer.status(),
            "wire_compression": self._ratios,
            "val_loss_first": self.val_loss_first,
            "evaluations": self.evaluations,
        }


def codec_ratios(spec: RunSpec) -> dict[str, float]:
    """float32 bytes / encoded bytes of one micro-batch's activation under the run's codecs."""
    import torch

    from ..transport.codecs import encode, parse_codec

    model = spec.model
    x = torch.randn(spec.batch.micro_batch_size, model.seq_len, model.d_model)  # (B, T, C)
    raw = x.numel() * x.element_size()
    forward = encode(x, parse_codec(spec.codecs.forward_activations))
    backward = encode(x, parse_codec(spec.codecs.backward_gradients))
    return {
        "forward": round(raw / len(forward.payload), 2),
        "backward": round(raw / len(backward.payload), 2),
    }


def build_components(config: NodeConfig) -> list[Component]:
    """The endpoint, then the stage server and the trainer as node.server / node.trainer say."""
    spec = run_spec_of(config)
    rng = random.Random()
    node = config.node
    endpoint = EndpointComponent(
        config.transport, spec,
        announce_host=node.announce_host,
        announce_port=node.announce_port,
        request_timeout_s=config.trainer.request_timeout_s,
        reach_period_s=node.reach_period,
        reach_timeout_s=node.reach_timeout,
        rng=rng,
    )
    out: list[Component] = [endpoint]
    server = None
    if node.server:
        server = ServerComponent(
            spec, endpoint, rng,
            config=config.stage_server,
            averaging=config.averaging,
            rebalance=config.rebalance,
            pinned_stage=node.stage,
            join_backoff=node.join_backoff,
        )
        out.append(server)
    if node.trainer:
        out.append(TrainerComponent(config.trainer, spec, endpoint, server, rng))
    return out


__all__ = [
    "TrainerComponent",
    "build_components",
    "codec_ratios",
    "own_server_info",
    "run_spec_of",
]
