"""An in-memory stand-in for dht.Dht with hivemind's rule for sub-keys: the latest expiration
wins."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import SimpleNamespace

from wanswarm.node.errors import DhtTimeout, JoinError, ProbeError
from wanswarm.node.membership.records import MembershipRead, RttRecord, ServerRecord


class MemoryDht:
    """Shared by several nodes of one test: publish/read like a DHT that never loses data."""

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self.wall_clock = wall_clock
        self.servers: dict[str, tuple[ServerRecord, float]] = {}
        self.rtts: dict[str, tuple[RttRecord, float]] = {}
        self.down = False
        self.published: list[tuple[ServerRecord, float]] = []

    async def publish(self, server: ServerRecord, rtt: RttRecord, expiration: float) -> bool:
        if self.down:
            raise DhtTimeout("store took longer than 1s")
        self.published.append((server, expiration))
        accepted = True
        for table, record in ((self.servers, server), (self.rtts, rtt)):
            held = table.get(record.peer_id)
            if held is not None and held[1] >= expiration:
                accepted = False  # hivemind refuses an older or equal expiration
                continue
            table[record.peer_id] = (record, expiration)  # type: ignore[assignment]
        return accepted

    async def read_membership(self) -> MembershipRead:
        if self.down:
            raise DhtTimeout("lookup took longer than 1s")
        now = self.wall_clock()
        return MembershipRead(
            servers={k: v for k, v in self.servers.items() if v[1] > now},
            rtts={k: v[0] for k, v in self.rtts.items() if v[1] > now},
        )


class FakeDht(MemoryDht):
    """What the daemon uses of dht.Dht, without a DHT process (its end is a pipe closing)."""

    def __init__(self, peer_id: str, join_error: str | None = None) -> None:
        super().__init__()
        self.peer_id = peer_id
        self.join_error = join_error
        self.validator = SimpleNamespace(rejected=0)
        self.exitcode: int | None = None
        self._read_fd, self._write_fd = os.pipe()
        self.shut_down = False
        self.pings: list[str] = []
        self.connected: dict[str, list[str]] = {}  # what connected_peers() answers
        self.dialed: list[list[tuple[str, tuple[str, ...]]]] = []

    @property
    def sentinel(self) -> int:
        return self._read_fd

    def die(self) -> None:
        """Simulate the DHT process exiting: its sentinel becomes readable."""
        self.exitcode = -9
        os.close(self._write_fd)
        self._write_fd = -1

    def is_alive(self) -> bool:
        return self._write_fd >= 0 and not self.shut_down

    async def wait_ready(self) -> None:
        if self.join_error is not None:
            raise JoinError(self.join_error)

    async def visible_maddrs(self) -> list[str]:
        return [f"/ip4/127.0.0.1/tcp/4000/p2p/{self.peer_id}"]

    async def connected_peers(self, max_addrs: int = 8) -> dict[str, list[str]]:
        return {peer: addrs[:max_addrs] for peer, addrs in self.connected.items()}

    async def dial(self, peers: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[str]:
        self.dialed.append(list(peers))
        return []

    async def ping(self, peer_id: str, timeout: float) -> float:
        self.pings.append(peer_id)
        if self.down:
            raise ProbeError("no answer")
        return 0.002

    async def shutdown(self, timeout: float) -> None:
        self.shut_down = True
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1
