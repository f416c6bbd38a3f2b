"""The device queue: a stage server's one device thread and the bounded queue in front of it.

All tensor work of a stage (validation of values, compute, reply encoding) runs on ONE
device thread, a dedicated single-worker executor; the event loop only parses headers and
queues jobs. The queue is bounded: when ``capacity`` jobs are queued or running,
``admit`` answers ``busy`` so that the trainer goes elsewhere. A job whose requester gave
up (the endpoint cancels the handler when the request stream is reset) or whose budget ran
out before it reached the device is dropped unrun. A job's slot is held until the job
really finishes on the device thread, whether or not its requester still waits.

Two lanes. A ``backward``, or the last stage's ``forward_loss``, finishes a micro-batch whose
forwards already ran on every stage before; a ``forward`` (or an ``eval_loss``) starts or
extends one. Under load the difference decides whether the swarm makes progress: with one
queue, a server full of forwards answered ``busy`` to the backwards of the micro-batches
those forwards belong to, the trainers dropped them after their attempts and sent new
forwards, and the swarm did the forward work of many micro-batches and completed few (in
CI, the lab's symmetric-NAT node completed 0 in 180 s, its stage-0 backwards refused as
``busy: 16 jobs queued``). So the last ``reserve`` slots of the capacity (a quarter) take
finishing jobs only, and the device thread runs every queued finishing job before any
other. The bound on memory is the capacity still: a queued job holds its payload,
whichever lane.

Fair shares between peers (issue #13): one peer may hold at most ``max_peer_share`` of the
capacity (half by default; its backwards may take half the reserve beyond), so a peer that
floods the queue leaves room for the others;
and the device thread takes queued jobs round-robin by peer, not in arrival order, so
another peer's job waits behind at most one job of each other peer in its lane, not behind a
flooder's whole backlog (which would expire it). Identities are free to make: a peer
running several identities gets several shares (docs/hostile.md).

A job that fails answers its error: a ``RemoteError`` as raised, anything else (a bug, a
torch failure) as ``internal``; the device thread goes on serving.

A job may return its reply :class:`Deferred`: on a GPU, a forward launches its kernels and
its output's copy to the host, and the rest (waiting for the copy, checking the payload,
building the reply) runs on the queue's finishing thread, while the device thread starts
the next job. So one micro-batch's reply crosses the bus while the next one computes,
instead of the device thread waiting for every copy (docs/gpu.md). The job's slot is held
until its reply is finished.
"""

from __future__ import annotations

import asyncio
import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ...transport.endpoint import Response
from ...transport.errors import RemoteError
from ..logs import get_logger
from ..protocol import ErrorCode, refuse

log = get_logger(__name__)


class QueueCounts(Protocol):
    """The counters the queue writes (fields of the server's ``StageServerCounters``)."""

    busy: int  # event loop: refused because the queue was full
    expired: int  # device thread: dropped before running, out of budget or abandoned
    failed: int  # device thread: refused or failed while running
    compute_s: float  # device thread: time spent running jobs


_R = TypeVar("_R")

MAX_PEER_SHARE = 0.5  # of the capacity, one peer's at most
FINISH_RESERVE = 0.25  # of the capacity, the slots only finishing jobs may take


class Lane(enum.IntEnum):
    """Which work a job is: the device thread runs ``FINISH`` jobs first."""

    FINISH = 0  # backward, forward_loss: completes a micro-batch whose forwards ran
    START = 1  # forward, eval_loss


@dataclass(frozen=True)
class Deferred:
    """A job's reply still on its way to the host: ``finish`` waits for it and returns the
    response (or raises the refusal). It runs on the finishing thread, beside the device
    thread, so it must not touch what only the device thread may (caches, the optimizer)."""

    finish: Callable[[], Response]


Work = Callable[[], "Response | Deferred"]


@dataclass
class _Job:
    peer: str
    lane: Lane
    deadline: float  # time.monotonic()
    work: Work
    future: asyncio.Future[Response] = field(repr=False)
    cancelled: bool = False  # the requester gave up (set from the event loop)


class _RoundRobin:
    """One lane's jobs not yet started, by peer, taken one per peer in turn."""

    def __init__(self) -> None:
        self._waiting: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()  # the peers that have some, in turn order

    def push(self, job: _Job) -> None:
        queue = self._waiting.get(job.peer)
        if queue is None:
            queue = self._waiting[job.peer] = deque()
            self._turns.append(job.peer)
        queue.append(job)

    def pop(self) -> _Job | None:
        """The next peer's oldest job; None when the lane is empty."""
        if not self._turns:
            return None
        peer = self._turns.popleft()
        queue = self._waiting[peer]
        job = queue.popleft()
        if queue:
            self._turns.append(peer)
        else:
            del self._waiting[peer]
        return job

    def remove(self, job: _Job) -> None:
        queue = self._waiting.get(job.peer)
        if queue is not None and job in queue:
            queue.remove(job)
            if not queue:
                del self._waiting[job.peer]
                self._turns.remove(job.peer)

    def drain(self) -> list[_Job]:
        """Every job, the lane left empty."""
        jobs = [job for queue in self._waiting.values() for job in queue]
        self._waiting.clear()
        self._turns.clear()
        return jobs


class DeviceQueue:
    """The device thread of stage ``stage`` and its queue of at most ``capacity`` jobs.

    ``on_change`` is called on the event loop with the number of jobs queued or running
    whenever it changes (the server announces it in its DHT record)."""

    def __init__(
        self,
        stage: int,
        capacity: int,
        counters: QueueCounts,
        *,
        clock: Callable[[], float],
        on_change: Callable[[int], None],
        max_peer_share: float = MAX_PEER_SHARE,
    ) -> None:
        self.stage = stage
        self.capacity = capacity
        # a lone server of capacity 1 must still serve someone
        self.peer_capacity = max(1, math.floor(capacity * max_peer_share))
        # a lone slot serves either lane
        self.reserve = math.ceil(capacity * FINISH_RESERVE) if capacity > 1 else 0
        # one peer's backwards may take half the reserve beyond its share
        self.peer_reserve = (self.reserve + 1) // 2
        self.counters = counters
        self.clock = clock
        # other device-thread work (state transfer, checkpoints, the optimizer's flush and
        # shutdown) runs on this executor directly, outside the queue's bound
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage}-device")
        # deferred replies: waits for their copies to the host and finishes them, in order
        self._finisher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"stage{stage}-finish"
        )
        self._failed_lock = threading.Lock()  # counters.failed: both threads write it
        self._on_change = on_change
        self._pending = 0
        self._per_peer: dict[str, int] = {}  # jobs queued or running, by peer
        self._idle = asyncio.Event()
        self._idle.set()
        # per lane, in Lane order, the jobs not yet started (touched by the event loop and
        # the device thread: under the lock)
        self._lock = threading.Lock()
        self._lanes = tuple(_RoundRobin() for _ in Lane)

    @property
    def pending(self) -> int:
        """Jobs queued or running on the device thread."""
        return self._pending

    def pending_of(self, peer: str) -> int:
        """Jobs of ``peer`` queued or running."""
        return self._per_peer.get(peer, 0)

    def admit(self, peer: str, lane: Lane = Lane.START) -> None:
        """Refuse with ``busy`` when the queue is full for ``lane`` (a ``START`` job finds
        the last ``reserve`` slots taken), or ``peer`` holds its share of it."""
        reserve = self.reserve if lane == Lane.START else 0
        if self._pending >= self.capacity - reserve:
            self.counters.busy += 1
            raise refuse(ErrorCode.BUSY, f"{self._pending} jobs queued")
        share = self.peer_capacity + (self.peer_reserve if lane == Lane.FINISH else 0)
        if self._per_peer.get(peer, 0) >= share:
            self.counters.busy += 1
            raise refuse(ErrorCode.BUSY, f"you hold {share} of the {self.capacity} slots")

    async def run(
        self, peer: str, budget_s: float, work: Work, lane: Lane = Lane.START
    ) -> Response:
        """Queue ``peer``'s ``work`` for the device thread (``FINISH`` jobs first, each lane
        taken round-robin by peer); the slot is held until it really finishes."""
        loop = asyncio.get_running_loop()
        job = _Job(peer, lane, self.clock() + budget_s, work, loop.create_future())
        with self._lock:
            self._lanes[lane].push(job)
        self._pending += 1
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._idle.clear()
        self._on_change(self._pending)
        job.future.add_done_callback(lambda f: self._job_done(peer, f))
        try:
            # one turn of the device thread per job; which job it runs is the fair pick
            self.executor.submit(self._device_next, loop)
        except RuntimeError:  # shut down
            self._drop(job)
            if not job.future.done():
                job.future.set_exception(refuse(ErrorCode.DRAINING, "the stage is closing"))
        try:
            # shielded: a cancelled handler must not free the slot of a job that still runs
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    async def wait_idle(self) -> None:
        """Until no job is queued or running."""
        await self._idle.wait()

    def shutdown(self) -> None:
        """Stop the device thread; queued work is refused (``draining``), a running job
        finishes. Call on the event loop."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        # a deferred reply's work is done: it is finished and answered, not dropped
        self._finisher.shutdown(wait=False)
        with self._lock:
            jobs = [job for lane in self._lanes for job in lane.drain()]
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(refuse(ErrorCode.DRAINING, "the stage is closing"))

    def _drop(self, job: _Job) -> None:
        with self._lock:
            self._lanes[job.lane].remove(job)

    def _job_done(self, peer: str, future: asyncio.Future[Response]) -> None:
        self._pending -= 1
        left = self._per_peer.get(peer, 1) - 1
        if left > 0:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)
        if self._pending == 0:
            self._idle.set()
        self._on_change(self._pending)
        if not future.cancelled():
            future.exception()  # retrieved: a shielded job whose requester left is not an error

    def _next_job(self) -> _Job | None:
        """The next job: the first lane that has one, round-robin by peer (device thread)."""
        with self._lock:
            for lane in self._lanes:
                job = lane.pop()
                if job is not None:
                    return job
            return None

    def _device_next(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the device thread: one turn, the next job in fair order."""
        job = self._next_job()
        if job is None:
            return
        try:
            result: Response | Deferred | BaseException = self._device(job)
        except BaseException as exc:  # settled on the loop; nothing escapes the thread
            result = exc
        if isinstance(result, Deferred):
            try:
                self._finisher.submit(self._finish, job, result.finish, loop)
            except RuntimeError:  # shut down while this job ran: finish it here
                self._finish(job, result.finish, loop)
            return
        _answer(loop, job, result)

    def _device(self, job: _Job) -> Response | Deferred:
        """Runs on the device thread."""
        if job.cancelled or self.clock() > job.deadline:
            self.counters.expired += 1
            raise refuse(ErrorCode.EXPIRED, "the request's budget ran out in the queue")
        started = time.perf_counter()
        try:
            return self._guarded(job.work)
        finally:
            self.counters.compute_s += time.perf_counter() - started

    def _finish(
        self, job: _Job, finish: Callable[[], Response], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Runs on the finishing thread: a deferred reply, finished and answered."""
        try:
            result: Response | BaseException = self._guarded(finish)
        except BaseException as exc:
            result = exc
        _answer(loop, job, result)

    def _guarded(self, call: Callable[[], _R]) -> _R:
        """``call()``; a failure counted, a bug or a torch failure answered ``internal``."""
        try:
            return call()
        except RemoteError:
            self._count_failed()
            raise
        except Exception as exc:  # a bug or a torch failure: answer 'internal', keep serving
            self._count_failed()
            log.exception("stage %d: job failed", self.stage)
            raise refuse(ErrorCode.INTERNAL, type(exc).__name__) from exc

    def _count_failed(self) -> None:
        with self._failed_lock:
            self.counters.failed += 1


def _answer(
    loop: asyncio.AbstractEventLoop, job: _Job, result: Response | BaseException
) -> None:
    """Settle ``job``'s future with ``result`` on the event loop (from another thread)."""
    try:
        loop.call_soon_threadsafe(_settle, job.future, result)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def _settle(future: asyncio.Future[Response], result: Response | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
