"""The image and docker/compose.yaml as a user runs them: real containers on a Docker network.

``docker compose -f docker/compose.yaml up --build --scale joiner=3`` builds the image from
the Dockerfile and starts a bootstrap node and three joiners with no address set by hand
(the joiners read the bootstrap's from its control socket). The test checks what the
README promises of that swarm: every node's health check passes (the first one runs
``wanswarm selftest``); no node announces loopback; every node's trainer completes
micro-batches through every stage; two replicas of a stage average across containers
(a round with two participants); a joiner SIGKILLed and started again comes back with the
same identity and serves, and so does the bootstrap (it has no initial peers: it finds the
swarm through its address book); ``docker compose stop`` (SIGTERM) makes every daemon leave the
swarm and exit 0.

Skipped without a Docker engine and Compose v2 (``docker compose``), so CI without Docker
skips it. Where Docker Hub is out of reach, build a stand-in base first and name it in
``BASE_IMAGE`` (the compose file passes it to the build): ``tests/docker/standin_base.sh``.
About 4 minutes after the image is built; the image is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
JOINERS = 3
N_NODES = 1 + JOINERS
LOOPBACK = ("/ip4/127.", "/ip6/::1/", "127.", "[::1]")
Status = dict[str, Any]

pytestmark = pytest.mark.slow


def _run(args: list[str], timeout: float, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _docker_or_skip() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker command")
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
        compose = subprocess.run(["docker", "compose", "version"], capture_output=True,
                                 timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("the Docker engine does not answer within 30 s")
    if info.returncode != 0:
        pytest.skip("no Docker engine answers ('docker info' failed)")
    if compose.returncode != 0:
        pytest.skip("Compose v2 ('docker compose') is not installed")
    for port, kind in ((31337, socket.SOCK_STREAM), (31338, socket.SOCK_DGRAM)):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                pytest.skip(f"port {port} is taken here: the compose file publishes it")


class Compose:
    """One compose project of docker/compose.yaml under its own name and image tag."""

    def __init__(self) -> None:
        self.project = f"wanswarm-test-{os.getpid()}"
        self.image = f"wanswarm:test-{os.getpid()}"
        self.env = {**os.environ, "WANSWARM_IMAGE": self.image}

    def __call__(self, *args: str, timeout: float = 300,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["docker", "compose", "-p", self.project, "-f", str(COMPOSE), *args],
                    timeout, self.env, check)

    def containers(self) -> list[str]:
        out = self("ps", "-a", "--format", "{{.Name}}").stdout
        return sorted(line for line in out.split() if line)

    def status(self, container: str) -> Status | None:
        result = _run(["docker", "exec", container, "wanswarm", "status", "--json"], 60,
                      check=False)
        if result.returncode != 0:
            return None
        status: Status = json.loads(result.stdout)
        return status

    def logs(self, tail: int = 15) -> str:
        return self("logs", "--no-color", "--tail", str(tail), timeout=60, check=False).stdout

    def logs_of(self, container: str) -> str:
        result = _run(["docker", "logs", container], 60, check=False)
        return result.stdout + result.stderr


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    _docker_or_skip()
    project = Compose()
    try:
        built = project("build", timeout=1800, check=False)
        if built.returncode != 0:
            if not os.environ.get("BASE_IMAGE") and "pull access denied" not in built.stderr \
                    and "pytorch/pytorch" in built.stderr + built.stdout:
                pytest.skip("the base image cannot be pulled here; build a stand-in with "
                            "tests/docker/standin_base.sh and set BASE_IMAGE")
            pytest.fail(f"docker compose build failed:\n{built.stdout[-3000:]}\n"
                        f"{built.stderr[-3000:]}")
        # 'up' waits for the bootstrap's health check (its selftest included) before it
        # starts the joiners
        project("up", "-d", "--no-build", "--scale", f"joiner={JOINERS}", timeout=600)
        yield project
    finally:
        project("down", "--volumes", "--timeout", "90", timeout=300, check=False)
        _run(["docker", "image", "rm", "-f", project.image], 120, check=False)


def _until(compose: Compose, what: str, check: Callable[[dict[str, Status]], bool],
           timeout: float) -> dict[str, Status]:
    deadline = time.monotonic() + timeout
    statuses: dict[str, Status] = {}
    while True:
        statuses = {}
        for name in compose.containers():
            status = compose.status(name)
            if status is not None:
                statuses[name] = status
        if check(statuses):
            return statuses
        if time.monotonic() > deadline:
            summary = "\n".join(f"{n}: {_summary(s)}" for n, s in statuses.items())
            pytest.fail(f"{what}: not within {timeout:g} s\n{summary}\n{compose.logs()}")
        time.sleep(5)


def _summary(status: Status) -> str:
    server = status["components"].get("stage_server") or {}
    trainer = status["components"].get("trainer") or {}
    averaging = server.get("averaging") or {}
    return (f"{status['peer_id'][-8:]} state={status['state']} stage={status.get('stage')} "
            f"micro-batches={trainer.get('micro_batches')} "
            f"participants={averaging.get('participants')} "
            f"digest={str(server.get('param_digest'))[:12]}@{server.get('digest_epoch')}")


def _completed(status: Status) -> int:
    trainer = status["components"].get("trainer") or {}
    return int((trainer.get("micro_batches") or {}).get("completed", 0))


def _restarted_and_training(status: Status | None, killed: float) -> bool:
    """Whether a node's status comes from after it was killed (monotonic ``killed``) and
    shows it online, serving its stage and having trained since."""
    if not status:
        return False
    server = status.get("components", {}).get("stage_server") or {}
    return bool(
        status["uptime_s"] < time.monotonic() - killed
        and status["state"] == "online" and server.get("state") == "online"
        and _completed(status) > 0
    )


# Every step below has its own bound (health, training, averaging, two restarts of up to
# 240 s each, a stop of up to 300 s), and the module's fixture builds the image first; the
# suite's default of 300 s for the whole test is below their sum: on a slower 2-core machine
# the test once passed every check and was cut off while its daemons were leaving.
@pytest.mark.timeout(1200)
def test_compose_swarm_trains_averages_rejoins_and_leaves(compose: Compose) -> None:
    names = compose.containers()
    assert len(names) == N_NODES, names
    for name in names:
        health = _run(["docker", "inspect", "-f", "{{.State.Health.Status}}", name], 30).stdout
        assert health.strip() in ("healthy", "starting"), f"{name}: health {health!r}"

    # every node online, announcing no loopback address, every stage served, and every
    # trainer through all stages (a completed micro-batch crossed every stage)
    def training(statuses: dict[str, Status]) -> bool:
        return (len(statuses) == N_NODES
                and all(s["state"] == "online" and _completed(s) > 0 for s in statuses.values())
                and {s.get("stage") for s in statuses.values()} >= set(
                    range(next(iter(statuses.values()))["n_stages"])))

    statuses = _until(compose, "every trainer completes micro-batches", training, 300)
    for name, status in statuses.items():
        addrs = [*status["dht_addrs"], status["quic_addr"]]
        assert addrs and not any(a.startswith(LOOPBACK) for a in addrs), (name, addrs)

    # four nodes on three stages: one stage has two replicas, and they average across
    # containers (hivemind's all-reduce over the compose network)
    def averaged(statuses: dict[str, Status]) -> bool:
        return any(
            int(((s["components"].get("stage_server") or {}).get("averaging") or {})
                .get("participants") or 0) >= 2
            for s in statuses.values())

    _until(compose, "two replicas of a stage average in one round", averaged, 300)

    # a joiner SIGKILLed and started again: same identity (its state volume), a new
    # process that serves its stage and trains again
    joiner = next(n for n in names if "joiner" in n)
    before = statuses[joiner]
    killed = time.monotonic()
    _run(["docker", "kill", "--signal", "KILL", joiner], 60)
    _run(["docker", "start", joiner], 120)

    def back(statuses: dict[str, Status]) -> bool:
        return _restarted_and_training(statuses.get(joiner), killed)

    after = _until(compose, f"{joiner} serves and trains again after SIGKILL", back, 240)
    assert after[joiner]["peer_id"] == before["peer_id"]

    # the bootstrap too: it has no initial peers, and finds the swarm again through the
    # members it remembered (peers.json, node/membership/address_book.py)
    boot = next(n for n in names if "bootstrap" in n)
    boot_id = after[boot]["peer_id"]
    killed = time.monotonic()
    _run(["docker", "kill", "--signal", "KILL", boot], 60)
    _run(["docker", "start", boot], 120)

    def boot_back(statuses: dict[str, Status]) -> bool:
        s = statuses.get(boot)
        return _restarted_and_training(s, killed) and len((s or {})["peers"]) >= N_NODES - 1

    again = _until(compose, "the bootstrap knows the swarm, serves and trains after SIGKILL",
                   boot_back, 240)
    assert again[boot]["peer_id"] == boot_id
    assert "remembered peer(s) answered" in compose.logs_of(boot)

    # graceful leave: SIGTERM through tini, every daemon withdraws and exits 0
    compose("stop", "--timeout", "90", timeout=300)
    for name in names:
        code = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name], 30).stdout
        assert code.strip() == "0", f"{name} exited {code.strip()}\n{compose.logs(30)}"
        logs = _run(["docker", "logs", "--tail", "40", name], 30)
        log = logs.stdout + logs.stderr
        assert "left the swarm" in log, f"{name}:\n{log}"
