"""A swarm of real daemons on separate hosts: the network lab's namespaces, or loopback.

Each node is ``wanswarm join`` as a volunteer starts it, bound to all addresses, with only
the bootstrap's DHT address (``--initial-peers``): no announce address, no stage pinned.
The bootstrap node listens on a fixed DHT port; the others pick free ports. On loopback
(the baseline) the same nodes bind 127.0.0.1. Every daemon gets its own state directory
and log file under ``root``; the control socket in the state directory answers ``status``
from the lab's owner (Unix sockets do not belong to a network namespace).

:class:`LabSwarm` starts, polls, kills and restarts nodes; :func:`swarm_figures` reads the
figures the benchmark and the lab tests check: micro-batches completed per node and per
stage, the connection paths, the stage replicas' parameter digests and the validation loss.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..control import ControlClient
from ..errors import NodeError
from ..stage.fingerprint import relative_distance
from .netlab import Lab

BOOT_DHT_PORT = 31337
# settings for every node: the defaults a volunteer gets, except a shorter shutdown so that
# a run's teardown takes seconds rather than the default drain
SWARM_SETTINGS: tuple[str, ...] = (
    "node.shutdown_timeout=20",
    "node.drain_grace=5",
)


@dataclass
class SwarmNode:
    """One daemon: where it runs, its files, its process and its last polled status."""

    name: str
    nat: str  # public, cone, symmetric, loopback
    state_dir: Path
    log_file: Path
    proc: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)
    starts: int = 0

    @property
    def client(self) -> ControlClient:
        return ControlClient(self.state_dir / "control.sock", timeout=5.0)

    async def poll(self) -> dict[str, Any] | None:
        """The daemon's status (kept in ``status``); None when it is down or did not answer."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            report = await asyncio.to_thread(lambda: self.client.status())
        except NodeError:
            return None
        self.status = report.model_dump(mode="json")
        return self.status

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n  ".join(text.strip().splitlines()[-lines:])


class LabSwarm:
    """Daemons on the hosts of ``lab`` (None: on this host's loopback)."""

    def __init__(
        self, lab: Lab | None, root: Path, settings: Sequence[str] = SWARM_SETTINGS
    ) -> None:
        self.lab = lab
        self.root = root
        self.settings = list(settings)
        self.nodes: dict[str, SwarmNode] = {}
        self.initial: list[str] = []
        self.bootstrap: str | None = None  # the node started first, without initial peers

    def add(self, name: str, nat: str) -> SwarmNode:
        node = SwarmNode(name, nat, self.root / name, self.root / f"{name}.log")
        node.state_dir.mkdir(mode=0o700, parents=True)
        self.nodes[name] = node
        return node

    def start(self, node: SwarmNode, extra: Sequence[str] = ()) -> None:
        """Start ``node``'s daemon (joining through ``self.initial`` when set). The first
        node started is the bootstrap, and starts again as one: on its fixed port, without
        initial peers (its address book finds the swarm)."""
        host = "127.0.0.1" if self.lab is None else "0.0.0.0"
        if self.bootstrap is None:
            self.bootstrap = node.name
        boot = node.name == self.bootstrap
        cmd = [
            sys.executable, "-m", "wanswarm.node.cli", "join",
            "--state-dir", str(node.state_dir),
            "--host", host,
            "--dht-port", str(BOOT_DHT_PORT if boot and self.lab is not None else 0),
            "--quic-port", "0",
            "--run", "lab",
        ]
        for item in [*self.settings, *extra]:
            cmd += ["--set", item]
        if self.initial and not boot:
            cmd += ["--initial-peers", *self.initial]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        with open(node.log_file, "ab") as sink:
            if self.lab is None:
                node.proc = subprocess.Popen(
                    cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env=env,
                )
            else:
                node.proc = self.lab.popen(
                    node.name, cmd, stdout=sink, stderr=subprocess.STDOUT, env=env
                )
        node.starts += 1

    async def wait_bootstrap(self, node: SwarmNode, timeout: float) -> list[str]:
        """The bootstrap node's DHT addresses once it prints them (``self.initial``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            status = await node.poll()
            if status and status["dht_addrs"]:
                self.initial = list(status["dht_addrs"])
                return self.initial
            await asyncio.sleep(0.5)
        raise NodeError(f"the bootstrap node did not start in {timeout:.0f}s:\n  "
                        f"{node.log_tail()}")

    def check_alive(self) -> None:
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is not None:
                raise NodeError(
                    f"node {node.name} exited with status {node.proc.returncode}; its log "
                    f"ends:\n  {node.log_tail()}"
                )

    async def poll_all(self) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*(n.poll() for n in self.nodes.values())))

    def kill(self, node: SwarmNode) -> None:
        """SIGKILL, as a crash or a power cut would."""
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait(10)
        node.proc = None

    async def stop(self) -> None:
        """SIGTERM every daemon (the graceful leave), SIGKILL what outlives 40 s."""
        running = [n for n in self.nodes.values() if n.proc is not None and n.proc.poll() is None]
        for node in running:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for node in running:
            assert node.proc is not None
            try:
                await asyncio.to_thread(node.proc.wait, max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                await asyncio.to_thread(node.proc.wait, 10)


def _trainer(status: dict[str, Any]) -> dict[str, Any]:
    trainer: dict[str, Any] = status.get("components", {}).get("trainer", {})
    return trainer


def _server(status: dict[str, Any]) -> dict[str, Any]:
    server: dict[str, Any] = status.get("components", {}).get("stage_server", {})
    return server


def all_serving(statuses: Sequence[dict[str, Any] | None], n_stages: int) -> bool:
    """Every node online, and every stage served by an online stage server."""
    if any(s is None or s["state"] != "online" for s in statuses):
        return False
    online = [_server(s) for s in statuses if s and _server(s).get("state") == "online"]
    served = {server.get("stage") for server in online}
    return served >= set(range(n_stages))


def through_every_stage(status: dict[str, Any], n_stages: int) -> bool:
    """The node's trainer has completed micro-batches, with hops to every stage."""
    trainer = _trainer(status)
    hops = trainer.get("hops", {})
    completed = trainer.get("micro_batches", {}).get("completed", 0)
    return completed > 0 and all(hops.get(str(s), 0) > 0 for s in range(n_stages))


def swarm_figures(statuses: Sequence[dict[str, Any]], n_stages: int) -> dict[str, Any]:
    """What the statuses show: per node (state, stage, micro-batches, tokens, path kinds),
    the paths counted over every node's peers, and per stage the replicas' digests."""
    paths: Counter[str] = Counter()
    nodes = []
    for status in statuses:
        trainer = _trainer(status)
        node_paths = Counter(p["path"] for p in status.get("peers", []) if p.get("path"))
        paths.update(node_paths)
        nodes.append({
            "peer_id": status.get("peer_id"),
            "state": status.get("state"),
            "stage": status.get("stage"),
            "micro_batches": trainer.get("micro_batches", {}).get("completed", 0),
            "failed": trainer.get("micro_batches", {}).get("failed", 0),
            "tokens": trainer.get("tokens", 0),
            "through_every_stage": through_every_stage(status, n_stages),
            "paths": dict(node_paths),
            "reach": status.get("components", {}).get("endpoint", {}).get("reach", {}),
        })
    digests: dict[int, list[tuple[int, str]]] = {}
    sketches: dict[int, list[tuple[int, list[float]]]] = {}
    for status in statuses:
        server = _server(status)
        if server.get("state") == "online" and server.get("stage") is not None:
            stage, epoch = int(server["stage"]), int(server.get("digest_epoch", -1))
            digests.setdefault(stage, []).append((epoch, str(server.get("param_digest", ""))))
            sketch = server.get("param_sketch") or []
            if epoch >= 0 and sketch:
                sketches.setdefault(stage, []).append((epoch, [float(v) for v in sketch]))
    return {"nodes": nodes, "paths": dict(paths), "digests": digests, "sketches": sketches}


def replicas_divergence(
    sketches: dict[int, list[tuple[int, list[float]]]],
) -> dict[int, float]:
    """Per stage with two replicas at the same epoch: the largest estimated relative distance
    between their parameters (fingerprint.py's count sketches; about 1e-7 when averaging left
    them equal up to rounding, about one optimizer step's size when one applied an update
    the other has not yet)."""
    out: dict[int, float] = {}
    for stage, held in sketches.items():
        worst = None
        for i, (epoch_a, a) in enumerate(held):
            for epoch_b, b in held[i + 1:]:
                if epoch_a == epoch_b and len(a) == len(b):
                    d = relative_distance(a, b)
                    worst = d if worst is None else max(worst, d)
        if worst is not None:
            out[stage] = worst
    return out


def replicas_agree(digests: dict[int, list[tuple[int, str]]]) -> dict[int, bool | None]:
    """Per stage with two or more replicas: whether those that hold a digest of the same
    epoch hold the same digest (None: no common epoch yet)."""
    out: dict[int, bool | None] = {}
    for stage, held in digests.items():
        if len(held) < 2:
            continue
        by_epoch: dict[int, set[str]] = {}
        for epoch, digest in held:
            if epoch >= 0 and digest:
                by_epoch.setdefault(epoch, set()).add(digest)
        common = [e for e, found in by_epoch.items()
                  if sum(1 for ep, _ in held if ep == e) >= 2]
        out[stage] = None if not common else all(len(by_epoch[e]) == 1 for e in common)
    return out


__all__ = [
    "BOOT_DHT_PORT",
    "SWARM_SETTINGS",
    "LabSwarm",
    "SwarmNode",
    "all_serving",
    "replicas_agree",
    "replicas_divergence",
    "swarm_figures",
    "through_every_stage",
]
