"""The network lab: an internet of Linux network namespaces, for tests and for people.

A :class:`Lab` builds a :class:`~.netlab_topology.Topology` (public hosts on a bridge, homes
behind NAT routers with shaped uplinks; see :mod:`.netlab_topology` for the picture and the
addresses) and tears it down again::

    topology = Topology(public=("boot",), homes=(Home("alice", "cone", Link(delay_ms=25)),))
    with Lab(topology) as lab:
        lab.exec("alice", ["ip", "addr"])
        server = lab.popen("boot", [...], stdout=subprocess.PIPE)
        lab.public_address("alice")  # the router's address, what "boot" sees

How each effect is made, all inside namespaces the lab creates (nothing in the root one):
NAT and the stateful firewall are nftables ``masquerade`` (cone) or ``masquerade
random,fully-random`` (symmetric) in the router; the rate is a ``tbf`` on each side of the
router (``wan`` egress: up, ``lan`` egress: down); loss is nftables ``numgen random``; the
one-way delay is a user-space stage (:mod:`.netlab_delay`) behind a TUN device that policy
routing sends every forwarded packet through.

Every name starts with the lab's id, ``wsnl-<pid>-<random>``: two labs never collide, and
:func:`cleanup_stale` finds what a killed lab left behind (its pid is gone) and removes it.
A lab is torn down by its context manager, by :meth:`Lab.close`, on SIGTERM (turned into
``SystemExit`` while a lab is up, when nothing else handles it), on Ctrl-C and at interpreter
exit. The delay stages and processes started with :meth:`Lab.popen` get SIGKILL from the
kernel if this process dies without tearing down (``PR_SET_PDEATHSIG``; it fires when the
thread that started them ends, so start labs from a long-lived thread).

Needs root, ``ip``, ``nft``, ``tc`` and ``/dev/net/tun`` (for delay); :func:`check_support`
says what is missing. The command line is ``python -m wanswarm.node.tools.netlab --help``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import NodeError
from . import netlab_delay, netlab_probe
from .netlab_topology import (
    BRIDGE_IF,
    DELAY_IF,
    DELAY_TABLE,
    HOST_IF,
    INTERNET_GATEWAY,
    LAN_IF,
    PUBLIC_NET,
    WAN_IF,
    HostPlan,
    Topology,
    has_delay_stage,
    plan,
    router_ruleset,
    tbf_args,
)

PREFIX = "wsnl"
LAB_ID_RE = re.compile(rf"^({PREFIX}-(\d+)-[0-9a-f]{{6}})(?:-|$)")
INET = "inet"  # the node (and namespace suffix) of the internet's bridge
COMMAND_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 3.0
LINK_POLL_S = 0.05
PR_SET_PDEATHSIG = 1


class LabError(NodeError):
    """The lab could not be built, or a command inside it failed."""


# --- support, ids and leftovers -----------------------------------------------------------


def check_support() -> str | None:
    """None when labs can be built here, else one line saying why not."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces): run it as root"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}: apt-get install iproute2 nftables"
    probe = f"{new_lab_id()}-probe"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
    if added.returncode != 0:
        reason = added.stderr.strip().splitlines()[-1:] or ["unknown error"]
        return f"cannot create network namespaces here ({reason[0]})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return None


def new_lab_id() -> str:
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"


def list_namespaces() -> list[str]:
    """Every named network namespace (``ip netns list``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def lab_namespaces() -> dict[str, list[str]]:
    """The namespaces of every lab present on this machine, by lab id."""
    labs: dict[str, list[str]] = {}
    for ns in list_namespaces():
        match = LAB_ID_RE.match(ns)
        if match:
            labs.setdefault(match.group(1), []).append(ns)
    return labs


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(*, include_live: bool = False) -> list[str]:
    """Remove the namespaces (and the processes in them) of labs whose process is gone.

    ``include_live`` removes every lab's, also those of running processes and this one's.
    Returns the namespaces removed.
    """
    removed = []
    for lab_id, namespaces in sorted(lab_namespaces().items()):
        match = LAB_ID_RE.match(lab_id)
        assert match is not None
        owner = int(match.group(2))
        if include_live or not pid_alive(owner):
            _destroy(namespaces)
            removed.extend(namespaces)
    return removed


def _destroy(namespaces: Sequence[str]) -> None:
    """Kill what runs in ``namespaces``, then delete them (missing ones are skipped)."""
    present = set(list_namespaces())
    for ns in namespaces:
        if ns not in present:
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    doomed = [ns for ns in namespaces if ns in present]
    if doomed:
        script = "".join(f"netns del {ns}\n" for ns in doomed)
        subprocess.run(["ip", "-force", "-batch", "-"], input=script, capture_output=True,
                       text=True, timeout=COMMAND_TIMEOUT_S)


# --- teardown on signals and exit ---------------------------------------------------------

_live: list[Lab] = []
_live_lock = threading.Lock()
_atexit_registered = False
_sigterm_installed = False


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _track(lab: Lab) -> None:
    global _atexit_registered, _sigterm_installed
    with _live_lock:
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        if (not _live and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_installed = True
        _live.append(lab)


def _untrack(lab: Lab) -> None:
    global _sigterm_installed
    with _live_lock:
        if lab in _live:
            _live.remove(lab)
        if (not _live and _sigterm_installed
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sigterm_installed = False


def _close_all() -> None:
    for lab in list(_live):
        lab.close()


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it ends."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved before any fork


def read_line(proc: subprocess.Popen[Any], timeout: float) -> str:
    """The next line ``proc`` writes to its stdout pipe, waiting at most ``timeout`` s.

    Reads the pipe's descriptor directly, a byte at a time, so that nothing is left in
    Python's buffer: ``proc.communicate()`` later gets the rest.
    """
    assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE"
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LabError(f"no line from {proc.args!r} within {timeout:g} s")
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        byte = os.read(fd, 1)
        if not byte:
            proc.wait(timeout=STOP_TIMEOUT_S)
            raise LabError(f"{proc.args!r} ended (status {proc.returncode}) before a line")
        if byte == b"\n":
            return line.decode()
        line += byte


def probe_argv(*args: str) -> list[str]:
    """The command line of a :mod:`.netlab_probe` program, to run inside a lab host."""
    return [sys.executable, netlab_probe.PATH, *args]


# --- the lab ------------------------------------------------------------------------------


class Lab:
    """One built topology. ``with Lab(topology) as lab:`` builds it and tears it down."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.plan = plan(topology)
        self.id = new_lab_id()
        self._procs: list[subprocess.Popen[Any]] = []
        self._delay_stages: dict[str, subprocess.Popen[Any]] = {}  # by router node
        self._created: list[str] = []
        self._closed = False

    # -- names and addresses --

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self.plan.hosts)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Hosts, routers (``r-<home>``) and ``inet``, the bridge: what exec/popen accept."""
        return (INET, *self.plan.hosts, *(r.node for r in self.plan.routers.values()))

    def netns(self, node: str) -> str:
        if node not in self.nodes:
            raise LabError(f"no node {node!r} in this lab (nodes: {', '.join(self.nodes)})")
        return f"{self.id}-{node}"

    def address(self, host: str) -> str:
        """The host's own address (a private one for a home host)."""
        return self._host(host).address

    def public_address(self, host: str) -> str:
        """The address hosts on the internet see: the router's for a home host."""
        return self._host(host).public_address

    def router(self, host: str) -> str | None:
        """The node of the router in front of ``host``; None for a public host."""
        home = self._host(host).home
        return None if home is None else self.plan.routers[home].node

    def _host(self, host: str) -> HostPlan:
        try:
            return self.plan.hosts[host]
        except KeyError:
            raise LabError(f"no host {host!r} (hosts: {', '.join(self.hosts)})") from None

    def describe(self) -> list[dict[str, Any]]:
        """One row per host: what people and ``--json`` are shown."""
        rows = []
        for host in self.plan.hosts.values():
            home = None if host.home is None else self.plan.routers[host.home].home
            rows.append({
                "host": host.name,
                "kind": "public" if home is None else "home",
                "netns": self.netns(host.name),
                "address": host.address,
                "public_address": host.public_address,
                "nat": None if home is None else home.nat,
                "link": None if home is None else home.link.describe(),
            })
        return rows

    # -- running things inside --

    def exec(self, node: str, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S,
             check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``node``'s namespace to completion (text output captured)."""
        cmd = ["ip", "netns", "exec", self.netns(node), *argv]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  input=input, stdin=None if input is not None else
                                  subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"{node}: {' '.join(argv)} ran past {timeout:g} s") from exc
        if check and done.returncode != 0:
            raise LabError(f"{node}: {' '.join(argv)} exited {done.returncode}: "
                           f"{done.stderr.strip()}")
        return done

    def popen(self, node: str, argv: Sequence[str], *, die_with_lab: bool = True,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``node``'s namespace; it is stopped when the lab is torn down.

        ``kwargs`` go to :class:`subprocess.Popen` (stdin defaults to /dev/null).
        """
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        if die_with_lab:
            kwargs["preexec_fn"] = _die_with_parent
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns(node), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def probe(self, node: str, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        """Run a :mod:`.netlab_probe` program in ``node`` and return its last JSON line."""
        done = self.exec(node, probe_argv(*args), timeout=timeout)
        lines = done.stdout.strip().splitlines()
        if not lines:
            raise LabError(f"{node}: probe {' '.join(args)} printed nothing ({done.stderr})")
        return json.loads(lines[-1])

    def probe_server(self, node: str, *args: str, timeout: float = READY_TIMEOUT_S
                     ) -> subprocess.Popen[Any]:
        """Start a :mod:`.netlab_probe` server in ``node``; returns once it is ``ready``."""
        proc = self.popen(node, probe_argv(*args), stdout=subprocess.PIPE)
        if read_line(proc, timeout) != "ready":
            raise LabError(f"{node}: probe {' '.join(args)} did not start")
        return proc

    def stop(self, proc: subprocess.Popen[Any]) -> int:
        """SIGTERM ``proc``, SIGKILL after a grace period; returns its exit status."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return proc.returncode

    # -- life cycle --

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Lab:
        """Build every namespace, link, rule and delay stage; on any failure, tear down."""
        _track(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process, delete every namespace. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            for proc in reversed(self._procs + list(self._delay_stages.values())):
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    self.stop(proc)
            _destroy(self._created)
        finally:
            _untrack(self)

    def alive(self) -> bool:
        """Whether every delay stage still runs (a dead one black-holes its home)."""
        return all(proc.poll() is None for proc in self._delay_stages.values())

    def _build(self) -> None:
        plan_ = self.plan
        routers = list(plan_.routers.values())
        if any(has_delay_stage(r.home.link) for r in routers) and not Path(
                "/dev/net/tun").exists():
            raise LabError("a delay needs /dev/net/tun (modprobe tun)")
        nodes = self.nodes
        self._created = [self.netns(n) for n in nodes]
        self._run(["ip", "-batch", "-"], "".join(f"netns add {ns}\n" for ns in self._created))
        for node in nodes:
            self._sysctls(node, router=node.startswith("r-"))
        inet = self.netns(INET)
        inet_lines = [
            "link set lo up",
            f"link add {BRIDGE_IF} type bridge",
            f"addr add {INTERNET_GATEWAY}/{PUBLIC_NET.prefixlen} dev {BRIDGE_IF}",
            f"link set {BRIDGE_IF} up",
        ]
        public = [h for h in plan_.hosts.values() if h.home is None]
        for i, host in enumerate(public):
            port = f"p{i}"
            self._ip(host.name, [
                "link set lo up",
                f"link add {HOST_IF} type veth peer name {port} netns {inet}",
                f"addr add {host.address}/{host.prefixlen} dev {HOST_IF}",
                f"link set {HOST_IF} up",
                f"route add default via {host.gateway}",
            ])
            inet_lines += [f"link set {port} master {BRIDGE_IF}", f"link set {port} up"]
        for k, router in enumerate(routers):
            port = f"r{k}"
            lines = [
                "link set lo up",
                f"link add {WAN_IF} type veth peer name {port} netns {inet}",
                f"addr add {router.wan_address}/{PUBLIC_NET.prefixlen} dev {WAN_IF}",
                f"link set {WAN_IF} up",
                f"route add default via {INTERNET_GATEWAY}",
                f"link add {LAN_IF} type bridge",
                f"addr add {router.lan_address}/{router.hosts[0].prefixlen} dev {LAN_IF}",
                f"link set {LAN_IF} up",
            ]
            for j, host in enumerate(router.hosts):
                lines += [
                    f"link add l{j} type veth peer name {HOST_IF} netns {self.netns(host.name)}",
                    f"link set l{j} master {LAN_IF}",
                    f"link set l{j} up",
                ]
            if has_delay_stage(router.home.link):
                lines += [
                    f"tuntap add dev {DELAY_IF} mode tun",
                    f"link set {DELAY_IF} up",
                    f"route add default dev {DELAY_IF} table {DELAY_TABLE}",
                    f"rule add iif {LAN_IF} lookup {DELAY_TABLE} pref 1000",
                    f"rule add iif {WAN_IF} lookup {DELAY_TABLE} pref 1001",
                ]
            self._ip(router.node, lines)
            inet_lines += [f"link set {port} master {BRIDGE_IF}", f"link set {port} up"]
            for host in router.hosts:
                self._ip(host.name, [
                    "link set lo up",
                    f"addr add {host.address}/{host.prefixlen} dev {HOST_IF}",
                    f"link set {HOST_IF} up",
                    f"route add default via {host.gateway}",
                ])
            self._run(["ip", "netns", "exec", self.netns(router.node), "nft", "-f", "-"],
                      router_ruleset(router))
            link = router.home.link
            if link.rate_mbit is not None:
                tbf = " ".join(tbf_args(link))
                self._run(["tc", "-n", self.netns(router.node), "-batch", "-"],
                          f"qdisc replace dev {WAN_IF} root {tbf}\n"
                          f"qdisc replace dev {LAN_IF} root {tbf}\n")
        self._ip(INET, inet_lines)
        for router in routers:
            if has_delay_stage(router.home.link):
                self._delay_stages[router.node] = subprocess.Popen(
                    ["ip", "netns", "exec", self.netns(router.node), sys.executable,
                     netlab_delay.__file__, "--dev", DELAY_IF,
                     "--delay-ms", f"{router.home.link.delay_ms:g}",
                     "--parent-pid", str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=_die_with_parent,
                )
        for stage in self._delay_stages.values():
            if read_line(stage, READY_TIMEOUT_S) != "ready":
                raise LabError(f"a delay stage did not start: {stage.args!r}")
        self._wait_links_ready()

    def delay_stage_pids(self) -> dict[str, int]:
        """The pid of each router's delay stage, by router node."""
        return {router: proc.pid for router, proc in self._delay_stages.items()}

    def delay_stage_packets(self, router: str) -> int:
        """Packets the router's delay stage has read from its TUN device so far."""
        link = self._json(["ip", "-n", self.netns(router), "-j", "-s", "link", "show", DELAY_IF])
        return int(link[0]["stats64"]["tx"]["packets"])

    def _wait_links_ready(self) -> None:
        """Wait until every link that is up carries traffic.

        The kernel brings a link's queueing discipline (and a bridge port) into service only
        when its link-watch work sees the carrier, which it batches up to a second after
        ``link set up`` (or after the delay stage attaches to its TUN device); until then
        the link silently drops what it is given. A lab is handed out only once every link
        is in service, so that its first packets are not lost.
        """
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = list(self.nodes)
        while waiting:
            waiting = [node for node in waiting if not self._links_ready(node)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise LabError(f"links of {', '.join(waiting)} not up within {READY_TIMEOUT_S} s")
            time.sleep(LINK_POLL_S)  # nothing to wait on: the kernel reports no such event

    def _links_ready(self, node: str) -> bool:
        # NO-CARRIER: the link-watch work has not run yet (LOWER_UP shows the carrier at
        # once, RUNNING follows only then); a bridge port forwards from that moment on
        links = self._json(["ip", "-n", self.netns(node), "-j", "link", "show"])
        if not all("NO-CARRIER" not in link.get("flags", ()) and link.get("qdisc") != "noop"
                   for link in links if "UP" in link.get("flags", ())):
            return False
        if node != INET and not node.startswith("r-"):
            return True
        ports = self._json(["bridge", "-n", self.netns(node), "-j", "link", "show"])
        return all(port.get("state") == "forwarding" for port in ports)

    def _json(self, argv: list[str]) -> Any:
        shown = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if shown.returncode != 0:
            raise LabError(f"{' '.join(argv)} failed: {shown.stderr.strip()}")
        return json.loads(shown.stdout or "[]")

    def _sysctls(self, node: str, *, router: bool) -> None:
        settings = [
            ("net/ipv6/conf/all/disable_ipv6", 1),  # IPv4 only: no DAD, no router solicits
            ("net/ipv6/conf/default/disable_ipv6", 1),
            ("net/bridge/bridge-nf-call-iptables", 0),  # bridged frames skip the IP hooks
            ("net/bridge/bridge-nf-call-ip6tables", 0),
            ("net/bridge/bridge-nf-call-arptables", 0),
        ]
        if router:
            settings += [
                ("net/ipv4/ip_forward", 1),
                # packets come back from the delay stage on its TUN device, not where the
                # route to their source points: reverse-path filtering would drop them
                ("net/ipv4/conf/all/rp_filter", 0),
                ("net/ipv4/conf/default/rp_filter", 0),
            ]
        script = "".join(
            f"if [ -e /proc/sys/{key} ]; then echo {value} > /proc/sys/{key}; fi\n"
            for key, value in settings
        )
        self._run(["ip", "netns", "exec", self.netns(node), "sh", "-ec", script])

    def _ip(self, node: str, lines: Sequence[str]) -> None:
        self._run(["ip", "-n", self.netns(node), "-batch", "-"], "".join(f"{ln}\n" for ln in lines))

    def _run(self, argv: Sequence[str], input: str | None = None) -> None:
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"{' '.join(argv)} ran past {COMMAND_TIMEOUT_S:g} s") from exc
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


if __name__ == "__main__":
    from .netlab_cli import main

    sys.exit(main())
