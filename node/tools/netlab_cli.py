"""The network lab's command: ``python -m wanswarm.node.tools.netlab --help``.

``up`` builds a lab from flags or TOML, prints its hosts and keeps it until Ctrl-C or
SIGTERM; ``list`` shows the labs present; ``cleanup`` removes stale ones; ``bench`` measures
what a delay stage forwards at most (docs/netlab.md, Limits). The lab itself is
:mod:`.netlab`; ``python -m wanswarm.node.tools.netlab`` runs :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .netlab import (
    LAB_ID_RE,
    Lab,
    LabError,
    check_support,
    cleanup_stale,
    lab_namespaces,
    pid_alive,
)
from .netlab_topology import Home, Link, Topology, TopologyError, from_flags, from_toml

EPILOG = """\
examples:
  # one public host and two homes (cone and symmetric NAT), 25 ms / 1% / 100 Mb/s uplinks
  python -m wanswarm.node.tools.netlab up --public boot --home alice:cone \\
      --home bob:symmetric --delay-ms 25 --loss 0.01 --rate-mbit 100
  # the same from a file (format: wanswarm.node.tools.netlab_topology)
  python -m wanswarm.node.tools.netlab up --config lab.toml
  # then, in another shell, run anything on a host:
  ip netns exec <netns from the table> bash
  # remove what killed labs left behind
  python -m wanswarm.node.tools.netlab cleanup
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m wanswarm.node.tools.netlab",
        description="An internet in Linux network namespaces: public hosts on a bridge, home "
        "hosts behind NAT routers with delay, loss and a rate limit. Needs root.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab, print its hosts, keep it until Ctrl-C")
    up.add_argument("--config", type=Path, help="a TOML topology ([[public]], [[home]])")
    up.add_argument("--public", action="append", default=[], metavar="NAME",
                    help="a public host (repeat)")
    up.add_argument("--home", action="append", default=[], metavar="NAME[:cone|symmetric]",
                    help="a home host behind its own NAT router (repeat; default NAT: cone)")
    up.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay of every home uplink, each direction")
    up.add_argument("--loss", type=float, default=0.0,
                    help="loss probability of every home uplink, each direction")
    up.add_argument("--rate-mbit", type=float, default=None,
                    help="tbf rate of every home uplink, each direction (default: unlimited)")
    up.add_argument("--queue-ms", type=float, default=50.0,
                    help="longest wait in the rate limiter's queue")
    up.add_argument("--json", action="store_true", help="print the hosts as one JSON line")
    sub.add_parser("list", help="the labs present on this machine")
    clean = sub.add_parser("cleanup", help="remove the namespaces of labs whose process is gone")
    clean.add_argument("--all", action="store_true", help="also those of running labs")
    bench = sub.add_parser("bench", help="measure what the delay stage forwards at most")
    bench.add_argument("--delay-ms", type=float, default=1.0)
    bench.add_argument("--seconds", type=float, default=1.0, help="per offered rate")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        for lab_id, namespaces in sorted(lab_namespaces().items()):
            match = LAB_ID_RE.match(lab_id)
            owner = int(match.group(2)) if match else 0
            state = "running" if pid_alive(owner) else "stale"
            print(f"{lab_id}  {state}  {len(namespaces)} namespaces")
        return 0
    reason = check_support()
    if reason is not None:
        print(f"netlab: {reason}", file=sys.stderr)
        return 2
    if args.command == "cleanup":
        removed = cleanup_stale(include_live=args.all)
        print(f"removed {len(removed)} namespaces" + "".join(f"\n  {ns}" for ns in removed))
        return 0
    if args.command == "bench":
        print(json.dumps(bench_delay_stage(args.delay_ms, args.seconds)))
        return 0
    try:
        if args.config is not None:
            topology = from_toml(args.config.read_text())
        else:
            link = Link(args.delay_ms, args.loss, args.rate_mbit, args.queue_ms)
            topology = from_flags(args.public, args.home, link)
    except (TopologyError, OSError) as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2
    return _up(topology, as_json=args.json)


def _up(topology: Topology, *, as_json: bool) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Lab(topology) as lab:
            rows = lab.describe()
            if as_json:
                print(json.dumps({"lab": lab.id, "hosts": rows}), flush=True)
            else:
                print(f"lab {lab.id} is up; Ctrl-C tears it down")
                columns = ("host", "kind", "netns", "address", "public_address", "nat", "link")
                widths = [max(len(c), *(len(str(r[c] or "-")) for r in rows)) for c in columns]
                for values in [columns, *([str(r[c] or "-") for c in columns] for r in rows)]:
                    cells = (v.ljust(w) for v, w in zip(values, widths, strict=True))
                    print("  ".join(cells).rstrip())
                print("run a command on a host: ip netns exec <netns> <command>", flush=True)
            while not stop.wait(1.0):
                if not lab.alive():
                    print("netlab: a delay stage died; tearing down", file=sys.stderr)
                    return 1
    except LabError as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 1
    return 0


def bench_delay_stage(delay_ms: float, seconds: float) -> dict[str, Any]:
    """What one delay stage forwards at most, and how close to its delay it holds packets.

    Measured: UDP (1200-byte datagrams), 200 UDP round trips, one TCP flow, and the stage's
    CPU time per packet during the TCP flow.

    A home host sends to a public host through a router with only a delay; the offered UDP
    rate doubles until less than 90% of it arrives. Senders and sink are Python too and share
    the machine's cores with the stage, so the figures are the lab's ceiling on this machine,
    not the stage's alone.
    """
    topology = Topology(public=("sink",), homes=(Home("src", link=Link(delay_ms=delay_ms)),))
    steps = []
    with Lab(topology) as lab:
        to = f"{lab.address('sink')}:9000"
        rate = 2000
        while rate <= 256_000:
            sink = lab.probe_server("sink", "sink", "--port", "9000", "--timeout", "60")
            figures = lab.probe("src", "blast", "--to", to, "--count", str(int(rate * seconds)),
                                "--rate-pps", str(rate), "--size", "1200", timeout=120)
            lab.stop(sink)
            sent_pps = figures["sent"] / max(figures["send_seconds"], 1e-9)
            steps.append({"offered_pps": rate, "sent_pps": round(sent_pps),
                          "delivered_pps": round(figures.get("pps", 0.0)),
                          "delivered_mbit_s": round(figures.get("payload_mbit_s", 0.0), 1),
                          "received": figures.get("received", 0), "sent": figures["sent"]})
            if figures.get("received", 0) < 0.9 * figures["sent"]:
                break
            rate *= 2
        echo = lab.probe_server("sink", "echo", "--port", "9002")
        rtts = sorted(lab.probe("src", "ping", "--to", f"{lab.address('sink')}:9002", "--count",
                                "200", "--interval", "0.005")["rtts_ms"])
        lab.stop(echo)
        bulk = lab.probe_server("sink", "bulk-server", "--port", "9001")
        stage = lab.delay_stage_pids()["r-src"]
        cpu_before, packets_before = _cpu_seconds(stage), lab.delay_stage_packets("r-src")
        tcp = lab.probe("src", "bulk", "--to", f"{lab.address('sink')}:9001",
                        "--bytes", str(100 << 20), "--direction", "up", timeout=120)
        cpu = _cpu_seconds(stage) - cpu_before
        packets = lab.delay_stage_packets("r-src") - packets_before
        lab.stop(bulk)
    us_per_packet = cpu / max(packets, 1) * 1e6
    return {
        "delay_ms": delay_ms,
        "udp_steps": steps,
        "udp_max_delivered_pps": max(s["delivered_pps"] for s in steps),
        "udp_max_delivered_mbit_s": max(s["delivered_mbit_s"] for s in steps),
        "rtt_above_2x_delay_ms": {  # what the stage (and the ping programs) add
            "min": round(rtts[0] - 2 * delay_ms, 2),
            "median": round(rtts[len(rtts) // 2] - 2 * delay_ms, 2),
            "p95": round(rtts[int(len(rtts) * 0.95)] - 2 * delay_ms, 2),
        },
        "tcp_mbit_s": round(tcp["mbit_s"], 1),
        "tcp_stage_packets": packets,  # both directions: data and acknowledgements
        "stage_cpu_us_per_packet": round(us_per_packet, 2),
        "stage_ceiling_pps": round(1e6 / us_per_packet) if us_per_packet else None,
    }


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid`` (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
