"""The daemon's lifecycle: join, serve, and the one graceful-leave path.

``wanswarm join`` calls :func:`run_daemon`. Before the event loop starts it takes the state
directory's lock, loads the identity and forks hivemind's DHT process (forking before any loop
or thread exists). Then one uvloop loop runs one ``asyncio.TaskGroup`` that owns every
long-lived task: the control socket, the announce and membership loops, the prober, the
systemd watchdog, a watch on the DHT process, and the components' own loops.

Lifecycle::

    starting -> joining (DHT ready, record 'joining') -> online (components started, READY=1)
             -> draining (SIGTERM / SIGINT / 'wanswarm leave') -> left (record withdrawn) -> exit 0

The leave path, whatever asked for it: announce ``draining`` and send STOPPING=1; drain every
component (stop accepting work, finish in-flight work) until ``node.shutdown_timeout`` after the
request; stay listed as draining for at least ``node.drain_grace``; withdraw the record
(tombstone); stop the loops; close the components (within CLOSE_GRACE_S past the drain's
deadline), the control socket and the DHT; exit 0. ``wanswarm join`` then exits without
waiting for a device thread still stuck in work the drain abandoned
(:func:`exit_past_abandoned_threads`).
A second signal skips what is left of the drain and the grace. A crash of any task cancels the
others (TaskGroup) and the daemon exits 1, which systemd's Restart=on-failure answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import uvloop

from ..transport.errors import TransportError
from ..transport.identity import Identity
from . import __version__
from .component import Component, ComponentContext, TrafficSource
from .config.node_config import NodeConfig
from .control import ControlServer, LeaveAck
from .errors import DhtError, JoinError, NodeError
from .logs import get_logger, set_log_context, setup_logging
from .membership.address_book import SAVE_PERIOD_S as PEERS_SAVE_PERIOD_S
from .membership.address_book import AddressBook, split_maddr
from .membership.dht import Dht, route_hivemind_logs
from .membership.peers import PeerTable
from .membership.prober import Prober, RttSource
from .membership.tracker import Membership
from .metrics import NodeMetrics
from .service import lifeline
from .service.lifetime import LifetimeTotals
from .service.page import PageServer
from .service.sdnotify import SdNotifier, notifier_from_env
from .service.statedir import StateDirLock, load_identity, prepare_state_dir
from .status import DaemonState, PeerStatus, StatusReport
from .timing import jittered

log = get_logger(__name__)
# after the drain's deadline, the components' close gets this long in all
CLOSE_GRACE_S = 5.0
# how long a returned daemon waits for its other threads before exiting without them
ABANDONED_THREAD_WAIT_S = 2.0
# in the name of every stage device thread (node/stage/device_queue.py: "stage{s}-device")
DEVICE_THREAD_MARK = "-device"
# remembered peers dialed at once: on start, and while we know no member
ADDRESS_BOOK_DIALS = 16
# how often the address book's loop may dial again (initial peers we are not connected to;
# everyone we remember or are connected to while we know no member)
REDIAL_PERIOD_S = PEERS_SAVE_PERIOD_S / 2
# how often the observer feeds status into the metrics, the page's history and lifetime totals
OBSERVE_PERIOD_S = 1.0


def run_daemon(config: NodeConfig, components: Sequence[Component] = ()) -> int:
    """Run a node in the foreground until it leaves; returns the exit status (0: left cleanly)."""
    route_hivemind_logs()
    setup_logging(config.log)
    lifeline.install()  # hivemind's forked averagers die with us, even on SIGKILL
    lock = StateDirLock(config.state_dir)
    try:
        prepare_state_dir(config.state_dir)
        lock.acquire()
        identity, identity_path = load_identity(config.state_dir)
        set_log_context(peer=identity.peer_id)
        log.info(
            "starting wanswarm %s, run %r, state dir %s",
            __version__, config.node.run, config.state_dir,
        )
        dht = Dht.spawn(config.dht, config.node.run, identity, identity_path)
    except (NodeError, TransportError) as exc:
        lock.release()
        log.error("cannot start: %s", exc)
        return 1
    # Until the loop installs its handlers, remember a SIGTERM/SIGINT instead of dying with the DHT
    # process orphaned. (Installed after the fork: the DHT process keeps the default handlers.)
    early: list[signal.Signals] = []
    previous = {sig: signal.signal(sig, lambda num, _frame: early.append(signal.Signals(num)))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    daemon = Daemon(config, identity, dht, components, early_signals=early)
    try:
        return uvloop.run(daemon.main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if dht.is_alive():  # the loop died before its own shutdown ran
            dht.shutdown_blocking()
        lock.release()


def exit_past_abandoned_threads(code: int, wait_s: float = ABANDONED_THREAD_WAIT_S) -> None:
    """Exit the process now with ``code`` if a stage's device thread is still running
    ``wait_s`` after the daemon returned (call it only from ``wanswarm join``'s own
    process); other threads are left to the interpreter. A device thread can still be
    inside a synchronous averaging step whose peers left (hivemind waits out its own
    timeouts); the leave already abandoned that work and logged it, and waiting for the
    interpreter to join the thread would overrun ``node.shutdown_timeout`` and the service
    manager's stop timeout."""
    deadline = time.monotonic() + wait_s
    device = [
        t for t in threading.enumerate() if DEVICE_THREAD_MARK in t.name and not t.daemon
    ]
    for thread in device:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in device if t.is_alive()]
    if not stuck:
        return
    log.warning("exiting without waiting for busy device threads: %s", ", ".join(stuck))
    logging.shutdown()
    os._exit(code)


class Daemon:
    """One node: membership, probing, control and components under one TaskGroup."""

    def __init__(
        self,
        config: NodeConfig,
        identity: Identity,
        dht: Dht,
        components: Sequence[Component] = (),
        early_signals: Sequence[signal.Signals] = (),
    ) -> None:
        self.config = config
        self._early_signals = early_signals
        self.identity = identity
        self.peer_id = identity.peer_id
        self.dht = dht
        self.components = list(components)
        self.rng = random.Random()
        self.table = PeerTable(self.peer_id, rtt_window=config.prober.min_window)
        self.metrics = NodeMetrics(config.node.run, self.peer_id, __version__)
        self.membership = Membership(
            dht, config.node, self.peer_id, self.table, self.rng, self.metrics
        )
        self.notifier: SdNotifier | None = notifier_from_env()
        self.state: DaemonState = "starting"
        self.dht_addrs: list[str] = []
        self.started_at = time.monotonic()
        self._leave: asyncio.Event | None = None
        self._hurry: asyncio.Event | None = None
        self._drain_deadline: float | None = None
        self._close_by: float | None = None  # set by the graceful leave (_close_components)
        self._loops: list[asyncio.Task[Any]] = []
        self._started_components: list[Component] = []
        self._starting: Component | None = None  # the component whose start() runs now
        self.paused = False
        self.lifetime = LifetimeTotals(config.state_dir)
        self.address_book = AddressBook(config.state_dir, self.peer_id)
        self.page: PageServer | None = None

    # ----------------------------------------------------------------- control handler

    def request_leave(self, reason: str) -> LeaveAck:
        """Start the graceful leave (idempotent); a second request while leaving hurries it."""
        already = self._leave is not None and self._leave.is_set()
        if self._leave is None:
            raise RuntimeError("request_leave before the event loop started")
        if already:
            log.info("%s while leaving: skipping the rest of the drain", reason)
            if self._hurry is not None:
                self._hurry.set()
        else:
            log.info("%s: leaving (drain up to %.0fs)", reason, self.config.node.shutdown_timeout)
            self._leave.set()
        return LeaveAck(
            accepted=True,
            already_leaving=already,
            pid=os.getpid(),
            shutdown_timeout_s=self.config.node.shutdown_timeout,
        )

    def pause(self, paused: bool) -> dict[str, Any]:
        """``wanswarm pause`` / ``resume``: take no work (or take it again), stay in the swarm,
        keep state. Each component that can (``pause()`` / ``resume()``) is told; the answer
        names them."""
        self.paused = paused
        told = []
        for component in self._started_components:
            method = getattr(component, "pause" if paused else "resume", None)
            if callable(method):
                method()
                told.append(component.name)
        log.info("%s (%s)", "paused: taking no work" if paused else "resumed",
                 ", ".join(told) or "no component takes work")
        return {"paused": paused, "components": told, "pid": os.getpid()}

    def status(self) -> StatusReport:
        now = time.monotonic()
        started = [*self._started_components, *([self._starting] if self._starting else [])]
        components = {c.name: c.status() for c in started}
        paths: dict[str, str] = components.get("endpoint", {}).get("paths", {})
        peers = []
        for peer in self.table.peers():
            low = peer.rtt.min_rtt(now)
            quic = peer.record.quic
            peers.append(
                PeerStatus(
                    peer_id=peer.peer_id,
                    stage=peer.stage,
                    state=peer.record.state,
                    rtt_ms=None if peer.rtt.srtt is None else round(peer.rtt.srtt * 1000, 3),
                    min_rtt_ms=None if low is None else round(low * 1000, 3),
                    probe_failures=peer.rtt.consecutive_failures,
                    throughput=peer.record.throughput,
                    queue=peer.record.queue,
                    quic_addr=None if quic is None else _hostport(quic.host, quic.port),
                    version=peer.record.version,
                    nat=None if peer.record.reach is None else peer.record.reach.nat,
                    path=paths.get(peer.peer_id),
                )
            )
        traffic = self._traffic()
        own_quic = self.membership.quic
        loop_deadline = self._drain_deadline
        left = None
        if loop_deadline is not None and self.state == "draining":
            left = max(0.0, loop_deadline - asyncio.get_running_loop().time())
        return StatusReport(
            peer_id=self.peer_id,
            run=self.config.node.run,
            stage=self.membership.stage,
            state=self.state,
            server=self.config.node.server,
            trainer=self.config.node.trainer,
            pid=os.getpid(),
            version=__version__,
            uptime_s=round(now - self.started_at, 3),
            dht_addrs=self.dht_addrs,
            quic_addr=None if own_quic is None else _hostport(own_quic.host, own_quic.port),
            peers=peers,
            bytes_in=None if traffic is None else traffic[0],
            bytes_out=None if traffic is None else traffic[1],
            records_published=self.membership.published,
            records_refused=self.dht.validator.rejected,
            drain_deadline_s=left,
            shutdown_timeout_s=self.config.node.shutdown_timeout,
            components=components,
            paused=self.paused,
            n_stages=next((int(c.spec.n_stages) for c in self.components if hasattr(c, "spec")),
                          None),
            upload_limit_mbps=getattr(self.config.transport, "upload_limit_mbps", None),
            lifetime=self.lifetime.as_dict(),
        )

    def _traffic(self) -> tuple[int, int] | None:
        sources = [c for c in self._started_components if isinstance(c, TrafficSource)]
        if not sources:
            return None
        totals = [c.traffic() for c in sources]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    # ----------------------------------------------------------------- lifecycle

    def _set_state(self, state: DaemonState) -> None:
        self.state = state
        self.metrics.set_state(state)

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        self._leave, self._hurry = asyncio.Event(), asyncio.Event()
        self._install_signal_handlers()
        for sig in self._early_signals:
            self._on_signal(sig)
        control = ControlServer(self.config.control, self.config.control_socket, self)
        code = 1
        try:
            await control.start()
            if self.config.metrics.port:
                host, port = self.metrics.serve(self.config.metrics.host, self.config.metrics.port)
                log.info("metrics on http://%s/metrics", _hostport(host, port))
            if self.config.metrics.page_port:
                self.page = PageServer(
                    self.config.metrics.host, self.config.metrics.page_port, self.status
                )
                host, port = await self.page.start()
                log.info("status page on http://%s/", _hostport(host, port))
            code = await self._supervise(control)
        except NodeError as exc:
            log.error("%s", exc)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self._close_components()
            await control.close()
            if self.page is not None:
                await self.page.close()
            self.metrics.close()
            self.lifetime.save()
            self.address_book.save()
            await self.dht.shutdown(timeout=max(5.0, self.config.dht.rpc_timeout))
        if code == 0:
            log.info("left the swarm")
        return code

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.request_leave(f"received {sig.name}")

    async def _supervise(self, control: ControlServer) -> int:
        assert self._leave is not None
        try:
            async with asyncio.TaskGroup() as tg:
                spawn = _Spawner(tg, self._loops)
                spawn(control.serve(), "control")
                spawn(self._watch_dht(), "dht-watch")
                spawn(self._observe(), "observer")
                if self.notifier is not None and self.notifier.watchdog_interval is not None:
                    interval = self.notifier.watchdog_interval
                    spawn(self._watchdog(self.notifier, interval), "watchdog")
                if await self._until_leave(self._join(spawn)):
                    await self._leave.wait()
                await self._graceful_leave()
                for task in self._loops:
                    task.cancel()
        except BaseExceptionGroup as group:
            for exc in _leaves(group):
                if isinstance(exc, NodeError):
                    log.error("%s", exc)
                else:
                    log.error("fatal: %s", exc, exc_info=exc)
            return 1
        return 0

    async def _until_leave(self, work: Coroutine[Any, Any, None]) -> bool:
        """Run ``work`` unless a leave is requested first; True when it completed."""
        assert self._leave is not None
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self._leave.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            task.result()  # re-raise a failed join
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False

    async def _join(self, spawn: _Spawner) -> None:
        self._set_state("joining")
        self._sd_status("joining the swarm")
        await self.dht.wait_ready()
        await self._refresh_addrs()
        log.info("DHT ready; reachable at %s", ", ".join(self.dht_addrs) or "(no public address)")
        if len(self.address_book):
            # before the swarm is read: a restarted node without initial peers (the swarm's
            # first node) would otherwise find nobody (membership/address_book.py)
            await self._dial(
                "rejoining", self.address_book.candidates(limit=ADDRESS_BOOK_DIALS),
                noun="remembered peer(s)",
            )
        spawn(self._keep_address_book(), "address-book")
        await self._announce_logged()
        with contextlib.suppress(DhtError):
            await self.membership.refresh()
        spawn(self.membership.refresh_loop(), "membership")
        source: RttSource = next((c for c in self.components if isinstance(c, RttSource)), self.dht)
        prober = Prober(
            self.config.prober, source, self.table, lambda: self.membership.stage, self.rng,
            on_sample=lambda peer, rtt: self.metrics.probes.labels("ok").inc(),
        )
        spawn(prober.run(), "prober")
        ctx = ComponentContext(
            identity=self.identity,
            run=self.config.node.run,
            state_dir=self.config.state_dir,
            peers=self.table,
            membership=self.membership,
            spawn=spawn,
            dht=self.dht,
        )
        for component in self.components:
            log.info("starting %s", component.name)
            self._starting = component
            await component.start(ctx)
            self._starting = None
            self._started_components.append(component)
            # hivemind's averager sets SIGINT to SIG_IGN in *our* process when it starts
            # (DecentralizedAverager.run_in_background): take the leave signals back
            self._install_signal_handlers()
        self.membership.set_state("online")
        self._set_state("online")
        await self._announce_logged()
        first_delay = self.config.node.record_ttl / 3
        spawn(self.membership.announce_loop(first_delay=first_delay), "announce")
        spawn(self._housekeeping(), "housekeeping")
        log.info("online: %d peers known", len(self.table))
        if self.notifier is not None:
            self.notifier.ready(self._summary())

    async def _graceful_leave(self) -> None:
        assert self._hurry is not None
        announced = self.membership.has_announced
        loop = asyncio.get_running_loop()
        cfg = self.config.node
        deadline = loop.time() + cfg.shutdown_timeout
        self._drain_deadline = deadline
        self._close_by = deadline + CLOSE_GRACE_S
        self._set_state("draining")
        if self.notifier is not None:
            self.notifier.stopping("draining")
        self.membership.set_state("draining")
        if announced:
            await self._announce_logged()
        draining_since = loop.time()
        await self._drain_components(deadline)
        grace_end = min(draining_since + cfg.drain_grace, deadline)
        if loop.time() < grace_end:
            # a deliberate pause (not a synchronisation): peers re-read records on their own period
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(grace_end):
                    await self._hurry.wait()
        for task in self._loops:
            if task.get_name() == "announce":  # nothing may re-announce after the tombstone
                task.cancel()
        if announced:
            try:
                ok = await self.membership.withdraw()
            except DhtError as exc:
                log.warning(
                    "could not withdraw our record (it expires within %.0fs): %s",
                    cfg.record_ttl, exc,
                )
            else:
                log.info("record withdrawn" if ok else "withdrawal not confirmed by the DHT")
        self._set_state("left")
        self._drain_deadline = None

    async def _drain_components(self, deadline: float) -> None:
        assert self._hurry is not None
        if not self._started_components:
            return
        drains = [asyncio.ensure_future(c.drain(deadline)) for c in self._started_components]
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.wait({*drains, hurry}, return_when=asyncio.FIRST_COMPLETED)
                while not hurry.done() and not all(d.done() for d in drains):
                    await asyncio.wait({*drains, hurry}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            pass
        finally:
            hurry.cancel()
        for component, drain in zip(self._started_components, drains, strict=True):
            if not drain.done():
                log.warning(
                    "%s did not finish draining in time; abandoning its in-flight work",
                    component.name,
                )
                drain.cancel()
            elif not drain.cancelled() and drain.exception() is not None:
                log.error("%s failed while draining: %s", component.name, drain.exception())

    async def _close_components(self) -> None:
        """Close every started component; after a graceful leave all of them together get
        until CLOSE_GRACE_S past the drain's deadline (each at least one second)."""
        loop = asyncio.get_running_loop()
        for component in reversed(self._started_components):
            budget = self.config.node.shutdown_timeout
            if self._close_by is not None:
                budget = max(1.0, self._close_by - loop.time())
            try:
                async with asyncio.timeout(budget):
                    await component.close()
            except Exception as exc:
                log.error("closing %s failed: %s", component.name, exc)
        self._started_components.clear()

    # ----------------------------------------------------------------- loops

    async def _announce_logged(self) -> None:
        try:
            ok = await self.membership.announce()
        except DhtError as exc:
            log.warning("announce failed: %s", exc)
        else:
            if not ok:
                log.warning("announce not confirmed by the DHT; retrying on the announce period")

    async def _refresh_addrs(self) -> None:
        try:
            self.dht_addrs = await self.dht.visible_maddrs()
        except DhtError as exc:
            log.warning("cannot read our DHT addresses: %s", exc)

    async def _dial(
        self, why: str, candidates: list[tuple[str, tuple[str, ...]]], noun: str = "peer(s)"
    ) -> int:
        """Connect to and DHT-ping ``candidates`` (peer id, addresses), all at once: each that
        answers and we are back in each other's routing tables. How many answered."""
        if not candidates:
            return 0
        try:
            answered = await self.dht.dial(candidates, timeout=self.config.dht.rpc_timeout)
        except DhtError as exc:
            log.warning("%s: could not dial peers: %s", why, exc)
            return 0
        log.log(logging.INFO if answered else logging.DEBUG,
                "%s: %d of %d %s answered", why, len(answered), len(candidates), noun)
        return len(answered)

    def _initial_peers_to_dial(self, connected: Mapping[str, Sequence[str]]) -> list[
            tuple[str, tuple[str, ...]]]:
        out = []
        for maddr in self.config.dht.initial_peers:
            split = split_maddr(maddr)
            if split is not None and split[0] not in connected and split[0] != self.peer_id:
                out.append(split)
        return out

    async def _keep_address_book(self) -> None:
        """Every membership period: remember the run's members we are connected to
        (address_book.py). At most every REDIAL_PERIOD_S: dial the initial peers we
        are not connected to (a restarted bootstrap cannot dial a home behind NAT: the home
        dials it), and, while we know no member at all, the remembered peers and the ones
        connected to us (peers that reconnected through p2pd, for a relay slot, but whose
        DHT has not met ours again)."""
        loop = asyncio.get_running_loop()
        last_dial = loop.time()
        while True:
            node = self.config.node
            await asyncio.sleep(jittered(node.membership_period, node.announce_jitter, self.rng))
            try:
                connected = await self.dht.connected_peers()
            except DhtError as exc:
                log.debug("address book: cannot list connected peers: %s", exc)
                continue
            self.address_book.remember(connected, (p.peer_id for p in self.table.peers()))
            self.address_book.save()
            if loop.time() - last_dial < REDIAL_PERIOD_S:
                continue
            candidates = self._initial_peers_to_dial(connected)
            if not len(self.table):
                listed = {peer_id for peer_id, _ in candidates}
                for peer_id, addrs in [
                    *self.address_book.candidates(limit=ADDRESS_BOOK_DIALS),
                    *((p, tuple(a[:4])) for p, a in connected.items()),
                ]:
                    if peer_id not in listed and len(listed) < 2 * ADDRESS_BOOK_DIALS:
                        candidates.append((peer_id, addrs))
                        listed.add(peer_id)
            if candidates:
                last_dial = loop.time()
                await self._dial("reconnecting", candidates)

    async def _watch_dht(self) -> None:
        """Fail the TaskGroup (exit 1, systemd restarts us) if the DHT process dies under us."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        sentinel = self.dht.sentinel
        def on_exit() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(sentinel, on_exit)
        try:
            await ended
        finally:
            loop.remove_reader(sentinel)
        raise JoinError(f"the DHT process exited unexpectedly (exit code {self.dht.exitcode})")

    async def _watchdog(self, notifier: SdNotifier, interval: float) -> None:
        while True:
            notifier.watchdog()
            # never later than the interval: jitter only shortens it
            await asyncio.sleep(jittered(interval * 0.9, 0.1, self.rng))

    async def _housekeeping(self) -> None:
        """Refresh addresses, traffic counters and systemd's STATUS= line."""
        while True:
            node = self.config.node
            await asyncio.sleep(jittered(node.membership_period, node.announce_jitter, self.rng))
            await self._refresh_addrs()
            traffic = self._traffic()
            if traffic is not None:
                self.metrics.set_traffic(*traffic)
            self.metrics.set_refused(self.dht.validator.rejected)
            self._sd_status(self._summary())

    async def _observe(self) -> None:
        """Every OBSERVE_PERIOD_S: the status report into the metrics, the page's history and
        the lifetime totals (written to the state directory every minute)."""
        while True:
            await asyncio.sleep(OBSERVE_PERIOD_S)
            report = self.status()
            self.metrics.observe_status(report, self.paused)
            self.lifetime.observe(report)
            self.lifetime.save_if_due()
            if self.page is not None:
                self.page.observe(report)

    def _summary(self) -> str:
        stage = "-" if self.membership.stage is None else self.membership.stage
        return f"{self.state}: run {self.config.node.run}, stage {stage}, {len(self.table)} peers"

    def _sd_status(self, text: str) -> None:
        if self.notifier is not None:
            self.notifier.status(text)


class _Spawner:
    """``ctx.spawn``: creates a named task in the daemon's TaskGroup and remembers it."""

    def __init__(self, tg: asyncio.TaskGroup, tasks: list[asyncio.Task[Any]]) -> None:
        self._tg = tg
        self._tasks = tasks

    def __call__(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = self._tg.create_task(coro, name=name)
        self._tasks.append(task)
        return task


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["Daemon", "run_daemon"]
