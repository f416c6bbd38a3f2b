"""How much traffic the WAN emulator relays, and the CPU it needs to do it.

Three processes, so that the relay has a core's worth of scheduling to itself:

    this process: blaster ──> relay (python -m wanswarm.transport.wan) ──> echo/sink process
                  counter <──                                           <── (with --echo)

The blaster sends fixed-size packets at ``--rate-mbps`` for ``--seconds``; the relay's
own stats (printed as JSON on SIGTERM) give what each direction delivered and dropped
and the CPU time it used. Prints one JSON line::

    python benchmarks/wan_emulator.py --profile wan --rate-mbps 100 --seconds 10 --echo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import uvloop


def _echo_main(port_pipe: int, echo: bool) -> None:
    """The target: count (and with ``echo``, return) every datagram, until SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.bind(("127.0.0.1", 0))
    os.write(port_pipe, b"%d\n" % sock.getsockname()[1])
    received = 0
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sock.settimeout(0.2)
    while not stop:
        try:
            data, addr = sock.recvfrom(65535)
        except TimeoutError:
            continue
        except InterruptedError:
            continue
        received += 1
        if echo:
            sock.sendto(data, addr)
    sys.stdout.write(json.dumps({"received": received}) + "\n")
    sys.stdout.flush()


class _Counter(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.packets = 0
        self.bytes = 0
        self.first: float | None = None
        self.last = 0.0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.packets += 1
        self.bytes += len(data)


async def _blast(
    relay: tuple[str, int], rate_bps: float, size: int, seconds: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.connect(relay)
    sock.setblocking(False)
    counter = _Counter()
    transport, _ = await loop.create_datagram_endpoint(lambda: counter, sock=sock)
    payload = os.urandom(size)
    pps = rate_bps / 8.0 / size
    start = time.monotonic()
    sent = 0
    done = loop.create_future()
    cpu0 = os.times()

    def tick() -> None:
        nonlocal sent
        now = time.monotonic()
        elapsed = min(now - start, seconds)
        owed = int(elapsed * pps) - sent
        for _ in range(owed):
            transport.sendto(payload)
        sent += owed
        if now - start >= seconds:
            done.set_result(None)
        else:
            loop.call_later(0.001, tick)

    tick()
    await done
    send_wall = time.monotonic() - start
    cpu1 = os.times()
    # let the last packets cross the emulated path (bounded by the relay's queue)
    drain = loop.create_future()
    loop.call_later(1.5, drain.set_result, None)
    await drain
    transport.close()
    return {
        "sent_packets": sent,
        "send_wall_s": send_wall,
        "sent_mbps": sent * size * 8 / send_wall / 1e6,
        "echo_packets": counter.packets,
        "echo_mbps": (
            counter.bytes * 8 / (counter.last - counter.first) / 1e6
            if counter.first is not None and counter.last > counter.first
            else 0.0
        ),
        "blaster_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--profile", default="wan", help="WAN profile name or JSON")
    parser.add_argument("--rate-mbps", type=float, default=100.0)
    parser.add_argument("--size", type=int, default=1400, help="datagram size in bytes")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--echo", action="store_true", help="target echoes: load both directions")
    parser.add_argument("--relay-cpu", type=int, default=None, help="pin the relay to this CPU")
    parser.add_argument(
        "--relay-nice",
        type=int,
        default=0,
        help="niceness of the relay process (negative, as root, on a busy machine)",
    )
    parser.add_argument(
        "--role", choices=["bench", "target"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "target":
        _echo_main(args.fd, args.echo)
        return 0

    read_fd, write_fd = os.pipe()
    target = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", "--fd", str(write_fd)]
        + (["--echo"] if args.echo else []),
        pass_fds=(write_fd,),
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        target_port = int(f.readline())
    relay_cmd = [
        sys.executable,
        "-m",
        "wanswarm.transport.wan",
        "--profile",
        args.profile,
        "--target",
        f"127.0.0.1:{target_port}",
    ]
    if args.relay_cpu is not None:
        relay_cmd += ["--cpu", str(args.relay_cpu)]
    if args.relay_nice:
        relay_cmd = ["nice", "-n", str(args.relay_nice), *relay_cmd]
    relay = subprocess.Popen(relay_cmd, stdout=subprocess.PIPE, text=True)
    assert relay.stdout is not None
    hello = json.loads(relay.stdout.readline())
    host, _, port = hello["address"].rpartition(":")
    relay_cpu0 = _cpu_seconds(relay.pid)
    wall0 = time.monotonic()
    result = uvloop.run(_blast((host, int(port)), args.rate_mbps * 1e6, args.size, args.seconds))
    relay_cpu = _cpu_seconds(relay.pid) - relay_cpu0
    wall = time.monotonic() - wall0
    relay.send_signal(signal.SIGTERM)
    relay_out, _ = relay.communicate(timeout=30)
    target.send_signal(signal.SIGTERM)
    target_out, _ = target.communicate(timeout=30)
    stats = json.loads(relay_out.strip().splitlines()[-1])
    up, down = stats["uplink"], stats["downlink"]
    summary = {
        "profile": stats["profile"],
        "size": args.size,
        "offered_mbps": round(result["sent_mbps"], 1),
        "uplink_delivered_mbps": round(up["delivered_bytes"] * 8 / result["send_wall_s"] / 1e6, 1),
        "uplink": {
            k: up[k]
            for k in (
                "offered_packets",
                "delivered_packets",
                "lost_packets",
                "overflow_packets",
                "queue_hwm_bytes",
                "mean_delay_s",
                "mean_late_s",
                "max_late_s",
            )
        },
        "downlink": {
            k: down[k]
            for k in (
                "offered_packets",
                "delivered_packets",
                "lost_packets",
                "overflow_packets",
                "mean_late_s",
                "max_late_s",
            )
        },
        "target_received": json.loads(target_out.strip().splitlines()[-1])["received"],
        "echo_received_mbps": round(result["echo_mbps"], 1),
        "relay_cpu_fraction": round(relay_cpu / wall, 3),
        # CPU per packet relayed, either direction (read, schedule, send)
        "relay_cpu_us_per_packet": round(
            relay_cpu / max(1, up["offered_packets"] + down["offered_packets"]) * 1e6, 1
        ),
        "relay_cpu_s": round(relay_cpu, 2),
        "wall_s": round(wall, 2),
        "blaster_cpu_fraction": round(result["blaster_cpu_s"] / result["send_wall_s"], 3),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(summary))
    return 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


if __name__ == "__main__":
    sys.exit(main())
