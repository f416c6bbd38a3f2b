"""Event loops of hivemind's processes keep every task they run until it is done.

asyncio holds tasks weakly: a task that nobody references lives only through the future it
awaits. hivemind starts many tasks and drops them (the DHT and averager processes start each
request as ``asyncio.create_task(...)`` and overwrite the only name for it with the next
request; the averagers' matchmaking starts its periodic declarations the same way). When
such a task awaits an ``MPFuture`` (a DHT call made from an averager process, say), the task,
its coroutine, the future and the future's asyncio event form a cycle that nothing outside
holds, since ``MPFuture`` keeps its pending futures only in a dictionary of weak
references. The garbage collector then destroys the task mid-wait ("Task was destroyed but
it is pending") and the answer, when it comes back, finds no future. What follows depends
on the task: a DHT request of the daemon is answered with ``GeneratorExit`` (it ended a
daemon, see ``Dht._call``); a stage's gradient averager lost its matchmaking and waited out
``averaging_timeout`` at every step from then on (a demo run stalled at 50k tokens).

asyncio's documentation says to keep a reference to every task one starts. :func:`install`
does it for hivemind: the loops that hivemind's processes make with ``switch_to_uvloop``
(the DHT's, each averager's) get a task factory that holds each task in a set until it is
done. A task that could have been woken (its future's answer still on its way) now is. A
task that nothing can ever wake stays pending instead of being destroyed: hivemind's waits
have timeouts, so none of its own tasks waits forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import InvalidStateError
from typing import Any

import hivemind.averaging.averager
import hivemind.dht.dht

from ..logs import get_logger

log = get_logger(__name__)

# how hivemind's MPFuture words the refusal to settle a future in that state
_CANCELLED = "future that is CANCELLED"

# the modules whose `switch_to_uvloop` makes the loop a hivemind process runs on
_LOOP_MAKERS = (hivemind.dht.dht, hivemind.averaging.averager)


class TaskKeeper:
    """A task factory that holds each task it makes until the task is done.

    One failure of a dropped task is expected and is not logged as an error: setting the
    outcome of an ``MPFuture`` that its caller already cancelled. hivemind's averager sets
    a round's result on the step's control after the round; when the stage gave up on the
    round first (its deadline, a leave), that raises ``InvalidStateError`` in a task nobody
    awaits, which asyncio reported at ERROR with a traceback ("Task exception was never
    retrieved") though the caller had already gone on. It is logged at debug instead; any
    other failure of a task is left to asyncio, as before."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        # read without retrieving it (``exception()`` would mark every failure retrieved,
        # silencing the ones nobody awaits too)
        failure = getattr(task, "_exception", None)
        if isinstance(failure, InvalidStateError) and _CANCELLED in str(failure):
            task.exception()  # retrieved: asyncio does not log it
            log.debug("%s: an outcome for a future its caller cancelled: %s",
                      task.get_name(), failure)


def keep_tasks(loop: asyncio.AbstractEventLoop) -> TaskKeeper:
    """Make ``loop`` hold every task it creates from now on until the task is done."""
    keeper = TaskKeeper()
    loop.set_task_factory(keeper)  # type: ignore[arg-type]
    return keeper


LoopMaker = Callable[[], asyncio.AbstractEventLoop]


def _keeping(make_loop: LoopMaker) -> LoopMaker:
    def switch_to_uvloop() -> asyncio.AbstractEventLoop:
        loop = make_loop()
        keep_tasks(loop)
        return loop

    switch_to_uvloop.keeps_tasks = True  # type: ignore[attr-defined]
    return switch_to_uvloop


def install() -> None:
    """Make the loops of hivemind processes started (forked) after this call keep their tasks.

    Idempotent. Called before the daemon forks its DHT process; the averagers' processes,
    which need a DHT, are forked later still."""
    for module in _LOOP_MAKERS:
        make_loop = module.switch_to_uvloop
        if not getattr(make_loop, "keeps_tasks", False):
            module.switch_to_uvloop = _keeping(make_loop)
