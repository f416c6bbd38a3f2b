"""The daemon's status report: the record ``wanswarm status --json`` prints, and its text form.

The daemon builds a :class:`StatusReport`, the control socket carries it as JSON, and the CLI
prints either that JSON or :func:`render_text`. ``dht_addrs`` are full multiaddrs (with
``/p2p/<peer id>``) that another node can pass as ``--initial-peers``.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from .logs import short_peer
from .membership.records import ServerState

STATUS_VERSION: Final = 1
DaemonState = Literal["starting", "joining", "online", "draining", "left"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PeerStatus(_Model):
    """One other peer of the run as this node sees it."""

    peer_id: str
    stage: int | None
    state: ServerState
    rtt_ms: float | None = Field(description="Our smoothed RTT to it (RFC 6298), ms.")
    min_rtt_ms: float | None = Field(description="Smallest RTT in the prober's window, ms.")
    probe_failures: int = 0
    throughput: float = 0.0
    queue: int = 0
    quic_addr: str | None = None
    version: str = ""
    nat: str | None = Field(
        default=None, description="Its NAT kind as it announces it (public, cone, symmetric)."
    )
    path: str | None = Field(
        default=None,
        description=(
            "Our connection to it: direct, reversed (it dialled us on request), punched "
            "(UDP hole punching) or relayed; None: no connection now."
        ),
    )


class StatusReport(_Model):
    """What a daemon says about itself (control request ``status``)."""

    v: Literal[1] = STATUS_VERSION
    peer_id: str
    run: str
    stage: int | None
    state: DaemonState
    server: bool
    trainer: bool
    pid: int
    version: str
    uptime_s: float
    dht_addrs: list[str]
    quic_addr: str | None
    peers: list[PeerStatus]
    bytes_in: int | None = Field(
        default=None, description="Payload bytes received (None: no transport)."
    )
    bytes_out: int | None = Field(
        default=None, description="Payload bytes sent (None: no transport)."
    )
    records_published: int = 0
    records_refused: int = Field(
        default=0,
        description="Forged or malformed records our DHT node refused (stores and answers).",
    )
    drain_deadline_s: float | None = Field(
        default=None, description="While draining: seconds left before in-flight work is abandoned."
    )
    shutdown_timeout_s: float = 0.0
    components: dict[str, dict[str, Any]] = Field(default_factory=dict)


def format_duration(seconds: float) -> str:
    """``3h07m``, ``4m05s``, ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def render_text(report: StatusReport) -> str:
    """A summary for people: identity, state, addresses, then the peers grouped by stage."""
    roles = (
        "+".join(r for r, on in (("server", report.server), ("trainer", report.trainer)) if on)
        or "none"
    )
    lines = [
        f"peer id   {report.peer_id}",
        f"run       {report.run}   stage {'-' if report.stage is None else report.stage}   "
        f"state {report.state}   roles {roles}",
        f"uptime    {format_duration(report.uptime_s)}   pid {report.pid}   "
        f"version {report.version}",
    ]
    if report.drain_deadline_s is not None:
        lines.append(
            f"draining  {report.drain_deadline_s:.1f}s left of {report.shutdown_timeout_s:.0f}s"
        )
    lines.append(
        "dht       " + ("\n          ".join(report.dht_addrs) if report.dht_addrs else "-")
    )
    lines.append(f"quic      {report.quic_addr or '-'}{_reach_line(report)}")
    lines.append(f"traffic   in {_bytes(report.bytes_in)}   out {_bytes(report.bytes_out)}")
    lines.append(f"peers     {len(report.peers)} known")
    if report.peers:
        lines.append(
            f"  {'stage':<6} {'peer':<11} {'state':<9} {'rtt':>9} {'min rtt':>9}  "
            f"{'path':<8} {'nat':<9} quic"
        )
        for peer in report.peers:
            stage = "-" if peer.stage is None else str(peer.stage)
            fails = f"  ({peer.probe_failures} failed pings)" if peer.probe_failures else ""
            lines.append(
                f"  {stage:<6} {short_peer(peer.peer_id):<11} {peer.state:<9} "
                f"{_ms(peer.rtt_ms):>9} {_ms(peer.min_rtt_ms):>9}  {peer.path or '-':<8} "
                f"{peer.nat or '-':<9} {peer.quic_addr or '-'}{fails}"
            )
    lines.extend(_training_lines(report))
    for name, fields in sorted(report.components.items()):
        if name in _SUMMARISED:
            continue
        summary = "  ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        lines.append(f"{name:<9} {summary}")
    return "\n".join(lines) + "\n"


def _reach_line(report: StatusReport) -> str:
    """``   nat cone, not reachable, rendezvous 12D3…`` from the endpoint's reachability."""
    reach = report.components.get("endpoint", {}).get("reach")
    if not reach:
        return ""
    text = f"   nat {reach.get('nat', '?')}, "
    text += "reachable" if reach.get("reachable") else "not reachable"
    if reach.get("rendezvous"):
        text += f", rendezvous {short_peer(str(reach['rendezvous']))}"
    return text


_SUMMARISED = frozenset({"stage_server", "trainer", "endpoint"})


def _training_lines(report: StatusReport) -> list[str]:
    """Replicas per stage, the server's work and optimizer step, the trainer's loss and rate."""
    comps = report.components
    lines = []
    replicas: dict[int, int] = {}
    for peer in report.peers:
        if peer.stage is not None and peer.state != "draining":
            replicas[peer.stage] = replicas.get(peer.stage, 0) + 1
    if report.stage is not None and report.server:
        replicas[report.stage] = replicas.get(report.stage, 0) + 1
    if replicas:
        lines.append("stages    " + "   ".join(f"{s}: {n} replica{'s' if n != 1 else ''}"
                                                for s, n in sorted(replicas.items())))
    server = comps.get("stage_server")
    if server:
        lines.append(
            f"server    stage {server.get('stage')} ({server.get('state')})   "
            f"{server.get('applied', 0)} micro-batches served   "
            f"optimizer step {server.get('epoch', 0)}   "
            f"queue {server.get('queue', 0)}   {server.get('throughput', 0)} samples/s"
        )
        state = [f"state from {server['resumed_from']}"] if server.get("resumed_from") else []
        if server.get("checkpoint_epoch") is not None:
            state.append(f"checkpoint at step {server['checkpoint_epoch']}")
        last = server.get("last_move") or {}
        if server.get("moves"):
            state.append(f"moves {server['moves']} (last {last.get('from')} -> {last.get('to')})")
        if server.get("compute_s"):
            # a synchronous step waits inside the optimizer for the stage's all-reduce
            state.append(
                f"requests ran {server['compute_s']:.0f}s   in the optimizer "
                f"{server.get('optimizer_s', 0.0):.0f}s "
                f"(longest {server.get('optimizer_max_s', 0.0):.1f}s)"
            )
        if state:
            lines.append("          " + "   ".join(state))
    trainer = comps.get("trainer")
    if trainer:
        mb = trainer.get("micro_batches", {})
        loss = trainer.get("loss_ewma")
        ratios = trainer.get("wire_compression") or {}
        wire = "   ".join(f"{k} {v}x" for k, v in ratios.items())
        lines.append(
            f"trainer   loss {'-' if loss is None else f'{loss:.3f}'}   "
            f"{trainer.get('tokens_per_s', 0)} tokens/s   "
            f"{mb.get('completed', 0)} micro-batches done, {mb.get('failed', 0)} failed"
            + (f"   wire compression {wire}" if wire else "")
        )
    endpoint = comps.get("endpoint")
    if endpoint:
        lines.append(
            f"endpoint  run {endpoint.get('run_id')}   "
            f"{endpoint.get('requests_served', 0)} requests served, "
            f"{endpoint.get('requests_sent', 0)} sent"
        )
    return lines
