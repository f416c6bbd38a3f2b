"""A SIGKILLed daemon takes its forked helpers (hivemind's averagers) with it
(node/service/lifeline.py).

Swarm tier: process lifetimes can only be tested with processes. A stand-in daemon runs as a
subprocess and forks its helper; the test SIGKILLs the stand-in and waits on the helper's
pidfd, which becomes readable when the helper exits.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and pidfds are Linux-only"
)

# A stand-in daemon: optionally installs the lifeline, forks a daemonic worker the way hivemind
# starts its averagers (multiprocessing, fork start method, from the main thread), prints the
# worker's pid and waits to be killed (both sleeps stand for work that never ends).
PARENT = textwrap.dedent(
    """
    import multiprocessing as mp, signal, sys, time
    from wanswarm.node.service import lifeline

    # like the daemon: a Python SIGTERM handler, which a forked child inherits
    signal.signal(signal.SIGTERM, lambda *_: None)

    def worker():
        time.sleep(120)

    if __name__ == "__main__":
        if sys.argv[1] == "install":
            assert lifeline.install()
        p = mp.get_context("fork").Process(target=worker, daemon=True)
        p.start()
        print(p.pid, flush=True)
        time.sleep(120)
    """
)


def _exits_within(pidfd: int, timeout_s: float) -> bool:
    """Whether the process behind ``pidfd`` has exited or exits within ``timeout_s`` (a pidfd
    polls readable once its process has exited, zombie or reaped: pidfd_open(2))."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _worker_after_parent_killed(mode: str, wait_s: float) -> tuple[int, bool]:
    """Start the stand-in daemon, SIGKILL it, and wait up to ``wait_s`` for its forked worker
    to exit; returns the worker's pid and whether it is still alive."""
    command = [sys.executable, "-c", PARENT, mode]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            worker = int(parent.stdout.readline())
            # opened while the worker surely runs, so the pid cannot have been reused
            pidfd = os.pidfd_open(worker)
            try:
                assert not _exits_within(pidfd, 0.0)
                parent.send_signal(signal.SIGKILL)
                parent.wait(timeout=10)
                return worker, not _exits_within(pidfd, wait_s)
            finally:
                os.close(pidfd)
        finally:
            parent.kill()


def test_forked_worker_dies_with_a_sigkilled_parent() -> None:
    _, alive = _worker_after_parent_killed("install", wait_s=10.0)
    assert not alive


def test_without_the_lifeline_the_worker_is_orphaned() -> None:
    worker, alive = _worker_after_parent_killed("none", wait_s=1.0)
    try:
        assert alive  # the failure mode install() exists for
    finally:
        if alive:
            os.kill(worker, signal.SIGKILL)
