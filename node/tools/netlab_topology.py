"""The network lab's topology: what people declare, the address plan and the router rules.

Pure data and text, no I/O: :mod:`netlab` turns a :class:`Plan` into namespaces, links and
processes. A topology is public hosts on one bridge (the "internet") and homes, each a
router namespace doing NAT for one or more hosts on its own LAN::

    public host 11.0.0.10 ─┐
    public host 11.0.0.11 ─┤ bridge br0 (11.0.0.1/15: the default gateway of the
                             │ internet; it forwards nothing, so the rest of the world
                             │ does not answer)
    router wan 11.1.0.10 ──┘
      │ NAT (cone or symmetric), tbf each way, random loss, user-space delay stage
    router lan 192.168.1.1/24 ── home host 192.168.1.2

Public and router addresses come from 11.0.0.0/15 and live only inside the lab's
namespaces (which route nowhere else). They must be addresses libp2p takes for public ones:
on the reserved ranges (RFC 2544's 198.18.0.0/15, the documentation ranges) its identify
protocol keeps no address of a peer, and hivemind's averaging then finds no one (docs/nat.md).

A topology is built from Python, command-line flags or TOML::

    [[public]]
    name = "boot"

    [[home]]
    name = "alice"
    nat = "cone"          # or "symmetric"
    delay_ms = 25         # one-way, each direction
    loss = 0.01           # each direction
    rate_mbit = 100       # each direction
    hosts = ["alice"]     # the default: one host named like the home
    lan = "192.168.1.0/24"
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NAT_KINDS = ("cone", "symmetric")
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,19}$")
RESERVED_NAMES = frozenset({"inet"})  # the bridge namespace's suffix

# Interface names, each unique within its namespace only (nothing is created in the root one).
HOST_IF = "eth0"
BRIDGE_IF = "br0"  # the internet's bridge, in the inet namespace
WAN_IF = "wan"
LAN_IF = "lan"  # the router's LAN bridge
DELAY_IF = "dly"  # the TUN device of the router's delay stage
DELAY_TABLE = 100  # the routing table that sends forwarded packets through the delay stage

PUBLIC_NET = ipaddress.IPv4Network("11.0.0.0/15")
INTERNET_GATEWAY = ipaddress.IPv4Address("11.0.0.1")
PUBLIC_HOSTS_FROM = ipaddress.IPv4Address("11.0.0.10")
ROUTERS_FROM = ipaddress.IPv4Address("11.1.0.10")
MAX_PUBLIC = 60000  # public hosts and routers each stay inside their half of the /15

LOSS_SCALE = 1_000_000  # loss is drawn as `numgen random mod LOSS_SCALE < loss * LOSS_SCALE`
MIN_TBF_BURST_BYTES = 3200  # two full Ethernet frames: tbf drops frames larger than its burst
TBF_BURST_S = 0.004  # burst = 4 ms of the rate, so that timer slack does not cap the rate


class TopologyError(ValueError):
    """A topology that cannot be built; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Link:
    """How a home's uplink is shaped, the same in both directions.

    ``delay_ms`` is the one-way propagation delay that the router's delay stage adds to each
    packet, each way (a home host's round trip to a public host is ``2 * delay_ms``, to a
    host of another home ``4 * delay_ms`` when both homes have it). ``loss`` is the chance
    that a packet is dropped, drawn independently for each packet in each direction.
    ``rate_mbit`` is the tbf rate each way (None: unlimited) and ``queue_ms`` the longest a
    packet may wait in the rate limiter's queue before tbf drops it.
    """

    delay_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None
    queue_ms: float = 50.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_ms <= 10_000.0:
            raise TopologyError(f"delay_ms: 0 to 10000 (got {self.delay_ms})")
        if not 0.0 <= self.loss < 1.0:
            raise TopologyError(f"loss: a probability, 0 <= loss < 1 (got {self.loss})")
        if self.rate_mbit is not None and not 0.01 <= self.rate_mbit <= 100_000.0:
            raise TopologyError(f"rate_mbit: 0.01 to 100000, or unset (got {self.rate_mbit})")
        if not 1.0 <= self.queue_ms <= 10_000.0:
            raise TopologyError(f"queue_ms: 1 to 10000 (got {self.queue_ms})")

    def describe(self) -> str:
        parts = []
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g} ms")
        if self.loss:
            parts.append(f"{self.loss * 100:g}% loss")
        if self.rate_mbit is not None:
            parts.append(f"{self.rate_mbit:g} Mb/s")
        return ", ".join(parts) or "unshaped"


@dataclass(frozen=True)
class Home:
    """A router namespace doing NAT for ``hosts`` (default: one host named like the home)."""

    name: str
    nat: str = "cone"
    link: Link = field(default_factory=Link)
    hosts: tuple[str, ...] = ()
    lan: str | None = None  # an IPv4 network; None: 192.168.<index + 1>.0/24

    def __post_init__(self) -> None:
        _check_name(self.name, "home name")
        if self.nat not in NAT_KINDS:
            raise TopologyError(f"home {self.name}: nat is one of {NAT_KINDS} (got {self.nat!r})")
        for host in self.hosts:
            _check_name(host, f"home {self.name}: host name")
        if self.lan is not None:
            try:
                net = ipaddress.IPv4Network(self.lan)
            except ValueError as exc:
                raise TopologyError(f"home {self.name}: lan is an IPv4 network ({exc})") from exc
            if net.num_addresses < len(self.host_names) + 4:
                raise TopologyError(f"home {self.name}: lan {net} is too small for its hosts")
            if net.overlaps(PUBLIC_NET):
                raise TopologyError(f"home {self.name}: lan must not overlap {PUBLIC_NET}")

    @property
    def host_names(self) -> tuple[str, ...]:
        return self.hosts or (self.name,)


@dataclass(frozen=True)
class Topology:
    public: tuple[str, ...] = ()
    homes: tuple[Home, ...] = ()

    def __post_init__(self) -> None:
        for name in self.public:
            _check_name(name, "public host name")
        hosts = [*self.public, *(h for home in self.homes for h in home.host_names)]
        duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
        if duplicates:
            raise TopologyError(f"host names must be unique (repeated: {', '.join(duplicates)})")
        homes = [home.name for home in self.homes]
        if len(set(homes)) != len(homes):
            raise TopologyError("home names must be unique")
        if not hosts:
            raise TopologyError("a topology needs at least one host")
        if len(self.public) > MAX_PUBLIC or len(self.homes) > min(MAX_PUBLIC, 254):
            raise TopologyError(f"at most {MAX_PUBLIC} public hosts and 254 homes")


def _check_name(name: str, what: str) -> None:
    if not NAME_RE.match(name) or name in RESERVED_NAMES:
        raise TopologyError(
            f"{what}: 1-20 lowercase letters and digits, starting with a letter, not 'inet'"
            f" (got {name!r})"
        )


# --- the address plan --------------------------------------------------------------------


@dataclass(frozen=True)
class HostPlan:
    name: str
    home: str | None  # None: a public host
    address: str
    prefixlen: int
    gateway: str
    public_address: str  # what hosts on the internet see: the router's WAN address for a home


@dataclass(frozen=True)
class RouterPlan:
    home: Home
    node: str  # "r-<home>", the router's node and namespace suffix
    wan_address: str
    lan_network: str
    lan_address: str
    hosts: tuple[HostPlan, ...]


@dataclass(frozen=True)
class Plan:
    topology: Topology
    hosts: dict[str, HostPlan]
    routers: dict[str, RouterPlan]  # by home name


def router_node(home: str) -> str:
    return f"r-{home}"


def plan(topology: Topology) -> Plan:
    """Assign every address of ``topology`` (deterministic: same topology, same addresses)."""
    hosts: dict[str, HostPlan] = {}
    routers: dict[str, RouterPlan] = {}
    for i, name in enumerate(topology.public):
        address = str(PUBLIC_HOSTS_FROM + i)
        hosts[name] = HostPlan(
            name, None, address, PUBLIC_NET.prefixlen, str(INTERNET_GATEWAY), address
        )
    for k, home in enumerate(topology.homes):
        wan = str(ROUTERS_FROM + k)
        lan = ipaddress.IPv4Network(home.lan or f"192.168.{k + 1}.0/24")
        members = tuple(
            HostPlan(name, home.name, str(lan.network_address + 2 + j), lan.prefixlen,
                     str(lan.network_address + 1), wan)
            for j, name in enumerate(home.host_names)
        )
        for member in members:
            hosts[member.name] = member
        routers[home.name] = RouterPlan(
            home, router_node(home.name), wan, str(lan), str(lan.network_address + 1), members
        )
    return Plan(topology, hosts, routers)


# --- what the router namespace runs ------------------------------------------------------


def has_delay_stage(link: Link) -> bool:
    return link.delay_ms > 0.0


def router_ruleset(router: RouterPlan) -> str:
    """The router's nftables ruleset (``nft -f``): NAT, a stateful firewall and random loss.

    Without a delay stage a forwarded packet crosses the forward hook once. With one, it
    crosses it twice: LAN -> TUN, then TUN -> WAN after the delay (and the reverse inbound),
    because the policy routes send whatever arrives on ``lan`` or ``wan`` to the TUN device.
    Conntrack must see each flow only on its WAN leg: a flow first seen on the LAN -> TUN leg
    would be confirmed there without NAT (masquerade matches ``oifname wan`` only), and the
    TUN -> WAN leg would then reuse that entry, unmasqueraded. So the legs between the LAN
    and the TUN device are ``notrack``, loss is drawn once (on the way into the TUN device),
    and only the WAN legs are tracked and NATed.
    """
    link = router.home.link
    masquerade = "masquerade random,fully-random" if router.home.nat == "symmetric" else (
        "masquerade"
    )
    delayed = has_delay_stage(link)
    loss = ""
    if link.loss > 0.0:
        threshold = max(1, round(link.loss * LOSS_SCALE))
        where = f'oifname "{DELAY_IF}" ' if delayed else ""
        loss = f"\t\t{where}numgen random mod {LOSS_SCALE} < {threshold} drop\n"
    raw = ""
    new_outbound = f'iifname "{LAN_IF}" oifname "{WAN_IF}" accept'
    if delayed:
        raw = (
            f'\t\tiifname "{LAN_IF}" notrack\n'
            f'\t\tiifname "{DELAY_IF}" ip daddr {router.lan_network} notrack\n'
        )
        new_outbound = f'iifname "{DELAY_IF}" oifname "{WAN_IF}" accept'
    return (
        "table ip netlab {\n"
        "\tchain raw_prerouting {\n"
        "\t\ttype filter hook prerouting priority raw; policy accept;\n"
        f"{raw}"
        "\t}\n"
        "\tchain filter_forward {\n"
        "\t\ttype filter hook forward priority filter; policy drop;\n"
        f"{loss}"
        "\t\tct state untracked accept\n"
        "\t\tct state established,related accept\n"
        f"\t\t{new_outbound}\n"
        "\t}\n"
        "\tchain filter_input {\n"
        "\t\ttype filter hook input priority filter; policy accept;\n"
        f'\t\tiifname "{WAN_IF}" ct state established,related accept\n'
        f'\t\tiifname "{WAN_IF}" drop\n'  # a home router answers nothing unsolicited
        "\t}\n"
        "\tchain nat_prerouting {\n"
        "\t\ttype nat hook prerouting priority dstnat; policy accept;\n"
        "\t}\n"
        "\tchain nat_postrouting {\n"
        "\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
        f'\t\toifname "{WAN_IF}" {masquerade}\n'
        "\t}\n"
        "}\n"
    )


def tbf_args(link: Link) -> list[str]:
    """``tc qdisc replace dev DEV root`` + these: the rate limiter of one direction."""
    assert link.rate_mbit is not None
    rate_bit = round(link.rate_mbit * 1e6)
    burst = max(MIN_TBF_BURST_BYTES, round(rate_bit / 8 * TBF_BURST_S))
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency",
            f"{link.queue_ms:g}ms"]


# --- topologies from TOML and flags -------------------------------------------------------


def from_mapping(data: Mapping[str, Any]) -> Topology:
    """A topology from TOML's shape: ``[[public]]`` and ``[[home]]`` tables (module doc)."""
    unknown = set(data) - {"public", "home"}
    if unknown:
        raise TopologyError(f"unknown top-level keys {sorted(unknown)}: use [[public]], [[home]]")
    public = []
    for entry in _tables(data, "public"):
        _only(entry, {"name"}, "[[public]]")
        public.append(str(entry.get("name", "")))
    homes = []
    for entry in _tables(data, "home"):
        _only(entry, {"name", "nat", "delay_ms", "loss", "rate_mbit", "queue_ms", "hosts", "lan"},
              "[[home]]")
        link_keys = ("delay_ms", "loss", "rate_mbit", "queue_ms")
        try:
            link = Link(**{k: float(entry[k]) for k in link_keys if k in entry})
            hosts = tuple(str(h) for h in entry.get("hosts", ()))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, TopologyError):
                raise
            raise TopologyError(f"[[home]] {entry.get('name')!r}: {exc}") from exc
        lan = entry.get("lan")
        homes.append(Home(str(entry.get("name", "")), str(entry.get("nat", "cone")), link,
                          hosts, None if lan is None else str(lan)))
    return Topology(tuple(public), tuple(homes))


def from_toml(text: str) -> Topology:
    try:
        return from_mapping(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"not TOML: {exc}") from exc


def _tables(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise TopologyError(f"{key}: an array of tables ([[{key}]])")
    return value


def _only(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise TopologyError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def from_flags(public: Sequence[str], homes: Sequence[str], link: Link) -> Topology:
    """``--public NAME`` and ``--home NAME[:cone|symmetric]``, every home with ``link``."""
    built = []
    for spec in homes:
        name, _, nat = spec.partition(":")
        built.append(Home(name, nat or "cone", link))
    return Topology(tuple(public), tuple(built))
