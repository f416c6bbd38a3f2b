"""The demo's supervisor (node/tools/demo_supervisor.py) with real processes standing in for
daemons (``python -c 'import time; time.sleep(30)'``): a daemon that dies is reported and
the demo goes on, the chaos plan's kills and restarts are carried out, a kill that would
empty a stage is skipped, and a swarm with no daemon left ends the demo."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wanswarm.node.tools import demo_figures
from wanswarm.node.tools.demo import Demo, DemoOptions
from wanswarm.node.tools.demo_chaos import ChaosEvent
from wanswarm.node.tools.demo_daemons import DemoDaemon, DemoError
from wanswarm.node.tools.demo_supervisor import StageWatch, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]
N_STAGES = 2


def _status(index: int, tokens: int = 0, online: bool = True) -> dict[str, Any]:
    stage = index % N_STAGES
    return {
        "peer_id": f"12D3KooWpeer{index}",
        "stage": stage,
        "dht_addrs": [f"/ip4/127.0.0.1/tcp/{4000 + index}/p2p/peer{index}"],
        "components": {
            "stage_server": {"stage": stage, "state": "online" if online else "joining"},
            "trainer": {
                "tokens": tokens,
                "micro_batches": {"completed": tokens // 1024, "failed": 0},
                "retried_hops": 0,
                "spot_checks": {"checked": tokens // 1024, "skipped": 1, "disagreements": 0,
                                "convicted": 0, "evidence": [],
                                "skipped_by": {"no_other_replica": 0, "unpromised": 1,
                                               "other_params": 0},
                                "compared_by": {"params": 2, "epoch": 1}},
            },
        },
    }


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[DemoDaemon]]:
    out = []
    for index in range(2 * N_STAGES):  # daemon i serves stage i mod 2
        log = tmp_path / f"node{index}.log"
        log.write_text(f"daemon {index} log line\n")
        proc = subprocess.Popen(SLEEPER, start_new_session=True)
        node = DemoDaemon(index, tmp_path / f"node{index}", proc, log, argv=SLEEPER, env={})
        node.status = _status(index, tokens=1024 * (index + 1))
        out.append(node)
    yield out
    for node in out:
        node.kill()
        node.proc.wait(10)


def tick(sup: Supervisor, now: float) -> None:
    asyncio.run(sup.tick(now))


def _wait_exit(node: DemoDaemon) -> None:
    node.proc.wait(10)


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


def _counters(sup: list[Supervisor], nodes: list[DemoDaemon]) -> Any:
    def counters() -> dict[str, int]:
        retired = sup[0].retired if sup else []
        t = demo_figures.totals([n.status for n in nodes], retired)
        return {"retried": t["retried"], "failed": t["failed"]}

    return counters


def test_a_daemon_that_dies_is_reported_and_training_goes_on(
    nodes: list[DemoDaemon],
) -> None:
    say = Recorder()
    holder: list[Supervisor] = []
    sup = Supervisor(nodes, N_STAGES, say, _counters(holder, nodes))
    holder.append(sup)
    tick(sup, 1.0)
    assert say.lines == [] and sup.served() == {0, 1}

    os.kill(nodes[1].proc.pid, signal.SIGKILL)  # as the kernel would, not the plan
    _wait_exit(nodes[1])
    tick(sup, 3.0)  # no DemoError: daemon 3 still serves stage 1
    assert sup.exits == 1 and sup.kills == 0
    (line,) = say.lines
    assert "daemon 1 (stage 1" in line and "exited with status -9 at 3s" in line
    assert "still served by daemon(s) [3]" in line and str(nodes[1].log_file) in line
    assert line.endswith("\n  daemon 1 log line")  # a crash: the end of its log
    # its trainer's tokens still count; its status is no longer a live one
    assert nodes[1].status == {} and sup.retired[0]["peer_id"] == "12D3KooWpeer1"
    t = demo_figures.totals([n.status for n in nodes], sup.retired)
    assert t["tokens"] == 1024 * (1 + 2 + 3 + 4)
    # and its spot checks
    assert t["spot_checks"] == {"checked": 1 + 2 + 3 + 4, "skipped": 4, "disagreements": 0,
                                "convicted": 0, "skipped_by": {"no_other_replica": 0,
                                                               "unpromised": 4,
                                                               "other_params": 0},
                                "compared_by": {"params": 8, "epoch": 4}}

    # the stage's last replica exits too: the stage is reported empty, the demo goes on
    nodes[3].kill()
    _wait_exit(nodes[3])
    tick(sup, 5.0)
    assert any("has no other server" in x for x in say.lines)
    assert any("stage 1 has no online server at 5s" in x for x in say.lines)
    assert sup.served() == {0} and sup.down() == 2
    tick(sup, 9.0)
    assert sup.summary()["stage_empty_s"] == [0.0, 4.0]
    assert sup.summary()["exits"] == 2
    assert [o["daemon"] for o in sup.summary()["outages"]] == [1, 3]

    # the others exit: nothing left to train with ends the demo
    for node in (nodes[0], nodes[2]):
        node.kill()
        _wait_exit(node)
    with pytest.raises(DemoError, match="every daemon"):
        tick(sup, 11.0)


def test_chaos_kills_and_restarts_with_the_same_state_dir(nodes: list[DemoDaemon]) -> None:
    say = Recorder()
    holder: list[Supervisor] = []
    plan = [ChaosEvent(2.0, "kill", 2, 0), ChaosEvent(4.0, "restart", 2, 0)]
    sup = Supervisor(nodes, N_STAGES, say, _counters(holder, nodes), plan)
    holder.append(sup)
    first_pid = nodes[2].proc.pid
    tick(sup, 1.0)
    assert nodes[2].proc.poll() is None
    tick(sup, 2.0)  # the kill falls due
    assert sup.kills == 1
    _wait_exit(nodes[2])
    assert nodes[2].proc.returncode == -signal.SIGKILL
    tick(sup, 3.0)
    (killed,) = [x for x in say.lines if "killed by --chaos (SIGKILL) at 2s" in x]
    assert killed.startswith("daemon 2 (stage 0") and "\n" not in killed
    assert sup.exits == 0 and sup.served() == {0, 1}  # daemon 0 still serves stage 0
    assert "3/4 up, 1 killed, 0 restarted" == sup.progress()

    tick(sup, 4.0)  # the restart falls due: a new process, same state dir, joining peers
    assert sup.restarts == 1 and nodes[2].lives == 2
    assert nodes[2].proc.poll() is None and nodes[2].proc.pid != first_pid
    assert nodes[2].state_dir.name == "node2"
    args = nodes[2].proc.args
    assert isinstance(args, list) and args[: len(SLEEPER)] == SLEEPER
    assert args[len(SLEEPER)] == "--initial-peers" and len(args) == len(SLEEPER) + 4
    assert any("restarted daemon 2" in x for x in say.lines)

    # not back until its stage server says online
    nodes[2].status = _status(2, online=False)
    tick(sup, 5.0)
    assert sup.down() == 1 and sup.restarting() == [2]
    nodes[2].status = _status(2)
    tick(sup, 8.0)
    assert sup.down() == 0 and sup.restarting() == []
    back = [x for x in say.lines if "serves stage 0 again at 8s" in x]
    assert back and "6s after it died, same identity" in back[0]
    summary = sup.summary()
    assert (summary["kills"], summary["restarts"], summary["exits"]) == (1, 1, 0)
    assert summary["outages"][0]["restarted_at_s"] == 4.0
    assert summary["outages"][0]["back_at_s"] == 8.0


def test_a_kill_that_would_empty_a_stage_is_skipped(nodes: list[DemoDaemon]) -> None:
    say = Recorder()
    holder: list[Supervisor] = []
    plan = [ChaosEvent(1.0, "kill", 1, 1), ChaosEvent(21.0, "restart", 1, 1)]
    sup = Supervisor(nodes, N_STAGES, say, _counters(holder, nodes), plan)
    holder.append(sup)
    nodes[3].status = _status(3, online=False)  # stage 1's other replica is still joining
    tick(sup, 1.0)
    assert sup.kills == 0 and sup.skipped == 1 and nodes[1].proc.poll() is None
    assert any("not killing daemon 1: stage 1 has no other online server" in x for x in say.lines)
    tick(sup, 21.0)  # its restart is dropped with it
    assert sup.restarts == 0 and nodes[1].lives == 1


def test_finish_restarts_what_chaos_left_down(nodes: list[DemoDaemon]) -> None:
    say = Recorder()
    holder: list[Supervisor] = []
    plan = [
        ChaosEvent(1.0, "kill", 0, 0),
        ChaosEvent(21.0, "restart", 0, 0),
        ChaosEvent(30.0, "kill", 1, 1),
        ChaosEvent(50.0, "restart", 1, 1),
    ]
    sup = Supervisor(nodes, N_STAGES, say, _counters(holder, nodes), plan)
    holder.append(sup)
    tick(sup, 1.0)
    _wait_exit(nodes[0])
    began = time.monotonic()
    sup.finish(5.0)  # training ended at 5 s: daemon 0 back now, the second kill dropped
    assert time.monotonic() - began < 5.0
    assert sup.restarts == 1 and sup.kills == 1 and not sup.pending
    assert nodes[0].proc.poll() is None and nodes[1].proc.poll() is None


def test_stage_watch_counts_empty_time() -> None:
    watch = StageWatch(3)
    assert watch.update(0.0, {0, 1, 2}) == []
    assert watch.update(10.0, {0, 2}) == [
        "stage 1 has no online server at 10s: training waits for it"
    ]
    assert watch.update(12.0, {0, 2}) == []
    assert watch.totals(15.0) == [0.0, 5.0, 0.0]
    assert watch.update(24.0, {0, 1, 2}) == [
        "stage 1 served again at 24s after 14s without a server"
    ]
    watch.update(30.0, {1, 2})
    assert watch.totals(31.0) == [1.0, 14.0, 0.0]


def test_eta_and_progress_line() -> None:
    # 100k tokens in 100 s since a start at 0: 400k left at 1000/s, 500 s of the cap left
    assert demo_figures.eta_s(100_000, 0, 500_000, 100.0, 600.0) == pytest.approx(400.0)
    assert demo_figures.eta_s(100_000, 0, 500_000, 100.0, 300.0) == pytest.approx(200.0)
    assert demo_figures.eta_s(0, 0, 500_000, 0.0, 300.0) == pytest.approx(300.0)
    assert demo_figures.eta_s(600_000, 0, 500_000, 100.0, 300.0) == 0.0
    t = demo_figures.totals([_status(0, tokens=4096)])
    line = demo_figures.progress_line(t, 42.0, 245.0, "3/4 up, 1 killed, 0 restarted")
    assert "ETA 4m05s" in line and "[3/4 up, 1 killed, 0 restarted]" in line
    assert "ETA" not in demo_figures.progress_line(t, 42.0)
    assert demo_figures.format_duration(3725) == "1h02m"
    assert demo_figures.interpolate([(0, 5.0), (100, 3.0)], 50) == 4.0
    assert demo_figures.interpolate([(0, 5.0), (100, 3.0)], 150) is None


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_step_size_sums_the_replicas_over_the_epochs_they_all_list() -> None:
    def server(steps: dict[str, int]) -> dict[str, Any]:
        return {"averaging": {"mode": "allreduce", "step_samples": steps}}

    a = server({"3": 40, "4": 32, "5": 24})
    b = server({"4": 40, "5": 48, "6": 16})  # epoch 3 fell out of its list; 6 not yet in a's
    size = demo_figures.step_size([a, b])
    assert size == {"samples_per_step": 72.0, "samples_per_step_range": [72, 72],
                    "steps_measured": 2}
    assert demo_figures.step_size([server({})])["samples_per_step"] is None
    assert demo_figures.step_size([{"averaging": {"mode": "solo"}}])["steps_measured"] == 0
    assert demo_figures.step_size([])["samples_per_step"] is None
    rows = demo_figures.stage_rows(
        [{"stage": 0, "peer_id": "p", "components": {"stage_server": a}}], 1
    )
    assert rows[0]["samples_per_step"] == 32.0 and rows[0]["steps_measured"] == 3
    assert demo_figures.stage_table(rows)[1].split()[-1] == "32.0"
    assert rows[0]["averaging"] == {
        "mode": "allreduce", "rounds": [None], "last_round_s": [None], "rounds_missed": 0,
        "rounds_alone": 0, "in_progress": 0, "bytes_sent": 0, "replicas_agree": None,
        "replica_distance": None, "local_gradient_steps": 0,
    }


def test_the_averaging_summary_sums_rounds_missed_and_bytes_over_replicas() -> None:
    def server(**fields: Any) -> dict[str, Any]:
        return {"averaging": {"mode": "gossip", **fields}}

    summary = demo_figures.averaging_summary([
        server(last_round=3, rounds_missed=1, bytes_sent_total=1000, rounds_alone=2, round_s=1.5),
        server(last_round=4, rounds_missed=0, bytes_sent_total=2500, round_in_progress=True),
        {},  # a replica without a status yet
    ])
    assert summary == {"mode": "gossip", "rounds": [3, 4], "last_round_s": [1.5, None],
                       "rounds_missed": 1,
                       "rounds_alone": 2, "in_progress": 1, "bytes_sent": 3500,
                       "replicas_agree": None, "replica_distance": None,
                       "local_gradient_steps": 0}
    assert demo_figures.averaging_summary([{}, {"averaging": {}}]) is None

    def at(epoch: int, digest: str) -> dict[str, Any]:
        return {"averaging": {"mode": "allreduce"}, "digest_epoch": epoch, "param_digest": digest}

    agree = demo_figures.averaging_summary([at(5, "aa"), at(5, "aa"), at(4, "bb")])
    assert agree is not None and agree["replicas_agree"] is True
    differ = demo_figures.averaging_summary([at(5, "aa"), at(5, "ab")])
    assert differ is not None and differ["replicas_agree"] is False
    sketched = [at(5, "aa") | {"param_sketch": [3.0, 4.0]},
                at(5, "ab") | {"param_sketch": [3.0, 4.5]}]
    far = demo_figures.averaging_summary(sketched)
    assert far is not None and far["replica_distance"] == 0.1  # |(0, 0.5)| / |(3, 4)|


def test_a_report_ends_the_progress_line_redrawn_in_place(tmp_path: Path) -> None:
    out = _Tty()
    demo = Demo(DemoOptions(root=tmp_path), out=out)
    assert demo.tty
    t = demo_figures.totals([_status(0, tokens=2048)])
    demo._progress(demo_figures.progress_line(t, 10.0, 50.0), 10.0, 0.0)
    demo._progress(demo_figures.progress_line(t, 12.0, 48.0), 12.0, 0.0)
    demo.say("daemon 1 (stage 1) exited with status -9 at 12s")
    demo._progress(demo_figures.progress_line(t, 14.0, 46.0), 14.0, 0.0)
    text = out.getvalue()
    redraws = text.split("\r")
    assert len(redraws) == 4 and redraws[0] == ""
    assert redraws[1].endswith("ETA 50s\x1b[K")
    # the report starts on a line of its own, and the next redraw after it
    assert redraws[2].endswith("ETA 48s\x1b[K\ndaemon 1 (stage 1) exited with status -9 at 12s\n")
    assert redraws[3].startswith("epoch") and "ETA 46s" in redraws[3]


def test_the_final_evaluation_is_tried_again_when_a_stage_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wanswarm.node.tools import demo as demo_module

    monkeypatch.setattr(demo_module, "FINAL_EVAL_RETRY_S", 0.01)
    out = io.StringIO()
    demo = Demo(DemoOptions(root=tmp_path, progress_period_s=1.0), out=out)
    answers: list[Any] = [DemoError("busy: 16 jobs queued"), DemoError("busy again"), 2.5]

    async def evaluate() -> float:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return float(answer)

    monkeypatch.setattr(demo, "evaluate", evaluate)

    async def both() -> None:
        assert await demo._final_evaluation() == 2.5
        assert out.getvalue().count("evaluating again in 0s") == 2
        answers[:] = [DemoError(f"busy {i}") for i in range(demo_module.FINAL_EVAL_ATTEMPTS)]
        with pytest.raises(DemoError, match="busy 3"):
            await demo._final_evaluation()

    asyncio.run(both())
