"""DiLoCo averaging between real daemons in separate processes (run spec ``[averaging]``).

Stage 1 of the tiny run is served twice (``node.stage`` pins), stages 0 and 2 once, and a
pure trainer routes micro-batches through them; the run averages in ``diloco`` mode every
2 inner steps with int8 pseudo-gradients and error feedback, streamed in 2 fragments (a
round every inner step, each carrying one half of the stage in turn: the same code as one
fragment, which rounds of ``round % 1`` are). What #18 asks of the swarm:

- after an outer round, every replica of the stage holds the same outer state: both report
  the same anchor digest for the same round, reached by the two of them together, each
  having fetched the other's payload over QUIC (outer_payloads.py);
- a replica SIGKILLed while the rounds go on does not stall the other for more than the
  round's timeout: the survivor's next rounds end within ``round_timeout_s`` (plus the
  matchmaking slack) and training goes on.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.swarm.helpers import FAST, LocalSwarm, short_tmpdir
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(420)

TINY = Path(__file__).resolve().parents[2] / "configs" / "runs" / "tiny.toml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ROUND_TIMEOUT_S = 15.0
ARGS: tuple[str, ...] = (
    "--set", "trainer.request_timeout_s=20",
    "--set", "trainer.max_in_flight=2",
    "--set", "averaging.matchmaking_time=2",
    "--set", "averaging.averaging_timeout=20",
    "--set", "node.shutdown_timeout=15",
)


# each mode's [averaging] section: a round every 2 inner steps of 2 micro-batches each
DILOCO = (
    'mode = "diloco"\ninner_steps = 2\nouter_lr = 1.0\nouter_momentum = 0.5\n'
    'compression = "int8"\nfragments = 2\n'
)
GOSSIP = 'mode = "gossip"\ninner_steps = 2\n'


def _averaging_spec(directory: Path, averaging: str) -> Path:
    """The tiny run with 16 samples (2 micro-batches) per inner step and ``averaging`` as its
    ``[averaging]`` section, rounds timing out after ``ROUND_TIMEOUT_S``."""
    text = TINY.read_text()
    text = re.sub(r"(?m)^target_batch_size = \d+", "target_batch_size = 16", text)
    text += f"\n[averaging]\n{averaging}round_timeout_s = {ROUND_TIMEOUT_S}\n"
    path = directory / "spec.toml"
    path.write_text(text)
    return path


def _averaging(node: Any) -> dict[str, Any]:
    report = node.status()
    if report is None:
        return {}
    return report.components.get("stage_server", {}).get("averaging", {}) or {}


@contextlib.contextmanager
def _stage1_twice(averaging: str) -> Iterator[tuple[LocalSwarm, Any, Any, Any]]:
    """The tiny run averaging as ``averaging`` says (:func:`_averaging_spec`): stage 1 served
    by two daemons, stages 0 and 2 once, and a pure trainer; yields the swarm, the two
    stage-1 daemons and the trainer."""
    spec_dir = short_tmpdir("wsw-spec-")
    spec = _averaging_spec(spec_dir, averaging)
    common = (*FAST, *ARGS, "--set", f"node.run_spec={spec}")
    swarm = LocalSwarm(0, extra_args=common, env=ENV)
    try:
        no_trainer = ("--set", "node.trainer=false")
        first = swarm.add("s0", (), extra_args=(*no_trainer, "--set", "node.stage=0"))
        addrs = first.status().dht_addrs
        stage1 = (*no_trainer, "--set", "node.stage=1")
        mid_a = swarm.add("s1a", addrs, wait=False, extra_args=stage1)
        mid_b = swarm.add("s1b", addrs, wait=False, extra_args=stage1)
        last = swarm.add("s2", addrs, wait=False, extra_args=(*no_trainer, "--set", "node.stage=2"))
        trainer = swarm.add("t", addrs, wait=False, extra_args=("--set", "node.server=false"))
        for node in (mid_a, mid_b, last, trainer):
            node.wait_online(timeout=120)
        yield swarm, mid_a, mid_b, trainer
    finally:
        swarm.close()
        for path in spec_dir.glob("*"):
            path.unlink()
        spec_dir.rmdir()


def test_diloco_replicas_agree_after_an_outer_round_and_survive_a_killed_peer() -> None:
    with _stage1_twice(DILOCO) as (swarm, mid_a, mid_b, trainer):

        # every (round, digest, participants) each replica reported after a successful round
        seen: dict[str, dict[int, tuple[str, int]]] = {"a": {}, "b": {}}

        def agreed() -> bool:
            for key, node in (("a", mid_a), ("b", mid_b)):
                avg = _averaging(node)
                assert avg.get("mode", "diloco") == "diloco", avg
                assert avg.get("fragments", 2) == 2, avg
                if avg.get("last_round_ok") and avg.get("anchor_digest"):
                    seen[key][int(avg["last_round"])] = (
                        str(avg["anchor_digest"]), int(avg["participants"])
                    )
            together = [
                r for r in set(seen["a"]) & set(seen["b"])
                if r >= 1 and seen["a"][r][1] == seen["b"][r][1] == 2
            ]
            return bool(together)

        wait_for(agreed, 240, "both stage-1 replicas to report an outer round taken together",
                 interval=0.3, explain=swarm.explain)
        for r in set(seen["a"]) & set(seen["b"]):
            if seen["a"][r][1] == seen["b"][r][1] == 2:
                assert seen["a"][r][0] == seen["b"][r][0], (r, seen)  # same outer state
        for node in (mid_a, mid_b):  # the payloads crossed QUIC, not the gather
            avg = _averaging(node)
            assert avg["carrier"] == "quic" and avg["payloads_fetched"] >= 1, avg
            assert avg["payloads_fetched_bytes"] >= avg["payloads_fetched"], avg

        # SIGKILL one replica: the other's rounds end within the round timeout, and training
        # goes on through it
        def completed() -> int:
            report = trainer.status()
            t = {} if report is None else report.components.get("trainer", {})
            return int(t.get("micro_batches", {}).get("completed", 0))

        mid_b.kill()
        killed_at = time.monotonic()
        before = _averaging(mid_a)
        base = (int(before.get("last_round", 0)), int(before.get("rounds_missed", 0)))
        done = completed()

        def next_round_ended() -> bool:
            avg = _averaging(mid_a)
            now = (int(avg.get("last_round", 0)), int(avg.get("rounds_missed", 0)))
            return now != base and avg.get("round_s") is not None

        wait_for(next_round_ended, 120, "the survivor's next outer round to end", interval=0.5,
                 explain=swarm.explain)
        avg = _averaging(mid_a)
        assert float(avg["round_s"]) <= ROUND_TIMEOUT_S + 5.0, avg
        wait_for(lambda: completed() >= done + 4, 90, "training to go on after the kill",
                 interval=0.5, explain=swarm.explain)
        print(f"\nrounds seen {seen}; survivor after the kill {avg}; "
              f"{time.monotonic() - killed_at:.1f}s from the kill to training again")
        assert mid_a.running() and trainer.running()


def test_gossip_replicas_average_with_each_other_in_real_daemons() -> None:
    """Two stage-1 daemons in ``gossip`` mode take a round together (hivemind's averager
    groups them): both report it successful, with two participants, at the same round."""
    with _stage1_twice(GOSSIP) as (swarm, mid_a, mid_b, trainer):
        seen: dict[str, dict[int, int]] = {"a": {}, "b": {}}  # round -> participants

        def together() -> bool:
            for key, node in (("a", mid_a), ("b", mid_b)):
                avg = _averaging(node)
                assert avg.get("mode", "gossip") == "gossip", avg
                if avg.get("last_round_ok"):
                    seen[key][int(avg["last_round"])] = int(avg["participants"])
            return any(seen["a"][r] == seen["b"][r] == 2 for r in set(seen["a"]) & set(seen["b"]))

        wait_for(together, 240, "both stage-1 replicas to report a gossip round taken together",
                 interval=0.3, explain=swarm.explain)
        avg = _averaging(mid_a)
        assert avg["bytes_sent_total"] > 0 and avg["rounds_refused"] == 0, avg
        print(f"\ngossip rounds seen {seen}; replica a {avg}")
        assert mid_a.running() and mid_b.running() and trainer.running()
