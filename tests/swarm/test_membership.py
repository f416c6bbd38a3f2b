"""Membership with real daemons: join, see each other, leave (CLI and SIGTERM), restart, junk records.

One bootstrap daemon serves the whole module; each test adds its own joiners to it. Every
wait polls with a deadline (helpers.wait_for).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import FAST, DaemonProcess, LocalSwarm, short_tmpdir, wait_for

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def swarm() -> Iterator[LocalSwarm]:
    metrics_port = _free_port()
    swarm = LocalSwarm(n=0)
    try:
        swarm.add("boot", initial_peers=(), extra_args=["--set", f"metrics.port={metrics_port}"])
        swarm.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield swarm
    finally:
        swarm.close()


def _boot(swarm: LocalSwarm) -> DaemonProcess:
    return swarm.nodes[0]


def _listed(observer: DaemonProcess, peer_id: str) -> bool:
    return peer_id in observer.peers()


@pytest.mark.timeout(90)
def test_join_status_and_cli_leave(swarm: LocalSwarm) -> None:
    boot = _boot(swarm)
    joiner = swarm.add("a", initial_peers=boot.wait_online().dht_addrs)
    a_id = joiner.wait_online().peer_id
    boot_id = boot.wait_online().peer_id

    wait_for(lambda: _listed(boot, a_id) and _listed(joiner, boot_id), 15, "both daemons to list each other",
             explain=swarm.explain)

    # the CLI's JSON carries what another node needs, and RTTs once the prober has measured them
    def measured() -> dict[str, object] | None:
        result = joiner.cli("status", "--json", timeout=20)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        peer = next((p for p in report["peers"] if p["peer_id"] == boot_id), None)
        return report if peer is not None and peer["rtt_ms"] is not None else None

    report = wait_for(measured, 15, "an RTT to the bootstrap node", explain=swarm.explain)
    assert report["peer_id"] == a_id and report["run"] == "demo" and report["state"] == "online"
    assert report["stage"] is None and report["quic_addr"] is None
    assert all(addr.endswith(f"/p2p/{a_id}") for addr in report["dht_addrs"])
    peer = next(p for p in report["peers"] if p["peer_id"] == boot_id)
    assert 0 < peer["rtt_ms"] < 1000 and peer["stage"] is None

    text = joiner.cli("status", timeout=20)
    assert text.returncode == 0 and a_id in text.stdout and "peers     1 known" in text.stdout

    # metrics of the bootstrap node count the joiner
    def scraped() -> str | None:
        body = urllib.request.urlopen(f"http://127.0.0.1:{swarm.metrics_port}/metrics", timeout=5).read().decode()  # type: ignore[attr-defined]
        return body if 'wanswarm_peers_known{stage="none"} 1.0' in body else None

    body = wait_for(scraped, 10, "metrics to count the joiner")
    assert 'wanswarm_state{wanswarm_state="online"} 1.0' in body
    assert "wanswarm_records_published_total" in body

    leave = joiner.cli("leave", timeout=40)
    assert leave.returncode == 0, leave.stdout + leave.stderr
    assert "left" in leave.stdout
    assert joiner.wait_exit(10) == 0
    # the tombstone makes the bootstrap node drop it well before the record would expire (6 s)
    started = time.monotonic()
    wait_for(lambda: not _listed(boot, a_id), 5, "the bootstrap node to drop the leaver", explain=swarm.explain)
    assert time.monotonic() - started < 5
    assert "record withdrawn" in joiner.log_path.read_text()


@pytest.mark.timeout(120)
def test_sigterm_leaves_with_sd_notify_and_restart_keeps_peer_id(swarm: LocalSwarm) -> None:
    boot = _boot(swarm)
    addrs = boot.wait_online().dht_addrs
    notify_dir = short_tmpdir("wsn-")
    notify_path = notify_dir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="1000000")
    try:
        node = DaemonProcess("b", swarm.base_dir / "b", [*FAST, "--initial-peers", *addrs], env).start()
        swarm.nodes.append(node)
        messages: list[str] = []

        def received(prefix: str) -> bool:
            while not any(m.startswith(prefix) or f"\n{prefix}" in m for m in messages):
                messages.append(sock.recv(4096).decode())  # bounded by the socket timeout
            return True

        received("READY=1")
        b_id = node.wait_online().peer_id
        assert any(f"MAINPID={node.pid}" in m for m in messages if "READY=1" in m)
        received("WATCHDOG=1")  # WATCHDOG_USEC=1 s: a ping at least every 0.5 s
        wait_for(lambda: _listed(boot, b_id), 15, "the bootstrap node to list b", explain=swarm.explain)

        assert node.terminate(30) == 0
        received("STOPPING=1")
        wait_for(lambda: not _listed(boot, b_id), 5, "the bootstrap node to drop b", explain=swarm.explain)

        # same state dir -> same identity -> same peer id, listed again
        again = DaemonProcess("b2", swarm.base_dir / "b", [*FAST, "--initial-peers", *addrs]).start()
        swarm.nodes.append(again)
        assert again.wait_online().peer_id == b_id
        wait_for(lambda: _listed(boot, b_id), 15, "the bootstrap node to list b again", explain=swarm.explain)
        assert again.terminate(30) == 0
    finally:
        sock.close()
        for path in notify_dir.iterdir():
            path.unlink()
        notify_dir.rmdir()


async def _servers_subkeys_held(_dht: object, node: object) -> set[str]:
    """Runs inside a raw hivemind DHT process: the sub-keys of demo.servers in its own storage."""
    from hivemind.dht.routing import DHTID

    item = node.protocol.storage.get(DHTID.generate(source="demo.servers"))  # type: ignore[attr-defined]
    return set() if item is None else {str(subkey) for subkey, _ in item.value.items()}


@pytest.mark.timeout(120)
def test_junk_and_forged_records_are_dropped(swarm: LocalSwarm) -> None:
    """A raw hivemind peer (no validator) stores junk under the run's keys and tries to
    overwrite a daemon's sub-key; the daemons ignore it and keep listing each other."""
    hivemind = pytest.importorskip("hivemind")
    from hivemind.utils import get_dht_time

    boot = _boot(swarm)
    addrs = boot.wait_online().dht_addrs
    victim = swarm.add("c", initial_peers=addrs)
    victim_id = victim.wait_online().peer_id
    boot_id = boot.wait_online().peer_id
    wait_for(lambda: _listed(boot, victim_id) and _listed(victim, boot_id), 15, "c and boot to list each other")

    raw = hivemind.DHT(initial_peers=addrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        expiration = get_dht_time() + 60
        forged = json.dumps({"v": 1, "peer_id": victim_id, "state": "left"}).encode()
        # honest nodes refuse every one of these; the raw node keeps them in its own storage and
        # serves them to lookups, where the daemons' validators drop them
        stores = [
            raw.store("demo.servers", b"\x00garbage", expiration, subkey="12D3KooWjunk", return_future=True),
            raw.store("demo.servers", {"v": 1, "state": 7}, expiration, subkey="12D3KooWwrongtype",
                      return_future=True),
            # an unsigned overwrite of the victim's sub-key, with a later expiration
            raw.store("demo.servers", forged, expiration + 1, subkey=victim_id, return_future=True),
            raw.store("demo.rtt", "not a dictionary", expiration, return_future=True),
        ]
        for future in stores:
            future.result(timeout=20)
        # the raw node holds the junk and serves it to lookups (it cannot read our signed records
        # itself: plain hivemind chokes on the signature, so we look into its storage)
        held = raw.run_coroutine(_servers_subkeys_held, return_future=True).result(timeout=20)
        assert {"12D3KooWjunk", "12D3KooWwrongtype", victim_id} <= held

        def refused() -> bool:
            reports = [boot.status(), victim.status()]
            return sum(r.records_refused for r in reports if r is not None) > 0

        wait_for(refused, 10, "the daemons' validators to refuse the junk", explain=swarm.explain)
        # several membership periods later, both daemons still see each other as online
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            for observer, target in ((boot, victim_id), (victim, boot_id)):
                report = observer.status()
                assert report is not None, observer.log_tail()
                listed = {p.peer_id: p for p in report.peers}
                assert target in listed, swarm.explain()
                assert listed[target].state == "online"
                assert not {"12D3KooWjunk", "12D3KooWwrongtype"} & set(listed)
            time.sleep(0.5)
        assert boot.running() and victim.running()
    finally:
        raw.shutdown()
    assert victim.terminate(30) == 0
