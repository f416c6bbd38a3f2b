"""The command line: help with examples, exit statuses, one-line config errors, no daemon."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from wanswarm.node.cli import main
from wanswarm.node.config.node_config import NodeConfig
from wanswarm.node.config.template import render_template

CLI = [sys.executable, "-m", "wanswarm.node.cli"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("command", [[], ["join"], ["status"], ["leave"], ["config"]])
def test_help_teaches_usage_with_examples(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "wanswarm" in out


@pytest.mark.parametrize(
    ("config_text", "flags", "expected"),
    [
        (
            "[dht]\nprot = 31337\n",
            [],
            "wanswarm: config error: dht.prot: unknown key; allowed: host, port",
        ),
        (
            "[node]\nshutdown_timeout = 'soon'\n",
            [],
            "node.shutdown_timeout: must be a finite number (got 'soon')",
        ),
        ("", ["--dht-port", "70000"], "dht.port: must be ≤ 65535 (got 70000) [from --dht-port]"),
        ("[dht\n", [], "invalid TOML"),
    ],
)
def test_config_errors_exit_2_with_one_line(
    tmp_path: Path, config_text: str, flags: list[str], expected: str
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(config_text)
    result = _run("join", "--config", str(path), "--state-dir", str(tmp_path / "state"), *flags)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0]
    assert not (tmp_path / "state").exists()  # nothing started


@pytest.mark.parametrize("command", ["status", "leave"])
def test_no_daemon_exits_1_with_a_clear_message(command: str) -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="wscli-", dir="/tmp"))
    try:
        result = _run(command, "--state-dir", str(state_dir))
    finally:
        state_dir.rmdir()
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"wanswarm: no daemon is running (nothing listens on {state_dir}/control.sock"
    )
    assert "Traceback" not in result.stderr


def test_config_prints_defaults_and_effective_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--defaults"]) == 0
    assert capsys.readouterr().out == render_template(NodeConfig)
    assert (
        main(["config", "--state-dir", "/tmp/x", "--set", "dht.port=5", "--host", "127.0.0.1"]) == 0
    )
    out = capsys.readouterr().out
    assert "[dht]\nhost = \"127.0.0.1\"\nport = 5\n" in out
    assert 'state_dir = "/tmp/x"' in out and 'socket = "/tmp/x/control.sock"' in out
    assert "[transport]\nhost = \"127.0.0.1\"" in out  # --host binds both sockets


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["join", "--dht-port", "many"])
    assert exit_info.value.code == 2
    assert main(["config", "--set", "no-equals-sign"]) == 2
    assert "expected section.key=value" in capsys.readouterr().err
