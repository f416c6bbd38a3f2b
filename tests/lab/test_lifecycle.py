"""A lab leaves nothing behind: closed, killed (then cleaned up as stale) or stopped by signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from wanswarm.node.tools import netlab, netlab_cli
from wanswarm.node.tools.netlab import Lab, read_line
from wanswarm.node.tools.netlab_topology import Home, Link, Topology

from .conftest import lab_support, wait_until

LabFactory = Callable[[Topology], Lab]
SMALL = Topology(public=("boot",), homes=(Home("alice", link=Link(delay_ms=5)),))


def _namespaces_of(lab_id: str) -> list[str]:
    return [ns for ns in netlab.list_namespaces() if ns.startswith(f"{lab_id}-")]


def _pids_in(namespaces: list[str]) -> list[int]:
    pids: list[int] = []
    for ns in namespaces:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                timeout=10)
        pids += [int(p) for p in listed.stdout.split()]
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_close_stops_every_process_and_removes_every_namespace(lab: LabFactory) -> None:
    net = lab(SMALL)
    net.popen("boot", [sys.executable, "-c", "import sys; sys.stdin.read()"],
              stdin=subprocess.PIPE)
    namespaces = _namespaces_of(net.id)
    assert len(namespaces) == 4  # inet, boot, alice, r-alice
    pids = _pids_in(namespaces)
    assert len(pids) == 2  # the delay stage and the process started above
    net.close()
    assert _namespaces_of(net.id) == []
    assert not [pid for pid in pids if _alive(pid)]


def test_a_build_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = lab_support()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    monkeypatch.setattr(netlab, "router_ruleset", lambda router: "table ip netlab { nonsense }")
    broken = Lab(SMALL)
    with pytest.raises(netlab.LabError, match="nft"):
        broken.start()
    assert _namespaces_of(broken.id) == []


def test_a_killed_labs_leftovers_are_cleaned_up_as_stale() -> None:
    reason = lab_support()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    script = (
        "import sys\n"
        "from wanswarm.node.tools.netlab import Lab\n"
        "from wanswarm.node.tools.netlab_topology import Home, Link, Topology\n"
        "lab = Lab(Topology(homes=(Home('alice', link=Link(delay_ms=5)),))).start()\n"
        "print(lab.id, flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    lab_id = ""
    try:
        lab_id = read_line(owner, 60)
        namespaces = _namespaces_of(lab_id)
        assert namespaces and _pids_in(namespaces)
        owner.kill()  # no teardown: what a crash or `kill -9` leaves
        owner.wait(timeout=10)
        # the delay stage dies with its parent (PR_SET_PDEATHSIG), the namespaces stay
        wait_until(lambda: not _pids_in(namespaces), 10, "the delay stage to die")
        assert _namespaces_of(lab_id) == namespaces
        removed = netlab.cleanup_stale()
        assert set(namespaces) <= set(removed)
        assert _namespaces_of(lab_id) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(timeout=10)
        for pipe in (owner.stdin, owner.stdout):
            assert pipe is not None
            pipe.close()
        if lab_id:
            netlab.cleanup_stale()


def test_the_command_tears_its_lab_down_on_sigterm() -> None:
    reason = lab_support()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    cmd = [sys.executable, "-m", "wanswarm.node.tools.netlab", "up", "--public", "boot",
           "--home", "alice:symmetric", "--delay-ms", "5", "--loss", "0.01", "--rate-mbit",
           "50", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        shown = json.loads(read_line(proc, 60))
        assert {row["host"] for row in shown["hosts"]} == {"boot", "alice"}
        assert _namespaces_of(shown["lab"])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert _namespaces_of(shown["lab"]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_the_command_refuses_without_root(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
    assert netlab_cli.main(["up", "--public", "boot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("netlab: needs root"), err


def test_the_command_teaches_its_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        netlab_cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for word in ("up", "cleanup", "list", "bench", "--home", "ip netns exec"):
        assert word in out
