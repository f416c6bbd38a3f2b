"""The network-lab tier: real namespaces, NAT, delay, loss and rate limits (needs root).

Every test gets a ``lab`` factory: ``lab(topology)`` builds a :class:`Lab` that is torn down
after the test, which then checks that no namespace of it is left. Without root or network
namespaces the tests that use it skip, saying why. Stale labs of killed runs are removed
once per session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from wanswarm.node.tools import netlab
from wanswarm.node.tools.netlab_topology import Topology

_support: dict[str, str | None] = {}


def lab_support() -> str | None:
    """Why labs cannot be built here (None: they can), checked once per session."""
    if "reason" not in _support:
        reason = netlab.check_support()
        _support["reason"] = reason
        if reason is None:
            netlab.cleanup_stale()
    return _support["reason"]


@pytest.fixture
def lab() -> Iterator[Callable[[Topology], netlab.Lab]]:
    reason = lab_support()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    labs: list[netlab.Lab] = []

    def make(topology: Topology) -> netlab.Lab:
        built = netlab.Lab(topology)
        labs.append(built)
        return built.start()

    try:
        yield make
    finally:
        for built in labs:
            built.close()
    left = [ns for ns in netlab.list_namespaces() for b in labs if ns.startswith(b.id)]
    assert not left, f"namespaces left behind: {left}"


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)
