"""The status page and the training metrics of a live daemon, and pause/resume over the socket.

One node serves stage 0 and trains, with ``metrics.port`` and ``metrics.page_port`` on;
while it is alone its page shows stages 1 and 2 EMPTY and why training waits (a screenshot
of that moment is kept). Two servers then take stages 1 and 2, the swarm trains, and the
test scrapes ``/metrics`` (the names of the README's table, values growing), loads the page
in headless Chromium (the node's stage and a plotted loss curve in the DOM, a screenshot kept
under the test's tmp path) and pauses and resumes the node with ``wanswarm pause``/``resume``.
Chromium is Debian's ``chromium`` package; without it the browser part is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.swarm.helpers import FAST, LocalSwarm
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAINING: tuple[str, ...] = (
    "--set", "trainer.request_timeout_s=8",
    "--set", "trainer.max_in_flight=2",
    "--set", "trainer.no_server_wait_s=0.5",
    "--set", "averaging.matchmaking_time=2",
    "--set", "averaging.averaging_timeout=20",
    "--set", "node.shutdown_timeout=10",
)
# the README's metrics table, as the daemon must expose it
README = Path(__file__).resolve().parents[2] / "README.md"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def _metric(body: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.MULTILINE)
    return None if match is None else float(match.group(1))


def _readme_metric_names() -> list[str]:
    text = README.read_text()
    section = text.split("<!-- metrics table -->", 2)
    assert len(section) == 3, "README.md lost its metrics table markers"
    names = re.findall(r"^\| `([a-z_]+)`", section[1], re.MULTILINE)
    assert len(names) >= 20, names
    return names


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _dump_dom(browser: str, url: str, screenshot: Path | None = None) -> str:
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-dev-shm-usage", "--virtual-time-budget=6000",
            "--window-size=1100,1700"]
    if screenshot is not None:
        subprocess.run([*base, f"--screenshot={screenshot}", url], capture_output=True,
                       timeout=90, check=False)
    result = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                            timeout=90, check=False)
    return result.stdout


def test_status_page_and_metrics_of_a_training_node(tmp_path: Path) -> None:
    names = _readme_metric_names()
    metrics_port, page_port = _free_port(), _free_port()
    browser = _chromium()
    swarm = LocalSwarm(0, extra_args=(*FAST, *TRAINING), env=ENV)
    try:
        first = swarm.add("a", (), extra_args=(
            "--set", "node.stage=0",
            "--set", f"metrics.port={metrics_port}",
            "--set", f"metrics.page_port={page_port}",
        ), wait=False)
        first.wait_online(timeout=150)
        page = f"http://127.0.0.1:{page_port}/"

        # alone: stages 1 and 2 have no server, and the node says that is what it waits for
        def waiting() -> dict | None:
            data = json.loads(_get(page + "status.json"))
            return data if data["waiting_for"] and "servers of stage(s) [1, 2]" in (
                data["waiting_for"]) else None

        data = wait_for(waiting, 60, "the page to say training waits", explain=first.log_tail)
        assert [s["online"] for s in data["stages"]] == [1, 0, 0], data["stages"]
        text = first.cli("status").stdout
        assert "1: EMPTY" in text and "2: EMPTY" in text, text
        assert "waiting   servers of stage(s) [1, 2]" in text, text
        if browser is not None:
            dom = _dump_dom(browser, page, tmp_path / "page-empty-stages.png")
            assert "0 (EMPTY)" in dom and "servers of stage(s) [1, 2]" in dom, dom[-3000:]

        addrs = first.status().dht_addrs
        for stage in (1, 2):
            swarm.add(f"s{stage}", addrs, wait=False, extra_args=(
                "--set", "node.trainer=false", "--set", f"node.stage={stage}"))
        for node in swarm.nodes[1:]:
            node.wait_online(timeout=120)

        metrics = f"http://127.0.0.1:{metrics_port}/metrics"

        def trained() -> str | None:
            body = _get(metrics).decode()
            done = _metric(body, "wanswarm_trainer_tokens_total") or 0.0
            served = _metric(body, "wanswarm_server_micro_batches_served_total") or 0.0
            return body if done > 0 and served > 0 else None

        body = wait_for(trained, 120, "training through the swarm", explain=first.log_tail)
        for name in names:  # a labelled counter nobody incremented yet has HELP but no sample
            base = name.removesuffix("_total")
            assert re.search(rf"^(# HELP {base} |{name}(\{{| ))", body, re.MULTILINE), name
        assert _metric(body, "wanswarm_stage") == 0.0
        assert _metric(body, "process_resident_memory_bytes")
        tokens = _metric(body, "wanswarm_trainer_tokens_total") or 0.0

        def grew() -> bool:
            return (_metric(_get(metrics).decode(), "wanswarm_trainer_tokens_total") or 0) > tokens

        wait_for(grew, 60, "tokens to grow between scrapes", explain=first.log_tail)

        # the page's history holds a loss curve (a few samples), then Chromium draws it
        def curve() -> dict | None:
            data = json.loads(_get(page + "status.json"))
            losses = [v for v in data["history"]["loss"] if v is not None]
            return data if len(losses) >= 3 else None

        data = wait_for(curve, 60, "loss samples in the page's history")
        assert data["status"]["stage"] == 0 and data["waiting_for"] is None, data["waiting_for"]
        if browser is None:
            pytest.skip("chromium is not installed (apt-get install -y chromium): "
                        "the page was checked over HTTP only")
        shot = tmp_path / "page-training.png"
        dom = _dump_dom(browser, page, shot)
        assert '<dd id="stage">stage 0</dd>' in dom, dom[-3000:]
        plot = re.search(r'<div id="loss-plot" class="plot" data-points="(\d+)"', dom)
        assert plot is not None and int(plot.group(1)) >= 3, dom[-3000:]
        loss_section = dom.split('id="loss-plot"', 1)[1].split('id="rate-plot"', 1)[0]
        assert "<canvas" in loss_section and "training loss" in loss_section
        assert shot.exists() and shot.stat().st_size > 10_000
        print(f"screenshots kept in {tmp_path}")

        # pause: the status says so, the metric too; resume undoes it
        result = first.cli("pause")
        assert result.returncode == 0 and "paused" in result.stdout, result.stderr
        report = first.status()
        assert report is not None and report.paused
        assert "state online (paused)" in first.cli("status").stdout
        wait_for(lambda: _metric(_get(metrics).decode(), "wanswarm_paused") == 1.0, 10,
                 "wanswarm_paused to be 1")
        # paused for real: the stage refuses work and the trainer starts no micro-batch
        assert report.components["stage_server"]["paused"] is True
        assert report.components["trainer"]["paused"] is True
        started = report.components["trainer"]["micro_batches"]["started"]
        time.sleep(3.0)
        later = first.status()
        assert later is not None
        assert later.components["trainer"]["micro_batches"]["started"] == started
        result = first.cli("resume")
        assert result.returncode == 0 and "resumed" in result.stdout, result.stderr
        assert not first.status().paused
        # the lifetime totals reach the state directory when the daemon leaves
        assert first.leave() == 0
        life = json.loads((first.state_dir / "lifetime.json").read_text())
        assert life["tokens"] > 0 and life["micro_batches_served"] > 0 and life["runs"] == 1
    finally:
        swarm.close()
