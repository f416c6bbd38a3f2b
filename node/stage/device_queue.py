"""The device queue: a stage server's one device thread and the bounded queue in front of it.

All tensor work of a stage (validation of values, compute, reply encoding) runs on ONE
device thread, a dedicated single-worker executor; the event loop only parses headers and
queues jobs. The queue is bounded: when ``capacity`` jobs are queued or running,
``admit`` answers ``busy`` so that the trainer goes elsewhere. A job whose requester gave
up (the endpoint cancels the handler when the request stream is reset) or whose budget ran
out before it reached the device is dropped unrun. A job's slot is held until the job
really finishes on the device thread, whether or not its requester still waits.

A job that fails answers its error: a ``RemoteError`` as raised, anything else (a bug, a
torch failure) as ``internal``; the device thread goes on serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

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


@dataclass
class _Job:
    deadline: float  # time.monotonic()
    cancelled: bool = False  # the requester gave up (set from the event loop)


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
    ) -> None:
        self.stage = stage
        self.capacity = capacity
        self.counters = counters
        self.clock = clock
        # other device-thread work (state transfer, checkpoints, the optimizer's flush and
        # shutdown) runs on this executor directly, outside the queue's bound
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage}-device")
        self._on_change = on_change
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def pending(self) -> int:
        """Jobs queued or running on the device thread."""
        return self._pending

    def admit(self) -> None:
        """Refuse with ``busy`` when the queue is full."""
        if self._pending >= self.capacity:
            self.counters.busy += 1
            raise refuse(ErrorCode.BUSY, f"{self._pending} jobs queued")

    async def run(self, budget_s: float, work: Callable[[], Response]) -> Response:
        """Queue ``work`` on the device thread; the slot is held until it really finishes."""
        job = _Job(deadline=self.clock() + budget_s)
        self._pending += 1
        self._idle.clear()
        self._on_change(self._pending)
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._device, job, work)
        future.add_done_callback(self._job_done)
        try:
            # shielded: a cancelled handler must not free the slot of a job that still runs
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    async def wait_idle(self) -> None:
        """Until no job is queued or running."""
        await self._idle.wait()

    def shutdown(self) -> None:
        """Stop the device thread; queued work is cancelled, a running job finishes."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _job_done(self, future: asyncio.Future[Response]) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()
        self._on_change(self._pending)
        if not future.cancelled():
            future.exception()  # retrieved: a shielded job whose requester left is not an error

    def _device(self, job: _Job, work: Callable[[], Response]) -> Response:
        """Runs on the device thread."""
        if job.cancelled or self.clock() > job.deadline:
            self.counters.expired += 1
            raise refuse(ErrorCode.EXPIRED, "the request's budget ran out in the queue")
        started = time.perf_counter()
        try:
            return work()
        except RemoteError:
            self.counters.failed += 1
            raise
        except Exception as exc:  # a bug or a torch failure: answer 'internal', keep serving
            self.counters.failed += 1
            log.exception("stage %d: job failed", self.stage)
            raise refuse(ErrorCode.INTERNAL, type(exc).__name__) from exc
        finally:
            self.counters.compute_s += time.perf_counter() - started
