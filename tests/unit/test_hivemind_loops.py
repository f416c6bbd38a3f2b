"""The loops of hivemind's processes keep the tasks hivemind starts and drops.

In-process: a uvloop loop as hivemind's ``switch_to_uvloop`` makes it (that function also
installs uvloop's policy for the whole process, so the tests make the loop themselves), a
task started and dropped the way hivemind's request loops do, awaiting an ``MPFuture``
whose answer comes later from another thread (as from hivemind's update thread).
tests/loopback/test_dht_adapter.py has the same through a real DHT process.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import hivemind.averaging.averager
import hivemind.dht.dht
import pytest
import uvloop
from hivemind.utils.mpfuture import MPFuture
from wanswarm.node.membership import hivemind_loops


def _park_and_collect(loop: asyncio.AbstractEventLoop) -> tuple[bool, Any]:
    """Start (and drop) a task that awaits an MPFuture, collect garbage, then answer the
    future the way hivemind's update thread does: by its uid. Returns whether the future
    was still there to answer, and what the parked task returned (None: it is gone)."""
    parked: dict[str, Any] = {}

    async def wait_for_answer() -> str:
        inner: MPFuture[str] = MPFuture()
        parked["uid"] = inner._uid
        return await inner

    async def main() -> tuple[bool, Any]:
        asyncio.get_running_loop().create_task(wait_for_answer())  # dropped
        await asyncio.sleep(0.01)
        gc.collect()
        ref = MPFuture._active_futures.get(parked["uid"])
        future = ref() if ref is not None else None
        if future is None:
            return False, None
        del ref
        kept = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        answer = threading.Thread(target=future.set_result, args=("answered",))
        answer.start()
        answer.join(timeout=5)
        del future
        done, _ = await asyncio.wait(kept, timeout=5)
        return True, [t.result() for t in done]

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


# the destroyed task's coroutine is closed by the collector, outside any test frame
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_task_awaiting_an_mpfuture_is_destroyed_on_a_plain_loop() -> None:
    """What the patch is for: the loop hivemind makes loses the task (and the future's
    answer) to the garbage collector."""
    assert _park_and_collect(uvloop.new_event_loop()) == (False, None)


@pytest.mark.parametrize("module", [hivemind.dht.dht, hivemind.averaging.averager])
def test_the_patched_loops_keep_the_task_until_its_answer(
    module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for patched in (hivemind.dht.dht, hivemind.averaging.averager):  # undone after the test
        monkeypatch.setattr(patched, "switch_to_uvloop", uvloop.new_event_loop)
    hivemind_loops.install()
    assert _park_and_collect(module.switch_to_uvloop()) == (True, ["answered"])


def test_install_is_idempotent_and_a_kept_task_is_released_when_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for module in (hivemind.dht.dht, hivemind.averaging.averager):
        monkeypatch.setattr(module, "switch_to_uvloop", uvloop.new_event_loop)
    hivemind_loops.install()
    once = hivemind.dht.dht.switch_to_uvloop
    hivemind_loops.install()
    assert hivemind.dht.dht.switch_to_uvloop is once
    loop = once()
    try:
        keeper = loop.get_task_factory()
        assert isinstance(keeper, hivemind_loops.TaskKeeper)

        async def main() -> int:
            task = asyncio.get_running_loop().create_task(asyncio.sleep(0, 7), name="named")
            assert task in keeper.tasks and task.get_name() == "named"
            result = await task
            await asyncio.sleep(0)  # the done callbacks run
            return result + len(keeper.tasks)

        # only main's own task is still held when it returns
        assert loop.run_until_complete(main()) == 8
        assert not keeper.tasks
    finally:
        loop.close()


def test_a_late_outcome_for_a_cancelled_mpfuture_is_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """hivemind's averager sets a round's result on a step its caller cancelled, in a task
    nobody awaits: asyncio logged that at ERROR ("Task exception was never retrieved"). A
    kept task's InvalidStateError of that kind is logged at debug; any other failure of a
    dropped task is still reported by asyncio."""
    loop = uvloop.new_event_loop()
    hivemind_loops.keep_tasks(loop)

    async def settle_cancelled() -> None:
        step: MPFuture[int] = MPFuture()
        step.cancel()  # by its caller, in the process it came from
        step._origin_pid = -1  # set from the averager's process, as hivemind's _step does
        step.set_result(1)  # raises InvalidStateError

    async def fail_otherwise() -> None:
        raise ValueError("a real failure")

    async def main() -> None:
        for coro in (settle_cancelled(), fail_otherwise()):
            asyncio.get_running_loop().create_task(coro)  # dropped
        await asyncio.sleep(0.05)

    caplog.set_level("DEBUG")
    try:
        loop.run_until_complete(main())
        gc.collect()  # the dropped, failed tasks are collected; asyncio logs the unretrieved
    finally:
        loop.close()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].getMessage().startswith("Task exception was never retrieved")
    assert "a real failure" in errors[0].getMessage()
    assert any("its caller cancelled" in r.getMessage() for r in caplog.records)
