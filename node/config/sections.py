"""The daemon's own config sections (node, dht, rebalance) and the client's view of the config.

Kept to pydantic and the standard library so that ``wanswarm status`` and ``wanswarm leave``,
which need only the state directory and the control socket, load their config without
importing the daemon's heavy parts (hivemind, torch): :class:`ClientConfig` is the slice of the
root tree they read, with the other sections ignored. The full tree is config.NodeConfig.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..control import ControlConfig
from ..errors import ConfigError
from ..stage.selection import RebalancePolicy
from .layers import Override, build, default_state_dir

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
            "QUIC host announced to peers, overriding what the node learns: empty: the address "
            "peers observe us at (after a reachability check, docs/nat.md), before that the "
            "bound address or, bound to 0.0.0.0, the interface address toward the swarm (never "
            "loopback off-host). Set it for a forwarded port on a fixed public address."
        ),
    )
    announce_port: int = Field(
        default=0, ge=0, le=65535, description="QUIC port announced to peers; 0: the bound port."
    )
    reach_period: float = Field(
        default=120.0,
        ge=5,
        le=3600,
        description=(
            "Seconds between reachability checks once the node knows its public address and "
            "NAT type (until then it checks every few seconds as peers appear)."
        ),
    )
    reach_timeout: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="Seconds each observed-address request or dial-back of a check may take.",
    )
    stage: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Serve this pipeline stage instead of choosing the least-served one. Unset: choose."
        ),
    )
    join_backoff: float = Field(
        default=3.0,
        ge=0,
        le=600,
        description=(
            "Longest random wait, seconds, before a server re-reads the records and claims a "
            "stage, so that servers starting together spread over the stages."
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
    port: int = Field(
        default=0, ge=0, le=65535, description="TCP port of the DHT; 0 picks a free one."
    )
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
            "Multiaddrs other peers should dial to reach us (e.g. /ip4/203.0.113.7/tcp/31337 "
            "behind a forwarded port). Empty: the addresses libp2p observes."
        ),
    )
    bootstrap_timeout: float = Field(
        default=60.0,
        gt=0,
        le=600,
        description="Seconds to start the DHT and hear from an initial peer.",
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
    num_replicas: int = Field(
        default=5,
        ge=1,
        le=20,
        description=(
            "DHT nodes that store each record (Kademlia's k; hivemind's default 5); lookups ask "
            "about as many. Fewer means fewer RPCs per store and lookup, at the cost of records "
            "lost sooner when their holders leave: a few for a small, stable swarm."
        ),
    )
    use_relays: bool = Field(
        default=True,
        description=(
            "Behind a NAT or firewall (found by libp2p's AutoNAT, or set by reachability), "
            "reserve a slot on a public peer's circuit relay and announce the relayed address, "
            "so that peers behind other NATs reach us (averaging, state downloads). "
            "docs/nat.md."
        ),
    )
    relays: tuple[str, ...] = Field(
        default=(),
        description=(
            "Public peers to reserve relay slots on, each ending in /p2p/<peer id>. Empty: the "
            "initial peers. Reservations start as soon as AutoNAT finds us unreachable; with no "
            "relays and no initial peers, libp2p looks for relays in the DHT instead (about 3 "
            "minutes until it reserves when fewer than 4 candidates are known)."
        ),
    )
    reachability: str = Field(
        default="auto",
        description=(
            "'auto': AutoNAT decides whether others can dial us; 'public' or 'private' forces "
            "it ('private' reserves relay slots at once; 'public' never does)."
        ),
    )
    nat_port_map: bool = Field(
        default=True,
        description="Ask the home router to forward a port (UPnP / NAT-PMP) when it offers to.",
    )
    relay_service: bool = Field(
        default=True,
        description=(
            "Relay for peers behind NAT when we are reachable (circuit relay v2 hop), within "
            "the relay_* limits below."
        ),
    )
    relay_max_reservations: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Peers that may hold a relay slot on this node at once.",
    )
    relay_max_circuits: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Relayed connections open at once per peer that holds a slot.",
    )
    relay_buffer_kib: int = Field(
        default=1024,
        ge=16,
        le=65536,
        description=(
            "Buffer of each relayed connection, KiB (memory per circuit; libp2p's daemon "
            "defaults to 16 MiB)."
        ),
    )
    relay_data_limit_mib: int = Field(
        default=4096,
        ge=1,
        le=1 << 20,
        description=(
            "MiB one relayed connection may carry each way before the relay resets it (the "
            "peers then dial a new one)."
        ),
    )
    relay_time_limit: float = Field(
        default=1800.0,
        gt=0,
        le=86400,
        description="Seconds one relayed connection may last before the relay resets it.",
    )

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("reachability")
    @classmethod
    def _check_reachability(cls, value: str) -> str:
        if value not in ("auto", "public", "private"):
            raise ValueError(f"must be 'auto', 'public' or 'private' (got {value!r})")
        return value

    @field_validator("initial_peers", "relays")
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
                    "each entry must be a multiaddr without /p2p/, such as "
                    f"/ip4/203.0.113.7/tcp/31337 (got {item!r})"
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


class RebalanceConfig(RebalancePolicy):
    """Moving stage servers from the best-served stage to the worst-served one
    (docs/stage_selection.md).

    The policy fields (period_s, jitter, min_gain, load_s, max_moves) are
    stage_selection.RebalancePolicy's: every server of a run should use the same values, so
    that they all compute the same plan.
    """

    enabled: bool = Field(
        default=True,
        description=(
            "Check every period_s (jittered) whether moving this server to another stage raises "
            "the swarm's bottleneck throughput by min_gain, and move when the plan names it."
        ),
    )
    move_pinned: bool = Field(
        default=False,
        description=(
            "Let a server pinned with node.stage move too (node.stage then only picks its first "
            "stage). Off: a pinned server never moves."
        ),
    )
    drain_timeout_s: float = Field(
        default=20.0,
        gt=0,
        le=600,
        description=(
            "Seconds a moving server may take to finish the requests queued at its old stage and "
            "apply pending averaging before it closes that stage."
        ),
    )


class ClientConfig(BaseModel):
    """The sections a control client reads; the daemon's other sections are not looked at."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    node: NodeSection = Field(default_factory=NodeSection)
    control: ControlConfig = Field(default_factory=ControlConfig)

    @property
    def state_dir(self) -> Path:
        if self.node.state_dir is None:
            raise ConfigError(
                "node.state_dir: not resolved; build the config with load_client_config()"
            )
        return self.node.state_dir

    @property
    def control_socket(self) -> Path:
        return (
            self.control.socket
            if self.control.socket is not None
            else self.state_dir / "control.sock"
        )


def resolved_paths(
    node: NodeSection, control: ControlConfig, environ: Mapping[str, str]
) -> dict[str, BaseModel]:
    """``node`` and ``control`` with the state dir and the socket made absolute (defaults
    filled)."""
    state_dir = node.state_dir if node.state_dir is not None else default_state_dir(environ)
    state_dir = Path(os.path.abspath(state_dir.expanduser()))
    socket = control.socket if control.socket is not None else state_dir / "control.sock"
    socket = Path(os.path.abspath(socket.expanduser()))
    return {
        "node": node.model_copy(update={"state_dir": state_dir}),
        "control": control.model_copy(update={"socket": socket}),
    }


def load_client_config(
    *,
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Override] = (),
) -> ClientConfig:
    """The client's slice of the config, layered like node_config.load_config; ConfigError on
    problems."""
    environ = os.environ if environ is None else environ
    config = build(ClientConfig, file=file, environ=environ, overrides=overrides)
    return config.model_copy(update=resolved_paths(config.node, config.control, environ))
