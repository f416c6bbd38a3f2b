"""The config tree: defaults, the committed template, precedence, and one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from wanswarm.node.config.node_config import (
    NodeConfig,
    Override,
    env_overrides,
    load_config,
    parse_assignment,
)
from wanswarm.node.config.template import render_template, render_values
from wanswarm.node.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs" / "node.toml"
ENV = {"HOME": "/home/volunteer"}


def test_committed_template_matches_the_generator() -> None:
    assert TEMPLATE.read_text() == render_template(NodeConfig), (
        "configs/node.toml is stale: regenerate it with "
        "'python -m wanswarm.node.config.node_config --dump-toml > configs/node.toml'"
    )


def test_template_parses_back_to_the_defaults() -> None:
    assert NodeConfig.model_validate(tomllib.loads(TEMPLATE.read_text())) == NodeConfig()


def test_every_field_of_the_template_is_described() -> None:
    def walk(model: type, path: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                missing += walk(field.annotation, f"{path}{name}.")
            elif not field.description:
                missing.append(path + name)
        return missing

    assert walk(NodeConfig, "") == []


def test_effective_values_render_as_toml_that_loads_back(tmp_path: Path) -> None:
    config = load_config(environ=ENV, overrides=[parse_assignment("dht.port=31337")])
    path = tmp_path / "effective.toml"
    path.write_text(render_values(config))
    assert load_config(file=path, environ={}) == config


def test_defaults_resolve_state_dir_and_socket() -> None:
    config = load_config(environ=ENV)
    assert config.state_dir == Path("/home/volunteer/.local/share/wanswarm")
    assert config.control_socket == config.state_dir / "control.sock"
    assert load_config(environ={**ENV, "XDG_DATA_HOME": "/x"}).state_dir == Path("/x/wanswarm")
    systemd = load_config(environ={**ENV, "STATE_DIRECTORY": "/var/lib/wanswarm:/var/lib/other"})
    assert systemd.state_dir == Path("/var/lib/wanswarm")
    assert systemd.control_socket == Path("/var/lib/wanswarm/control.sock")


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("[dht]\nport = 1000\nhost = '127.0.0.1'\n[node]\nrun = 'from-file'\n")
    assert load_config(file=path, environ=ENV).dht.port == 1000
    env = {**ENV, "WANSWARM__DHT__PORT": "2000"}
    assert load_config(file=path, environ=env).dht.port == 2000
    flags = [parse_assignment("dht.port=3000")]
    config = load_config(file=path, environ=env, overrides=flags)
    assert config.dht.port == 3000
    # untouched keys survive
    assert config.dht.host == "127.0.0.1" and config.node.run == "from-file"
    typed = [Override("dht.port", 4000, "--dht-port", raw=False)]
    assert load_config(file=path, environ=env, overrides=[*flags, *typed]).dht.port == 4000


def test_environment_values_are_typed_by_their_field() -> None:
    peer = "/ip4/10.0.0.5/tcp/31337/p2p/12D3KooWPfgLbNkKzKggCYFjwxJqEseiFJ1V37Enkgs6TDrMjZLk"
    env = {
        **ENV,
        "WANSWARM__DHT__INITIAL_PEERS": f"{peer}, {peer}",  # comma-separated list
        "WANSWARM__DHT__ANNOUNCE_MADDRS": '["/ip4/203.0.113.7/tcp/31337"]',  # TOML array
        "WANSWARM__TRANSPORT__FEC__ENABLED": "false",  # nested section, TOML literal
        "WANSWARM__NODE__RUN": "true",  # a string field keeps the string
        "WANSWARM__NODE__SHUTDOWN_TIMEOUT": "12.5",
        "WANSWARM__CONTROL__SOCKET": "",  # optional: empty means unset
        "WANSWARM_UNRELATED": "ignored",
    }
    config = load_config(environ=env)
    assert config.dht.initial_peers == (peer, peer)
    assert config.dht.announce_maddrs == ("/ip4/203.0.113.7/tcp/31337",)
    assert config.transport.fec.enabled is False
    assert config.node.run == "true"
    assert config.node.shutdown_timeout == 12.5
    assert config.control_socket == config.state_dir / "control.sock"
    assert [o.path for o in env_overrides(env)][0] == "control.socket"


def test_config_is_frozen() -> None:
    config = NodeConfig()
    with pytest.raises(ValidationError):
        config.dht.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("file_text", "env", "expected"),
    [
        ("[dht]\nprot = 1\n", {}, "dht.prot: unknown key; allowed: host, port, initial_peers"),
        ("[dhtt]\n", {}, "dhtt: unknown section; allowed: node, dht, control"),
        ("[dht]\nport = 'x'\n", {}, "dht.port: must be an integer (got 'x')"),
        (
            "",
            {"WANSWARM__DHT__PORT": "70000"},
            "dht.port: must be ≤ 65535 (got 70000) [from WANSWARM__DHT__PORT]",
        ),
        ("[log]\nformat = 'xml'\n", {}, "log.format: must be one of 'text' or 'json' (got 'xml')"),
        (
            "[node]\nrun = 'a.b'\n",
            {},
            "node.run: must match ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$ (got 'a.b')",
        ),
        ("[dht]\nhost = 'localhost'\n", {}, "dht.host: must be an IPv4 or IPv6 address"),
        (
            "[dht]\ninitial_peers = ['/ip4/1.2.3.4/tcp/1']\n",
            {},
            "dht.initial_peers: each entry must be a multiaddr",
        ),
        (
            "[node]\ndrain_grace = 40\n",
            {},
            "node: drain_grace (40.0) must be shorter than shutdown_timeout",
        ),
        ("[dht]\nport = -1\n", {}, "dht.port: must be ≥ 0 (got -1)"),
        ("[prober]\ntimeout = 20\n", {}, "lower prober.timeout or raise prober.period"),
    ],
)
def test_bad_values_give_one_line_naming_the_field(
    tmp_path: Path, file_text: str, env: dict[str, str], expected: str
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(file_text)
    with pytest.raises(ConfigError) as info:
        load_config(file=path, environ={**ENV, **env})
    message = str(info.value)
    assert "\n" not in message
    assert expected in message, message


def test_file_problems_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[dht\nport = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML: .*line 1"):
        load_config(file=bad, environ=ENV)
    with pytest.raises(ConfigError, match=r"missing.toml: cannot read config file: No such file"):
        load_config(file=tmp_path / "missing.toml", environ=ENV)
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_assignment("dht.port")
    with pytest.raises(ConfigError, match="dht.port: is a value, not a section"):
        load_config(
            environ=ENV,
            overrides=[parse_assignment("dht.port=1"), parse_assignment("dht.port.x=2")],
        )


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_port_range_is_enforced_exactly(port: int) -> None:
    override = [Override("dht.port", str(port), "--set dht.port")]
    if 0 <= port <= 65535:
        assert load_config(environ=ENV, overrides=override).dht.port == port
    else:
        with pytest.raises(
            ConfigError,
            match=r"^dht\.port: must be [≤≥] (65535|0) \(got -?\d+\) \[from --set dht\.port\]$",
        ):
            load_config(environ=ENV, overrides=override)
