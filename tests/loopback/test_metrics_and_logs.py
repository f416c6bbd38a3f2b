"""Prometheus metrics (rendered and served on 127.0.0.1) and log lines carrying peer and stage."""

from __future__ import annotations

import io
import json
import logging
import urllib.request
from collections.abc import Iterator

import pytest
from wanswarm.node.logs import (
    QUIET_LIBRARIES,
    LogConfig,
    get_logger,
    log_context,
    set_log_context,
    setup_logging,
)
from wanswarm.node.membership.peers import PeerTable
from wanswarm.node.membership.records import ServerRecord
from wanswarm.node.metrics import NodeMetrics
from wanswarm.transport.identity import Identity

A, B, C = (Identity.generate().peer_id for _ in range(3))


def test_metrics_follow_the_peer_table() -> None:
    metrics = NodeMetrics("demo", A, "0.1.0")
    table = PeerTable(A)
    table.apply({B: (ServerRecord(peer_id=B, state="online", stage=0), 2e9),
                 C: (ServerRecord(peer_id=C, state="online"), 2e9)}, {}, now=0.0, wall_now=1e9)
    table.on_rtt_sample(B, 0.012, now=1.0)
    metrics.observe_table(table, now=1.0)
    metrics.set_state("online")
    metrics.records_published.inc()
    metrics.set_traffic(10, 20)
    metrics.set_refused(3)
    metrics.count_dropped(["malformed", "malformed"])
    body = metrics.render().decode()
    for line in [
        'wanswarm_peers_known{stage="0"} 1.0',
        'wanswarm_peers_known{stage="none"} 1.0',
        f'wanswarm_peer_rtt_seconds{{kind="srtt",peer="{B}"}} 0.012',
        f'wanswarm_peer_rtt_seconds{{kind="min",peer="{B}"}} 0.012',
        'wanswarm_state{wanswarm_state="online"} 1.0',
        "wanswarm_records_published_total 1.0",
        'wanswarm_transport_bytes_total{direction="out"} 20.0',
        "wanswarm_records_refused_total 3.0",
        'wanswarm_records_dropped_total{reason="malformed"} 2.0',
        f'wanswarm_node_info{{peer_id="{A}",run="demo",version="0.1.0"}} 1.0',
    ]:
        assert line in body, line
    # departed peers and emptied stages disappear instead of freezing at their last value
    table.apply({}, {}, now=2.0, wall_now=1e9)
    metrics.observe_table(table, now=2.0)
    body = metrics.render().decode()
    assert B not in body.replace(f'peer_id="{A}"', "") and "wanswarm_peers_known{" not in body


def test_metrics_are_served_on_loopback() -> None:
    metrics = NodeMetrics("demo", A, "0.1.0")
    host, port = metrics.serve("127.0.0.1", 0)
    try:
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert b"wanswarm_uptime_seconds" in response.read()
    finally:
        metrics.close()


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    saved = (
        logging.getLogger().handlers[:],
        logging.getLogger().level,
        log_context().peer,
        log_context().stage,
    )
    libraries = {name: logging.getLogger(name).level for name in QUIET_LIBRARIES}
    yield buffer
    for name, level in libraries.items():
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    set_log_context(peer=saved[2], stage=saved[3])


def test_text_lines_carry_peer_and_stage(stream: io.StringIO) -> None:
    setup_logging(LogConfig(level="INFO", format="text"), stream)
    setup_logging(LogConfig(level="INFO", format="text"), stream)  # twice: no duplicate lines
    set_log_context(peer=A, stage=3)
    get_logger("wanswarm.node.test").info("joined with %d peers", 2)
    logging.getLogger("somelib").warning("third-party line")  # not through our adapter
    get_logger("wanswarm.node.test").debug("below the level")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert f"[peer=…{A[-8:]} stage=3] wanswarm.node.test: joined with 2 peers" in lines[0]
    assert f"[peer=…{A[-8:]} stage=3] somelib: third-party line" in lines[1]


def test_library_internals_stay_out_of_info_logs(stream: io.StringIO) -> None:
    """aioquic's and hivemind's INFO lines (a stream reset at the end of every request, the
    version of every connection) are their internals: left out at INFO, kept at DEBUG;
    their warnings always pass."""
    setup_logging(LogConfig(level="INFO", format="text"), stream)
    logging.getLogger("quic").info("[abc] Stream 36 reset by peer (error code 512)")
    logging.getLogger("hivemind.averaging.averager").info("internal progress")
    logging.getLogger("quic").warning("[abc] a warning")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "quic: [abc] a warning" in lines[0]
    setup_logging(LogConfig(level="DEBUG", format="text"), stream)
    logging.getLogger("quic").info("[abc] Stream 40 reset by peer (error code 512)")
    assert "Stream 40 reset by peer" in stream.getvalue()


def test_json_lines(stream: io.StringIO) -> None:
    setup_logging(LogConfig(level="DEBUG", format="json"), stream)
    set_log_context(peer=B, stage=None)
    try:
        raise ValueError("boom")
    except ValueError:
        get_logger("wanswarm.node.test").exception("it failed")
    entry = json.loads(stream.getvalue().splitlines()[0])
    assert entry["peer"] == B and entry["stage"] is None and entry["msg"] == "it failed"
    assert entry["level"] == "ERROR" and entry["logger"] == "wanswarm.node.test"
    assert "ValueError: boom" in entry["exc"] and entry["ts"].endswith("+00:00")
