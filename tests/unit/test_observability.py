"""What a volunteer sees: status text (empty stages, why training waits, downloads, pause),
training metrics from a status report, lifetime totals, journald log lines, the client's
fallback to a system service's socket, shell completion, the upload limiter's token bucket,
and the systemd unit's security score."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from wanswarm.node.cli import build_parser
from wanswarm.node.logs import LogConfig, TextFormatter, setup_logging, writes_to_journal
from wanswarm.node.metrics import NodeMetrics
from wanswarm.node.service.completion import bash_script, zsh_script
from wanswarm.node.service.lifetime import LIFETIME_FILE, LifetimeTotals
from wanswarm.node.service.statedir import client_control_socket
from wanswarm.node.status import PeerStatus, StatusReport, render_text, stage_summary, waiting_for
from wanswarm.transport.upload_limit import TokenBucket, UploadLimiter

ROOT = Path(__file__).resolve().parents[2]


def _report(**kw: Any) -> StatusReport:
    base: dict[str, Any] = dict(
        peer_id="12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", run="tiny", stage=0,
        state="online", server=True, trainer=True, pid=1, version="0.1.0", uptime_s=10.0,
        dht_addrs=[], quic_addr=None, peers=[], n_stages=3,
        components={"stage_server": {"stage": 0, "state": "online", "throughput": 4.0,
                                     "applied": 5, "checkpoint_epoch": -1}},
    )
    base.update(kw)
    return StatusReport(**base)


def _peer(stage: int | None, state: str = "online", throughput: float = 2.0) -> PeerStatus:
    return PeerStatus(peer_id=f"12D3KooWpeer{stage}{state}", stage=stage, state=state,  # type: ignore[arg-type]
                      rtt_ms=1.0, min_rtt_ms=1.0, throughput=throughput)


def test_empty_stages_and_the_reason_training_waits() -> None:
    report = _report(peers=[_peer(2, "joining")])
    summary = stage_summary(report)
    assert [(s.stage, s.online, s.joining) for s in summary] == [(0, 1, 0), (1, 0, 0), (2, 0, 1)]
    assert waiting_for(report) == (
        "servers of stage(s) [1, 2]: training waits until every stage has one"
    )
    text = render_text(report)
    assert "stages    0: 1 replica   1: EMPTY   2: 0 replicas (+1 joining)" in text
    assert "waiting   servers of stage(s) [1, 2]" in text
    assert "checkpoint at step -1" not in text and "no checkpoint written yet" in text
    full = _report(peers=[_peer(1), _peer(2)])
    assert waiting_for(full) is None and "waiting" not in render_text(full)


def test_paused_download_memory_and_upload_lines() -> None:
    report = _report(paused=True, upload_limit_mbps=20.0)
    assert waiting_for(report) is not None and "paused" in waiting_for(report)  # type: ignore[operator]
    text = render_text(report)
    assert "state online (paused)" in text and "upload limit 20 Mb/s" in text
    joining = _report(state="joining", components={"stage_server": {
        "stage": 1, "state": "joining", "memory_limit_mb": 8 << 10,
        "memory_estimate_mb": 3 << 10,
        "state_download_progress": {"done_bytes": 1 << 20, "total_bytes": 4 << 20,
                                    "donors": 2, "eta_s": 9.0}}})
    text = render_text(joining)
    assert "download  1.0 MiB of 4.0 MiB (25%) from 2 donors, ETA 9.0s" in text
    assert "memory    stage needs about 3.0 GiB, limit 8.0 GiB" in text
    assert waiting_for(joining) == "downloading the stage's state"
    refused = _report(state="joining", components={"stage_server": {
        "stage": 1, "state": "joining", "state_wait": {
            "refusals": 2, "of": 3, "reason": "no state is held by a quorum (2 of 2)",
            "next_try_unix": 0.0}}})
    assert waiting_for(refused) == (
        "the replicas of stage 1 offered no state to trust (2 of 3 refusals); asking again")
    assert "download  refused 2 of 3 times: no state is held by a quorum" in render_text(refused)


def test_training_metrics_follow_status_reports() -> None:
    metrics = NodeMetrics("tiny", "p", "0.1.0")
    server = {"stage": 0, "state": "online", "queue": 3, "throughput": 4.0, "epoch": 2,
              "replicas_seen": 2, "applied": 7, "busy": 1, "forward": 9,
              "averaging": {"catch_ups": {"ours": 2, "stand_in": 1, "deferred": 5},
                            "downloads_refused": 1},
              "state_wait": {"refusals": 2, "of": 3, "reason": "no quorum"},
              "state_download": {"epoch": 2, "donors": 1, "bytes": 1000, "seconds": 0.5},
              "state_donated": {"manifests": 1, "chunks": 4}}
    trainer = {"loss_ewma": 3.5, "tokens_per_s": 100.0, "tokens": 4096,
               "micro_batches": {"completed": 4, "failed": 1}, "errors": {"busy": 2}}
    metrics.observe_status(_report(components={"stage_server": server, "trainer": trainer}))
    metrics.observe_status(_report(components={"stage_server": {**server, "epoch": 4},
                                               "trainer": trainer}), paused=True)
    body = metrics.render().decode()
    for line in [
        "wanswarm_stage 0.0", "wanswarm_paused 1.0", "wanswarm_trainer_loss 3.5",
        "wanswarm_trainer_tokens_total 4096.0", "wanswarm_server_queue_length 3.0",
        'wanswarm_trainer_micro_batches_total{result="failed"} 1.0',
        'wanswarm_trainer_hop_errors_total{reason="busy"} 2.0',
        'wanswarm_server_refusals_total{reason="busy"} 1.0',
        'wanswarm_server_requests_total{kind="forward"} 9.0',
        "wanswarm_server_optimizer_step 4.0", "wanswarm_averaging_rounds_total 2.0",
        "wanswarm_state_downloads_total 1.0", "wanswarm_state_download_bytes_total 1000.0",
        'wanswarm_state_donations_total{part="chunks"} 4.0',
        'wanswarm_catch_ups_total{how="stand_in"} 1.0', 'wanswarm_catch_ups_total{how="ours"} 2.0',
        'wanswarm_catch_ups_total{how="hivemind"} 0.0',
        "wanswarm_state_downloads_refused_total 1.0", "wanswarm_state_open_refusals 2.0",
    ]:
        assert line in body, line
    assert "process_cpu_seconds_total" in body and "python_info" in body
    from wanswarm.node.metrics import _HOP_ERROR_CODES
    from wanswarm.node.protocol import ErrorCode

    assert set(_HOP_ERROR_CODES) == {str(code) for code in ErrorCode}


def test_lifetime_totals_survive_restarts_and_bad_files(tmp_path: Path) -> None:
    first = LifetimeTotals(tmp_path, clock=1000.0)
    for uptime, applied, tokens in ((1.0, 2, 100), (3.0, 5, 300)):
        first.observe(_report(uptime_s=uptime, bytes_out=applied * 10, components={
            "stage_server": {"applied": applied}, "trainer": {"tokens": tokens}}))
    # a stage move rebuilds the server: its counter restarts from 0
    first.observe(_report(uptime_s=4.0, bytes_out=60, components={
        "stage_server": {"applied": 1}, "trainer": {"tokens": 300}}))
    first.save()
    second = LifetimeTotals(tmp_path, clock=2000.0)
    totals = second.totals
    assert (totals.micro_batches_served, totals.tokens, totals.bytes_out) == (6, 300, 60)
    assert totals.uptime_s == pytest.approx(3.0) and totals.runs == 2
    assert totals.since_unix == 1000.0
    (tmp_path / LIFETIME_FILE).write_text('{"tokens": -5}')
    assert LifetimeTotals(tmp_path).totals.tokens == 0  # refused, counted from zero


def test_journal_lines_carry_priorities_and_no_timestamp(tmp_path: Path) -> None:
    record = logging.LogRecord("wanswarm.x", logging.WARNING, __file__, 1, "a\nb", None, None)
    # (the level's name as logging knows it: the daemon's setup shortens WARNING to WARN)
    name = f"{logging.getLevelName(logging.WARNING):<7}"
    assert TextFormatter(journal=True).format(record).split("\n") == [
        f"<4>{name} [peer=- stage=-] wanswarm.x: a", "<4>b"]
    assert TextFormatter().format(record)[:2] == "20"  # a timestamp outside the journal
    path = tmp_path / "err"
    with open(path, "w") as f:
        st = os.fstat(f.fileno())
        assert writes_to_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not writes_to_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not writes_to_journal(f, {})
    assert not writes_to_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})
    saved = logging.getLogger().handlers[:], logging.getLogger().level
    try:
        stream = io.StringIO()
        setup_logging(LogConfig(), stream)
        logging.getLogger("wanswarm.y").error("plain")
        assert not stream.getvalue().startswith("<")
    finally:
        logging.getLogger().handlers[:] = saved[0]
        logging.getLogger().setLevel(saved[1])


def test_client_falls_back_to_the_system_service(tmp_path: Path) -> None:
    default = tmp_path / "user" / "control.sock"
    system = tmp_path / "system"
    assert client_control_socket(default, default, system) == default  # no service either
    system.mkdir()
    (system / "control.sock").touch()
    assert client_control_socket(default, default, system) == system / "control.sock"
    named = tmp_path / "other" / "control.sock"
    assert client_control_socket(named, default, system) == named  # a named dir is kept
    default.parent.mkdir()
    default.touch()
    assert client_control_socket(default, default, system) == default  # a user daemon wins


def test_bash_completion_completes_commands_flags_and_choices() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = bash_script(build_parser(), "wanswarm")

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        program = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _wanswarm; "
                   'printf "%s\\n" "${COMPREPLY[@]}"')
        out = subprocess.run([bash, "-c", program], capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert {"join", "status", "pause", "resume", "completion"} <= set(complete("wanswarm", ""))
    assert complete("wanswarm", "pa") == ["pause"]
    assert "--initial-peers" in complete("wanswarm", "join", "--in")
    assert complete("wanswarm", "join", "--log-format", "") == ["text", "json"]
    assert complete("wanswarm", "completion", "z") == ["zsh"]  # a positional's choices


def test_zsh_completion_script_parses() -> None:
    script = zsh_script(build_parser(), "wanswarm")
    assert script.startswith("#compdef wanswarm") and "'--initial-peers[" in script
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed: the script was generated but not parsed")
    out = subprocess.run([zsh, "-n", "-c", script], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr


def test_token_bucket_paces_to_its_rate() -> None:
    bucket = TokenBucket(1000.0, 100.0, now=0.0)
    assert bucket.wait(100, 0.0) == 0.0
    bucket.take(100, 0.0)
    assert bucket.wait(50, 0.0) == pytest.approx(0.05)
    assert bucket.wait(50, 0.05) == 0.0
    assert bucket.wait(100, 10.0) == 0.0 and bucket.tokens == 100.0  # never above the burst


def test_upload_limiter_sends_at_the_limit_and_bounds_its_queue() -> None:
    now = [0.0]
    sent: list[tuple[float, int]] = []
    timers: list[tuple[float, Any]] = []

    class _Loop:
        def call_later(self, delay: float, fn: Any) -> Any:
            timers.append((now[0] + delay, fn))

            class _H:
                def cancel(self) -> None: ...
            return _H()

    limiter = UploadLimiter(8e6, lambda d, a: sent.append((now[0], len(d))), clock=lambda: now[0])
    limiter._loop = _Loop()  # type: ignore[assignment]
    for _ in range(400):  # 400 x 1000 B = 400 kB offered at once; 1 MB/s limit
        limiter.sendto(b"x" * 1000, ("127.0.0.1", 1))
    while timers:
        timers.sort(key=lambda t: t[0])
        at, fn = timers.pop(0)
        now[0] = at
        fn()
    assert limiter.dropped > 0 and limiter.queued_bytes == 0  # beyond 0.2 s of queue: dropped
    total = sum(n for _, n in sent)
    assert total == limiter.sent_bytes == (400 - limiter.dropped) * 1000
    burst = limiter.bucket.burst
    span = sent[-1][0]
    assert (total - burst) / span == pytest.approx(1e6, rel=0.02)


def test_systemd_unit_security_score() -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = ROOT / "configs" / "systemd" / "wanswarm.service"
    out = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit)],
                         capture_output=True, text=True, timeout=60)
    line = [x for x in out.stdout.splitlines() if "Overall exposure level" in x]
    if not line:
        pytest.skip(f"systemd-analyze gave no score: {out.stderr.strip()[:200]}")
    score = float(line[0].split(":")[1].split()[0])
    assert score <= 2.5, line[0]  # 5.5 (MEDIUM) before CapabilityBoundingSet= and the rest
    text = unit.read_text()
    for needed in ("AF_UNIX", "DeviceAllow=/dev/nvidiactl", "TRITON_CACHE_DIR=%C/wanswarm"):
        assert needed in text
