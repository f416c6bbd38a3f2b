"""The seam through which the daemon's parts plug in: the QUIC endpoint, a stage server, a trainer.

A component is started after the node has joined the DHT and before it announces ``online``;
drained (stop accepting work, finish what is in flight by a deadline) when the node leaves;
closed last. The daemon owns their long-lived tasks: a component hands its loops to
``ctx.spawn`` so that they live in the daemon's one TaskGroup (a crash in one stops the daemon
instead of dying silently) and are cancelled on leave. Lifecycle code never changes to add one::

    class StageServer:
        name = "stage_server"
        async def start(self, ctx):   # load weights, then
            ctx.spawn(self._serve(), "stage-server")
            ctx.membership.update(stage=self.stage, throughput=self.measured_throughput)
        async def drain(self, deadline):  # refuse new requests, finish queued ones by deadline
            ...
        async def close(self): ...
        def status(self): return {"queue": len(self.queue)}

Optional capabilities are found by shape: a component with ``async ping(peer_id, timeout=)``
(:class:`~wanswarm.node.membership.prober.RttSource`) replaces the DHT ping as the prober's
RTT source, one with ``traffic() -> (bytes_in, bytes_out)`` (:class:`TrafficSource`) feeds
status and metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..transport.identity import Identity
from .membership.peers import PeerTable
from .membership.tracker import Membership

if TYPE_CHECKING:  # dht.py imports hivemind, which importing this module must not
    from .membership.dht import Dht


@dataclass(frozen=True)
class ComponentContext:
    """What a component may use: who we are, where state lives, the peer table, the announcer."""

    identity: Identity
    run: str
    state_dir: Path
    peers: PeerTable
    membership: Membership
    spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]
    # the DHT adapter: a stage server's optimizer averages over it (Dht.hivemind_optimizer)
    dht: Dht


@runtime_checkable
class Component(Protocol):
    name: str

    async def start(self, ctx: ComponentContext) -> None:
        """Become ready (bind sockets, load state); spawn long-lived loops with ``ctx.spawn``."""

    async def drain(self, deadline: float) -> None:
        """Stop accepting work and finish in-flight work before ``deadline`` (loop.time())."""

    async def close(self) -> None:
        """Release sockets, threads and files. Called once, after drain (or after a failure)."""

    def status(self) -> dict[str, Any]:
        """A few JSON-serialisable fields shown by ``wanswarm status``."""


@runtime_checkable
class TrafficSource(Protocol):
    def traffic(self) -> tuple[int, int]:
        """Payload bytes (received, sent) since start."""
