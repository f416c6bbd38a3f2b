"""The demo's supervisor: daemons that die are reported and training goes on.

The demo calls :meth:`Supervisor.tick` after every status poll of its training phase. A
tick

- reaps the daemons whose process exited: one line says which daemon (stage, peer id),
  when (seconds of training), why (killed by ``--chaos``, or its exit status), what is left
  of its stage and where its log is; its last status is kept among the ``retired`` ones, so
  that the tokens and micro-batches its trainer completed still count;
- watches the stages (:class:`StageWatch`, pure): a stage left with no online server is
  reported, and again when it is served once more, with how long it was empty (training
  waits for it meanwhile: every micro-batch needs every stage);
- reports a restarted daemon once it serves its stage again (same identity: its state
  directory is kept; its state comes from the stage's replicas), with what the trainers did
  meanwhile: hops re-routed to another replica, micro-batches that failed;
- carries out the chaos plan (demo_chaos.py) that fell due: SIGKILL, restart. A kill that
  would leave a stage with no online server is skipped (unless the plan allows it): the
  plan assumes restarted daemons rejoin in ``rejoin_s``, a loaded machine may take longer.

Only a swarm with no daemon left and none to restart ends the demo (``DemoError``).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .demo_chaos import ChaosEvent
from .demo_daemons import DemoDaemon, DemoError

Status = dict[str, Any]


def _online_stage(status: Status) -> int | None:
    """The stage a daemon's status says it serves, when its stage server is online."""
    server = status.get("components", {}).get("stage_server", {})
    if server.get("state") != "online":
        return None
    stage = server.get("stage", status.get("stage"))
    return stage if isinstance(stage, int) else None


class StageWatch:
    """Which stages have had no online server, since when, and for how long in all (pure:
    the caller passes ``now`` in seconds and the stages served then)."""

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
        self.empty_since: dict[int, float] = {}
        self.empty_s = [0.0] * n_stages  # per stage, closed empty intervals so far

    def update(self, now: float, served: set[int]) -> list[str]:
        """Lines to show for the stages that became empty or were served again."""
        lines = []
        for stage in range(self.n_stages):
            if stage not in served and stage not in self.empty_since:
                self.empty_since[stage] = now
                lines.append(
                    f"stage {stage} has no online server at {now:.0f}s: training waits for it"
                )
            elif stage in served and stage in self.empty_since:
                gap = now - self.empty_since.pop(stage)
                self.empty_s[stage] += gap
                lines.append(
                    f"stage {stage} served again at {now:.0f}s after {gap:.0f}s without a server"
                )
        return lines

    def totals(self, now: float) -> list[float]:
        """Seconds each stage has been empty, an interval still open counted up to ``now``."""
        open_s = {s: now - since for s, since in self.empty_since.items()}
        return [round(self.empty_s[s] + open_s.get(s, 0.0), 1) for s in range(self.n_stages)]


@dataclass
class Outage:
    """One death of a daemon's process and, once it serves again, its return."""

    daemon: int
    stage: int | None
    peer_id: str | None
    at_s: float
    cause: str
    log_file: Path
    counters_at_death: dict[str, int]
    restarted_at_s: float | None = None
    back_at_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "daemon": self.daemon,
            "stage": self.stage,
            "at_s": round(self.at_s, 1),
            "cause": self.cause,
            "restarted_at_s": None
            if self.restarted_at_s is None
            else round(self.restarted_at_s, 1),
            "back_at_s": None if self.back_at_s is None else round(self.back_at_s, 1),
            "log": str(self.log_file),
        }


class Supervisor:
    """Reaps, reports, and kills and restarts daemons on the chaos plan (see the module
    docstring). ``counters()`` gives the trainers' cumulative ``retried`` hops and
    ``failed`` micro-batches, for what the swarm did while a daemon was down."""

    def __init__(
        self,
        nodes: Sequence[DemoDaemon],
        n_stages: int,
        say: Callable[[str], None],
        counters: Callable[[], dict[str, int]],
        schedule: Sequence[ChaosEvent] = (),
        allow_empty: bool = False,
    ) -> None:
        self.nodes = list(nodes)
        self.n_stages = n_stages
        self.say = say
        self.counters = counters
        self.pending: deque[ChaosEvent] = deque(sorted(schedule))
        self.allow_empty = allow_empty
        self.watch = StageWatch(n_stages)
        self.retired: list[Status] = []  # the last status of every process that ended
        self.outages: list[Outage] = []
        self.kills = 0  # SIGKILLs sent by the chaos plan
        self.restarts = 0  # daemons started again
        self.exits = 0  # processes that ended without being killed by the plan
        self.skipped = 0  # planned kills not carried out (the stage would have been empty)
        self._killed: set[int] = set()  # killed by the plan, not reaped yet
        self._down: dict[int, Outage] = {}  # daemon index -> its open outage
        self._skipped_restarts: set[int] = set()
        self._reaped: dict[int, int] = {}  # daemon index -> pid of its last reaped process
        self._now = 0.0

    # ---- views ------------------------------------------------------------------------

    def alive(self) -> list[DemoDaemon]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def served(self) -> set[int]:
        """Stages with a running daemon whose last status says its stage server is online."""
        out = set()
        for node in self.alive():
            stage = _online_stage(node.status)
            if stage is not None:
                out.add(stage)
        return out

    def restarting(self) -> list[int]:
        """Daemons restarted and not serving again yet."""
        return [i for i, o in self._down.items() if o.restarted_at_s is not None]

    def down(self) -> int:
        """Daemons not serving now (exited, or restarted and not back yet)."""
        return len(self._down)

    def summary(self) -> dict[str, Any]:
        """``kills``, ``restarts``, ``exits``, ``skipped_kills``, seconds each stage was
        empty, and every outage."""
        return {
            "kills": self.kills,
            "restarts": self.restarts,
            "exits": self.exits,
            "skipped_kills": self.skipped,
            "stage_empty_s": self.watch.totals(self._now),
            "outages": [o.as_dict() for o in self.outages],
        }

    def progress(self) -> str:
        """The supervisor's part of the progress line ('' while nothing happened)."""
        if not self.outages and not self.kills:
            return ""
        up = len(self.nodes) - len(self._down)
        return f"{up}/{len(self.nodes)} up, {self.kills} killed, {self.restarts} restarted"

    # ---- the tick ---------------------------------------------------------------------

    async def tick(self, now: float) -> None:
        """Reap, report and carry out the plan's due events (``now``: seconds of training)."""
        self._now = now
        self._reap(now)
        for line in self.watch.update(now, self.served()):
            self.say(line)
        self._report_returns(now)
        while self.pending and self.pending[0].at_s <= now:
            self._apply(self.pending.popleft(), now)
        if not self.alive():
            raise DemoError("every daemon of the demo has exited")

    def finish(self, now: float) -> None:
        """Training is over: drop the plan's remaining kills, restart every killed daemon
        still down (the final evaluation needs every stage)."""
        self._now = now
        self._reap(now)
        restarts = [
            e
            for e in self.pending
            if e.action == "restart" and self.nodes[e.daemon].proc.poll() is not None
        ]
        self.pending.clear()
        for event in restarts:
            self._apply(event, now)

    def _reap(self, now: float) -> None:
        for node in self.nodes:
            code = node.proc.poll()
            if code is None or self._reaped.get(node.index) == node.proc.pid:
                continue
            self._reaped[node.index] = node.proc.pid
            stage = node.status.get("stage")
            killed = set(self._killed)
            if node.index in self._killed:
                self._killed.discard(node.index)
                cause = "killed by --chaos (SIGKILL)"
            else:
                self.exits += 1
                cause = f"exited with status {code}"
            outage = Outage(
                node.index,
                stage if isinstance(stage, int) else None,
                node.status.get("peer_id"),
                now,
                cause,
                node.log_file,
                self.counters(),
            )
            if node.status:
                self.retired.append(node.status)
                node.status = {}
            self.outages.append(outage)
            self._down[node.index] = outage
            left = [
                n.index
                for n in self.alive()
                if outage.stage is not None and _online_stage(n.status) == outage.stage
            ]
            what = (
                f"stage {outage.stage} still served by daemon(s) {left}"
                if left
                else f"stage {outage.stage} has no other server"
            )
            peer = "" if outage.peer_id is None else f", peer {outage.peer_id[:12]}…"
            # a crash says why at the end of its log; a SIGKILL leaves nothing to say
            tail = (
                ""
                if node.index in killed
                else "".join(f"\n  {line}" for line in node.log_tail(3))
            )
            self.say(
                f"daemon {node.index} (stage {outage.stage}{peer}) {cause} at {now:.0f}s; "
                f"{what}; log: {node.log_file}{tail}"
            )

    def _report_returns(self, now: float) -> None:
        for index, outage in list(self._down.items()):
            node = self.nodes[index]
            if outage.restarted_at_s is None or node.proc.poll() is not None:
                continue
            if _online_stage(node.status) is None:
                continue
            outage.back_at_s = now
            del self._down[index]
            counters = self.counters()
            rerouted = counters["retried"] - outage.counters_at_death["retried"]
            failed = counters["failed"] - outage.counters_at_death["failed"]
            same = "same" if node.status.get("peer_id") == outage.peer_id else "NEW"
            self.say(
                f"daemon {index} serves stage {_online_stage(node.status)} again at {now:.0f}s "
                f"({now - outage.at_s:.0f}s after it died, {same} identity, epoch "
                f"{node.status.get('components', {}).get('stage_server', {}).get('epoch')}); "
                f"meanwhile trainers re-routed {rerouted} hop(s), {failed} micro-batch(es) failed"
            )

    def _apply(self, event: ChaosEvent, now: float) -> None:
        node = self.nodes[event.daemon]
        if event.action == "kill":
            if node.proc.poll() is not None or node.index in self._down:
                self._skip(event, "it is already down")
                return
            others = [
                n
                for n in self.alive()
                if n is not node and _online_stage(n.status) == event.stage
            ]
            if not others and not self.allow_empty:
                self._skip(event, f"stage {event.stage} has no other online server now")
                return
            self.say(f"chaos: SIGKILL daemon {node.index} (stage {event.stage}) at {now:.0f}s")
            self._killed.add(node.index)
            self.kills += 1
            node.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=2.0)  # SIGKILL: a moment; reaped now, with this time
            self._reap(now)
            return
        if node.index in self._skipped_restarts:
            self._skipped_restarts.discard(node.index)
            return
        if node.proc.poll() is None:
            self.say(f"chaos: daemon {node.index} has not exited; not restarted")
            return
        self._reap(now)
        initial = [a for n in self.alive() for a in n.status.get("dht_addrs") or []]
        node.restart(initial)
        self.restarts += 1
        outage = self._down.get(node.index)
        if outage is not None:
            outage.restarted_at_s = now
        self.say(
            f"chaos: restarted daemon {node.index} (stage {event.stage}) at {now:.0f}s with its "
            f"state dir {node.state_dir}"
        )

    def _skip(self, event: ChaosEvent, why: str) -> None:
        self.skipped += 1
        self._skipped_restarts.add(event.daemon)
        self.say(f"chaos: not killing daemon {event.daemon}: {why}")


__all__ = ["Outage", "StageWatch", "Supervisor"]
