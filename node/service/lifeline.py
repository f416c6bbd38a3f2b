"""Forked helpers die with the daemon.

hivemind forks worker processes inside the daemon (the averagers of every stage optimizer:
``multiprocessing`` with the fork start method). They are ``daemon=True`` processes, which
Python only stops when the parent exits normally: a daemon killed with SIGKILL (an OOM kill,
a supervisor's stop timeout, ``kill -9``) left them running forever, each holding a libp2p
client and its share of the machine (seen in the demo: two orphans per killed daemon).

``install()`` registers an at-fork hook: a child forked from the daemon's main thread asks
the kernel to send it SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``), and exits at
once if the parent is already gone. SIGKILL, not SIGTERM: a forked child inherits the
daemon's Python-level SIGTERM handler (the graceful leave), which in the child does nothing,
so a SIGTERM would be swallowed (seen: orphaned averagers with SIGTERM caught). The children
hold no state of their own worth a clean exit: the daemon that owned it is gone. Forks from
other threads are left alone: the death signal fires when the *forking thread* ends, which
for a worker thread is not the daemon's death. (The DHT process sets the same thing itself
and also leaves the process group: node/membership/dht.py.) Elsewhere than Linux
``install()`` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_installed = False
_forking: dict[str, int | bool] = {"pid": 0, "main_thread": False}


def _before_fork() -> None:
    _forking["pid"] = os.getpid()
    _forking["main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if not _forking["main_thread"]:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forking["pid"]:
        os._exit(1)  # the daemon died between the fork and the prctl


def install() -> bool:
    """Tie main-thread forks of this process to its life; True where supported (Linux)."""
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    if not _installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True
    return True


__all__ = ["install"]
