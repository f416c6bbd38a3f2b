"""``wanswarm join`` exits on time even when a thread is stuck in abandoned work (a stage's
device thread inside an averaging step whose peers left): the process ends with the
daemon's exit status instead of waiting for the interpreter to join the thread."""

from __future__ import annotations

import subprocess
import sys
import time

SCRIPT = """
import threading, time, sys
from wanswarm.node.daemon import exit_past_abandoned_threads
stuck = sys.argv[1] == "stuck"
if stuck:
    threading.Thread(target=time.sleep, args=(60,), name="stage2-device_0").start()
else:
    threading.Thread(target=time.sleep, args=(0.05,), name="short").start()
exit_past_abandoned_threads(3, wait_s=0.5)
print("returned", flush=True)
"""


def _run(mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=60)
    return done, time.monotonic() - started


def test_a_stuck_thread_does_not_hold_the_exit() -> None:
    done, took = _run("stuck")
    assert done.returncode == 3, done.stderr
    assert "returned" not in done.stdout
    assert took < 30  # far below the 60 s the thread would have kept the process alive
    assert "stage2-device_0" in done.stderr  # the warning names it


def test_threads_that_finish_are_waited_for() -> None:
    done, _ = _run("short")
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr
