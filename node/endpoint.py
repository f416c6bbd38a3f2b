"""The node's QUIC endpoint as a daemon component.

Binds QUIC (``transport.host``/``transport.port``), announces its address and the run id in
the node's record, and answers ``run_spec`` requests. It is the prober's RTT source (a QUIC
PING to a peer's announced address) and the source of the traffic counters.

Run-spec consistency: every server record carries the spec's ``run_id``. A joining node that
sees a peer of the same run name with another ``run_id`` asks that peer for its spec (a
``run_spec`` request) and refuses to join (JoinError, exit 1) with the differing fields
(runspec.describe_mismatch).
"""

from __future__ import annotations

import json
from typing import Any

from ..transport.config import TransportConfig
from ..transport.endpoint import Endpoint, PeerAddress, Request, Response
from ..transport.errors import TransportError
from .component import ComponentContext
from .config.runspec import RunSpec, describe_mismatch
from .errors import JoinError, ProbeError
from .logs import get_logger
from .membership.peers import PeerTable
from .membership.records import QuicAddress

log = get_logger(__name__)

RUN_SPEC_KIND = "run_spec"


class EndpointComponent:
    """The node's QUIC endpoint (see the module docstring).

    ``announce_host``/``announce_port`` (node.announce_host/announce_port) replace the bound
    address in our record when set; ``request_timeout_s`` bounds the ``run_spec`` request to
    a peer whose spec differs.
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
    ) -> None:
        self.config = config
        self.spec = spec
        self.announce_host = announce_host
        self.announce_port = announce_port
        self.request_timeout_s = request_timeout_s
        self.endpoint: Endpoint | None = None
        self.announced: QuicAddress | None = None
        self._peers: PeerTable | None = None

    async def start(self, ctx: ComponentContext) -> None:
        endpoint = Endpoint(ctx.identity, self.config)
        endpoint.register(RUN_SPEC_KIND, self._on_run_spec)
        await endpoint.start(self.config.host, self.config.port)
        self.endpoint = endpoint
        self._peers = ctx.peers
        host, port = endpoint.address
        if self.announce_host:
            host = self.announce_host
        elif host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        self.announced = QuicAddress(host=host, port=self.announce_port or port)
        log.info(
            "QUIC on %s:%d, announced as %s:%d",
            *endpoint.address, self.announced.host, self.announced.port,
        )
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
                        RUN_SPEC_KIND, {}, timeout=self.request_timeout_s,
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
        peer = self._peers.get(peer_id)
        record = None if peer is None else peer.record
        if record is None or record.quic is None:
            raise ProbeError(f"no QUIC address known for {peer_id}")
        address = PeerAddress(peer_id, record.quic.host, record.quic.port)
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
        return {
            "address": f"{announced.host}:{announced.port}" if announced else None,
            "run_id": self.spec.run_id,
            "bytes_in": totals["bytes_in"],
            "bytes_out": totals["bytes_out"],
            "requests_sent": totals["requests_sent"],
            "requests_served": totals["requests_served"],
        }


__all__ = ["RUN_SPEC_KIND", "EndpointComponent"]
