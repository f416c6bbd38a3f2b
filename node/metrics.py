"""Prometheus metrics of the daemon (the only prometheus-client importer), on 127.0.0.1.

Off unless ``metrics.port`` is set. The daemon pushes values from its event loop into the
metric objects (prometheus-client's metrics are thread-safe); the HTTP server runs in
prometheus-client's own thread and only reads them. Metrics live in a private registry, so
several daemons in one test process never collide; the registry also holds
prometheus-client's process and platform collectors (``process_*``, ``python_info``).

The training figures (stage, loss, tokens/s, queue, optimizer step, averaging rounds, state
transfers, refusals and hop errors by reason) come from the daemon's status report:
:meth:`NodeMetrics.observe_status` takes one report (the daemon's observer loop, about once a
second) and :class:`_TrainingCollector` exposes it at scrape time. Every name is listed in
docs/operations.md and the README's metrics table.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import NodeError
from .membership.peers import PeerTable
from .status import StatusReport

STATES = ["starting", "joining", "online", "draining", "left"]


class MetricsConfig(BaseModel):
    """Prometheus metrics over HTTP (GET /metrics)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(
        default="127.0.0.1",
        description="Address the metrics server binds to; keep it local or firewalled.",
    )
    port: int = Field(
        default=0, ge=0, le=65535, description="TCP port of the metrics server; 0 turns it off."
    )
    page_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "TCP port of the local status page (http://<host>:<port>/, the same host as the "
            "metrics server); 0 turns it off."
        ),
    )

    @field_validator("host")
    @classmethod
    def _host_is_ip(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"must be an IP address such as 127.0.0.1 (got {value!r})") from None
        return value


class _TotalsCollector(Collector):
    """Totals counted elsewhere (the transport, the DHT process), exposed as counters."""

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.refused = 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "wanswarm_transport_bytes",
            "Payload bytes moved by the transport.",
            labels=["direction"],
        )
        family.add_metric(["in"], float(self.bytes_in))
        family.add_metric(["out"], float(self.bytes_out))
        yield family
        yield CounterMetricFamily(
            "wanswarm_records_refused",
            "Forged or malformed records our DHT node refused (in stores and lookup answers).",
            value=float(self.refused),
        )


# server counters (StageServerCounters) exposed as refusals, by reason
_REFUSAL_REASONS = ("busy", "refused", "expired", "failed", "out_of_range")
_REQUEST_KINDS = ("forward", "forward_loss", "backward", "eval_loss", "info")
# how a per-step catch-up ended (resync.py's CatchUp.counts, "deferred" aside)
_CATCH_UP_ENDS = ("ours", "stand_in", "hivemind", "not_behind", "refused", "failed")
# protocol.ErrorCode's values (that module imports torch), exposed at 0 until counted
_HOP_ERROR_CODES = ("busy", "wrong_run", "wrong_stage", "cache_miss", "bad_request", "expired",
                    "not_ready", "draining", "internal", "out_of_range")


class _TrainingCollector(Collector):
    """The training figures of the last status report, rendered at scrape time.

    ``observe`` runs on the event loop; ``collect`` on the HTTP thread reads the fields it
    set (each a whole value, replaced, never mutated in place).
    """

    def __init__(self) -> None:
        self.report: StatusReport | None = None
        self.paused = False
        self.downloads = 0
        self.download_bytes = 0
        self.averaging_rounds = 0
        self._last_download: dict[str, Any] | None = None
        self._last_epoch: tuple[int | None, int] | None = None  # (stage, epoch) last seen

    def observe(self, report: StatusReport, paused: bool) -> None:
        server = report.components.get("stage_server") or {}
        download = server.get("state_download")
        if isinstance(download, dict) and download != self._last_download:
            self.downloads += 1
            self.download_bytes += int(download.get("bytes", 0) or 0)
        self._last_download = download if isinstance(download, dict) else self._last_download
        epoch = server.get("epoch")
        if isinstance(epoch, int):
            key = (server.get("stage"), epoch)
            last = self._last_epoch
            if (
                last is not None
                and last[0] == key[0]
                and epoch > last[1]
                and int(server.get("replicas_seen", 1) or 1) > 1
            ):
                self.averaging_rounds += epoch - last[1]
            self._last_epoch = key
        self.paused = paused
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report = self.report
        yield GaugeMetricFamily(
            "wanswarm_paused", "1 while 'wanswarm pause' holds the node.",
            value=1.0 if self.paused else 0.0,
        )
        stage = GaugeMetricFamily("wanswarm_stage", "The stage this node serves (absent: none).")
        if report is not None and report.stage is not None:
            stage.add_metric([], float(report.stage))
        yield stage
        comps = report.components if report is not None else {}
        yield from _trainer_families(comps.get("trainer") or {})
        yield from self._server_families(comps.get("stage_server") or {})

    def _server_families(self, server: dict[str, Any]) -> Iterator[Metric]:
        gauges = [
            ("wanswarm_server_queue_length", "Requests queued or running on the device thread.",
             server.get("queue")),
            ("wanswarm_server_throughput_samples_per_second",
             "The stage's measured forward+backward throughput (announced), samples/s.",
             server.get("throughput")),
            ("wanswarm_server_optimizer_step", "The stage optimizer's local epoch (step).",
             server.get("epoch")),
            ("wanswarm_averaging_replicas",
             "Replicas of the stage (this one included) that reported progress recently.",
             server.get("replicas_seen")),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc)
            if isinstance(value, int | float):
                family.add_metric([], float(value))
            yield family
        yield CounterMetricFamily(
            "wanswarm_server_micro_batches_served",
            "Micro-batches whose gradients this server accumulated.",
            value=float(server.get("applied", 0) or 0),
        )
        yield _by_label("wanswarm_server_requests", "Requests answered, by kind.", "kind",
                        _REQUEST_KINDS, server)
        yield _by_label(
            "wanswarm_server_refusals",
            "Requests the server did not run, by reason: busy (queue full or paused), refused "
            "(wrong run/stage, malformed, not ready, draining), expired, failed, out_of_range.",
            "reason", _REFUSAL_REASONS, server,
        )
        yield CounterMetricFamily(
            "wanswarm_averaging_rounds",
            "Optimizer steps this server took with other replicas of its stage (one all-reduce "
            "round each).",
            value=float(self.averaging_rounds),
        )
        yield CounterMetricFamily(
            "wanswarm_state_downloads", "Stage states downloaded from peers.",
            value=float(self.downloads),
        )
        yield CounterMetricFamily(
            "wanswarm_state_download_bytes", "Bytes of the stage states downloaded from peers.",
            value=float(self.download_bytes),
        )
        yield _by_label(
            "wanswarm_state_donations",
            "State requests this server answered, by part ('preparing': a manifest request "
            "answered while a snapshot waited for the stage's averaging round).",
            "part", ("manifests", "chunks", "preparing"), server.get("state_donated"),
        )
        averaging = server.get("averaging") or {}
        yield _by_label(
            "wanswarm_catch_ups",
            "Catch-ups of a replica that fell behind its stage (the per-step mode), by how they "
            "ended: ours (a quorum's state), stand_in (donors that kept disagreeing: the state "
            "most hold at their lower median epoch), hivemind (no donor answered ours), "
            "not_behind, refused, failed.",
            "how", _CATCH_UP_ENDS, averaging.get("catch_ups"),
        )
        yield CounterMetricFamily(
            "wanswarm_state_downloads_refused",
            "hivemind downloads whose values failed the checks after they arrived (NaN, "
            "impossible step counters): the replica's own state was put back.",
            value=float(averaging.get("downloads_refused", 0) or 0),
        )
        wait = server.get("state_wait") or {}
        waiting = GaugeMetricFamily(
            "wanswarm_state_open_refusals",
            "An opening server's refused downloads so far, while it waits for donors that "
            "offered no state to trust (absent: not waiting).",
        )
        if isinstance(wait.get("refusals"), int):
            waiting.add_metric([], float(wait["refusals"]))
        yield waiting
        progress = server.get("state_download_progress") or {}
        for name, key, doc in (
            ("wanswarm_state_download_progress_bytes", "done_bytes",
             "Bytes of the stage state downloaded so far (absent: no download running)."),
            ("wanswarm_state_download_total_bytes", "total_bytes",
             "Size of the stage state being downloaded (absent: no download running)."),
        ):
            family = GaugeMetricFamily(name, doc)
            if isinstance(progress.get(key), int | float):
                family.add_metric([], float(progress[key]))
            yield family


def _trainer_families(trainer: dict[str, Any]) -> Iterator[Metric]:
    for name, doc, value in (
        ("wanswarm_trainer_loss",
         "Training loss (nats/token), moving average over completed micro-batches.",
         trainer.get("loss_ewma")),
        ("wanswarm_trainer_validation_loss", "Last validation loss measured (nats/token).",
         trainer.get("val_loss")),
        ("wanswarm_trainer_tokens_per_second",
         "Tokens of completed micro-batches per second over the last 30 s.",
         trainer.get("tokens_per_s")),
    ):
        family = GaugeMetricFamily(name, doc)
        if isinstance(value, int | float):
            family.add_metric([], float(value))
        yield family
    yield CounterMetricFamily(
        "wanswarm_trainer_tokens", "Tokens of completed micro-batches.",
        value=float(trainer.get("tokens", 0) or 0),
    )
    yield _by_label(
        "wanswarm_trainer_micro_batches", "Micro-batches this trainer finished, by result.",
        "result", ("completed", "failed"), trainer.get("micro_batches"),
    )
    errors = CounterMetricFamily(
        "wanswarm_trainer_hop_errors",
        "Failed hop attempts, by error code or exception; each but cache_miss bans the server "
        "for a back-off and sends the hop elsewhere.",
        labels=["reason"],
    )
    counted = trainer.get("errors") or {}
    for reason in sorted(set(_HOP_ERROR_CODES) | set(counted)):
        errors.add_metric([str(reason)], float(counted.get(reason, 0)))
    yield errors


def _by_label(name: str, doc: str, label: str, keys: Iterable[str],
              counts: dict[str, Any] | None) -> CounterMetricFamily:
    """A counter family with one sample per key, its value read from ``counts`` (0 where
    missing or null): a status report's counts under one label."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in keys:
        family.add_metric([key], float((counts or {}).get(key, 0) or 0))
    return family


class NodeMetrics:
    """The daemon's metrics, in their own registry."""

    def __init__(self, run: str, peer_id: str, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._started = time.monotonic()
        self.info = Info("wanswarm_node", "Identity of this daemon.", registry=r)
        self.info.info({"peer_id": peer_id, "run": run, "version": version})
        self.state = Enum(
            "wanswarm_state", "Lifecycle state of the daemon.", states=STATES, registry=r
        )
        self.state.state("starting")
        self.uptime = Gauge(
            "wanswarm_uptime_seconds", "Seconds since the daemon started.", registry=r
        )
        self.uptime.set_function(lambda: time.monotonic() - self._started)
        self.peers_known = Gauge(
            "wanswarm_peers_known",
            "Peers of the run listed in the DHT, by stage.",
            ["stage"],
            registry=r,
        )
        self.records_published = Counter(
            "wanswarm_records_published", "Records this node stored in the DHT.", registry=r
        )
        self.publish_failures = Counter(
            "wanswarm_record_publish_failures",
            "Record stores that failed or timed out.",
            registry=r,
        )
        self.records_dropped = Counter(
            "wanswarm_records_dropped",
            "Records read from the DHT and dropped (malformed, forged or from a newer release).",
            ["reason"],
            registry=r,
        )
        self.membership_reads = Counter(
            "wanswarm_membership_reads",
            "Reads of the run's records, by result.",
            ["result"],
            registry=r,
        )
        self.probes = Counter("wanswarm_probes", "RTT probes, by result.", ["result"], registry=r)
        self.rtt = Gauge(
            "wanswarm_peer_rtt_seconds",
            "RTT to a peer: kind=srtt (RFC 6298 smoothed) or min (windowed minimum).",
            ["peer", "kind"],
            registry=r,
        )
        # the labels known in advance are exposed at 0 from the start (a scrape finds the name)
        for reason in ("malformed", "forged", "unsupported_version"):
            self.records_dropped.labels(reason)
        for result in ("ok", "failed"):
            self.membership_reads.labels(result)
        self.probes.labels("ok")
        self._totals = _TotalsCollector()
        r.register(self._totals)
        self._training = _TrainingCollector()
        r.register(self._training)
        # the default registry's process and platform collectors, in ours
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self._rtt_peers: set[str] = set()
        self._stages: set[str] = set()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- updates (event-loop thread)

    def set_state(self, state: str) -> None:
        self.state.state(state)

    def set_traffic(self, bytes_in: int, bytes_out: int) -> None:
        self._totals.bytes_in, self._totals.bytes_out = bytes_in, bytes_out

    def set_refused(self, total: int) -> None:
        self._totals.refused = total

    def observe_table(self, table: PeerTable, now: float) -> None:
        """Refresh the per-stage peer counts and per-peer RTTs from the peer table."""
        counts: dict[str, int] = {}
        for peer in table.peers():
            stage = "none" if peer.stage is None else str(peer.stage)
            counts[stage] = counts.get(stage, 0) + 1
        for stage in self._stages - set(counts):
            self.peers_known.remove(stage)
        for stage, count in counts.items():
            self.peers_known.labels(stage).set(count)
        self._stages = set(counts)

        present = set()
        for peer in table.peers():
            if peer.rtt.srtt is None:
                continue
            present.add(peer.peer_id)
            self.rtt.labels(peer.peer_id, "srtt").set(peer.rtt.srtt)
            low = peer.rtt.min_rtt(now)
            if low is not None:
                self.rtt.labels(peer.peer_id, "min").set(low)
        for gone in self._rtt_peers - present:
            for kind in ("srtt", "min"):
                with contextlib.suppress(KeyError):
                    self.rtt.remove(gone, kind)
        self._rtt_peers = present

    def observe_status(self, report: StatusReport, paused: bool = False) -> None:
        """Take the training figures of ``report`` (event-loop thread)."""
        self._training.observe(report, paused)

    def count_dropped(self, reasons: Iterable[str]) -> None:
        for reason in reasons:
            self.records_dropped.labels(reason).inc()

    # -- exposition

    def render(self) -> bytes:
        """The text exposition format, as GET /metrics returns it."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Start the HTTP server thread; returns the bound (host, port)."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise NodeError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        bound_host, bound_port = self._server.server_address[:2]
        return str(bound_host), int(bound_port)

    def close(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
