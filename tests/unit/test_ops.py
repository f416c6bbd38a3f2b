"""Ops files: the Dockerfile's required directives, compose file, its helper, systemd unit."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from wanswarm.node.config.node_config import NodeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = NodeConfig()


def _instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _one(keyword: str) -> str:
    values = [rest for k, rest in _instructions() if k == keyword]
    assert len(values) == 1, f"Dockerfile needs exactly one {keyword}"
    return values[0]


def _env() -> dict[str, str]:
    env = {}
    for keyword, rest in _instructions():
        if keyword == "ENV":
            for name, value in re.findall(r"(\w+)=(\S+)", rest):
                env[name] = value
    return env


def test_dockerfile_base_user_entrypoint_and_cmd() -> None:
    # FROM ${BASE_IMAGE}, whose default is a CUDA runtime image of PyTorch (tests/docker
    # builds on a stand-in where Docker Hub is out of reach); the ARG comes before FROM
    keywords = [k for k, _ in _instructions()]
    assert keywords[:2] == ["ARG", "FROM"] and _one("FROM") == "${BASE_IMAGE}"
    name, _, default = _one("ARG").partition("=")
    assert name == "BASE_IMAGE"
    assert re.match(r"pytorch/pytorch:[\w.]+-cuda[\d.]+-cudnn\d+-runtime$", default)
    user = _one("USER")
    assert user not in ("root", "0") and not user.startswith("0:")
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert any(k == "RUN" and "pip install ." in rest for k, rest in _instructions())
    assert json.loads(_one("ENTRYPOINT")) == ["wanswarm"]  # exec form: signals reach the daemon
    cmd = json.loads(_one("CMD"))
    assert cmd[0] == "join"
    assert _one("STOPSIGNAL") == "SIGTERM"


def test_dockerfile_state_volume_ports_and_healthcheck() -> None:
    env = _env()
    assert json.loads(_one("VOLUME")) == [env["STATE_DIRECTORY"]]
    exposed = set(_one("EXPOSE").split())
    assert exposed == {
        f"{env['WANSWARM__DHT__PORT']}/tcp",
        f"{env['WANSWARM__TRANSPORT__PORT']}/udp",
    }
    config = load_config(environ=env)  # the image's environment is a valid config
    assert config.state_dir == Path(env["STATE_DIRECTORY"])
    health = _one("HEALTHCHECK")
    # Docker before 25 refuses a whole Dockerfile with this flag (seen with 20.10.24)
    assert "--start-interval" not in health
    command = json.loads(health[health.index("CMD") + 3 :].strip())
    # the first check runs the selftest once (a marker in the container's /tmp), then
    # every check asks the daemon (docs/gpu.md)
    assert command[:2] == ["sh", "-c"]
    selftest, status = command[2].split(" && ")
    assert selftest.startswith("wanswarm selftest ") and " --once /tmp/" in selftest
    assert status == "exec wanswarm status"


def _dockerignored(path: str) -> bool:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) for p in patterns)


def test_dockerfile_copies_files_that_exist_and_are_not_ignored() -> None:
    copies = [rest.split() for k, rest in _instructions() if k == "COPY"]
    assert copies
    for *sources, _target in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file"
            assert not _dockerignored(source), f"COPY {source}: excluded by .dockerignore"
    cmd = json.loads(_one("CMD"))
    config_target = cmd[cmd.index("--config") + 1]
    assert ["configs/node.toml", config_target] in copies


def test_compose_starts_a_bootstrap_and_joiners() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    boot, joiner = services["bootstrap"], services["joiner"]
    assert boot["build"]["dockerfile"] == "Dockerfile"
    assert (ROOT / "docker" / boot["build"]["context"] / "Dockerfile").exists()
    assert joiner["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert joiner["entrypoint"][0] == "wanswarm-initial-peers"
    boot_volume = boot["volumes"][0].split(":")
    assert boot_volume[1] == _env()["STATE_DIRECTORY"]
    assert f"{boot_volume[0]}:{joiner['entrypoint'][1]}:ro" in joiner["volumes"]
    grace = int(boot["stop_grace_period"].rstrip("s"))
    assert grace > DEFAULTS.node.shutdown_timeout + DEFAULTS.dht.request_timeout
    assert joiner["deploy"]["replicas"] >= 1
    # all of them share one host's cores: one compute thread each, as `wanswarm demo` runs
    assert boot["environment"]["OMP_NUM_THREADS"] == "1"


def test_initial_peers_helper_filters_loopback_and_execs_join(tmp_path: Path) -> None:
    """Runs docker/initial-peers.sh against a stand-in 'wanswarm' on PATH."""
    script = ROOT / "docker" / "initial-peers.sh"
    assert subprocess.run(["sh", "-n", str(script)], timeout=10).returncode == 0
    fake = tmp_path / "wanswarm"
    peer = "12D3KooWPfgLbNkKzKggCYFjwxJqEseiFJ1V37Enkgs6TDrMjZLk"
    status = {
        "dht_addrs": [
            f"/ip4/127.0.0.1/tcp/31337/p2p/{peer}",
            f"/ip4/172.18.0.2/tcp/31337/p2p/{peer}",
        ]
    }
    fake.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = status ]; then echo '{json.dumps(status)}'; exit 0; fi\n"
        "echo \"exec: $*\"\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", str(script), "/bootstrap", "join", "--config", "/etc/x.toml"],
                            capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"exec: join --config /etc/x.toml --initial-peers /ip4/172.18.0.2/tcp/31337/p2p/{peer}"
    )
    usage = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert usage.returncode == 2 and "usage" in usage.stderr


UNIT = ROOT / "configs" / "systemd" / "wanswarm.service"


def _unit() -> dict[str, str]:
    values = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def test_systemd_unit_directives() -> None:
    unit = _unit()
    assert unit["Type"] == "notify" and unit["NotifyAccess"] == "main"
    assert unit["Restart"] == "on-failure" and unit["RestartPreventExitStatus"] == "2"
    assert unit["WatchdogSec"].endswith("s") and int(unit["WatchdogSec"][:-1]) >= 10
    stop = int(unit["TimeoutStopSec"].rstrip("s"))
    assert stop > (
        DEFAULTS.node.shutdown_timeout + DEFAULTS.dht.request_timeout + DEFAULTS.dht.rpc_timeout
    )
    # SIGTERM to the daemon only; it stops its DHT process itself
    assert unit["KillMode"] == "mixed"
    hardening = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DynamicUser": "yes",
        "StateDirectory": "wanswarm",
    }
    for key, value in hardening.items():
        assert unit[key] == value, key
    assert unit["ExecStart"].split()[1] == "join"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    wanswarm = Path(sys.executable).parent / "wanswarm"
    assert wanswarm.exists()
    # verify the unit as installed here: ExecStart must name an executable that exists
    installed = tmp_path / "wanswarm.service"
    installed.write_text(UNIT.read_text().replace("/opt/wanswarm/bin/wanswarm", str(wanswarm)))
    result = subprocess.run(
        [analyze, "verify", str(installed)], capture_output=True, text=True, timeout=60
    )
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if "wanswarm.service" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
