"""User-space WAN emulator: a UDP relay on loopback that gives each direction a link
with delay, jitter, loss and a rate-limited drop-tail queue.

The kernel of our test machines has neither netem nor fq_codel, so tests and
benchmarks put this relay between a client and a server::

    client(s) ──> [listen socket] ──uplink──> [one socket per client] ──> target
    client(s) <── [listen socket] <─downlink─ [one socket per client] <── target

Each client source address gets its own upstream socket, so the target sees one
distinct peer per client (as behind a NAT). All clients share the two links: the
uplink and downlink are each one bottleneck, as an access link would be.

The packet scheduling lives in the sans-I/O ``wan_link.LinkEmulator``; this module only
pumps it: one ``loop.call_later`` handle per direction, armed for the earliest due
packet of the link's heap (never one task or timer per packet).

Two ways to use it:

- in process: ``async with WanEmulator("wan", target=("127.0.0.1", port)) as wan:``
  then send to ``wan.address``; ``wan.stats()`` returns the counters;
- as a process of its own (for benchmarks, so that it has its own core)::

      python -m wanswarm.transport.wan --profile wan --target 127.0.0.1:4433

  prints ``{"event": "listening", "address": "127.0.0.1:PORT", ...}`` as one JSON line
  on stdout, and on SIGTERM or SIGINT ``{"event": "stats", ...}`` (the counters and
  the process's CPU time) as one more JSON line before exiting 0.

With ``tcp_target`` (``--tcp-target``) the emulator also relays TCP connections to it
(``tcp_address``), and their bytes cross the same two links as the datagrams: a daemon's
libp2p traffic (DHT, hivemind's averaging, state downloads) then shares its emulated
access link with its QUIC traffic (wan_tcp.py says what a stream takes from the profile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError
from .wan_link import (
    BernoulliLoss,
    GilbertElliottLoss,
    LinkEmulator,
    LinkProfile,
)
from .wan_tcp import StreamChunk, TcpRelay

__all__ = ["PROFILES", "WanEmulator", "WanProfile", "main"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Address = tuple[str, int]

# Deliver a packet at most this early: uvloop's timers have a granularity of 1 ms and
# round to the nearest millisecond, so waiting for a sub-millisecond remainder would
# only spin the loop. The error this leaves is measured (``lateness`` in the stats).
_EARLY_TOLERANCE_S = 0.0005
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
_MAX_DATAGRAM = 65535
_READ_BATCH = 256
# Kernel receive timestamps (socket(7)); Python's socket module does not name this
# Linux option, whose value is the same on every architecture but a few old ones.
_SO_TIMESTAMPNS: int = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")  # struct timespec on 64-bit Linux
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)


class WanProfile(BaseModel):
    """A path between clients and the target: one link per direction.

    ``uplink`` carries client -> target packets, ``downlink`` target -> client.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="custom", description="Name shown in the stats.")
    uplink: LinkProfile = Field(..., description="Client to target direction.")
    downlink: LinkProfile = Field(..., description="Target to client direction.")

    @property
    def rtt_s(self) -> float:
        """Round-trip propagation delay (without queueing, serialization or jitter)."""
        return self.uplink.delay_s + self.downlink.delay_s

    @classmethod
    def symmetric(
        cls,
        name: str,
        *,
        rate_bps: float | None,
        rtt_s: float,
        loss: BernoulliLoss | GilbertElliottLoss | None = None,
        jitter_s: float = 0.0,
        reorder: bool = False,
        queue_ms: float | None = None,
        queue_packets: int | None = None,
    ) -> WanProfile:
        """The same link both ways, the RTT split evenly between the directions.

        The queue holds ``queue_ms`` of traffic at the link rate; with neither
        ``queue_ms`` nor ``queue_packets`` it holds one bandwidth-delay product
        (``rate * rtt``), the classic router buffer rule.
        """
        queue_bytes: int | None = None
        if rate_bps is not None:
            if queue_ms is None and queue_packets is None:
                queue_ms = rtt_s * 1000.0
            if queue_ms is not None:
                queue_bytes = max(1500, int(rate_bps / 8.0 * queue_ms / 1000.0))
        link = LinkProfile(
            rate_bps=rate_bps,
            delay_s=rtt_s / 2.0,
            jitter_s=jitter_s,
            reorder=reorder,
            loss=loss if loss is not None else BernoulliLoss(),
            queue_bytes=queue_bytes,
            queue_packets=queue_packets,
        )
        return cls(name=name, uplink=link, downlink=link)

    @classmethod
    def parse(cls, spec: str) -> WanProfile:
        """A named profile (``lan``, ``home``, ``wan``, ``bad``) or a profile as JSON."""
        if spec in PROFILES:
            return PROFILES[spec]
        if spec.lstrip().startswith("{"):
            try:
                return cls.model_validate_json(spec)
            except ValidationError as e:
                raise ConfigError(f"invalid WAN profile JSON: {e}") from e
        raise ConfigError(
            f"unknown WAN profile {spec!r}: use one of {sorted(PROFILES)} or a JSON profile"
        )


# Loss rates are per direction. Queues hold one bandwidth-delay product.
PROFILES: Mapping[str, WanProfile] = MappingProxyType(
    {
        "lan": WanProfile.symmetric("lan", rate_bps=1e9, rtt_s=0.001),
        "home": WanProfile.symmetric(
            "home", rate_bps=50e6, rtt_s=0.040, loss=BernoulliLoss(rate=0.001)
        ),
        "wan": WanProfile.symmetric(
            "wan", rate_bps=100e6, rtt_s=0.100, loss=BernoulliLoss(rate=0.01)
        ),
        "bad": WanProfile.symmetric(
            "bad",
            rate_bps=20e6,
            rtt_s=0.200,
            loss=GilbertElliottLoss.from_mean(0.03, mean_burst=3.0),
        ),
    }
)


class _Lateness:
    """How far actual delivery times strayed from the scheduled ones."""

    __slots__ = ("count", "total", "worst")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.worst = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "mean_late_s": self.total / self.count if self.count else 0.0,
            "max_late_s": self.worst,
        }


class _Pump(Generic[T]):
    """Drives one ``LinkEmulator`` from the event loop with a single timer handle."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        link: LinkEmulator[T],
        deliver: Callable[[T], None],
        observer: Callable[[], None] | None,
    ) -> None:
        self.link = link
        self.lateness = _Lateness()
        self._loop = loop
        self._deliver = deliver
        self._observer = observer
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = float("inf")
        self._last_arrival = float("-inf")

    def submit(self, payload: T, size: int, arrived: float, *, stream: bool = False) -> None:
        # Arrival stamps of one link come from several sockets (the downlink reads one
        # per client), so they may step back a little; the link model wants them in order.
        arrived = max(arrived, self._last_arrival)
        self._last_arrival = arrived
        self.link.submit(payload, size, arrived, stream=stream)
        self._arm()
        if self._observer is not None:
            self._observer()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_for = float("inf")

    def _arm(self) -> None:
        deadline = self.link.next_deadline()
        if deadline is None or deadline >= self._armed_for:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = deadline
        self._timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = float("inf")
        now = time.monotonic()
        lateness = self.lateness
        for due, payload in self.link.pop_due(now + _EARLY_TOLERANCE_S):
            late = now - due
            lateness.count += 1
            lateness.total += late
            lateness.worst = max(lateness.worst, late)
            self._deliver(payload)
        self._arm()
        if self._observer is not None:
            self._observer()


def _or_stream(deliver: Callable[[T], None]) -> Callable[[T | StreamChunk], None]:
    """A link's delivery: ``deliver`` for datagrams; a TCP stream's chunk delivers itself
    (wan_tcp.py)."""

    def route(item: T | StreamChunk) -> None:
        if isinstance(item, StreamChunk):
            item.deliver()
        else:
            deliver(item)

    return route


def _udp_socket(bind: Address, connect: Address | None = None) -> socket.socket:
    """A non-blocking UDP socket that stamps each datagram with its kernel arrival time."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # Bursts at 100 Mb/s and more overrun the default buffers (about 200 KiB); the
        # kernel caps these at net.core.{r,w}mem_max.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except OSError:
        sock.close()
        raise
    return sock


class _Client:
    """One client source address and its own upstream socket to the target."""

    __slots__ = ("addr", "last_seen", "sock")

    def __init__(self, addr: Address, sock: socket.socket, now: float) -> None:
        self.addr = addr
        self.sock = sock
        self.last_seen = now


class WanEmulator:
    """The relay: ``address`` is where clients send; packets reach ``target`` after
    crossing ``profile.uplink``, and replies come back across ``profile.downlink``.

    ``seed`` seeds the loss and jitter draws (uplink and downlink each get their own
    stream). Clients silent for ``idle_timeout_s`` lose their upstream socket; at most
    ``max_clients`` are tracked at once, packets from further addresses are dropped
    and counted as ``refused``.

    ``observer``, when given, is called after every packet a link accepts, drops or
    delivers, so that a test can check the counters the moment they change (and set
    an event) instead of polling them.

    Arrival times are the kernel's receive timestamps (``SO_TIMESTAMPNS``), not the
    time the relay got round to reading a packet: a relay descheduled for a few
    milliseconds on a busy machine delivers late (measured: ``mean_late_s``,
    ``max_late_s``) but does not also lose the link capacity of those milliseconds.
    """

    def __init__(
        self,
        profile: WanProfile | str,
        target: Address,
        *,
        listen: Address = ("127.0.0.1", 0),
        seed: int = 0,
        idle_timeout_s: float = 60.0,
        max_clients: int = 1024,
        observer: Callable[[], None] | None = None,
        tcp_target: Address | None = None,
    ) -> None:
        self.profile = WanProfile.parse(profile) if isinstance(profile, str) else profile
        self.target = target
        self._listen_addr = listen
        self._seed = seed
        self._idle_timeout_s = idle_timeout_s
        self._max_clients = max_clients
        self._observer = observer
        self._clients: dict[Address, _Client] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listen: socket.socket | None = None
        self._up: _Pump[tuple[_Client, bytes] | StreamChunk] | None = None
        self._down: _Pump[tuple[Address, bytes] | StreamChunk] | None = None
        self._tcp_target = tcp_target
        self.tcp: TcpRelay | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._rng = random.Random(seed)
        self._io_errors = 0
        self._send_buffer_drops = 0
        self._refused = 0
        self._address: Address | None = None

    @property
    def address(self) -> Address:
        """The relay's bound address, where clients send."""
        if self._address is None:
            raise RuntimeError("WanEmulator not started")
        return self._address

    async def start(self) -> None:
        """Bind the listen socket and start relaying."""
        loop = self._loop = asyncio.get_running_loop()
        rngs = random.Random(self._seed)
        self._up = _Pump(
            loop,
            LinkEmulator(self.profile.uplink, random.Random(rngs.getrandbits(64))),
            _or_stream(self._to_target),
            self._observer,
        )
        self._down = _Pump(
            loop,
            LinkEmulator(self.profile.downlink, random.Random(rngs.getrandbits(64))),
            _or_stream(self._to_client),
            self._observer,
        )
        sock = self._listen = _udp_socket(self._listen_addr)
        host, port = sock.getsockname()[:2]
        self._address = (host, port)
        loop.add_reader(sock.fileno(), self._read, sock, None)
        self._schedule_sweep()
        logger.info(
            "WAN emulator %s on %s:%d -> %s:%d", self.profile.name, host, port, *self.target
        )
        if self._tcp_target is not None:
            # TCP streams share the two links with the datagrams (wan_tcp.py)
            up, down = self._up, self._down
            self.tcp = TcpRelay(
                self._tcp_target,
                (lambda c, n, t: up.submit(c, n, t, stream=True), up.link.room),
                (lambda c, n, t: down.submit(c, n, t, stream=True), down.link.room),
                listen=(host, 0),
            )
            await self.tcp.start()

    @property
    def tcp_address(self) -> Address | None:
        """The TCP relay's bound address (None without a ``tcp_target``)."""
        return self.tcp.address if self.tcp is not None else None

    async def close(self) -> None:
        """Stop relaying; packets still in flight stay counted as pending."""
        if self.tcp is not None:
            await self.tcp.close()
        for pump in (self._up, self._down):
            if pump is not None:
                pump.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for client in self._clients.values():
            self._close_socket(client.sock)
        self._clients.clear()
        if self._listen is not None:
            self._close_socket(self._listen)
            self._listen = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def set_mtu(self, mtu_bytes: int) -> None:
        """Change both directions' MTU while running (``LinkEmulator.set_mtu``): the path
        moves onto a route that carries smaller (or larger) packets, silently."""
        for pump in (self._up, self._down):
            if pump is None:
                raise RuntimeError("the emulator is not running")
            pump.link.set_mtu(mtu_bytes)

    def stats(self) -> dict[str, Any]:
        """Counters per direction (see ``LinkCounters``) plus how late the relay
        actually delivered against the schedule, and relay-level counts:
        ``send_buffer_drops`` (a full socket send buffer refused a due packet) and
        ``io_errors`` (e.g. ICMP port unreachable from a target that is down)."""
        out: dict[str, Any] = {"profile": self.profile.name}
        for name, pump in (("uplink", self._up), ("downlink", self._down)):
            if pump is not None:
                out[name] = pump.link.counters.as_dict() | pump.lateness.as_dict()
        out["clients"] = len(self._clients)
        out["refused_packets"] = self._refused
        out["send_buffer_drops"] = self._send_buffer_drops
        out["io_errors"] = self._io_errors
        if self.tcp is not None:
            out["tcp"] = self.tcp.stats()
        return out

    # -- packet paths ------------------------------------------------------------------

    def _read(self, sock: socket.socket, client: _Client | None) -> None:
        """Read what ``sock`` holds (up to a batch, to stay fair to the other sockets):
        the listen socket when ``client`` is None, else that client's upstream socket."""
        # CLOCK_REALTIME stamps to the monotonic clock of the link model
        offset = time.time() - time.monotonic()
        for _ in range(_READ_BATCH):
            try:
                data, ancillary, _, addr = sock.recvmsg(_MAX_DATAGRAM, _ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # ECONNREFUSED after an ICMP port unreachable
                self._io_errors += 1
                logger.debug("receive error on %s: %s", sock.getsockname(), e)
                continue
            arrived = None
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                    sec, nsec = _TIMESPEC.unpack_from(raw)
                    arrived = sec + nsec * 1e-9 - offset
            if arrived is None:
                arrived = time.monotonic()
            if client is None:
                self._from_client(data, (addr[0], addr[1]), arrived)
            else:
                client.last_seen = arrived
                assert self._down is not None
                self._down.submit((client.addr, data), len(data), arrived)

    def _from_client(self, data: bytes, addr: Address, arrived: float) -> None:
        client = self._clients.get(addr)
        if client is None:
            if len(self._clients) >= self._max_clients:
                self._refused += 1
                return
            client = self._open_client(addr, arrived)
            if client is None:
                return
        client.last_seen = arrived
        assert self._up is not None
        self._up.submit((client, data), len(data), arrived)

    def _open_client(self, addr: Address, now: float) -> _Client | None:
        assert self._loop is not None and self._address is not None
        try:
            sock = _udp_socket((self._address[0], 0), self.target)
        except OSError as e:
            logger.warning("cannot open an upstream socket for %s: %s", addr, e)
            self._io_errors += 1
            return None
        client = self._clients[addr] = _Client(addr, sock, now)
        self._loop.add_reader(sock.fileno(), self._read, sock, client)
        return client

    def _to_target(self, item: tuple[_Client, bytes]) -> None:
        client, data = item
        if client.sock.fileno() >= 0:  # not swept meanwhile
            self._send(client.sock, data, None)

    def _to_client(self, item: tuple[Address, bytes]) -> None:
        if self._listen is not None:
            self._send(self._listen, item[1], item[0])

    def _send(self, sock: socket.socket, data: bytes, addr: Address | None) -> None:
        try:
            if addr is None:
                sock.send(data)
            else:
                sock.sendto(data, addr)
        except BlockingIOError:
            self._send_buffer_drops += 1
        except OSError as e:
            self._io_errors += 1
            logger.debug("send error on %s: %s", sock.getsockname(), e)

    def _close_socket(self, sock: socket.socket) -> None:
        if self._loop is not None and sock.fileno() >= 0:
            self._loop.remove_reader(sock.fileno())
        sock.close()

    def _schedule_sweep(self) -> None:
        assert self._loop is not None
        period = self._idle_timeout_s / 4.0
        delay = period * self._rng.uniform(0.9, 1.1)
        self._sweeper = self._loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        cutoff = time.monotonic() - self._idle_timeout_s
        for addr, client in list(self._clients.items()):
            if client.last_seen < cutoff:
                self._close_socket(client.sock)
                del self._clients[addr]
        self._schedule_sweep()


# -- command line ----------------------------------------------------------------------


def _parse_address(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    try:
        return host, int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None


def _emit(record: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def _serve(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    wan = WanEmulator(
        args.profile, args.target, listen=args.listen, seed=args.seed, tcp_target=args.tcp_target
    )
    async with wan:
        host, port = wan.address
        tcp = wan.tcp_address
        _emit(
            {
                "event": "listening",
                "address": f"{host}:{port}",
                "tcp_address": f"{tcp[0]}:{tcp[1]}" if tcp is not None else None,
                "profile": wan.profile.model_dump(mode="json"),
                "pid": os.getpid(),
            }
        )
        await stop.wait()
        stats = wan.stats()
    cpu = os.times()
    stats["cpu_user_s"] = cpu.user
    stats["cpu_system_s"] = cpu.system
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    """Run the relay until SIGTERM/SIGINT; JSON lines on stdout (see module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m wanswarm.transport.wan",
        description="User-space WAN emulator: a UDP relay, and optionally a TCP relay whose "
        "streams share its links.",
    )
    parser.add_argument(
        "--profile", default="wan", help=f"one of {sorted(PROFILES)} or a JSON WanProfile"
    )
    parser.add_argument("--target", type=_parse_address, required=True, help="HOST:PORT (UDP)")
    parser.add_argument(
        "--tcp-target",
        type=_parse_address,
        default=None,
        help="HOST:PORT: also relay TCP connections there, through the same links "
        "(listening on the UDP address's host, a port of its own: 'tcp_address')",
    )
    parser.add_argument("--listen", type=_parse_address, default=("127.0.0.1", 0), help="HOST:PORT")
    parser.add_argument("--seed", type=int, default=0, help="seed of loss and jitter draws")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    args = parser.parse_args(argv)
    try:
        args.profile = WanProfile.parse(args.profile)
    except ConfigError as e:
        parser.error(str(e))
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but the relay works without it
        stats = asyncio.run(_serve(args))
    else:
        stats = uvloop.run(_serve(args))
    _emit({"event": "stats", **stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
