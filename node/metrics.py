"""Prometheus metrics of the daemon (the only prometheus-client importer), on 127.0.0.1.

Off unless ``metrics.port`` is set. The daemon pushes values from its event loop into the
metric objects (prometheus-client's metrics are thread-safe); the HTTP server runs in
prometheus-client's own thread and only reads them. Metrics live in a private registry, so
several daemons in one test process never collide.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time
from collections.abc import Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Info,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import NodeError
from .membership.peers import PeerTable

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
        self._totals = _TotalsCollector()
        r.register(self._totals)
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
