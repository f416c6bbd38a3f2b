"""Transfer time and goodput of one large payload across emulated WAN paths: plain aioquic
streams against the wanswarm transport, side by side in one run.

Variants (one request = one payload of N bytes, answered by a small acknowledgement):

- ``aioquic_default``: a plain aioquic bidirectional stream, aioquic's default settings
  (``_transport_baseline.py``): N bytes and FIN; the server answers (count, CRC-32);
- ``aioquic_tuned``: the same stream with flow-control windows of max(1 MiB, 2 x BDP) of
  the profile, 1452-byte packets (1500-byte path MTU) and 4 MiB socket buffers;
- ``wanswarm``: ``Endpoint.request`` carrying the payload as one uint8 tensor with codec
  ``none`` (above the FEC threshold it travels as FEC-protected DATAGRAM frames), the
  handler answering (count, CRC-32) in the response header. The Endpoint runs with
  ``TransportConfig`` defaults (host aside): its congestion controller, windows, FEC
  (``--wanswarm-congestion reno`` swaps the controller, to tell its share in a result).

Path: client -> WAN emulator -> server. The emulator (``python -m wanswarm.transport.wan``)
is a child process of its own, one per (profile, size, variant) cell, applying the
profile in both directions and printing its counters when stopped. The clients run in
this process; every server (plain default, plain tuned per window, wanswarm) runs in one
child process; uvloop everywhere (``--loop asyncio`` for the stock loop). So client,
server and emulator each get a core's worth of scheduling where the machine has the
cores; where it does not (other work, or 2 cores for 3 busy processes) every process's
CPU seconds and run-queue wait (Linux schedstat: time runnable but not running) are in
the diagnostics, with the load average, to tell a CPU-starved run from a slow transport.

Method. Each cell opens one fresh connection and warms it up with one request of 1 KiB
(the QUIC/TLS handshake is excluded from every time), then runs ``--repeats`` transfers
back to back, each followed by an idle gap of 3 RTTs (the emulator's queue, at most one
BDP, drains) so that every transfer starts on an empty path; the congestion controller's
state carries over from one transfer to the next, as on a long-lived connection. A
transfer's time runs from the request call (payload handed to the transport) to the
acknowledgement's receipt, so it includes one RTT beyond the payload's own delivery;
goodput = payload bits / median time; the link rate counts UDP payload bytes (what the
emulator serializes). A transfer that does not complete within min(--timeout, max(10 s,
20 x ideal)) (ideal = payload / link rate + RTT; 20 is ``--timeout-factor``), fails, or
is acknowledged with a wrong count or CRC does not count as completed: its connection is
closed and the next repeat opens a new one (warmed up again); after ``--max-failures``
of them the cell stops (attempted < repeats says so). p50 is the median over attempted
transfers (a transfer that did not complete counts as infinitely slow, so a median
that falls on one is reported as null, its goodput as an upper bound only); p95 is
the nearest-rank 95th percentile. Sizes are MiB (2^20 bytes); Mb/s are 10^6 bits/s.
``--budget`` bounds the whole run: a transfer whose timeout would end past it is not
started (reported as skipped); cells run wanswarm first, then aioquic_tuned, then
aioquic_default, so a budget cuts the baselines first.

Loopback (no emulator, after the emulated cells): the wanswarm variant with 16 MiB
payloads, client and server endpoints in this one process and event loop (so both ends
share one core), its goodput and CPU seconds (``time.process_time``, all threads) per GB
(10^9 payload bytes) moved; then aioquic_tuned measured the same way, as a reference for
what plain QUIC costs on the same machine at the same time, and the wanswarm variant again
with path MTU probing off. On loopback wanswarm's connections find that 16448-byte
datagrams pass and use them (transport/path_mtu.py); with probing off, and always for
aioquic_tuned, packets are at most 1452 bytes (a 1500-byte path MTU), which is all the
emulated paths (a 1500-byte MTU each) and the internet carry.

Output: a table, target checks and, as the last line of stdout, one JSON object
``{"results": [...], "loopback": {...}, "targets": [...], "diagnostics": [...], "meta":
{...}}``. Progress goes to stderr. ::

    python benchmarks/transport.py --quick
    python benchmarks/transport.py --profiles wan bad --sizes 16 --repeats 5
    python benchmarks/transport.py --loopback only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import _transport_baseline as plain  # benchmarks/ is sys.path[0] when run as a script
import aioquic
import torch
import uvloop
from wanswarm.transport.codecs import CodecSpec
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.errors import RemoteError, TransportError
from wanswarm.transport.identity import Identity
from wanswarm.transport.wan import PROFILES

logger = logging.getLogger("benchmarks.transport")

VARIANTS = ("aioquic_default", "aioquic_tuned", "wanswarm")
MIB = 1 << 20
KIND = "bench"
WARMUP_BYTES = 1024
WARMUP_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 120.0  # a child imports torch before it listens; slow on a busy machine
STOP_TIMEOUT_S = 15.0
MIN_TIMEOUT_S = 10.0
TIMEOUT_IDEAL_FACTOR = 20.0
LOOPBACK_SIZE_MB = 16.0
LOOPBACK_TARGET_MBPS = 300.0
QUICK_BUDGET_S = 155.0  # + imports (torch: ~10 s on a busy machine) and teardown < 3 min
HOST = "127.0.0.1"

Address = tuple[str, int]


class BenchmarkError(Exception):
    """The benchmark itself could not run (a child did not start, bad arguments)."""


class Corrupt(Exception):
    """The server acknowledged a different byte count or checksum than was sent."""


# -- payloads and servers ---------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """Random bytes, the same memory seen as a uint8 tensor, and their CRC-32."""

    data: bytearray
    tensor: torch.Tensor
    crc: int

    @classmethod
    def random(cls, nbytes: int, seed: int) -> Payload:
        data = bytearray(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(seed)).numpy())
        return cls(data, torch.frombuffer(data, dtype=torch.uint8), zlib.crc32(data))

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def check(self, count: int, crc: int) -> None:
        if count != self.nbytes or crc != self.crc:
            raise Corrupt(
                f"server got {count} bytes, CRC {crc:#010x}; sent {self.nbytes}, {self.crc:#010x}"
            )


def wanswarm_config(congestion: str | None = None) -> TransportConfig:
    """What the wanswarm variant runs with: the shipped defaults, bound to loopback
    (``congestion`` swaps the congestion control algorithm, for diagnosis only)."""
    config = TransportConfig(host=HOST)
    if congestion is not None:
        config = config.model_copy(
            update={"congestion": config.congestion.model_copy(update={"algorithm": congestion})}
        )
    return config


async def _sink(request: Request) -> Response:
    """The wanswarm server's handler: the byte count and CRC-32 of the one tensor."""
    if len(request.tensors) != 1 or request.tensors[0].dtype != torch.uint8:
        raise RemoteError("bad_request", "expected one uint8 tensor")
    array = request.tensors[0].contiguous().numpy()
    return Response(header={"n": int(array.size), "crc": zlib.crc32(array)})


@dataclass
class Servers:
    """The servers of every variant, listening on ``HOST``: one plain-aioquic server with
    default settings, one tuned per flow-control window, one wanswarm Endpoint."""

    peer_id: str
    default_port: int
    tuned_ports: dict[int, int]  # window -> port
    wanswarm_port: int
    endpoint: Endpoint
    plain_servers: list[plain.PlainServer] = field(default_factory=list)

    def port(self, variant: str, window: int) -> int:
        if variant == "aioquic_default":
            return self.default_port
        if variant == "aioquic_tuned":
            return self.tuned_ports[window]
        return self.wanswarm_port

    def describe(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "default_port": self.default_port,
                "tuned_ports": self.tuned_ports, "wanswarm_port": self.wanswarm_port}

    async def close(self) -> None:
        for server in self.plain_servers:
            server.close()
        await self.endpoint.close()


async def start_servers(tuned_windows: Sequence[int], config: TransportConfig) -> Servers:
    creds = plain.credentials()
    default = await plain.serve(HOST, None, creds)
    tuned = {w: await plain.serve(HOST, w, creds) for w in sorted(set(tuned_windows))}
    endpoint = Endpoint(Identity.generate(), config)
    endpoint.register(KIND, _sink)
    await endpoint.start(HOST, 0)
    return Servers(endpoint.peer_id, default.port, {w: t.port for w, t in tuned.items()},
                   endpoint.address[1], endpoint, [default, *tuned.values()])


def tuned_window(profile: str) -> int:
    """Flow-control window of the tuned baseline: 2 x BDP, never below aioquic's 1 MiB."""
    wan = PROFILES[profile]
    rate = wan.uplink.rate_bps or 1e9
    return max(MIB, int(2 * rate * wan.rtt_s / 8))


# -- the clients of the three variants --------------------------------------------------


class Client(Protocol):
    async def open(self) -> None:
        """Connect and warm the connection up with one small request."""

    async def send(self, payload: Payload, timeout: float) -> None:
        """One request; returns once acknowledged intact, raises otherwise."""

    async def close(self) -> None: ...

    def counters(self) -> dict[str, Any]: ...


class PlainVariant:
    def __init__(self, target: Address, window: int | None) -> None:
        self._target = target
        self._client = plain.PlainClient(window)

    async def open(self) -> None:
        await self._client.connect(self._target, CONNECT_TIMEOUT_S)
        warmup = Payload.random(WARMUP_BYTES, seed=0)
        await self.send(warmup, WARMUP_TIMEOUT_S)

    async def send(self, payload: Payload, timeout: float) -> None:
        payload.check(*await self._client.request(payload.data, timeout))

    async def close(self) -> None:
        await self._client.close()

    def counters(self) -> dict[str, Any]:
        return {}


class WanswarmVariant:
    def __init__(self, target: Address, peer_id: str, config: TransportConfig) -> None:
        self._peer = PeerAddress(peer_id, target[0], target[1])
        self._endpoint = Endpoint(Identity.generate(), config)
        self._codec = CodecSpec("none")

    async def open(self) -> None:
        await self._endpoint.start(HOST, 0)
        await self.send(Payload.random(WARMUP_BYTES, seed=0), WARMUP_TIMEOUT_S)

    async def send(self, payload: Payload, timeout: float) -> None:
        response = await self._endpoint.request(
            self._peer, KIND, {}, [payload.tensor], codec=self._codec, timeout=timeout
        )
        payload.check(int(response.header.get("n", -1)), int(response.header.get("crc", -1)))

    async def close(self) -> None:
        await self._endpoint.close()

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {"totals": self._endpoint.totals()}
        stats = self._endpoint.path_stats(self._peer.peer_id)
        if stats is not None:
            out["path"] = {
                "smoothed_rtt_s": round(stats.smoothed_rtt, 4),
                "min_rtt_s": round(stats.min_rtt, 4),
                "loss_rate": round(stats.loss_rate, 4),
                "delivery_rate_mbps": round(stats.delivery_rate_bps / 1e6, 1),
            }
        return out


def make_client(
    variant: str, target: Address, peer_id: str, window: int, config: TransportConfig
) -> Client:
    if variant == "aioquic_default":
        return PlainVariant(target, None)
    if variant == "aioquic_tuned":
        return PlainVariant(target, window)
    return WanswarmVariant(target, peer_id, config)


# -- one cell: repeats of one variant on one path ---------------------------------------


@dataclass
class Cell:
    """The transfers of one (profile, size, variant); times are None if not completed."""

    profile: str
    size_mb: float
    variant: str
    nbytes: int
    link_bps: float | None
    rtt_s: float
    timeout_s: float
    times: list[float | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: int = 0  # repeats not attempted: the run's time budget was spent
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return sum(t is not None for t in self.times)

    @property
    def attempted(self) -> int:
        return len(self.times)

    def _ordered(self) -> list[float]:
        return sorted(math.inf if t is None else t for t in self.times)

    @property
    def p50_s(self) -> float | None:
        if not self.times:
            return None
        median = statistics.median(self._ordered())
        return None if math.isinf(median) else median

    @property
    def p95_s(self) -> float | None:
        if not self.times:
            return None
        ordered = self._ordered()
        value = ordered[math.ceil(0.95 * len(ordered)) - 1]
        return None if math.isinf(value) else value

    @property
    def goodput_mbps(self) -> float | None:
        p50 = self.p50_s
        return None if p50 is None else self.nbytes * 8 / p50 / 1e6

    @property
    def goodput_bound_mbps(self) -> float:
        """Upper bound on the goodput when the median transfer did not complete."""
        return self.nbytes * 8 / self.timeout_s / 1e6

    @property
    def ideal_s(self) -> float | None:
        return None if self.link_bps is None else self.nbytes * 8 / self.link_bps + self.rtt_s

    def result(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "size_mb": self.size_mb,
            "variant": self.variant,
            "link_mbps": None if self.link_bps is None else self.link_bps / 1e6,
            "goodput_mbps": _round(self.goodput_mbps, 2),
            "p50_s": _round(self.p50_s, 4),
            "p95_s": _round(self.p95_s, 4),
            "completed": self.completed,
            "attempted": self.attempted,
        }


class Budget:
    """The run's wall-clock budget (``--budget``): a transfer starts only if its timeout
    still fits, so that the run ends in time however the transfers go."""

    def __init__(self, seconds: float | None) -> None:
        self._deadline = None if seconds is None else time.monotonic() + seconds

    def fits(self, seconds: float) -> bool:
        return self._deadline is None or time.monotonic() + seconds <= self._deadline


_FAILURES = (TimeoutError, TransportError, plain.PlainError, Corrupt, OSError)


async def run_transfers(
    cell: Cell,
    new_client: Callable[[], Client],
    payload: Payload,
    repeats: int,
    *,
    max_failures: int,
    gap_s: float,
    budget: Budget,
) -> None:
    """Fill ``cell.times``: ``repeats`` transfers, a fresh connection after a failure."""
    client: Client | None = None
    failures = 0
    label = f"{cell.profile} {cell.size_mb:g}MB {cell.variant}"
    try:
        for i in range(repeats):
            if not budget.fits(cell.timeout_s + CONNECT_TIMEOUT_S):
                cell.skipped = repeats - i
                logger.info("%s: time budget spent, %d repeats skipped", label, cell.skipped)
                break
            if client is None:
                client = new_client()
                try:
                    await client.open()
                except _FAILURES as exc:
                    error = f"connect/warm-up: {_describe(exc)}"
                    await _close_quietly(client)
                    client = None
                    cell.times.append(None)
                    cell.errors.append(error)
                    logger.info("%s #%d: %s", label, i + 1, error)
                    failures += 1
                    if failures >= max_failures:
                        break
                    continue
            start = time.perf_counter()
            try:
                await client.send(payload, cell.timeout_s)
            except _FAILURES as exc:
                error = _describe(exc)
                cell.times.append(None)
                cell.errors.append(error)
                logger.info("%s #%d: not completed (%s)", label, i + 1, error)
                cell.diagnostics.update(client.counters())
                await _close_quietly(client)
                client = None
                failures += 1
                if failures >= max_failures:
                    break
                continue
            elapsed = time.perf_counter() - start
            cell.times.append(elapsed)
            logger.info("%s #%d: %.3f s, %.1f Mb/s", label, i + 1, elapsed,
                        payload.nbytes * 8 / elapsed / 1e6)
            await asyncio.sleep(gap_s)  # an idle path: the emulator's queue drains
        if client is not None:
            cell.diagnostics.update(client.counters())
    finally:
        if client is not None:
            await _close_quietly(client)


async def _close_quietly(client: Client) -> None:
    try:
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await client.close()
    except (TimeoutError, TransportError, plain.PlainError, OSError) as exc:
        logger.warning("closing a client failed: %s", _describe(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"{type(exc).__name__}: {exc}"[:200]


# -- child processes --------------------------------------------------------------------

# Runs first in every child, then execs the real command line: the child gets SIGTERM
# when this process dies, even by SIGKILL (Linux PR_SET_PDEATHSIG = 1 survives execve).
# A preexec_fn would do the same, but is unsafe in a process that has threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform == 'linux':\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent died before prctl took effect
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class Children:
    """Every child process of this run; :meth:`stop_all` ends those still running."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: Sequence[str], *, stdin: bool) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], *, signal_: int | None) -> bytes:
        """Ask ``proc`` to end (a signal, or EOF on its stdin), collect the rest of its
        stdout, kill it if it does not end within STOP_TIMEOUT_S."""
        if proc.stdin is not None:
            proc.stdin.close()
        if signal_ is not None and proc.poll() is None:
            proc.send_signal(signal_)
        out = _read_until_eof(proc, STOP_TIMEOUT_S)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%r did not exit; killed", proc.args)
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self._procs.remove(proc)
        return out

    def stop_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._procs.clear()


def _read_json_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """The first line of ``proc``'s stdout, parsed as JSON (BenchmarkError otherwise)."""
    assert proc.stdout is not None
    fd, buffer, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise BenchmarkError(f"{proc.args!r} printed no line in {timeout:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise BenchmarkError(f"{proc.args!r} exited with {proc.wait()} before listening")
        buffer += chunk
    line = buffer.split(b"\n", 1)[0]
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchmarkError(f"{proc.args!r} printed {line[:200]!r}") from exc
    if not isinstance(record, dict):
        raise BenchmarkError(f"{proc.args!r} printed {line[:200]!r}")
    return record


def _read_until_eof(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    if proc.stdout is None or proc.stdout.closed:
        return b""
    fd, chunks, deadline = proc.stdout.fileno(), [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _sched(pid: int | str) -> tuple[float, float] | None:
    """(CPU seconds of all its threads, seconds its main thread waited on a run queue)
    of a process so far, from Linux /proc; None where unavailable. The wait is what
    tells a CPU-starved process (busy machine) from one that is idle on the network."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open(f"/proc/{pid}/schedstat") as f:
            waited_ns = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), waited_ns / 1e9


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    servers: dict[str, Any]

    @property
    def peer_id(self) -> str:
        return str(self.servers["peer_id"])

    def port(self, variant: str, window: int) -> int:
        if variant == "aioquic_default":
            return int(self.servers["default_port"])
        if variant == "aioquic_tuned":
            return int(self.servers["tuned_ports"][str(window)])
        return int(self.servers["wanswarm_port"])


async def start_server_process(
    children: Children, windows: Sequence[int], args: argparse.Namespace
) -> ServerProcess:
    argv = [sys.executable, os.path.abspath(__file__), "--role", "server", "--loop", args.loop,
            "--tuned-windows", *map(str, windows)]
    if args.wanswarm_congestion is not None:
        argv += ["--wanswarm-congestion", args.wanswarm_congestion]
    proc = children.spawn(argv, stdin=True)
    hello = await asyncio.to_thread(_read_json_line, proc, READY_TIMEOUT_S)
    return ServerProcess(proc, hello)


@dataclass
class EmulatorProcess:
    proc: subprocess.Popen[bytes]
    address: Address


async def start_emulator(
    children: Children, profile: str, target: Address, seed: int
) -> EmulatorProcess:
    argv = [sys.executable, "-m", "wanswarm.transport.wan", "--profile", profile,
            "--target", f"{target[0]}:{target[1]}", "--listen", f"{HOST}:0", "--seed", str(seed)]
    proc = children.spawn(argv, stdin=False)
    hello = await asyncio.to_thread(_read_json_line, proc, READY_TIMEOUT_S)
    if hello.get("event") != "listening":
        raise BenchmarkError(f"WAN emulator said {hello!r}")
    host, _, port = str(hello["address"]).rpartition(":")
    return EmulatorProcess(proc, (host, int(port)))


def stop_emulator(children: Children, emulator: EmulatorProcess) -> dict[str, Any]:
    """Its counters (the JSON line it prints on SIGTERM), {} if it printed none."""
    out = children.stop(emulator.proc, signal_=signal.SIGTERM)
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == "stats":
            return record
    return {}


_LINK_KEYS = ("offered_packets", "offered_bytes", "delivered_packets", "delivered_bytes",
              "lost_packets", "overflow_packets", "queue_hwm_bytes", "mean_delay_s",
              "max_delay_s", "mean_late_s", "max_late_s")


def _emulator_summary(stats: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for direction in ("uplink", "downlink"):
        link = stats.get(direction, {})
        out[direction] = {k: _round(link[k], 4) for k in _LINK_KEYS if k in link}
    for key in ("send_buffer_drops", "io_errors"):
        out[key] = stats.get(key)
    return out


# -- the emulated runs ------------------------------------------------------------------


async def run_emulated(
    args: argparse.Namespace, children: Children, budget: Budget
) -> list[Cell]:
    windows = {profile: tuned_window(profile) for profile in args.profiles}
    logger.info("starting the server process")
    server = await start_server_process(children, sorted(set(windows.values())), args)
    payloads = {s: Payload.random(int(s * MIB), args.seed) for s in args.sizes}
    # when the time budget runs out, it cuts the baselines first
    order = [v for v in ("wanswarm", "aioquic_tuned", "aioquic_default") if v in args.variants]
    cells: list[Cell] = []
    try:
        for profile in args.profiles:
            wan = PROFILES[profile]
            for size_mb in args.sizes:
                payload = payloads[size_mb]
                for variant in order:
                    cell = Cell(profile, size_mb, variant, payload.nbytes, wan.uplink.rate_bps,
                                wan.rtt_s, timeout_s=0.0)
                    cell.timeout_s = min(
                        args.timeout, max(MIN_TIMEOUT_S, args.timeout_factor * (cell.ideal_s or 0))
                    )
                    await run_emulated_cell(cell, server, windows[profile], payload, args,
                                            children, budget)
                    cells.append(cell)
                    _log_cell(cell)
    finally:
        children.stop(server.proc, signal_=None)
    rank = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(cells, key=lambda c: (args.profiles.index(c.profile), c.size_mb, rank[c.variant]))


async def run_emulated_cell(
    cell: Cell,
    server: ServerProcess,
    window: int,
    payload: Payload,
    args: argparse.Namespace,
    children: Children,
    budget: Budget,
) -> None:
    if not budget.fits(cell.timeout_s + CONNECT_TIMEOUT_S):
        cell.skipped = args.repeats
        logger.info("%s %gMB %s: time budget spent, cell skipped", cell.profile, cell.size_mb,
                    cell.variant)
        return
    target = (HOST, server.port(cell.variant, window))
    emulator = await start_emulator(children, cell.profile, target, args.seed)
    pids: dict[str, int | str] = {
        "client": "self", "server": server.proc.pid, "emulator": emulator.proc.pid
    }
    load0 = os.getloadavg()[0]
    before = {name: _sched(pid) for name, pid in pids.items()}
    wall = time.perf_counter()
    try:
        await run_transfers(
            cell,
            lambda: make_client(cell.variant, emulator.address, server.peer_id, window,
                                wanswarm_config(args.wanswarm_congestion)),
            payload,
            args.repeats,
            max_failures=args.max_failures,
            gap_s=max(0.05, 3 * cell.rtt_s),
            budget=budget,
        )
    finally:
        wall = time.perf_counter() - wall
        after = {name: _sched(pid) for name, pid in pids.items()}
        stats = stop_emulator(children, emulator)
    d = cell.diagnostics
    d["wall_s"] = round(wall, 2)
    d["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    for name in pids:
        b, a = before[name], after[name]
        if b is not None and a is not None:  # CPU used, and time spent waiting for a CPU
            d[f"{name}_cpu_s"] = round(a[0] - b[0], 2)
            d[f"{name}_runqueue_wait_s"] = round(a[1] - b[1], 2)
            if name != "emulator" and cell.completed == cell.attempted > 0 and a[0] > b[0]:
                # the goodput this end would sustain on a whole core at the CPU it used
                bits = cell.completed * cell.nbytes * 8
                d[f"{name}_cpu_ceiling_mbps"] = round(bits / (a[0] - b[0]) / 1e6, 1)
    waits = [d[f"{name}_runqueue_wait_s"] for name in pids if f"{name}_runqueue_wait_s" in d]
    if waits and wall > 0:  # how CPU-starved the most starved of the three processes was
        d["max_runqueue_wait_fraction"] = round(max(waits) / wall, 3)
    d["emulator"] = _emulator_summary(stats)
    uplink = stats.get("uplink", {})
    if uplink.get("offered_bytes"):
        moved = cell.attempted * cell.nbytes + WARMUP_BYTES * (1 + cell.attempted - cell.completed)
        d["uplink_bytes_per_payload_byte"] = round(uplink["offered_bytes"] / moved, 4)
        # what the path carried for this variant over the cell (includes retransmissions)
        d["uplink_delivered_mbps"] = round(uplink["delivered_bytes"] * 8 / wall / 1e6, 2)
    if cell.errors:
        d["errors"] = cell.errors


def _log_cell(cell: Cell) -> None:
    d = cell.diagnostics
    if "wall_s" not in d or not cell.attempted:
        return
    up = d.get("emulator", {}).get("uplink", {})
    down = d.get("emulator", {}).get("downlink", {})

    def proc(name: str) -> str:
        ceiling = d.get(name + "_cpu_ceiling_mbps")
        return (f"{name} {d.get(name + '_cpu_s')}/{d.get(name + '_runqueue_wait_s')}"
                + (f" (whole-core ceiling {ceiling} Mb/s)" if ceiling else ""))

    logger.info(
        "%s %gMB %s: %d/%d done, p50 %s s, %s s wall, load %s | CPU/run-queue wait s: %s, %s, "
        "%s | uplink lost %s overflow %s queue max %s B delay mean %s late mean %s max %s s, "
        "carried %s Mb/s, %s wire B per payload B | downlink lost %s overflow %s%s",
        cell.profile, cell.size_mb, cell.variant, cell.completed, cell.attempted,
        _fmt(cell.p50_s, 3), d["wall_s"], d.get("loadavg_1m"), proc("client"), proc("server"),
        proc("emulator"), up.get("lost_packets"), up.get("overflow_packets"),
        up.get("queue_hwm_bytes"), up.get("mean_delay_s"), up.get("mean_late_s"),
        up.get("max_late_s"), d.get("uplink_delivered_mbps"),
        d.get("uplink_bytes_per_payload_byte"), down.get("lost_packets"),
        down.get("overflow_packets"),
        f" | path {d['path']} totals {d.get('totals')}" if "path" in d else "",
    )


# -- loopback ---------------------------------------------------------------------------


async def run_loopback(
    size_mb: float,
    repeats: int,
    timeout: float,
    seed: int,
    *,
    budget: Budget,
    config: TransportConfig,
    reference: bool = True,
) -> dict[str, Any]:
    """The wanswarm variant on plain loopback, both ends in this process (one core); with
    ``reference``, aioquic_tuned measured the same way, for the CPU cost of plain QUIC
    on this machine at this moment."""
    payload = Payload.random(int(size_mb * MIB), seed)
    servers = await start_servers([MIB], config)
    try:
        out = await _loopback_variant("wanswarm", servers, payload, repeats, timeout, budget,
                                      config)
        if reference:
            # the same transport with path MTU probing off: 1452-byte datagrams, as on
            # the internet (the client's direction carries the payload)
            unprobed = config.model_copy(update={"mtu_probe_bytes": ()})
            out["reference_wanswarm_1452"] = await _loopback_variant(
                "wanswarm", servers, payload, repeats, timeout, budget, unprobed
            )
            out["reference_aioquic_tuned"] = await _loopback_variant(
                "aioquic_tuned", servers, payload, repeats, timeout, budget, config
            )
    finally:
        await servers.close()
    return out


async def _loopback_variant(
    variant: str,
    servers: Servers,
    payload: Payload,
    repeats: int,
    timeout: float,
    budget: Budget,
    config: TransportConfig,
) -> dict[str, Any]:
    target = (HOST, servers.port(variant, MIB))
    client = make_client(variant, target, servers.peer_id, MIB, config)
    cell = Cell("loopback", payload.nbytes / MIB, variant, payload.nbytes, None, 0.0, timeout)
    cpu = wall = waited = 0.0
    counters: dict[str, Any] = {}
    try:
        await client.open()
        cpu0, wall0, sched0 = time.process_time(), time.perf_counter(), _sched("self")
        for i in range(repeats):
            if not budget.fits(timeout):
                cell.skipped = repeats - i
                logger.info("loopback %s: time budget spent, %d repeats skipped", variant,
                            cell.skipped)
                break
            start = time.perf_counter()
            try:
                await client.send(payload, timeout)
            except _FAILURES as exc:
                cell.times.append(None)
                cell.errors.append(_describe(exc))
                logger.info("loopback %s #%d: not completed (%s)", variant, i + 1, _describe(exc))
                continue
            elapsed = time.perf_counter() - start
            cell.times.append(elapsed)
            logger.info("loopback %s #%d: %.3f s, %.1f Mb/s", variant, i + 1, elapsed,
                        payload.nbytes * 8 / elapsed / 1e6)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        sched1 = _sched("self")
        if sched0 is not None and sched1 is not None:
            waited = sched1[1] - sched0[1]
        counters = client.counters()
    except _FAILURES as exc:  # connect or warm-up
        cell.errors.append(f"connect/warm-up: {_describe(exc)}")
    finally:
        await _close_quietly(client)
    gigabytes = cell.completed * payload.nbytes / 1e9
    cpu_per_gb = cpu / gigabytes if gigabytes else None
    return {
        "goodput_mbps": _round(cell.goodput_mbps, 1),
        "cpu_s_per_gb": _round(cpu_per_gb, 2),
        # the goodput one whole core would carry for both ends at this CPU cost
        "one_core_mbps": _round(8000 / cpu_per_gb if cpu_per_gb else None, 1),
        "cpu_utilization": round(cpu / wall, 3) if wall > 0 else None,
        "runqueue_wait_s": round(waited, 2),
        "wall_s": round(wall, 2),
        "size_mb": cell.size_mb,
        "p50_s": _round(cell.p50_s, 4),
        "completed": cell.completed,
        "attempted": cell.attempted,
        "skipped": cell.skipped,
        "errors": cell.errors,
        **counters,
    }


# -- report -----------------------------------------------------------------------------


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def evaluate_targets(cells: list[Cell], loopback: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The issue's targets: PASS, MISS, UNDECIDED or NOT RUN (never adjusted to results)."""
    by_key = {(c.profile, c.size_mb, c.variant): c for c in cells if c.attempted}
    targets: list[dict[str, Any]] = []

    def add(name: str, status: str, detail: str = "") -> None:
        targets.append({"target": name, "status": status, "detail": detail})

    ours, tuned = by_key.get(("wan", 16.0, "wanswarm")), by_key.get(("wan", 16.0, "aioquic_tuned"))
    name = "wan 16 MB: wanswarm goodput >= 80% of link"
    if ours is None or ours.link_bps is None:
        add(name, "NOT RUN")
    elif ours.goodput_mbps is None:
        add(name, "MISS", f"< {ours.goodput_bound_mbps / (ours.link_bps / 1e6):.1%} of link "
                          "(the median transfer did not complete)")
    else:
        share = ours.goodput_mbps / (ours.link_bps / 1e6)
        add(name, "PASS" if share >= 0.8 else "MISS", f"{share:.1%} of link")
    name = "wan 16 MB: wanswarm goodput >= 5x aioquic_tuned"
    if ours is None or tuned is None:
        add(name, "NOT RUN")
    elif tuned.goodput_mbps is not None:
        ratio = (ours.goodput_mbps or 0.0) / tuned.goodput_mbps
        add(name, "PASS" if ratio >= 5 else "MISS", f"{ratio:.2f}x")
    else:  # the tuned median did not complete: its goodput is below bits / timeout
        goodput = ours.goodput_mbps or 0.0
        carried = tuned.diagnostics.get("uplink_delivered_mbps")
        estimate = f"; aioquic_tuned carried {carried} Mb/s of wire bytes until its timeout" \
            if carried else ""
        add(name, "PASS" if goodput >= 5 * tuned.goodput_bound_mbps else "UNDECIDED",
            f"wanswarm {goodput:.2f} Mb/s vs aioquic_tuned < {tuned.goodput_bound_mbps:.2f} "
            f"Mb/s (its median transfer timed out){estimate}")
    bad = [c for c in cells if c.profile == "bad" and c.variant == "wanswarm"]
    if not bad:
        add("bad: wanswarm completes every transfer, goodput >= 60% of link", "NOT RUN")
    for c in bad:
        every = f"bad {c.size_mb:g} MB: wanswarm completes every transfer"
        fast = f"bad {c.size_mb:g} MB: wanswarm goodput >= 60% of link"
        if not c.attempted:
            add(every, "NOT RUN", "skipped: time budget")
            add(fast, "NOT RUN", "skipped: time budget")
            continue
        done = f"{c.completed}/{c.attempted} completed, {c.skipped} skipped (time budget)"
        add(every, "MISS" if c.completed < c.attempted else "UNDECIDED" if c.skipped else "PASS",
            done)
        link = (c.link_bps or 1.0) / 1e6
        if c.goodput_mbps is None:
            add(fast, "MISS", f"< {c.goodput_bound_mbps / link:.1%} of link (the median "
                              "transfer did not complete)")
        else:
            share = c.goodput_mbps / link
            add(fast, "PASS" if share >= 0.6 else "MISS", f"{share:.1%} of link")
    name = f"loopback: wanswarm >= {LOOPBACK_TARGET_MBPS:g} Mb/s on one core"
    if loopback is None or not loopback.get("attempted"):
        add(name, "NOT RUN", "" if loopback is None else "skipped: time budget")
    elif loopback.get("goodput_mbps") is None:
        add(name, "MISS", f"no transfer completed: {loopback.get('errors', [])[:1]}")
    else:
        measured = loopback["goodput_mbps"]
        add(name, "PASS" if measured >= LOOPBACK_TARGET_MBPS else "MISS",
            f"{measured:.1f} Mb/s with both ends in one process (CPU utilization "
            f"{loopback['cpu_utilization']}); its CPU cost, {loopback['cpu_s_per_gb']} s/GB, "
            f"would carry {loopback['one_core_mbps']} Mb/s on a whole core")
    return targets


def write_report(report: dict[str, Any], cells: list[Cell]) -> None:
    """The benchmark's output: the table, target checks, then the JSON line (stdout)."""
    header = ("profile", "size MB", "variant", "link Mb/s", "goodput Mb/s", "% of link",
              "p50 s", "p95 s", "done", "ideal s", "rq wait")
    rows = [header]
    for c in cells:
        link = None if c.link_bps is None else c.link_bps / 1e6
        goodput = c.goodput_mbps
        censored = f">{c.timeout_s:.0f}" if c.attempted else "-"
        wait = c.diagnostics.get("max_runqueue_wait_fraction")
        starved = "-" if wait is None or not c.attempted else f"{wait:.0%}"
        if goodput is not None:
            shown, share = f"{goodput:.1f}", "-" if link is None else f"{goodput / link:.1%}"
        elif c.attempted:
            bound = c.goodput_bound_mbps
            shown, share = f"<{bound:.1f}", "-" if link is None else f"<{bound / link:.1%}"
        else:
            shown, share = "skipped", "-"
        rows.append((
            c.profile, f"{c.size_mb:g}", c.variant, _fmt(link, 0), shown, share,
            _fmt(c.p50_s, 3) if c.p50_s is not None else censored,
            _fmt(c.p95_s, 3) if c.p95_s is not None else censored,
            f"{c.completed}/{c.attempted}", _fmt(c.ideal_s, 3), starved,
        ))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if not cells:
        lines = []
    loop = report["loopback"]
    if "attempted" in loop and not loop["attempted"]:
        lines.append("loopback: skipped (time budget)")
    elif "attempted" in loop:
        lines.append(
            f"loopback (no emulator, {loop['size_mb']:g} MB, both ends in one process): "
            f"goodput {loop['goodput_mbps']} Mb/s, {loop['cpu_s_per_gb']} CPU s/GB "
            f"(= {loop['one_core_mbps']} Mb/s on a whole core), CPU utilization "
            f"{loop['cpu_utilization']}, run-queue wait {loop['runqueue_wait_s']} s of "
            f"{loop['wall_s']} s, {loop['completed']}/{loop['attempted']} completed"
        )
        for key, what in (
            ("reference_wanswarm_1452", "wanswarm with 1452-byte datagrams (probing off)"),
            ("reference_aioquic_tuned", "aioquic_tuned"),
        ):
            ref = loop.get(key)
            if ref and ref["attempted"]:
                lines.append(
                    f"loopback reference, {what} the same way: goodput {ref['goodput_mbps']} "
                    f"Mb/s, {ref['cpu_s_per_gb']} CPU s/GB (= {ref['one_core_mbps']} Mb/s on a "
                    f"whole core), CPU utilization {ref['cpu_utilization']}, "
                    f"{ref['completed']}/{ref['attempted']} completed"
                )
    meta = report["meta"]
    lines.append("rq wait: the largest share of the cell's wall time that client, server or "
                 "emulator spent runnable but waiting for a CPU (0% on an idle machine)")
    lines.append(f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
                 f"on {meta['cpus']} CPUs; {meta['layout']}")
    for t in report["targets"]:
        detail = f": {t['detail']}" if t["detail"] else ""
        lines.append(f"target {t['status']:9} {t['target']}{detail}")
    sys.stdout.write("\n".join(lines) + "\n" + json.dumps(report) + "\n")
    sys.stdout.flush()


# -- main -------------------------------------------------------------------------------


LAYOUT = ("clients in the benchmark process, every server in one child process, the WAN "
          "emulator in a child process per cell")


async def run_benchmark(args: argparse.Namespace, children: Children) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    budget = Budget(args.budget)
    load_start = os.getloadavg()
    cells = await run_emulated(args, children, budget) if args.loopback != "only" else []
    loopback: dict[str, Any] | None = None
    if args.loopback in ("on", "only"):
        logger.info("loopback: %g MB x %d, no emulator", LOOPBACK_SIZE_MB, args.repeats)
        loopback = await run_loopback(LOOPBACK_SIZE_MB, args.repeats, args.timeout, args.seed,
                                      budget=budget,
                                      config=wanswarm_config(args.wanswarm_congestion))
    report: dict[str, Any] = {
        "results": [c.result() for c in cells],
        "loopback": loopback or {"goodput_mbps": None, "cpu_s_per_gb": None},
        "targets": evaluate_targets(cells, loopback),
        "diagnostics": [
            {"profile": c.profile, "size_mb": c.size_mb, "variant": c.variant,
             "timeout_s": round(c.timeout_s, 1), "skipped": c.skipped, **c.diagnostics}
            for c in cells
        ],
        "meta": {
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "layout": LAYOUT,
            "event_loop": args.loop,
            "wanswarm_congestion": wanswarm_config(args.wanswarm_congestion).congestion.algorithm,
            "repeats": args.repeats,
            "max_failures": args.max_failures,
            "timeout_cap_s": args.timeout,
            "timeout_factor": args.timeout_factor,
            "seed": args.seed,
            "aioquic": aioquic.__version__,
            "python": sys.version.split()[0],
            "timing": "request call to acknowledgement receipt (one RTT of ack included); "
                      "handshake and a 1 KiB warm-up request excluded",
        },
    }
    return {"report": report, "cells": cells}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Defaults: every profile, sizes 1 4 16, 5 repeats, 60 s timeout cap, no "
               "budget. --quick: wan and bad, 16 MiB, 3 repeats, 20 s timeout cap, "
               f"{QUICK_BUDGET_S:g} s budget (each can still be set).",
    )
    parser.add_argument("--quick", action="store_true", help="a run of under 3 minutes")
    parser.add_argument("--profiles", nargs="+", choices=sorted(PROFILES), default=None)
    parser.add_argument("--sizes", nargs="+", type=float, default=None, help="payloads, MiB")
    parser.add_argument("--repeats", type=int, default=None, help="transfers per cell")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None)
    parser.add_argument("--timeout", type=float, default=None,
                        help="cap on the per-transfer timeout, seconds")
    parser.add_argument("--timeout-factor", type=float, default=TIMEOUT_IDEAL_FACTOR,
                        help="per-transfer timeout: min(--timeout, max(10 s, this x ideal))")
    parser.add_argument("--max-failures", type=int, default=1,
                        help="a cell stops after this many transfers that did not complete")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run: no transfer starts whose timeout "
                             "would end past it")
    parser.add_argument("--loopback", choices=("on", "off", "only"), default="on",
                        help="the no-emulator loopback measurement")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop of the clients and servers")
    parser.add_argument("--seed", type=int, default=1, help="payload and emulator loss seed")
    parser.add_argument("--wanswarm-congestion", choices=("wanswarm", "reno", "cubic"),
                        default=None, help="diagnosis only: run the wanswarm variant with "
                        "another congestion controller (default: the shipped setting)")
    parser.add_argument("--role", choices=("bench", "server"), default="bench",
                        help=argparse.SUPPRESS)
    parser.add_argument("--tuned-windows", nargs="+", type=int, default=[MIB],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    if args.profiles is None:
        args.profiles = ["wan", "bad"] if quick else ["lan", "home", "wan", "bad"]
    if args.sizes is None:
        args.sizes = [16.0] if quick else [1.0, 4.0, 16.0]
    if args.repeats is None:
        args.repeats = 3 if quick else 5
    if args.variants is None:
        args.variants = list(VARIANTS)
    if args.timeout is None:
        args.timeout = 20.0 if quick else 60.0
    if args.budget is None and quick:
        args.budget = QUICK_BUDGET_S
    if args.repeats < 1 or args.max_failures < 1 or args.timeout <= 0 or args.timeout_factor <= 0:
        parser.error("--repeats and --max-failures must be >= 1, --timeout(-factor) > 0")
    if any(s <= 0 for s in args.sizes):
        parser.error("--sizes must be positive")
    args.profiles = list(dict.fromkeys(args.profiles))
    args.sizes = list(dict.fromkeys(args.sizes))
    args.variants = list(dict.fromkeys(args.variants))
    return args


async def _server_role(windows: Sequence[int], config: TransportConfig) -> None:
    """Child process: serve every variant until stdin closes or a signal comes."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stdin = sys.stdin.fileno()

    def on_stdin() -> None:
        if not os.read(stdin, 4096):
            stop.set()

    loop.add_reader(stdin, on_stdin)
    servers = await start_servers(windows, config)
    try:
        sys.stdout.write(json.dumps(servers.describe()) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        loop.remove_reader(stdin)
        await servers.close()


class _Elapsed(logging.Formatter):
    """Seconds since the start, then the message (and its traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"[{record.relativeCreated / 1000:7.1f}s] {super().format(record)}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Elapsed())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    if args.role == "server":
        run(_server_role(args.tuned_windows, wanswarm_config(args.wanswarm_congestion)))
        return 0
    logger.setLevel(logging.INFO)
    children = Children()
    try:
        outcome = run(run_benchmark(args, children))
    except (KeyboardInterrupt, asyncio.CancelledError):
        logger.warning("interrupted: no results")
        return 130
    finally:
        children.stop_all()
    write_report(outcome["report"], outcome["cells"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
