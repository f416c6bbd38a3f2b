"""The trainer's view of the swarm's servers: who serves each stage, where, and how loaded.

The daemon's peer table gives the servers by stage (``servers_from_peers``, a
``ServerSource``); a ``ServerView`` adds the endpoint's measurements of the path to each
(smoothed RTT, delivery rate) and turns the online ones of a stage into the router's
candidates for a hop. It remembers the stage each server was last seen serving: a server
that moved to another stage (rebalancing) has its ban lifted, since the refusals that
banned it while it drained the old stage say nothing about it as a server of the new one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...transport.endpoint import PathStats, PeerAddress
from .routing import Candidate, Router


@dataclass(frozen=True)
class ServerInfo:
    """A live server as the daemon's peer table sees it."""

    peer_id: str
    host: str
    port: int
    throughput: float  # announced samples/s of forward+backward
    queue_len: int  # announced queued jobs
    state: str  # joining / online / draining
    rtt: float | None  # seconds, smoothed, None if never measured
    # how to reach it when the peer table knows more than host:port (its LAN address behind
    # our own NAT, its reachability and rendezvous for NAT traversal)
    address: PeerAddress | None = None

    @property
    def target(self) -> PeerAddress:
        return self.address or PeerAddress(self.peer_id, self.host, self.port)


ServerSource = Callable[[], Mapping[int, Sequence[ServerInfo]]]


class ServerView:
    """The servers a trainer can send a hop to (see the module docstring).

    ``path_stats`` is the endpoint's measurement of the path to a peer, None if it has none;
    ``router`` is the trainer's, whose bans the view lifts for servers that changed stage."""

    def __init__(
        self,
        servers: ServerSource,
        path_stats: Callable[[str], PathStats | None],
        router: Router,
    ) -> None:
        self.servers = servers
        self._path_stats = path_stats
        self._router = router
        self._live: dict[str, ServerInfo] = {}
        self._stage_of: dict[str, int] = {}  # the stage each server was last seen serving

    def missing_stages(self, n_stages: int) -> list[int]:
        """The stages of ``range(n_stages)`` that no online server serves."""
        view = self.servers()
        return [s for s in range(n_stages) if not _online(view.get(s, ()))]

    def candidates(self, stage: int) -> list[Candidate]:
        """The online servers of ``stage``, as the router weighs them."""
        view = self.servers()
        live = [s for s in view.get(stage, ()) if s.state == "online"]
        self._live.update((s.peer_id, s) for s in live)
        for server in live:
            if self._stage_of.get(server.peer_id, stage) != stage:
                # it moved here from another stage (rebalancing): the refusals that banned it
                # while it drained the old stage say nothing about it as a server of this one
                self._router.clear_ban(server.peer_id)
            self._stage_of[server.peer_id] = stage
        out = []
        for server in live:
            stats = self._path_stats(server.peer_id)
            rtt = stats.smoothed_rtt if stats is not None and stats.smoothed_rtt > 0 else server.rtt
            rate = stats.delivery_rate_bps if stats is not None else None
            out.append(Candidate(server.peer_id, server.throughput, server.queue_len, rtt, rate))
        return out

    def server(self, peer_id: str) -> ServerInfo:
        """The server ``peer_id`` as last returned among ``candidates``."""
        return self._live[peer_id]


def _online(servers: Sequence[ServerInfo]) -> bool:
    return any(s.state == "online" for s in servers)


def servers_from_peers(peers: Any, run_id: str | None = None) -> dict[int, list[ServerInfo]]:
    """The ``ServerSource`` view of the daemon's PeerTable: online-capable servers by stage,
    of the run spec ``run_id`` when given (a record of another spec is never routed to)."""
    out: dict[int, list[ServerInfo]] = {}
    for server in peers.servers(run_id=run_id):
        record = server.record
        out.setdefault(server.stage, []).append(
            ServerInfo(
                peer_id=record.peer_id,
                host=server.quic.host,
                port=server.quic.port,
                throughput=record.throughput,
                queue_len=record.queue,
                state=record.state,
                rtt=server.peer.rtt.srtt,
                address=server.address,
            )
        )
    return out
