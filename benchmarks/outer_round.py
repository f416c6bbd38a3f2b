"""DiLoCo outer-round carriers side by side: payloads in hivemind's gather vs over QUIC.

One cell = one carrier and one payload size. ``--replicas`` members, each a process of its
own with a real hivemind DHT (and its libp2p daemon) and a real QUIC endpoint on its own
uvloop thread, as a daemon has them, all on loopback, start an outer round at the same
time with a seeded random payload of that size each; a round's time runs from the first
member's start to the moment the last member holds every member's payload (one
CLOCK_MONOTONIC for all processes). The carriers are the daemon's own
(node/stage/diloco.py, node/stage/outer_payloads.py):

- ``gather``: ``HivemindCarrier`` alone, the payload inside the gathered data (libp2p
  matchmaking messages relayed by the group's leader); refused above its
  ``MAX_PAYLOAD_BYTES`` (768 KiB), as the optimizer refuses such a stage;
- ``quic``: ``QuicOuterCarrier``, the gather carrying a descriptor and every member
  fetching the others' payloads from their endpoints, checked by SHA-256.

Each round is checked: every member must end with every member's exact bytes (a round that
fails or brings other bytes counts as failed; so does one whose replicas split into groups
that average apart). Every carrier matches with the same ``--matchmaking`` time (hivemind
waits that long for a group that has not reached its target size). As in a daemon, every
member knows how many replicas there are and a group is full when all of them joined (at
most 4 for ``gather`` and ``quic4``, the QUIC carrier with the group cap it had before;
``MAX_GROUP_QUIC``, 8, for ``quic``). ``quic8`` is the QUIC carrier as it was before
groups were sized by the replicas known: its target is always 8, so fewer replicas wait
out the matchmaking time every round. With more than 4 replicas, ``quic4`` is the
baseline: its replicas split into groups.

Where: this host's loopback (the default: both carriers' CPU costs, no link limit), or with
``--lab-rate-mbit R`` (root) each member on a public host of its own in the network lab
(node/tools/netlab.py), every host's uplink limited to R Mbit/s by tbf, no added delay or
loss: there the gather's relay through the group's leader, which sends every member the
others' payloads, meets the leader's uplink.

Prints one line per cell as it ends (stderr), the carriers side by side per size, then one
JSON line:
``{"replicas", "matchmaking_s", "lab_rate_mbit", "gather_cap_bytes", "results":
[{"carrier", "size_mib", "rounds", "failed", "refused", "p50_s", "max_s"}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from wanswarm.node.stage.averaging import AveragingConfig
from wanswarm.node.stage.diloco import (
    MAX_GROUP,
    MAX_GROUP_QUIC,
    MAX_PAYLOAD_BYTES,
    HivemindCarrier,
)
from wanswarm.node.stage.outer_payloads import PayloadLink, QuicOuterCarrier
from wanswarm.transport.config import CongestionConfig, TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.identity import Identity

CARRIERS = ("gather", "quic4", "quic8", "quic")
DEFAULT_CARRIERS = ("gather", "quic")
DEFAULT_SIZES = (0.25, 0.7, 4.0, 21.0)  # MiB; 21: an int8 round of the small run's stage
ROUND_TIMEOUT_S = 60.0


class _Host:
    """Builds averagers over a raw hivemind DHT (as membership.dht.Dht does over its own)."""

    def __init__(self, dht: Any) -> None:
        self.dht = dht

    def hivemind_averager(self, factory: Any, **options: Any) -> Any:
        return factory(dht=self.dht, **options)


@contextmanager
def _loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """A uvloop event loop on its own thread (the daemon's loop)."""
    import uvloop

    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="node-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _payload(size: int, seed: int, member: int) -> bytes:
    gen = torch.Generator().manual_seed(seed * 101 + member)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy().tobytes()


def member(args: argparse.Namespace) -> int:
    """One replica in its own process: a hivemind DHT, a QUIC endpoint, the carriers asked
    for; rounds on the commands read from stdin (JSON lines), answers on stdout."""
    import hivemind

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    config = AveragingConfig(matchmaking_time=args.matchmaking,
                             averaging_timeout=ROUND_TIMEOUT_S, load_state_timeout=10.0,
                             outer_fetches_at_once=args.fetches_at_once)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/0"],
                       initial_peers=args.initial_peers or None)
    # aioquic's Reno on loopback: the WAN controller's min-RTT estimate needs real delay
    transport = (TransportConfig(host=args.host) if args.lab_rate_mbit else
                 TransportConfig(host=args.host, congestion=CongestionConfig(algorithm="reno")))
    with _loop_thread() as loop:
        ep = Endpoint(Identity.generate(), transport)
        asyncio.run_coroutine_threadsafe(ep.start(args.host, 0), loop).result(timeout=30)
        book: list[PeerAddress] = []
        host = _Host(dht)
        groups = {"quic4": MAX_GROUP, "quic8": MAX_GROUP_QUIC, "quic": MAX_GROUP_QUIC}
        # each QUIC carrier serves its payloads under a request kind of its own stage's
        stages = {"quic4": 1, "quic8": 2, "quic": 0}

        def others() -> int:  # the daemon's count of the stage's other replicas
            return int(args.replicas) - 1

        carriers: dict[str, Any] = {}
        for name in args.carriers:  # each an averager process of its own: only those asked
            if name == "gather":
                carriers[name] = HivemindCarrier(host, "bench_outer_gather", lambda: ({}, []),
                                                 config, ROUND_TIMEOUT_S, others=others)
                continue
            carriers[name] = QuicOuterCarrier(
                HivemindCarrier(host, f"bench_outer_{name}", lambda: ({}, []), config,
                                ROUND_TIMEOUT_S, groups[name],
                                others=None if name == "quic8" else others),
                PayloadLink(ep, loop, lambda: book), stages[name], f"bench_outer_{name}", config,
                round_timeout=ROUND_TIMEOUT_S,
            )
        say({"ready": True, "maddrs": [str(m) for m in dht.get_visible_maddrs()],
             "peer_id": ep.peer_id, "address": list(ep.address)})
        try:
            for line in sys.stdin:
                command = json.loads(line)
                if command["cmd"] == "book":
                    book[:] = [PeerAddress(p, h, port) for p, h, port in command["book"]]
                    say({"ok": True})
                elif command["cmd"] == "round":
                    say(_member_round(carriers[command["carrier"]], command, args.index))
                else:
                    break
        finally:
            for carrier in carriers.values():
                carrier.shutdown()
            asyncio.run_coroutine_threadsafe(ep.close(), loop).result(timeout=30)
            dht.shutdown()
    return 0


def _member_round(carrier: Any, command: dict[str, Any], index: int) -> dict[str, Any]:
    """Start the round, wait for it, check that every member's exact bytes arrived."""
    size, seed, n = command["size"], command["seed"], command["replicas"]
    payload = _payload(size, seed, index)
    started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
    pending = carrier.start_gather(
        {"round": command["number"], "anchor": "0" * 16, "weight": 1.0, "member": index,
         "payload": payload}, ROUND_TIMEOUT_S)
    deadline = started + 2 * ROUND_TIMEOUT_S + 15.0
    while not pending.done():
        if time.monotonic() > deadline:
            return {"ok": False, "why": "timed out", "start": started}
        time.sleep(0.002)
    ended = time.monotonic()
    result = pending.result()
    if result is None:
        return {"ok": False, "why": "the round failed", "start": started}
    got = {d.get("member"): d.get("payload") for d in result.values() if isinstance(d, dict)}
    if sorted(k for k in got if isinstance(k, int)) != list(range(n)):
        return {"ok": False, "why": f"members {sorted(map(str, got))}", "start": started}
    if any(got[j] != (payload if j == index else _payload(size, seed, j)) for j in range(n)):
        return {"ok": False, "why": "a payload with other bytes", "start": started}
    return {"ok": True, "start": started, "end": ended}


class _Members:
    """The member processes, spoken to over their stdin and stdout: on this host's loopback,
    or each on a host of its own in ``lab`` (its uplink shaped)."""

    def __init__(self, args: argparse.Namespace, lab: Any = None) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self._args, self._lab = args, lab
        first = self._spawn(0, [])
        book = [[first["peer_id"], *first["address"]]]
        for i in range(1, args.replicas):
            ready = self._spawn(i, first["maddrs"])
            book.append([ready["peer_id"], *ready["address"]])
        self.ask_all({"cmd": "book", "book": book})

    def _spawn(self, index: int, initial: list[str]) -> dict[str, Any]:
        host = "127.0.0.1" if self._lab is None else self._lab.address(_lab_host(index))
        argv = [sys.executable, __file__, "--role", "member", "--index", str(index),
                "--host", host, "--matchmaking", str(self._args.matchmaking),
                "--replicas", str(self._args.replicas),
                "--lab-rate-mbit", str(self._args.lab_rate_mbit or 0),
                "--carriers", *self._args.carriers,
                "--fetches-at-once", str(self._args.fetches_at_once), "--initial-peers", *initial]
        pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE,
                                 "text": True}
        if self._lab is None:
            proc = subprocess.Popen(argv, **pipes)
        else:
            proc = self._lab.popen(_lab_host(index), argv, **pipes)
        self.procs.append(proc)
        return self._read(proc)

    @staticmethod
    def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"member process exited with {proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask_all(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        for proc in self.procs:  # all first, so that the members start together
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        return [self._read(proc) for proc in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _lab_host(index: int) -> str:
    return f"m{index}"


@contextmanager
def _lab(args: argparse.Namespace) -> Iterator[Any]:
    """With ``--lab-rate-mbit``: one public host per member in the network lab, each host's
    egress (its uplink) limited by tbf; else nothing (loopback)."""
    if not args.lab_rate_mbit:
        yield None
        return
    from wanswarm.node.tools.netlab import Lab, check_support
    from wanswarm.node.tools.netlab_topology import Link, Topology, tbf_args

    missing = check_support()
    if missing:
        raise SystemExit(f"--lab-rate-mbit needs the network lab: {missing}")
    topology = Topology(public=tuple(_lab_host(i) for i in range(args.replicas)))
    with Lab(topology) as lab:
        shape = tbf_args(Link(rate_mbit=args.lab_rate_mbit))
        for host in topology.public:
            lab.exec(host, ["tc", "qdisc", "replace", "dev", "eth0", "root", *shape])
        yield lab


def run(args: argparse.Namespace) -> dict[str, Any]:
    with _lab(args) as lab:
        return _run(args, lab)


def _run(args: argparse.Namespace, lab: Any) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    members = _Members(args, lab)
    try:
        number = 0
        for kind in args.carriers:
            for size_mib in args.sizes:
                size = int(size_mib * (1 << 20))
                cell: dict[str, Any] = {"carrier": kind, "size_mib": size_mib, "rounds": 0,
                                        "failed": 0, "refused": False, "p50_s": None,
                                        "max_s": None}
                if kind == "gather" and size > MAX_PAYLOAD_BYTES:
                    cell["refused"] = True  # as DilocoOptimizer refuses such a stage
                else:
                    times = []
                    for r in range(args.repeats):
                        number += 1
                        replies = members.ask_all({
                            "cmd": "round", "carrier": kind, "size": size, "number": number,
                            "seed": args.seed * 1000 + number, "replicas": args.replicas,
                        })
                        failed = [m.get("why") for m in replies if not m.get("ok")]
                        if failed:
                            cell["failed"] += 1
                            print(f"  {kind} {size_mib} MiB round {r}: {failed}",
                                  file=sys.stderr, flush=True)
                        else:
                            times.append(max(m["end"] for m in replies)
                                         - min(m["start"] for m in replies))
                    cell["rounds"] = len(times)
                    if times:
                        cell["p50_s"] = round(statistics.median(times), 3)
                        cell["max_s"] = round(max(times), 3)
                results.append(cell)
                print(_line(cell), file=sys.stderr, flush=True)  # progress
    finally:
        members.close()
    return {"replicas": args.replicas, "matchmaking_s": args.matchmaking,
            "fetches_at_once": args.fetches_at_once,
            "lab_rate_mbit": args.lab_rate_mbit or None,
            "gather_cap_bytes": MAX_PAYLOAD_BYTES, "results": results}


def _line(cell: dict[str, Any]) -> str:
    head = f"{cell['carrier']:>6}  {cell['size_mib']:>7.2f} MiB"
    if cell["refused"]:
        return f"{head}  refused: over the gather's {MAX_PAYLOAD_BYTES} bytes"
    return (f"{head}  p50 {cell['p50_s']} s  max {cell['max_s']} s  "
            f"({cell['rounds']} rounds, {cell['failed']} failed)")


def _table(report: dict[str, Any]) -> str:
    """The carriers side by side per size."""
    by = {(c["carrier"], c["size_mib"]): c for c in report["results"]}
    sizes = sorted({c["size_mib"] for c in report["results"]})
    kinds = [k for k in CARRIERS if any(c["carrier"] == k for c in report["results"])]
    lines = [f"{'MiB':>7}  " + "  ".join(f"{k + ' p50 s':>14}" for k in kinds)]
    for size in sizes:
        cells = []
        for kind in kinds:
            c = by.get((kind, size))
            text = ("-" if c is None else "refused" if c["refused"]
                    else "all failed" if c["p50_s"] is None else str(c["p50_s"]))
            cells.append(f"{text:>14}")
        lines.append(f"{size:>7.2f}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="DiLoCo outer rounds with each payload carrier, side by side: hivemind's "
        "gather (payload in libp2p matchmaking messages, capped at 768 KiB) against the "
        "daemon's QUIC fetches; real hivemind DHTs and QUIC endpoints, one process per "
        "member, on loopback or (--lab-rate-mbit) on hosts of their own with shaped uplinks.",
    )
    parser.add_argument("--replicas", type=int, default=2, choices=range(2, MAX_GROUP_QUIC + 1),
                        metavar=f"2..{MAX_GROUP_QUIC}",
                        help="members of every round; a round counts only when every member "
                        f"holds every member's payload (one group: at most {MAX_GROUP} with "
                        f"the gather and quic4, {MAX_GROUP_QUIC} with quic)")
    parser.add_argument("--sizes", type=float, nargs="+", default=list(DEFAULT_SIZES),
                        help="payload per replica, MiB (21: the small run's stage in int8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per cell")
    parser.add_argument("--carriers", nargs="+", choices=CARRIERS, default=list(DEFAULT_CARRIERS),
                        help="gather: payloads in hivemind's gather (groups of 4); quic: the "
                        f"daemon's QUIC carrier (groups of up to {MAX_GROUP_QUIC}, full when "
                        f"every replica joined); quic4: the QUIC carrier with groups of "
                        f"{MAX_GROUP}, as before groups grew; quic8: groups of up to "
                        f"{MAX_GROUP_QUIC} that wait out --matchmaking below 8 replicas, as "
                        "before groups were sized by the replicas known")
    parser.add_argument("--matchmaking", type=float, default=1.0,
                        help="hivemind's min_matchmaking_time, s (the floor of a round "
                        "whose group stays under its carrier's target size)")
    parser.add_argument("--fetches-at-once", type=int, default=None,
                        help="QUIC carriers: payloads a member fetches at once (the node's "
                        "averaging.outer_fetches_at_once by default)")
    parser.add_argument("--lab-rate-mbit", type=float, default=None,
                        help="run each member on a host of its own in the network lab (root), "
                        "its uplink limited to this rate by tbf (no added delay or loss)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true",
                        help="only the final JSON line on stdout (progress stays on stderr)")
    parser.add_argument("--role", choices=("bench", "member"), default="bench",
                        help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fetches_at_once is None:
        args.fetches_at_once = AveragingConfig().outer_fetches_at_once
    if args.role == "member":
        return member(args)
    if args.repeats < 1 or any(s <= 0 for s in args.sizes):
        parser.error("--repeats and --sizes must be positive")
    report = run(args)
    if not args.json:
        print(_table(report))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0 if all(c["failed"] == 0 for c in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
