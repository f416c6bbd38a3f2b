"""The daemon's status report: the record ``wanswarm status --json`` prints, and its text form.

The daemon builds a :class:`StatusReport`, the control socket carries it as JSON, and the CLI
prints either that JSON or :func:`render_text`. ``dht_addrs`` are full multiaddrs (with
``/p2p/<peer id>``) that another node can pass as ``--initial-peers``.

:func:`stage_summary` and :func:`waiting_for` derive, from one report, the servers of every
stage (empty ones included) and what the node waits for; the text form and the status page
(service/page.py) both show them.
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
    paused: bool = Field(
        default=False, description="'wanswarm pause' holds the node: it takes no work."
    )
    n_stages: int | None = Field(default=None, description="Stages of the run (None: unknown).")
    upload_limit_mbps: float | None = Field(
        default=None, description="Upload bandwidth limit of the QUIC socket, Mb/s (None: none)."
    )
    lifetime: dict[str, float] | None = Field(
        default=None,
        description="Totals over every run of this state directory (service/lifetime.py).",
    )


class StageSummary(_Model):
    """The servers of one stage as this node sees them (itself included)."""

    stage: int
    online: int = Field(description="Servers online (the ones trainers route to).")
    joining: int = Field(description="Servers loading the stage's state.")
    throughput: float = Field(description="Sum of the online servers' throughput, samples/s.")


def stage_summary(report: StatusReport) -> list[StageSummary]:
    """Every stage of the run (0..n_stages-1, and any other one a peer announces), with its
    online and joining servers; a stage nobody serves is listed with zeros."""
    online: dict[int, int] = {}
    joining: dict[int, int] = {}
    rate: dict[int, float] = {}

    def count(stage: int, state: str, throughput: float) -> None:
        if state == "online":
            online[stage] = online.get(stage, 0) + 1
            rate[stage] = rate.get(stage, 0.0) + throughput
        elif state == "joining":
            joining[stage] = joining.get(stage, 0) + 1

    for peer in report.peers:
        if peer.stage is not None:
            count(peer.stage, peer.state, peer.throughput)
    server = report.components.get("stage_server") or {}
    if report.server and isinstance(server.get("stage"), int):
        state = "joining" if report.paused else str(server.get("state"))
        count(int(server["stage"]), state, float(server.get("throughput") or 0.0))
    stages = set(online) | set(joining)
    if report.n_stages is not None:
        stages |= set(range(report.n_stages))
    return [
        StageSummary(
            stage=s, online=online.get(s, 0), joining=joining.get(s, 0),
            throughput=round(rate.get(s, 0.0), 2),
        )
        for s in sorted(stages)
    ]


def waiting_for(report: StatusReport) -> str | None:
    """Why this node does no training work now, in words; None when nothing holds it."""
    if report.paused:
        return "paused ('wanswarm resume' to take work again)"
    if report.state in ("starting", "joining"):
        server = report.components.get("stage_server") or {}
        progress = server.get("state_download_progress")
        if progress:
            return "downloading the stage's state"
        return _refused_text(server) or "joining the swarm"
    if report.state != "online":
        return None
    server = report.components.get("stage_server") or {}
    if report.server and server.get("state") == "joining":
        return _refused_text(server) or f"loading the state of stage {server.get('stage')}"
    if report.trainer and report.n_stages is not None:
        empty = [s.stage for s in stage_summary(report) if s.online == 0]
        if empty:
            return f"servers of stage(s) {empty}: training waits until every stage has one"
    return None


def _refused_text(server: dict[str, Any]) -> str | None:
    """An opening server's wait for donors that offered no state to trust, in words."""
    wait = server.get("state_wait")
    if not wait:
        return None
    return (f"the replicas of stage {server.get('stage')} offered no state to trust "
            f"({wait.get('refusals')} of {wait.get('of')} refusals); asking again")


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
    state = f"{report.state} (paused)" if report.paused else report.state
    lines = [
        f"peer id   {report.peer_id}",
        f"run       {report.run}   stage {'-' if report.stage is None else report.stage}   "
        f"state {state}   roles {roles}",
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
    limit = (
        f"   upload limit {report.upload_limit_mbps:g} Mb/s"
        if report.upload_limit_mbps is not None else ""
    )
    lines.append(
        f"traffic   in {_bytes(report.bytes_in)}   out {_bytes(report.bytes_out)}{limit}"
    )
    if report.lifetime:
        life = report.lifetime
        lines.append(
            f"lifetime  {int(life.get('micro_batches_served', 0))} micro-batches served   "
            f"{int(life.get('tokens', 0))} tokens trained   "
            f"up {format_duration(life.get('uptime_s', 0.0))}   "
            f"out {_bytes(int(life.get('bytes_out', 0)))}"
        )
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


def _stage_text(summary: StageSummary) -> str:
    if summary.online == 0 and summary.joining == 0:
        return f"{summary.stage}: EMPTY"
    text = f"{summary.stage}: {summary.online} replica{'s' if summary.online != 1 else ''}"
    if summary.joining:
        text += f" (+{summary.joining} joining)"
    return text


def download_text(progress: dict[str, Any]) -> str:
    """``12.0 MiB of 48.0 MiB (25%) from 2 donors, ETA 9s`` from a download's progress."""
    done, total = int(progress.get("done_bytes", 0)), int(progress.get("total_bytes", 0))
    text = f"{_bytes(done)} of {_bytes(total)}"
    if total > 0:
        text += f" ({100 * done / total:.0f}%)"
    donors = progress.get("donors")
    if donors is not None:
        text += f" from {donors} donor{'s' if donors != 1 else ''}"
    eta = progress.get("eta_s")
    if isinstance(eta, int | float):
        text += f", ETA {format_duration(float(eta))}"
    return text


def _memory_text(server: dict[str, Any]) -> str:
    """The device memory limit and the stage's estimated footprint, when the server has them."""
    limit, estimate = server.get("memory_limit_mb"), server.get("memory_estimate_mb")
    parts = []
    if isinstance(estimate, int | float):
        parts.append(f"stage needs about {_bytes(int(estimate * 2**20))}")
    if isinstance(limit, int | float):
        parts.append(f"limit {_bytes(int(limit * 2**20))}")
    elif parts:
        parts.append("no limit")
    return ", ".join(parts)


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
    stages = stage_summary(report)
    if stages:
        lines.append("stages    " + "   ".join(_stage_text(s) for s in stages))
    reason = waiting_for(report)
    if reason is not None:
        lines.append(f"waiting   {reason}")
    server = comps.get("stage_server")
    if server:
        lines.append(
            f"server    stage {server.get('stage')} ({server.get('state')})   "
            f"{server.get('applied', 0)} micro-batches served   "
            f"optimizer step {server.get('epoch', 0)}   "
            f"queue {server.get('queue', 0)}   {server.get('throughput', 0)} samples/s"
        )
        averaging = server.get("averaging")
        if isinstance(averaging, dict):  # mode, last round, participants, bytes sent
            lines.append("averaging " + "   ".join(f"{k} {v}" for k, v in averaging.items()))
        state = [f"state from {server['resumed_from']}"] if server.get("resumed_from") else []
        checkpoint = server.get("checkpoint_epoch")
        if isinstance(checkpoint, int) and checkpoint >= 0:  # -1: none written yet
            state.append(f"checkpoint at step {checkpoint}")
        elif server.get("checkpoint_epoch") is not None:
            state.append("no checkpoint written yet")
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
        progress = server.get("state_download_progress")
        if progress:
            lines.append("download  " + download_text(progress))
        wait = server.get("state_wait")
        if wait:
            lines.append(f"download  refused {wait.get('refusals')} of {wait.get('of')} times: "
                         f"{wait.get('reason')}")
        memory = _memory_text(server)
        if memory:
            lines.append(f"memory    {memory}")
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
