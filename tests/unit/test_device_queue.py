"""The device queue's two lanes: backwards are admitted past a queue full of forwards and run
before them, so that an overloaded server finishes the micro-batches it started."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
from wanswarm.node.protocol import ErrorCode
from wanswarm.node.stage.device_queue import Deferred, DeviceQueue, Lane
from wanswarm.transport.endpoint import Response
from wanswarm.transport.errors import RemoteError


@dataclass
class _Counts:
    busy: int = 0
    expired: int = 0
    failed: int = 0
    compute_s: float = 0.0


def _queue(capacity: int) -> tuple[DeviceQueue, _Counts]:
    counts = _Counts()
    return DeviceQueue(0, capacity, counts, clock=time.monotonic, on_change=lambda _: None), counts


def test_forwards_leave_the_reserve_to_backwards_which_run_first() -> None:
    order: list[str] = []
    gate = threading.Event()
    entered = threading.Event()

    def hold() -> Response:
        entered.set()
        gate.wait(30)
        order.append("held")
        return Response({})

    def job(name: str) -> Response:
        order.append(name)
        return Response({})

    async def main() -> None:
        queue, counts = _queue(8)
        assert queue.reserve == 2
        tasks = [asyncio.create_task(queue.run("a", 30, hold))]
        assert await asyncio.to_thread(entered.wait, 30)  # the device thread is held
        peers = ["a", "b", "c", "a", "b"]
        for i, peer in enumerate(peers):  # 6 of 8 slots: the forwards' share is taken
            queue.admit(peer, Lane.START)
            tasks.append(asyncio.create_task(
                queue.run(peer, 30, lambda i=i: job(f"forward{i}"))))
            await asyncio.sleep(0)
        with pytest.raises(RemoteError) as refused:
            queue.admit("c", Lane.START)
        assert refused.value.code == ErrorCode.BUSY and counts.busy == 1
        for i, peer in enumerate(["c", "b"]):  # the reserve takes backwards
            queue.admit(peer, Lane.FINISH)
            tasks.append(asyncio.create_task(
                queue.run(peer, 30, lambda i=i: job(f"backward{i}"), Lane.FINISH)))
            await asyncio.sleep(0)
        assert queue.pending == 8
        with pytest.raises(RemoteError):  # full for both lanes now
            queue.admit("d", Lane.FINISH)
        gate.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
        # backwards first (round-robin by peer), then the forwards round-robin by peer
        assert order == ["held", "backward0", "backward1",
                         "forward0", "forward1", "forward2", "forward3", "forward4"]
        assert queue.pending == 0
        queue.shutdown()

    asyncio.run(main())


def test_a_peers_share_leaves_room_for_its_own_backwards() -> None:
    gate = threading.Event()

    def hold() -> Response:
        gate.wait(30)
        return Response({})

    async def main() -> None:
        queue, _ = _queue(16)  # a peer's share: 8 slots, plus 2 of the reserve for backwards
        tasks = []
        for _ in range(8):
            queue.admit("a", Lane.START)
            tasks.append(asyncio.create_task(queue.run("a", 30, hold)))
            await asyncio.sleep(0)
        with pytest.raises(RemoteError) as refused:
            queue.admit("a", Lane.START)
        assert "you hold 8 of the 16" in str(refused.value)
        for _ in range(2):
            queue.admit("a", Lane.FINISH)
            tasks.append(asyncio.create_task(queue.run("a", 30, hold, Lane.FINISH)))
            await asyncio.sleep(0)
        with pytest.raises(RemoteError) as refused:
            queue.admit("a", Lane.FINISH)
        assert "you hold 10 of the 16" in str(refused.value)
        queue.admit("b", Lane.START)  # another peer still gets in
        gate.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
        queue.shutdown()

    asyncio.run(main())


def test_a_lone_slot_serves_either_lane() -> None:
    queue, _ = _queue(1)
    assert queue.reserve == 0
    queue.admit("a", Lane.START)
    queue.admit("a", Lane.FINISH)
    queue.shutdown()


# ---- deferred replies (a forward's copy to the host under way, device_queue.Deferred) ----


def test_a_deferred_reply_finishes_off_the_device_thread_which_runs_the_next_job() -> None:
    gate = threading.Event()
    threads: dict[str, str] = {}

    def finish() -> Response:
        assert gate.wait(30)
        threads["finish"] = threading.current_thread().name
        return Response({"which": "first"})

    def first() -> Deferred:
        threads["first"] = threading.current_thread().name
        return Deferred(finish)

    def second() -> Response:
        threads["second"] = threading.current_thread().name
        return Response({"which": "second"})

    def refused_later() -> Deferred:
        def refuse() -> Response:
            raise RemoteError(ErrorCode.OUT_OF_RANGE, "the output reaches 1e+38")

        return Deferred(refuse)

    def broken_later() -> Deferred:
        def broken() -> Response:
            raise ValueError("a bug in a finisher")

        return Deferred(broken)

    async def main() -> None:
        queue, counts = _queue(4)
        try:
            one = asyncio.create_task(queue.run("a", 30, first))
            two = asyncio.create_task(queue.run("b", 30, second))
            assert (await two).header == {"which": "second"}  # while the first is unfinished
            assert not one.done() and queue.pending == 1  # its slot is held
            gate.set()
            assert (await one).header == {"which": "first"}
            assert threads["first"] == threads["second"]
            assert threads["first"].startswith("stage0-device")
            assert threads["finish"].startswith("stage0-finish")
            with pytest.raises(RemoteError) as refused:
                await queue.run("a", 30, refused_later)
            assert refused.value.code == ErrorCode.OUT_OF_RANGE
            with pytest.raises(RemoteError) as internal:
                await queue.run("a", 30, broken_later)
            assert internal.value.code == ErrorCode.INTERNAL
            assert counts.failed == 2 and queue.pending == 0
        finally:
            queue.shutdown()

    asyncio.run(main())


def test_a_deferred_reply_launched_as_the_queue_shuts_down_is_still_answered() -> None:
    entered, gate = threading.Event(), threading.Event()

    def work() -> Deferred:
        entered.set()
        assert gate.wait(30)
        return Deferred(lambda: Response({"answered": True}))

    async def main() -> None:
        queue, _ = _queue(2)
        task = asyncio.create_task(queue.run("a", 30, work))
        assert await asyncio.to_thread(entered.wait, 30)
        queue.shutdown()  # the finishing thread takes no more work
        gate.set()
        assert (await task).header == {"answered": True}
        async with asyncio.timeout(30):
            await queue.wait_idle()

    asyncio.run(main())
