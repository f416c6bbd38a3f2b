"""Real daemons on separate hosts, behind home NATs, started as volunteers start them.

One public bootstrap host and three homes (two cone NATs, one symmetric NAT), each uplink
with 10 ms one-way delay and 0.5% loss; every daemon is ``wanswarm join --host 0.0.0.0
--initial-peers <bootstrap>`` and nothing else (node/tools/lab_swarm.py). The test checks
what a volunteer behind NAT needs: every node's trainer completes micro-batches through
every stage; no node announces loopback; the homes are classified behind NAT and keep a
rendezvous; connections between the homes are hole-punched (cone to cone) or relayed
(with the symmetric NAT); ``wanswarm netcheck`` run in a home reports its public address;
a home node that is SIGKILLed and restarted serves and trains again; and so does the
bootstrap, which has no initial peers and cannot dial the homes behind NAT.

The acceptance figures (25 ms, 1% loss, 100 Mb/s, tokens/s against loopback) come from
``benchmarks/netlab.py``; this test keeps the same path working within a few minutes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from wanswarm.node.config.runspec import default_run_spec
from wanswarm.node.tools.lab_swarm import LabSwarm, all_serving, through_every_stage
from wanswarm.node.tools.netlab import Lab
from wanswarm.node.tools.netlab_topology import Home, Link, Topology

LabFactory = Callable[[Topology], Lab]
HOSTS = (("boot", "public"), ("alice", "cone"), ("bob", "cone"), ("carol", "symmetric"))
N_STAGES = default_run_spec().n_stages


async def _until(swarm: LabSwarm, what: str, check: Callable[[list[Any]], bool],
                 timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        swarm.check_alive()
        statuses = await swarm.poll_all()
        if check(statuses):
            return statuses
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"{n.name}: {_summary(n.status)}\n  {n.log_tail(12)}" for n in swarm.nodes.values()
            )
            pytest.fail(f"{what}: not within {timeout:g} s\n{logs}")
        await asyncio.sleep(1.0)


def _summary(status: dict[str, Any] | None) -> str:
    """One line of what a node's status says: enough to tell why a wait ran out."""
    if not status:
        return "no status"
    server = status["components"].get("stage_server", {})
    trainer = status["components"].get("trainer", {})
    batches = trainer.get("micro_batches", {})
    return (f"state={status['state']} stage={server.get('stage')}/{server.get('state')} "
            f"moves={server.get('moves')} completed={batches.get('completed')} "
            f"failed={batches.get('failed')} hops={trainer.get('hops')}")


def _serving_and_training(status: dict[str, Any] | None) -> bool:
    """Whether a node's status shows it online, serving its stage, and its trainer through
    every stage."""
    return bool(
        status and status["state"] == "online"
        and status["components"].get("stage_server", {}).get("state") == "online"
        and through_every_stage(status, N_STAGES)
    )


def _paths(statuses: list[dict[str, Any]]) -> set[str]:
    return {p["path"] for s in statuses for p in s["peers"] if p.get("path")}


@pytest.mark.timeout(600)
def test_volunteers_behind_nat_train_together(lab: LabFactory, tmp_path: Path) -> None:
    link = Link(delay_ms=10, loss=0.005, rate_mbit=100)
    net = lab(Topology(public=("boot",),
                       homes=tuple(Home(name, nat, link) for name, nat in HOSTS[1:])))
    swarm = LabSwarm(net, tmp_path)
    nodes = {name: swarm.add(name, nat) for name, nat in HOSTS}

    async def scenario() -> None:
        try:
            swarm.start(nodes["boot"])
            initial = await swarm.wait_bootstrap(nodes["boot"], 60)
            assert initial and not any("/127." in a for a in initial)
            for name in ("alice", "bob", "carol"):
                swarm.start(nodes[name])
            await _until(swarm, "every stage served", lambda st: all_serving(st, N_STAGES), 120)
            statuses = await _until(
                swarm, "every trainer through every stage, every node's reachability known",
                lambda st: all(
                    s and through_every_stage(s, N_STAGES)
                    and s["components"]["endpoint"]["reach"]["nat"] != "unknown"
                    for s in st
                ),
                # the acceptance's 3 minutes: on a loaded 2-core CI machine the single server
                # of a stage, behind a relay, is what the four trainers wait for
                180,
            )
            for status in statuses:  # what each node announces, as its peers read it
                for peer in status["peers"]:
                    assert peer["quic_addr"] and not peer["quic_addr"].startswith("127."), peer
            reach = {n: nodes[n].status["components"]["endpoint"]["reach"] for n in nodes}
            assert reach["boot"]["nat"] == "public" and reach["boot"]["reachable"]
            for home, nat in HOSTS[1:]:
                assert reach[home]["nat"] == nat, reach
                assert not reach[home]["reachable"] and reach[home]["rendezvous"], reach
                public = net.public_address(home)
                assert reach[home]["observed"].startswith(public + ":"), reach
            paths = _paths(statuses)
            assert "relayed" in paths, paths  # carol's symmetric NAT
            assert "punched" in paths or "reversed" in paths, paths

            done = net.exec("alice", [sys.executable, "-m", "wanswarm.node.cli", "netcheck",
                                      "--initial-peers", *initial, "--run", "lab", "--json"],
                            timeout=90, check=False)
            assert done.returncode == 0, done.stdout + done.stderr
            report = json.loads(done.stdout.strip().splitlines()[-1])
            assert report["observed"].startswith(net.public_address("alice") + ":"), report
            assert report["udp_reachable"] is False and report["nat"] != "public", report
            assert report["advice"], report

            bob = nodes["bob"]
            swarm.kill(bob)
            bob.status = {}
            swarm.start(bob)

            def back(st: list[Any]) -> bool:
                return _serving_and_training(bob.status) and all_serving(st, N_STAGES)

            await _until(swarm, "bob back after SIGKILL", back, 150)

            # the bootstrap too: started again without initial peers, it cannot dial the
            # homes behind NAT; it dials the members it remembered (peers.json), and the
            # homes dial it, their initial peer, again (node/daemon.py: _keep_address_book)
            boot = nodes["boot"]
            swarm.kill(boot)
            boot.status = {}
            swarm.start(boot)

            def boot_back(st: list[Any]) -> bool:
                status = boot.status
                return _serving_and_training(status) and len(status["peers"]) >= len(HOSTS) - 1

            await _until(swarm, "the bootstrap knows the homes and trains after SIGKILL",
                         boot_back, 180)
        finally:
            await swarm.stop()

    asyncio.run(scenario())
