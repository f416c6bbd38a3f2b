"""The demo's daemons as processes: how each is started, polled, checked and stopped.

Each daemon is ``wanswarm join`` on 127.0.0.1 in a subprocess of its own session (ports 0,
its own state directory and log file), with the demo's settings (:func:`daemon_settings`):
daemon ``i`` serves stage ``i mod S``, and the trainer, averaging and membership settings
suit a few daemons sharing one machine over loopback. With a WAN profile, a WAN emulator
process (``python -m wanswarm.transport.wan``) listens in front of the daemon's QUIC port
and its DHT (libp2p TCP) port, and the daemon announces the emulator's addresses: stage
traffic, the DHT, hivemind's averaging and state downloads to that daemon all cross its
emulated link, which they share. A daemon's status comes from its control
socket; one that exits during start-up ends the demo with the tail of its log
(:func:`check_alive`), one that exits later is the supervisor's (demo_supervisor.py), which
may start it again (:meth:`DemoDaemon.restart`: same state directory, so same identity and
stage). Stopping is SIGTERM (the graceful leave), then SIGKILL for a daemon that outlives
the shutdown timeout, then the emulators.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..control import ControlClient
from ..errors import NodeError

SHUTDOWN_TIMEOUT_S = 20.0  # node.shutdown_timeout of the demo's daemons
DEMO_MAX_IN_FLIGHT = 1  # trainer.max_in_flight of every daemon (see daemon_settings)


class DemoError(NodeError):
    """The demo swarm could not start or lost its daemons."""


@dataclass
class DemoDaemon:
    """One daemon of the demo: its process, files, WAN emulator and last polled status."""

    index: int
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_file: Path
    emulator: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)
    # the command line without --initial-peers and its environment (what restart runs again)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    lives: int = 1  # processes started for this daemon so far

    def restart(self, initial: Sequence[str]) -> None:
        """Start the daemon again after its process exited: the same state directory (so the
        same identity and stage), the same QUIC port and WAN emulator, its log appended to,
        joining through ``initial``. ``status`` is cleared until the new process answers."""
        if self.proc.poll() is None:
            raise DemoError(f"daemon {self.index} is still running")
        self.proc = _popen(self.argv, initial, self.env, self.log_file, append=True)
        self.status = {}
        self.lives += 1

    def kill(self) -> None:
        """SIGKILL the daemon's process (no graceful leave: a crash, as chaos wants)."""
        if self.proc.poll() is None:
            self.proc.kill()

    def log_tail(self, lines: int = 5) -> list[str]:
        """The last ``lines`` lines of the daemon's log."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return []
        return text.strip().splitlines()[-lines:]

    @property
    def client(self) -> ControlClient:
        return ControlClient(self.state_dir / "control.sock", timeout=5.0)

    async def poll(self) -> dict[str, Any] | None:
        """The daemon's status (kept in ``status``), or None when it exited or did not answer."""
        if self.proc.poll() is not None:
            return None
        try:
            report = await asyncio.to_thread(lambda: self.client.status())
        except NodeError:
            return None
        self.status = report.model_dump(mode="json")
        return self.status


def _free_port(kind: socket.SocketKind) -> int:
    """A port of 127.0.0.1 free now for ``kind`` (SOCK_DGRAM: UDP, SOCK_STREAM: TCP)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def daemon_settings(
    index: int, n_stages: int, spec_path: Path | None, data_seed: int | None
) -> list[str]:
    """The ``--set`` items of daemon ``index`` (before the WAN announce address and the
    user's own items)."""
    sets = [
        f"node.shutdown_timeout={SHUTDOWN_TIMEOUT_S}",
        # the layout is known here: daemon i serves stage i mod S, so every stage gets its
        # replicas and all daemons but the first start at once (no claim to wait for)
        f"node.stage={index % n_stages}",
        "node.record_ttl=15",
        "node.membership_period=5",
        # micro-batches in flight over the whole swarm make gradients stale by about
        # (in flight / micro-batches per step) epochs: one per trainer keeps that small
        f"trainer.max_in_flight={DEMO_MAX_IN_FLIGHT}",
        "trainer.request_timeout_s=15",  # loopback: a hop that takes longer is stuck
        # each trainer completes only ~100 micro-batches in the demo: a slower average would
        # show the loss of minutes ago in the progress line
        "trainer.loss_ewma_alpha=0.2",
        "averaging.matchmaking_time=2",  # loopback: peers answer at once
        # Synchronous steps: the demo's few, large-lr steps lose more to one epoch of
        # staleness (delayed updates: val loss 2.99 after 237k tokens) than the swarm loses
        # to the all-reduce stall (2.70 after 209k tokens, single-process reference 2.57);
        # docs/tiny_run.md has the figures.
        "averaging.delayed_updates=false",
        # on a loaded machine a peer's chunk can take seconds; dropping it from the round
        # would leave the replicas with different averages
        "averaging.next_chunk_timeout=10",
        # parameters are averaged every 5th epoch: the gradient all-reduce already keeps the
        # replicas together, and each averaging round costs DHT matchmaking on 2 shared cores
        "averaging.average_state_every=5",
    ]
    if spec_path is not None:
        sets.append(f"node.run_spec={spec_path}")
    if data_seed is not None:
        sets.append(f"trainer.data_seed={data_seed + index}")
    return sets


def _start_emulator(
    profile: str, index: int, quic_port: int, dht_port: int
) -> tuple[subprocess.Popen[bytes], str, str, str]:
    """A WAN emulator in front of ``quic_port`` (UDP) and ``dht_port`` (TCP): the process,
    the host and UDP port it bound, and its TCP port."""
    emulator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wanswarm.transport.wan",
            "--profile",
            profile,
            "--target",
            f"127.0.0.1:{quic_port}",
            "--tcp-target",
            f"127.0.0.1:{dht_port}",
            "--listen",
            "127.0.0.1:0",
            "--seed",
            str(index),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert emulator.stdout is not None
    line = emulator.stdout.readline().decode()  # its first line: the bound address
    try:
        event = json.loads(line)
        host, _, port = event["address"].rpartition(":")
        tcp_port = event["tcp_address"].rpartition(":")[2]
    except (ValueError, KeyError, AttributeError) as exc:
        emulator.kill()
        raise DemoError(f"WAN emulator did not start: {line!r}") from exc
    return emulator, host, port, tcp_port


def spawn_daemon(
    root: Path,
    index: int,
    initial: Sequence[str],
    *,
    n_stages: int,
    spec_path: Path | None,
    data_seed: int | None,
    wan: str | None,
    extra: Sequence[str],
) -> DemoDaemon:
    """Start daemon ``index`` under ``root`` (behind a WAN emulator when ``wan`` names a
    profile), joining through ``initial`` (none: it bootstraps the DHT)."""
    state_dir = root / f"node{index}"
    state_dir.mkdir(mode=0o700)
    log_file = root / f"node{index}.log"
    emulator = None
    quic_port = dht_port = 0
    sets = daemon_settings(index, n_stages, spec_path, data_seed)
    if wan is not None:
        quic_port = _free_port(socket.SOCK_DGRAM)
        dht_port = _free_port(socket.SOCK_STREAM)
        emulator, host, port, tcp_port = _start_emulator(wan, index, quic_port, dht_port)
        sets += [
            f"node.announce_host={host}",
            f"node.announce_port={port}",
            f"dht.announce_maddrs=/ip4/{host}/tcp/{tcp_port}",
        ]
    cmd = [
        sys.executable,
        "-m",
        "wanswarm.node.cli",
        "join",
        "--state-dir",
        str(state_dir),
        "--host",
        "127.0.0.1",
        "--dht-port",
        str(dht_port),
        "--quic-port",
        str(quic_port),
        "--run",
        "demo",
    ]
    for item in [*sets, *extra]:
        cmd += ["--set", item]
    # one compute thread per daemon: several daemons share the machine's cores
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    proc = _popen(cmd, initial, env, log_file, append=False)
    return DemoDaemon(index, state_dir, proc, log_file, emulator, argv=cmd, env=env)


def _popen(
    argv: Sequence[str], initial: Sequence[str], env: dict[str, str], log_file: Path, append: bool
) -> subprocess.Popen[bytes]:
    """``argv`` (joining through ``initial`` when given) in a session of its own, its stdout
    and stderr into ``log_file``."""
    cmd = [*argv, "--initial-peers", *initial] if initial else list(argv)
    with open(log_file, "ab" if append else "wb") as sink:
        return subprocess.Popen(
            cmd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


def check_alive(daemons: Sequence[DemoDaemon]) -> None:
    """``DemoError`` with the end of its log when any daemon has exited."""
    for daemon in daemons:
        code = daemon.proc.poll()
        if code is not None:
            tail = daemon.log_file.read_text(errors="replace").strip().splitlines()[-5:]
            raise DemoError(
                f"daemon {daemon.index} exited with status {code}; its log ends:\n  "
                + "\n  ".join(tail)
            )


async def stop_daemons(
    daemons: Sequence[DemoDaemon], say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """SIGTERM every daemon, SIGKILL those that outlive the shutdown timeout, then stop the
    WAN emulators; ``say`` reports a daemon killed. Returns the stats each emulator printed
    as it stopped (``python -m wanswarm.transport.wan``'s last line)."""
    stats: list[dict[str, Any]] = []
    for daemon in daemons:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S + 15
    for daemon in daemons:
        left = max(0.1, deadline - time.monotonic())
        try:
            await asyncio.to_thread(daemon.proc.wait, left)
        except subprocess.TimeoutExpired:
            say(f"daemon {daemon.index} did not leave in time: killing it")
            daemon.proc.kill()
            await asyncio.to_thread(daemon.proc.wait, 10)
        if daemon.emulator is not None and daemon.emulator.poll() is None:
            daemon.emulator.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(daemon.emulator.wait, 10)
            except subprocess.TimeoutExpired:
                daemon.emulator.kill()
                await asyncio.to_thread(daemon.emulator.wait, 10)
            else:
                stats += _emulator_stats(daemon.emulator)
        if daemon.emulator is not None and daemon.emulator.stdout is not None:
            daemon.emulator.stdout.close()
    return stats


def _emulator_stats(emulator: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    """The stats line an emulator printed as it stopped (none when it printed none)."""
    if emulator.stdout is None:
        return []
    text = emulator.stdout.read().decode(errors="replace")  # the caller closes the pipe
    for line in reversed(text.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "stats":
            return [record]
    return []


def wan_link_totals(stats: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What crossed the emulated links, summed over the emulators: datagrams (QUIC) and
    stream bytes (libp2p: DHT, averaging, state downloads), both directions."""

    def links(counter: str) -> int:  # both directions of every emulator's link
        return sum(s.get(d, {}).get(counter, 0) for s in stats for d in ("uplink", "downlink"))

    def relays(counter: str) -> int:  # every emulator's TCP relay
        return sum(s.get("tcp", {}).get(counter, 0) for s in stats)

    tcp = relays("bytes_up") + relays("bytes_down")
    return {
        "emulators": len(stats),
        # datagrams the links' queues dropped (overflow) and their random loss
        "overflow_packets": links("overflow_packets"),
        "lost_packets": links("lost_packets"),
        "quic_bytes": max(0, links("delivered_bytes") - tcp),
        "libp2p_bytes": tcp,
        "libp2p_connections": relays("connections"),
    }


def describe_wan_links(links: dict[str, int]) -> str:
    """:func:`wan_link_totals` in words, as the demo and the swarm benchmark print it."""
    return (
        f"{links['quic_bytes'] / 1e6:.1f} MB of QUIC datagrams and "
        f"{links['libp2p_bytes'] / 1e6:.1f} MB of libp2p streams (DHT, hivemind's averaging, "
        f"state downloads) on {links['libp2p_connections']} connections"
    )
