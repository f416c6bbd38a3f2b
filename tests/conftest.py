"""Shared pytest fixtures and settings for every test tier."""

from __future__ import annotations

import os

# Triton kernels are checked on the CPU through Triton's interpreter; set it before any
# test module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402  (after TRITON_INTERPRET, which must come first)

# Property tests draw new examples on every run, which finds new bugs on developers' machines
# but would let CI turn red at random. Under CI (CI=true, as .ci/run is run) every property
# test draws the same broad examples each run: hypothesis derives them from the test itself
# (derandomize) and keeps no example database between runs. Locally the default profile
# stays random; `HYPOTHESIS_PROFILE=ci` reproduces CI's draws.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture(autouse=True)
def _close_default_loop() -> Iterator[None]:
    """hivemind's MPFuture calls ``asyncio.get_event_loop()`` in the thread that waits on it,
    which outside a running loop creates and installs a default loop that nothing closes:
    close it after each test, so that its sockets do not reach the garbage collector in some
    later test. Looked up without creating one (the policy's thread-local slot)."""
    yield
    policy = asyncio.get_event_loop_policy()
    loop = getattr(getattr(policy, "_local", None), "_loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_running():
        asyncio.set_event_loop(None)
        if not loop.is_closed():
            loop.close()


if os.environ.get("WANSWARM_GC_EACH_TEST"):
    import gc

    @pytest.fixture(autouse=True)
    def _collect_garbage_after_each_test() -> Iterator[None]:
        """Diagnosis of leaks (unclosed event loops, sockets): collect garbage as each test
        ends, so that the warnings about what it left land on that test, not a later one."""
        yield
        gc.collect()
