"""The node's QUIC endpoint as a daemon component.

Binds QUIC (``transport.host``/``transport.port``), announces its address, reachability and
the run id in the node's record, and answers ``run_spec`` requests. It is the prober's RTT
source (a QUIC PING to a peer) and the source of the traffic counters.

Addresses (docs/nat.md): bound to all addresses, the node first announces its interface
address toward the swarm, never loopback off-host (membership/addresses.py); the
reachability checks (membership/reachability.py) then announce the address peers observe,
the NAT kind, whether peers can dial us, our LAN addresses and our rendezvous.
``node.announce_host``/``announce_port`` override all of this (a forwarded port on a fixed
address, the WAN emulator): the node then announces them as reachable and runs no checks.

Run-spec consistency: every server record carries the spec's ``run_id``. A joining node that
sees peers of the same run name with another ``run_id`` and none with ours asks one of them
for its spec (a ``run_spec`` request) and refuses to join (JoinError, exit 1) with the
differing fields (runspec.describe_mismatch); when some peer runs our spec, the others are
logged and ignored (a signed record is no proof of a swarm: anyone can make one).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import torch

from ..transport.codecs import CodecSpec
from ..transport.config import TransportConfig
from ..transport.endpoint import Endpoint, Request, Response
from ..transport.errors import RemoteError, TransportError
from .component import ComponentContext
from .config.runspec import RunSpec, describe_mismatch
from .errors import JoinError, ProbeError
from .logs import get_logger
from .membership.addresses import local_hosts, peer_address
from .membership.peers import PeerTable
from .membership.reachability import Reachability
from .membership.records import QuicAddress, Reach
from .protocol import Kind

log = get_logger(__name__)

RUN_SPEC_KIND = "run_spec"
# netcheck's TCP reachability question: "can you open a TCP connection to me at this port?"
TCP_DIALBACK_KIND = "tcp_dialback"
# a peer may ask at most once per this many seconds; this many at once for everyone
TCP_DIALBACK_INTERVAL_S = 10.0
TCP_DIALBACK_CONCURRENT = 4
TCP_DIALBACK_TIMEOUT_S = 3.0


class EndpointComponent:
    """The node's QUIC endpoint (see the module docstring).

    ``announce_host``/``announce_port`` (node.announce_host/announce_port) replace what the
    node learns when set; ``request_timeout_s`` bounds the ``run_spec`` request to a peer
    whose spec differs; ``reach_period_s``/``reach_timeout_s`` pace the reachability checks.
    """

    name = "endpoint"

    def __init__(
        self,
        config: TransportConfig,
        spec: RunSpec,
        *,
        announce_host: str,
        announce_port: int,
        request_timeout_s: float,
        reach_period_s: float = 120.0,
        reach_timeout_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.announce_host = announce_host
        self.announce_port = announce_port
        self.request_timeout_s = request_timeout_s
        self.reach_period_s = reach_period_s
        self.reach_timeout_s = reach_timeout_s
        self.rng = rng or random.Random()
        self.endpoint: Endpoint | None = None
        self.announced: QuicAddress | None = None
        self.reachability: Reachability | None = None
        self._peers: PeerTable | None = None
        self._tcp_dialbacks: dict[str, float] = {}  # peer id -> loop time of its last one
        self._tcp_dialing = 0

    async def start(self, ctx: ComponentContext) -> None:
        # kinds take no tensors unless declared: the stage kinds' sizes follow from the spec
        endpoint = Endpoint(ctx.identity, self.config, default_request_bytes=0)
        for kind, max_bytes in stage_request_limits(self.spec).items():
            endpoint.limit(kind, max_bytes)
        endpoint.register(RUN_SPEC_KIND, self._on_run_spec, max_bytes=0)
        endpoint.register(TCP_DIALBACK_KIND, self._on_tcp_dialback, max_bytes=0)
        await endpoint.start(self.config.host, self.config.port)
        self.endpoint = endpoint
        self._peers = ctx.peers
        bound_host, port = endpoint.address
        peers = ctx.peers

        def hosts() -> list[str]:
            toward = [p.record.quic.host for p in peers.peers() if p.record.quic is not None]
            return local_hosts(bound_host, toward)

        if self.announce_host or self.announce_port:
            host = self.announce_host or hosts()[0]
            self.announced = QuicAddress(host=host, port=self.announce_port or port)
            endpoint.reachable = True  # the operator says so: peers dial it directly
        else:
            self.announced = QuicAddress(host=hosts()[0], port=port)
            self.reachability = Reachability(
                endpoint, peers,
                local_hosts=hosts,
                bound_port=port,
                publish=lambda quic, reach: self._publish(ctx, quic, reach),
                period_s=self.reach_period_s,
                timeout_s=self.reach_timeout_s,
                rng=self.rng,
            )
        log.info(
            "QUIC on %s:%d, announced as %s:%d",
            bound_host, port, self.announced.host, self.announced.port,
        )
        await self._check_run_spec(ctx)
        ctx.membership.update(quic=self.announced, run_id=self.spec.run_id)
        if self.reachability is not None:
            ctx.spawn(self.reachability.run(), "reachability")

    def _publish(self, ctx: ComponentContext, quic: QuicAddress, reach: Reach) -> None:
        self.announced = quic
        ctx.membership.update(quic=quic, reach=reach)

    async def _on_run_spec(self, request: Request) -> Response:
        return Response({"spec": json.loads(self.spec.canonical_json())["spec"]})

    async def _on_tcp_dialback(self, request: Request) -> Response:
        """Open (and close) a TCP connection to the requester's observed host at the port it
        names: whether its DHT port is reachable from outside (``wanswarm netcheck``). Only
        its own address, at most once per TCP_DIALBACK_INTERVAL_S per peer, a few at once."""
        port = request.header.get("port")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise RemoteError("bad_request", "port must be an integer in 1..65535")
        loop = asyncio.get_running_loop()
        last = self._tcp_dialbacks.get(request.peer_id)
        if last is not None and loop.time() - last < TCP_DIALBACK_INTERVAL_S:
            raise RemoteError("busy", f"one TCP dial-back per {TCP_DIALBACK_INTERVAL_S:.0f}s")
        if self._tcp_dialing >= TCP_DIALBACK_CONCURRENT:
            raise RemoteError("busy", "too many TCP dial-backs at once")
        if len(self._tcp_dialbacks) > 4096:  # bounded memory: forget the oldest half
            for peer_id in sorted(self._tcp_dialbacks, key=self._tcp_dialbacks.__getitem__)[:2048]:
                del self._tcp_dialbacks[peer_id]
        self._tcp_dialbacks[request.peer_id] = loop.time()
        self._tcp_dialing += 1
        host = request.remote[0]
        try:
            async with asyncio.timeout(TCP_DIALBACK_TIMEOUT_S):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
            reachable = True
        except (OSError, TimeoutError):
            reachable = False
        finally:
            self._tcp_dialing -= 1
        return Response({"reachable": reachable})

    async def _check_run_spec(self, ctx: ComponentContext) -> None:
        """JoinError when peers of this run announce another run_id and none announces ours
        (a misconfigured node: the message names the differences). When some peer runs our
        spec, records of other specs are logged and ignored (anyone can sign one: it must not
        keep a node from joining), and no view of the swarm's servers includes them."""
        ours = sum(1 for p in ctx.peers.peers() if p.record.run_id == self.spec.run_id)
        others = [
            p for p in ctx.peers.peers() if p.record.run_id and p.record.run_id != self.spec.run_id
        ]
        if others and ours:
            log.warning(
                "ignoring %d peer(s) announcing another run spec than ours (%s), e.g. %s with %s",
                len(others), self.spec.run_id, others[0].peer_id, others[0].record.run_id,
            )
            return
        for peer in others[:1]:
            record = peer.record
            detail = f"peer {record.peer_id} runs spec {record.run_id}, ours is {self.spec.run_id}"
            address = peer_address(record)
            if address is not None and self.endpoint is not None:
                try:
                    reply = await self.endpoint.request(
                        address, RUN_SPEC_KIND, {}, timeout=self.request_timeout_s
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
        address = self._peers.address(peer_id)
        if address is None:
            raise ProbeError(f"no QUIC address known for {peer_id}")
        try:
            return await self.endpoint.ping(address, timeout=timeout)
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
        announced = self.announced
        reach: dict[str, Any] = (
            self.reachability.status() if self.reachability is not None
            else {"nat": "configured", "reachable": True}
        )
        return {
            "address": f"{announced.host}:{announced.port}" if announced else None,
            "reach": reach,
            "paths": self.endpoint.paths(),
            "run_id": self.spec.run_id,
            "bytes_in": totals["bytes_in"],
            "bytes_out": totals["bytes_out"],
            "requests_sent": totals["requests_sent"],
            "requests_served": totals["requests_served"],
        }


def stage_request_limits(spec: RunSpec) -> dict[str, int]:
    """The most payload bytes a request of each stage kind can carry in this run, from
    the spec alone: a micro-batch of at most ``micro_batch_size`` x ``seq_len`` tokens
    (int64) or activations of ``d_model`` float32 values each, uncompressed (the largest
    encoding any codec gives; a quantized payload is smaller). A request announcing more
    is refused from its header (``too_large``), before anything is allocated."""
    none = CodecSpec("none")
    cells = spec.batch.micro_batch_size * spec.model.seq_len
    tokens = none.payload_nbytes(cells, torch.int64)  # ids or targets, (B, T)
    activation = none.payload_nbytes(cells * spec.model.d_model, torch.float32)  # (B, T, C)
    x = max(tokens, activation)  # stage 0 takes ids, the others activations
    return {
        str(Kind.FORWARD): x,
        str(Kind.FORWARD_LOSS): x + tokens,
        str(Kind.EVAL_LOSS): x + tokens,
        str(Kind.BACKWARD): x + activation,  # [x, dL/dy], or [dL/dy] with x cached
        str(Kind.STAGE_INFO): 0,
    }


__all__ = ["RUN_SPEC_KIND", "TCP_DIALBACK_KIND", "EndpointComponent", "stage_request_limits"]
