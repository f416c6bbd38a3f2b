"""A SIGKILLed daemon takes its forked helpers (hivemind's averagers) with it (node/service/lifeline.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

# A stand-in daemon: optionally installs the lifeline, forks a daemonic worker the way hivemind
# starts its averagers (multiprocessing, fork start method, from the main thread), prints the
# worker's pid and waits to be killed.
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _worker_after_parent_killed(mode: str, wait_s: float) -> tuple[int, bool]:
    with subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            worker = int(parent.stdout.readline())
            assert _alive(worker)
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=10)
            deadline = time.monotonic() + wait_s  # polls the kernel's view: nothing to wait on
            while _alive(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
            return worker, _alive(worker)
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
