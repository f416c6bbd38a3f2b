"""Real hivemind DHTs on loopback for the averaging tests, and their teardown in one place.

hivemind's DHT and P2P clients in this process leave an event loop and control sockets to the
garbage collector after shutdown: the teardown shuts down what the test built on the DHTs
(optimizers, averagers) first, then the DHTs, and collects the garbage itself, so that the
warnings land in the test that caused them (the tests carry narrow filters for exactly those).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import pytest

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class _ShutsDown(Protocol):
    def shutdown(self) -> None: ...


T = TypeVar("T", bound=_ShutsDown)


class Dhts:
    """The DHTs of one test (the first is the others' initial peer) and what runs on them."""

    def __init__(self) -> None:
        self.hivemind = pytest.importorskip("hivemind")
        self.dhts: list[Any] = []
        self.owned: list[tuple[_ShutsDown, Callable[[], object]]] = []

    def __getitem__(self, index: int) -> Any:
        return self.dhts[index]

    def __len__(self) -> int:
        return len(self.dhts)

    def add(self) -> Any:
        """One more DHT, joined through the first."""
        initial = self.dhts[0].get_visible_maddrs() if self.dhts else None
        dht = self.hivemind.DHT(start=True, host_maddrs=[LOOPBACK], initial_peers=initial)
        self.dhts.append(dht)
        return dht

    def own(self, item: T, shutdown: Callable[[], object] | None = None) -> T:
        """Shut ``item`` down (``shutdown``, else its ``shutdown()``) before the DHTs at the
        end of the test, in the order owned."""
        self.owned.append((item, shutdown or item.shutdown))
        return item

    def release(self, item: _ShutsDown) -> None:
        """Shut ``item`` down now."""
        entry = next(e for e in self.owned if e[0] is item)
        self.owned.remove(entry)
        entry[1]()

    def close(self) -> None:
        for _, shutdown in self.owned:
            shutdown()
        for dht in self.dhts:
            dht.shutdown()
        self.owned.clear()
        self.dhts.clear()
        gc.collect()


@contextmanager
def hivemind_dhts(n: int) -> Iterator[Dhts]:
    """``n`` DHTs on loopback (more with ``.add()``); everything torn down on exit."""
    dhts = Dhts()
    try:
        for _ in range(n):
            dhts.add()
        yield dhts
    finally:
        dhts.close()
