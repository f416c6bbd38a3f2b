"""Start real ``wanswarm join`` daemons as subprocesses on loopback and wait on their state.

Reusable by every swarm-tier test (membership today, training later)::

    with LocalSwarm(n=3, extra_args=FAST) as swarm:     # a bootstrap node and two joiners
        swarm.wait_all_see_each_other(timeout=15)
        node = swarm.nodes[1]
        node.status()                                   # the StatusReport, over the control socket
        assert node.leave() == 0                        # 'wanswarm leave', waits for the exit

Each daemon gets its own short state dir under /tmp (Unix socket paths are limited to 107
bytes), binds 127.0.0.1 on free ports, and logs to ``<state_dir>/daemon.log``; on failure the
helpers put the log tails in the assertion message. Every wait polls with a deadline; nothing
sleeps to synchronise. Teardown sends SIGTERM, waits, then SIGKILLs whatever is left (the DHT
process dies with its daemon through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from wanswarm.node.control import ControlClient
from wanswarm.node.errors import ControlError
from wanswarm.node.status import StatusReport

from tests.waiting import wait_for

# Timings that make membership converge in a second or two on loopback.
FAST: tuple[str, ...] = (
    "--host", "127.0.0.1",
    "--set", "node.membership_period=0.5",
    "--set", "node.record_ttl=6",
    "--set", "node.drain_grace=0.3",
    "--set", "node.shutdown_timeout=10",
    "--set", "prober.period=1",
    "--set", "prober.timeout=0.8",
    "--set", "dht.bootstrap_timeout=30",
    "--set", "dht.rpc_timeout=3",
    "--set", "dht.request_timeout=5",
)

# Membership only: the QUIC endpoint, but no stage server or trainer (no model, no training).
NO_TRAINING: tuple[str, ...] = ("--set", "node.server=false", "--set", "node.trainer=false")

WANSWARM = [sys.executable, "-m", "wanswarm.node.cli"]


def short_tmpdir(prefix: str = "wsw-") -> Path:
    """A fresh directory with a short path (pytest's tmp_path is too long for Unix sockets)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class DaemonProcess:
    """One ``wanswarm join`` subprocess and its state dir."""

    def __init__(self, name: str, state_dir: Path, args: Sequence[str],
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.state_dir = state_dir
        self.args = list(args)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_path = state_dir.parent / f"{state_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*WANSWARM, "join", "--state-dir", str(self.state_dir), *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"[{self.name}: no log]"
        return f"--- {self.name} ({self.log_path}) ---\n" + "\n".join(text[-lines:])

    def status(self, timeout: float = 5.0) -> StatusReport | None:
        """The daemon's status, or None while its control socket does not answer."""
        try:
            return ControlClient(self.state_dir / "control.sock", timeout=timeout).status()
        except ControlError:
            return None

    def wait_online(self, timeout: float = 60.0) -> StatusReport:
        def online() -> StatusReport | None:
            if not self.running():
                returncode = self.proc and self.proc.returncode
                raise AssertionError(f"{self.name} exited with {returncode}\n{self.log_tail()}")
            report = self.status()
            if report is not None and report.state == "online" and report.dht_addrs:
                return report
            return None

        return wait_for(online, timeout, f"{self.name} to be online", explain=self.log_tail)

    def peers(self) -> set[str]:
        report = self.status()
        return {p.peer_id for p in report.peers} if report is not None else set()

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``wanswarm <args> --state-dir <this node's>`` and capture its output."""
        return subprocess.run(
            [*WANSWARM, *args, "--state-dir", str(self.state_dir)],
            capture_output=True, text=True, timeout=timeout, env=self.env,
        )

    def leave(self, timeout: float = 30.0) -> int:
        """``wanswarm leave``; returns the daemon's exit status once it has exited."""
        result = self.cli("leave", timeout=timeout + 10)
        assert result.returncode == 0, (
            f"wanswarm leave failed: {result.stdout}{result.stderr}\n{self.log_tail()}"
        )
        return self.wait_exit(timeout)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM; returns the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout}s\n{self.log_tail()}"
            ) from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class LocalSwarm:
    """A bootstrap daemon and ``n - 1`` joiners with its address as ``--initial-peers``."""

    def __init__(self, n: int, extra_args: Sequence[str] = FAST, base_dir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.n = n
        self.extra_args = list(extra_args)
        self.base_dir = base_dir if base_dir is not None else short_tmpdir()
        self._own_base = base_dir is None
        self.env = env
        self.nodes: list[DaemonProcess] = []

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        bootstrap = self.add("n0", initial_peers=())
        addrs = bootstrap.wait_online().dht_addrs
        joiners = [self.add(f"n{i}", initial_peers=addrs, wait=False) for i in range(1, self.n)]
        for node in joiners:
            node.wait_online()

    def add(self, name: str, initial_peers: Sequence[str], wait: bool = True,
            extra_args: Sequence[str] = ()) -> DaemonProcess:
        args = [*self.extra_args, *extra_args]
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        node = DaemonProcess(name, self.base_dir / name, args, self.env).start()
        self.nodes.append(node)
        if wait:
            node.wait_online()
        return node

    def explain(self) -> str:
        return "\n".join(node.log_tail(25) for node in self.nodes)

    def wait_all_see_each_other(self, timeout: float = 15.0) -> None:
        alive = [n for n in self.nodes if n.running()]

        def converged() -> bool:
            reports = [n.status() for n in alive]
            if any(r is None for r in reports):
                return False
            ids = {r.peer_id for r in reports if r is not None}
            return all(
                {p.peer_id for p in r.peers} >= ids - {r.peer_id} for r in reports if r is not None
            )

        wait_for(converged, timeout, "every daemon to list every other", explain=self.explain)

    def close(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            if node.running() and node.proc is not None:
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.kill()
        keep = os.environ.get("WANSWARM_KEEP_TEST_LOGS")
        if keep:  # the daemons' logs of every swarm test, for a failure seen once
            target = Path(keep) / self.base_dir.name
            for node in self.nodes:
                if node.log_path.exists():
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(node.log_path, target / node.log_path.name)
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)
