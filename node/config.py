"""The node's configuration: one frozen pydantic tree composed from its owners' sections.

Precedence, lowest first: defaults < TOML file (``--config``) < environment
(``WANSWARM__SECTION__KEY``; ``__`` separates nesting levels, e.g.
``WANSWARM__TRANSPORT__FEC__ENABLED=false``) < command-line flags (``--set section.key=value``
and the common shortcuts the CLI maps onto keys). Values from the environment and ``--set``
are strings: for string and path fields they are taken as they are, for list fields either a
TOML array or a comma-separated list, otherwise they are read as TOML literals (``70000``,
``true``, ``2.5``).

Every error becomes one :class:`~wanswarm.node.errors.ConfigError` line naming the field, what is
allowed and where the bad value came from, e.g.
``dht.port: must be ≤ 65535 (got 70000) [from WANSWARM__DHT__PORT]``.

Sections live next to their owners (log in logs.py, control in control.py, metrics in
metrics.py, prober in prober.py, transport in wanswarm.transport.config); the node and DHT
sections live here because their owners (daemon.py, dht.py) import hivemind and torch, which
``wanswarm status`` must not pay for.

``python -m wanswarm.node.config --dump-toml`` prints the commented template that is committed
as configs/node.toml (see config_template.py).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..transport.config import TransportConfig
from .control import ControlConfig
from .errors import ConfigError
from .logs import LogConfig
from .metrics import MetricsConfig
from .prober import ProberConfig
from .averaging import AveragingConfig
from .stage_server import StageServerConfig
from .trainer import TrainerConfig

ENV_PREFIX = "WANSWARM__"
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# A multiaddr that names the peer to dial: /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...
_PEER_MADDR = re.compile(r"^(/[A-Za-z0-9_.:-]+)+/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}$")
_MADDR = re.compile(r"^(/[A-Za-z0-9_.:-]+)+$")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def check_host(value: str) -> str:
    """An IP address literal (what hivemind's and QUIC's bind addresses accept)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(
            f"must be an IPv4 or IPv6 address such as 0.0.0.0 or 127.0.0.1 (got {value!r})"
        ) from None
    return value


class NodeSection(_Section):
    """The daemon itself: where it keeps state, which run it joins, which roles it plays."""

    state_dir: Path | None = Field(
        default=None,
        description=(
            "Directory for identity.key, control.sock and checkpoints (created with mode 0700). "
            "Unset: $STATE_DIRECTORY (systemd's StateDirectory=), else $XDG_DATA_HOME/wanswarm, "
            "else ~/.local/share/wanswarm."
        ),
    )
    run: str = Field(
        default="demo",
        pattern=RUN_NAME_PATTERN,
        description="Name of the training run to join: letters, digits, '-' and '_', at most 64.",
    )
    server: bool = Field(default=True, description="Serve a pipeline stage.")
    trainer: bool = Field(default=True, description="Drive micro-batches through the swarm.")
    shutdown_timeout: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "Seconds a leave (SIGTERM, SIGINT, 'wanswarm leave') may take to finish in-flight work "
            "before the daemon withdraws its record and exits."
        ),
    )
    drain_grace: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Seconds to stay listed as 'draining' before withdrawing, so that peers that read our "
            "record just before the leave see the change and stop sending work."
        ),
    )
    record_ttl: float = Field(
        default=30.0,
        ge=3,
        le=3600,
        description=(
            "Lifetime of our DHT records, seconds; they are re-announced at a third of it. A node "
            "that dies without leaving drops out of peers' lists after at most this long."
        ),
    )
    announce_jitter: float = Field(
        default=0.1,
        ge=0,
        le=0.5,
        description="Relative jitter of every periodic loop (0.1: each period varies by ±10%).",
    )
    membership_period: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Seconds between reads of the swarm's records (the peer list).",
    )
    run_spec: Path | None = Field(
        default=None,
        description=(
            "Run spec TOML (model, stages, batch, optimizer, codecs, data; see configs/runs/). "
            "Unset: the embedded default tiny run. Every peer of a run must use the same spec."
        ),
    )
    announce_host: str = Field(
        default="",
        description=(
            "QUIC host announced to peers; empty: the bound address (or 127.0.0.1 when bound to "
            "0.0.0.0). Set it when peers reach us through another address (NAT, a WAN emulator)."
        ),
    )
    announce_port: int = Field(
        default=0, ge=0, le=65535, description="QUIC port announced to peers; 0: the bound port."
    )
    join_backoff: float = Field(
        default=3.0,
        ge=0,
        le=600,
        description=(
            "Longest random wait, seconds, before a server re-reads the records and claims a stage, "
            "so that servers starting together spread over the stages."
        ),
    )

    @model_validator(mode="after")
    def _drain_fits(self) -> NodeSection:
        if self.drain_grace >= self.shutdown_timeout:
            raise ValueError(
                f"drain_grace ({self.drain_grace}) must be shorter than shutdown_timeout "
                f"({self.shutdown_timeout}); lower node.drain_grace or raise node.shutdown_timeout"
            )
        return self


class DhtConfig(_Section):
    """Membership: hivemind's Kademlia DHT over a libp2p daemon (TCP)."""

    host: str = Field(default="0.0.0.0", description="Address the DHT's TCP socket binds to.")
    port: int = Field(default=0, ge=0, le=65535, description="TCP port of the DHT; 0 picks a free one.")
    initial_peers: tuple[str, ...] = Field(
        default=(),
        description=(
            "Multiaddrs of running peers to join through, each ending in /p2p/<peer id> (what "
            "'wanswarm status' prints as dht_addrs). Empty: start a new swarm."
        ),
    )
    announce_maddrs: tuple[str, ...] = Field(
        default=(),
        description=(
            "Multiaddrs other peers should dial to reach us (e.g. /ip4/203.0.113.7/tcp/31337 behind "
            "a forwarded port). Empty: the addresses libp2p observes."
        ),
    )
    bootstrap_timeout: float = Field(
        default=60.0, gt=0, le=600, description="Seconds to start the DHT and hear from an initial peer."
    )
    rpc_timeout: float = Field(
        default=5.0, gt=0, le=120, description="Seconds one DHT RPC to one peer may take."
    )
    request_timeout: float = Field(
        default=15.0,
        gt=0,
        le=600,
        description="Seconds one store or lookup (several RPCs across the DHT) may take.",
    )

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("initial_peers")
    @classmethod
    def _check_initial_peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not _PEER_MADDR.match(item):
                raise ValueError(
                    f"each entry must be a multiaddr ending in /p2p/<peer id>, such as "
                    f"/ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... (got {item!r})"
                )
        return value

    @field_validator("announce_maddrs")
    @classmethod
    def _check_announce(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not _MADDR.match(item) or "/p2p/" in item:
                raise ValueError(
                    f"each entry must be a multiaddr without /p2p/, such as /ip4/203.0.113.7/tcp/31337 "
                    f"(got {item!r})"
                )
        return value

    @model_validator(mode="after")
    def _timeouts_nest(self) -> DhtConfig:
        if self.rpc_timeout > self.request_timeout:
            raise ValueError(
                f"rpc_timeout ({self.rpc_timeout}) must not exceed request_timeout "
                f"({self.request_timeout}); lower dht.rpc_timeout or raise dht.request_timeout"
            )
        return self


class NodeConfig(_Section):
    """Every setting of a wanswarm daemon."""

    node: NodeSection = Field(default_factory=NodeSection)
    dht: DhtConfig = Field(default_factory=DhtConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    prober: ProberConfig = Field(default_factory=ProberConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    stage_server: StageServerConfig = Field(default_factory=StageServerConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @property
    def state_dir(self) -> Path:
        """The resolved state directory (load_config always sets it)."""
        if self.node.state_dir is None:
            raise ConfigError("node.state_dir: not resolved; build the config with load_config()")
        return self.node.state_dir

    @property
    def control_socket(self) -> Path:
        return self.control.socket if self.control.socket is not None else self.state_dir / "control.sock"


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Override:
    """One value set above the file: ``path`` is dotted (``dht.port``), ``source`` is for errors.

    ``raw`` values are strings typed by the user (environment, ``--set``) and are converted by
    the target field's type; other values (from typed CLI flags) are used as they are.
    """

    path: str
    value: Any
    source: str
    raw: bool = True


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """$STATE_DIRECTORY (first entry), else $XDG_DATA_HOME/wanswarm, else ~/.local/share/wanswarm."""
    if environ.get("STATE_DIRECTORY"):
        # systemd passes a colon-separated list when the unit names several directories
        return Path(environ["STATE_DIRECTORY"].split(":")[0])
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"]) / "wanswarm"
    home = environ.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "wanswarm"


def env_overrides(environ: Mapping[str, str]) -> list[Override]:
    """``WANSWARM__SECTION__KEY=value`` variables as overrides, in a stable order."""
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            path = ".".join(part.lower() for part in name[len(ENV_PREFIX) :].split("__"))
            out.append(Override(path, environ[name], name))
    return out


def parse_assignment(text: str, source: str = "--set") -> Override:
    """``section.key=value`` (from ``--set``) as an override."""
    path, sep, value = text.partition("=")
    path = path.strip()
    if not sep or not path or not all(path.split(".")):
        raise ConfigError(f"{source} {text!r}: expected section.key=value, e.g. dht.port=31337")
    return Override(path, value, f"{source} {path}")


def load_config(
    *,
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Override] = (),
) -> NodeConfig:
    """Build the root config from defaults, the file, the environment and the overrides.

    The returned tree has ``node.state_dir`` and ``control.socket`` resolved to absolute paths.
    Raises ConfigError (one line) on any problem.
    """
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    if file is not None:
        _merge(tree, _read_toml(file), provenance, str(file), ())
    for override in [*env_overrides(environ), *overrides]:
        parts = override.path.split(".")
        value = _coerce(override.value, parts) if override.raw and isinstance(override.value, str) else override.value
        _set_path(tree, parts, value, override.source)
        provenance[override.path] = override.source
    try:
        config = NodeConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, provenance)) from None
    return _resolve_paths(config, environ)


def _resolve_paths(config: NodeConfig, environ: Mapping[str, str]) -> NodeConfig:
    state_dir = config.node.state_dir if config.node.state_dir is not None else default_state_dir(environ)
    state_dir = Path(os.path.abspath(state_dir.expanduser()))
    socket = config.control.socket if config.control.socket is not None else state_dir / "control.sock"
    socket = Path(os.path.abspath(socket.expanduser()))
    return config.model_copy(
        update={
            "node": config.node.model_copy(update={"state_dir": state_dir}),
            "control": config.control.model_copy(update={"socket": socket}),
        }
    )


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{file}: cannot read config file: {reason}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: invalid TOML: {exc}") from None


def _merge(
    into: dict[str, Any], new: Mapping[str, Any], provenance: dict[str, str], source: str, prefix: tuple[str, ...]
) -> None:
    for key, value in new.items():
        path = (*prefix, key)
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value, provenance, source, path)
        elif isinstance(value, Mapping):
            into[key] = {}
            _merge(into[key], value, provenance, source, path)
        else:
            into[key] = value
            provenance[".".join(path)] = source


def _set_path(tree: dict[str, Any], parts: list[str], value: Any, source: str) -> None:
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"{'.'.join(parts[: depth + 1])}: is a value, not a section, so {'.'.join(parts)} "
                f"cannot be set [from {source}]"
            )
        node = child
    node[parts[-1]] = value


def _field_annotation(parts: list[str]) -> Any:
    """The annotation of the field at ``parts`` in NodeConfig, or None when there is none."""
    model: Any = NodeConfig
    annotation: Any = None
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = annotation
    return annotation


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _coerce(raw: str, parts: list[str]) -> Any:
    """Turn a user-typed string into a value for the field at ``parts`` (see module docstring)."""
    annotation, optional = _strip_optional(_field_annotation(parts))
    if optional and raw.strip() in ("", "none", "null"):
        return None
    if annotation in (str, Path):
        return raw
    if typing.get_origin(annotation) in (list, tuple) and not raw.lstrip().startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# --------------------------------------------------------------------------- error messages


def _allowed_keys(parts: Sequence[str | int]) -> list[str]:
    model: Any = NodeConfig
    for part in parts:
        is_model = isinstance(model, type) and issubclass(model, BaseModel)
        field = model.model_fields.get(str(part)) if is_model else None
        if field is None:
            return []
        model = field.annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _describe_one(error: Mapping[str, Any]) -> tuple[str, str]:
    loc = [p for p in error["loc"] if isinstance(p, str | int)]
    # list items show up as tuple indices; keep the field name only
    field_parts = [p for p in loc if isinstance(p, str)]
    field = ".".join(field_parts) or "config"
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(field_parts[:-1])
        what = "section" if len(field_parts) == 1 else "key"
        return field, f"unknown {what}; allowed: {', '.join(allowed)}"
    bounds = {
        "less_than_equal": ("≤", "le"),
        "less_than": ("<", "lt"),
        "greater_than_equal": ("≥", "ge"),
        "greater_than": (">", "gt"),
    }
    if kind in bounds:
        symbol, key = bounds[kind]
        text = f"must be {symbol} {ctx.get(key)}"
    elif kind == "literal_error":
        text = f"must be one of {ctx.get('expected')}"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        text = "must be an integer"
    elif kind in ("float_type", "float_parsing", "finite_number"):
        text = "must be a finite number"
    elif kind in ("bool_type", "bool_parsing"):
        text = "must be true or false"
    elif kind == "string_type":
        text = "must be a string"
    elif kind in ("list_type", "tuple_type"):
        text = "must be a list"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        text = "must be a table (a [section])"
    elif kind == "string_pattern_mismatch":
        text = f"must match {ctx.get('pattern')}"
    elif kind == "value_error":
        # our validators write complete sentences (they already quote the bad value)
        return field, str(error["msg"]).removeprefix("Value error, ")
    else:
        text = str(error["msg"])
        text = text[:1].lower() + text[1:]
    return field, f"{text} (got {got!r})"


def describe_validation_error(exc: ValidationError, provenance: Mapping[str, str] | None = None) -> str:
    """One line for all errors of ``exc``: ``field: problem [from source]; ...``."""
    provenance = provenance or {}
    parts = []
    for error in exc.errors():
        field, text = _describe_one(error)
        source = provenance.get(field)
        parts.append(f"{field}: {text}" + (f" [from {source}]" if source else ""))
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wanswarm.node.config --dump-toml``: print the commented template."""
    from .config_template import render_template

    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--dump-toml"]:
        sys.stderr.write("usage: python -m wanswarm.node.config --dump-toml\n")
        return 2
    sys.stdout.write(render_template(NodeConfig))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "ENV_PREFIX",
    "DhtConfig",
    "NodeConfig",
    "NodeSection",
    "Override",
    "default_state_dir",
    "describe_validation_error",
    "env_overrides",
    "load_config",
    "parse_assignment",
]
