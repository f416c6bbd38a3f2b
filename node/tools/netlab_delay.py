"""The network lab's delay stage: holds every packet of a TUN device for a fixed time.

This kernel has no netem, so propagation delay is made in user space. The router namespace
routes each forwarded packet into a TUN device (policy rules, see
:func:`netlab_topology.router_ruleset`); this process reads it, keeps it for ``--delay-ms``
and writes it back into the same device, where the kernel routes it onward (now arriving from
the TUN device, so the main table applies). The delay is constant, so packets leave in the
order they came and a FIFO is enough. A packet read while ``--limit`` packets are held is
dropped, as a full router buffer would.

Run inside the router's namespace, by path, standard library only (it is started through
``ip netns exec``, without the package on the path)::

    ip netns exec NS python3 netlab_delay.py --dev dly --delay-ms 25 --parent-pid PID

It prints ``ready`` once attached to the device, and exits when its parent is gone (also set
as the kernel's parent-death signal) or on SIGTERM. It runs at nice -10, so that the load of
the machine delays its wake-ups less.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA  # linux/if_tun.h: _IOW('T', 202, int)
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000  # packets without the 4-byte protocol-information prefix
PR_SET_PDEATHSIG = 1  # linux/prctl.h
READ_SIZE = 65536
READ_BATCH = 256  # packets read per wake-up before due packets are written again
PARENT_CHECK_S = 0.5
NICE = -10


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device ``name`` of this namespace, non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def run(fd: int, delay_ns: int, limit: int, parent_pid: int) -> None:
    held: collections.deque[tuple[int, bytes]] = collections.deque()
    next_parent_check = 0
    while True:
        now = time.monotonic_ns()
        while held and held[0][0] <= now:
            with contextlib.suppress(OSError):  # the kernel refused it: a lost packet
                os.write(fd, held.popleft()[1])
        if now >= next_parent_check:
            if parent_pid and os.getppid() != parent_pid:
                return
            next_parent_check = now + int(PARENT_CHECK_S * 1e9)
        timeout = PARENT_CHECK_S if not held else max(0.0, (held[0][0] - now) / 1e9)
        readable, _, _ = select.select([fd], [], [], min(timeout, PARENT_CHECK_S))
        if not readable:
            continue
        for _ in range(READ_BATCH):
            try:
                packet = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            if len(held) < limit:
                held.append((time.monotonic_ns() + delay_ns, packet))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--dev", required=True, help="TUN device to serve")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay of every packet")
    parser.add_argument("--limit", type=int, default=20000, help="most packets held at once")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit once this process is no longer the parent")
    args = parser.parse_args(argv)
    if args.parent_pid:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != args.parent_pid:
            return 1
    # A link's delay should not grow with the machine's load: ahead of ordinary processes,
    # the stage wakes closer to each packet's due time (root may raise its priority).
    with contextlib.suppress(OSError):
        os.nice(NICE)
    fd = open_tun(args.dev)
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        run(fd, int(args.delay_ms * 1e6), args.limit, args.parent_pid)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
