"""Membership with real daemons: join, see each other, junk records, SIGTERM, restart, CLI leave.

Daemon starts dominate the runtime (each imports torch and hivemind and starts a p2pd), so the
module shares two daemons: a bootstrap node and a member that joins through it. The member is
started with $NOTIFY_SOCKET pointing at a datagram socket the module owns; a test that needs the
member running gets it (re)started by the ``member`` fixture, with the same state dir and
therefore the same identity. Every wait polls with a deadline (helpers.wait_for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.waiting import wait_for

from .helpers import FAST, NO_TRAINING, DaemonProcess, LocalSwarm, short_tmpdir

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Module:
    swarm: LocalSwarm
    boot: DaemonProcess
    metrics_port: int
    notify: socket.socket
    notify_env: dict[str, str]
    member: DaemonProcess | None = None
    messages: list[str] = field(default_factory=list)

    def start_member(self) -> DaemonProcess:
        addrs = self.boot.wait_online().dht_addrs
        args = [*FAST, *NO_TRAINING, "--initial-peers", *addrs]
        node = DaemonProcess("member", self.swarm.base_dir / "member", args,
                             self.notify_env).start()
        self.swarm.nodes.append(node)
        self.member = node
        node.wait_online()
        return node

    def notified(self, prefix: str, after: int = 0) -> int:
        """Index of the first sd_notify datagram from ``after`` on with a ``prefix`` line."""
        while True:
            for index in range(after, len(self.messages)):
                if any(line.startswith(prefix) for line in self.messages[index].split("\n")):
                    return index
            self.messages.append(self.notify.recv(4096).decode())  # bounded by the socket timeout


@pytest.fixture(scope="module")
def module() -> Iterator[Module]:
    notify_dir = short_tmpdir("wsn-")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_dir / "notify.sock"))
    notify.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_dir / "notify.sock"), WATCHDOG_USEC="1000000")
    metrics_port = _free_port()
    swarm = LocalSwarm(n=0, extra_args=[*FAST, *NO_TRAINING])
    try:
        boot = swarm.add("boot", initial_peers=(),
                         extra_args=["--set", f"metrics.port={metrics_port}"])
        yield Module(swarm, boot, metrics_port, notify, env)
    finally:
        swarm.close()
        notify.close()
        shutil.rmtree(notify_dir, ignore_errors=True)


@pytest.fixture
def member(module: Module) -> DaemonProcess:
    if module.member is None or not module.member.running():
        module.start_member()
    assert module.member is not None
    return module.member


def _listed(observer: DaemonProcess, peer_id: str) -> bool:
    return peer_id in observer.peers()


@pytest.mark.timeout(90)
def test_join_status_rtt_and_metrics(module: Module, member: DaemonProcess) -> None:
    boot = module.boot
    member_id, boot_id = member.wait_online().peer_id, boot.wait_online().peer_id
    wait_for(lambda: _listed(boot, member_id) and _listed(member, boot_id), 15,
             "both daemons to list each other", explain=module.swarm.explain)

    # the CLI's JSON carries what another node needs, and RTTs once the prober has measured them
    def measured() -> dict[str, object] | None:
        result = member.cli("status", "--json", timeout=20)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        peer = next((p for p in report["peers"] if p["peer_id"] == boot_id), None)
        return report if peer is not None and peer["rtt_ms"] is not None else None

    report = wait_for(measured, 15, "an RTT to the bootstrap node", explain=module.swarm.explain)
    assert report["peer_id"] == member_id and report["run"] == "demo"
    assert report["state"] == "online"
    assert report["stage"] is None  # no stage server
    assert re.fullmatch(r"127\.0\.0\.1:\d+", report["quic_addr"])  # type: ignore[arg-type]
    assert report["dht_addrs"] and all(a.endswith(f"/p2p/{member_id}") for a in report["dht_addrs"])  # type: ignore[union-attr]
    peer = next(p for p in report["peers"] if p["peer_id"] == boot_id)  # type: ignore[union-attr]
    assert 0 < peer["rtt_ms"] < 1000 and peer["stage"] is None
    assert peer["quic_addr"] == boot.wait_online().quic_addr

    text = member.cli("status", timeout=20)
    assert text.returncode == 0 and member_id in text.stdout and "peers     1 known" in text.stdout

    def scraped() -> str | None:
        url = f"http://127.0.0.1:{module.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        return body if 'wanswarm_peers_known{stage="none"} 1.0' in body else None

    body = wait_for(scraped, 10, "the bootstrap node's metrics to count the member")
    assert 'wanswarm_state{wanswarm_state="online"} 1.0' in body
    assert "wanswarm_records_published_total" in body and "wanswarm_peer_rtt_seconds" in body


async def _servers_subkeys_held(_dht: object, node: object) -> set[str]:
    """Runs inside a raw hivemind DHT process: the sub-keys of demo.servers in its own storage."""
    from hivemind.dht.routing import DHTID

    item = node.protocol.storage.get(DHTID.generate(source="demo.servers"))  # type: ignore[attr-defined]
    return set() if item is None else {str(subkey) for subkey, _ in item.value.items()}


@pytest.mark.timeout(120)
def test_junk_and_forged_records_are_dropped(module: Module, member: DaemonProcess) -> None:
    """A raw hivemind peer (no validator) stores junk under the run's keys and tries to
    overwrite the member's sub-key; the daemons refuse it and keep listing each other."""
    hivemind = pytest.importorskip("hivemind")
    from hivemind.utils import get_dht_time

    boot = module.boot
    addrs = boot.wait_online().dht_addrs
    member_id, boot_id = member.wait_online().peer_id, boot.wait_online().peer_id
    wait_for(lambda: _listed(boot, member_id) and _listed(member, boot_id), 15,
             "member and boot to list each other")

    raw = hivemind.DHT(initial_peers=addrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        expiration = get_dht_time() + 60
        forged = json.dumps({"v": 1, "peer_id": member_id, "state": "left"}).encode()
        stores = [
            raw.store("demo.servers", b"\x00garbage", expiration, subkey="12D3KooWjunk",
                      return_future=True),
            raw.store("demo.servers", {"v": 1, "state": 7}, expiration, subkey="12D3KooWwrongtype",
                      return_future=True),
            # an unsigned overwrite of the member's sub-key, with a later expiration
            raw.store("demo.servers", forged, expiration + 1, subkey=member_id, return_future=True),
            raw.store("demo.rtt", "not a dictionary", expiration, return_future=True),
        ]
        for future in stores:
            future.result(timeout=20)
        # the raw node holds the junk and serves it to lookups (plain hivemind cannot read our
        # signed records itself, so we look into its storage)
        held = raw.run_coroutine(_servers_subkeys_held, return_future=True).result(timeout=20)
        assert {"12D3KooWjunk", "12D3KooWwrongtype", member_id} <= held

        def refused() -> bool:
            reports = [boot.status(), member.status()]
            return sum(r.records_refused for r in reports if r is not None) > 0

        wait_for(refused, 10, "the daemons' validators to refuse the junk",
                 explain=module.swarm.explain)
        # four membership periods later, both daemons still list each other as online: what is
        # checked is that nothing changes, so there is no event to wait for, only samples
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for observer, target in ((boot, member_id), (member, boot_id)):
                report = observer.status()
                assert report is not None, observer.log_tail()
                listed = {p.peer_id: p for p in report.peers}
                assert target in listed and listed[target].state == "online", module.swarm.explain()
                assert not {"12D3KooWjunk", "12D3KooWwrongtype"} & set(listed)
            time.sleep(0.25)  # the sampling interval, not a synchronisation
        assert boot.running() and member.running()
    finally:
        raw.shutdown()


@pytest.mark.timeout(120)
def test_sigterm_leaves_with_sd_notify_and_restart_keeps_peer_id(
    module: Module, member: DaemonProcess
) -> None:
    boot = module.boot
    member_id = member.wait_online().peer_id
    ready = module.notified("READY=1")
    assert f"MAINPID={member.pid}" in module.messages[ready]
    module.notified("WATCHDOG=1", after=ready)  # WATCHDOG_USEC=1 s: a ping at least every 0.5 s
    wait_for(lambda: _listed(boot, member_id), 15, "the bootstrap node to list the member")

    assert member.terminate(30) == 0
    stopping = module.notified("STOPPING=1", after=ready)
    # the tombstone makes the bootstrap node drop it well before the record would expire (6 s)
    wait_for(lambda: not _listed(boot, member_id), 4, "the bootstrap node to drop the member",
             explain=module.swarm.explain)
    assert "record withdrawn" in member.log_path.read_text()

    # same state dir -> same identity -> same peer id, listed again
    again = module.start_member()
    assert again.wait_online().peer_id == member_id
    module.notified("READY=1", after=stopping)
    wait_for(lambda: _listed(boot, member_id), 15, "the bootstrap node to list the member again",
             explain=module.swarm.explain)


@pytest.mark.timeout(90)
def test_cli_leave_exits_0_and_peers_drop_the_leaver(module: Module, member: DaemonProcess) -> None:
    boot = module.boot
    member_id = member.wait_online().peer_id
    wait_for(lambda: _listed(boot, member_id), 15, "the bootstrap node to list the member")
    started = time.monotonic()
    leave = member.cli("leave", timeout=40)
    assert leave.returncode == 0, leave.stdout + leave.stderr
    assert leave.stdout.splitlines()[0].startswith(f"daemon (pid {member.pid}) is leaving")
    assert leave.stdout.splitlines()[-1] == "left"
    assert member.wait_exit(10) == 0
    wait_for(lambda: not _listed(boot, member_id), 4, "the bootstrap node to drop the leaver",
             explain=module.swarm.explain)
    assert time.monotonic() - started < 15
    assert member.cli("status").returncode == 1


@pytest.mark.timeout(150)
def test_a_restarted_first_node_finds_its_swarm_through_its_address_book() -> None:
    """The swarm's first node has no initial peers. SIGKILLed and restarted (same state dir,
    a new port), it dials the members it remembered (peers.json) and lists them again; the
    member, which had dropped it, lists it again too. Without the address book the first
    node came back alone: 0 peers known (the compose swarm showed it, docs/nat.md)."""
    with LocalSwarm(n=2, extra_args=[*FAST, *NO_TRAINING]) as swarm:
        boot, member = swarm.nodes
        boot_id, member_id = boot.wait_online().peer_id, member.wait_online().peer_id
        swarm.wait_all_see_each_other()
        book = boot.state_dir / "peers.json"
        wait_for(lambda: book.exists() and member_id in book.read_text(), 15,
                 "the first node to remember the member", explain=swarm.explain)

        boot.kill()
        wait_for(lambda: not _listed(member, boot_id), 20,
                 "the member to drop the killed node (its record expired)", explain=swarm.explain)
        boot.start()
        assert boot.wait_online().peer_id == boot_id
        wait_for(lambda: _listed(boot, member_id) and _listed(member, boot_id), 30,
                 "both to list each other after the restart", explain=swarm.explain)
        assert "rejoining: 1 of 1 remembered peer(s) answered" in boot.log_path.read_text()
