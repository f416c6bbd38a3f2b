"""``wanswarm netcheck``: how peers of the swarm see this host, and what a volunteer may do.

Joins the run's DHT with a throwaway identity (the node's own stays untouched, so this runs
beside a daemon), reads the swarm's records, and asks reachable peers what a daemon's
reachability check asks (membership/reachability.py): the address they observe our QUIC
socket at, from two peers to tell a cone NAT from a symmetric one, and a dial-back from a
port we never sent to. Then one of them tries a TCP connection to our public address at the
DHT port (``dht.port``), which tells whether that port is forwarded. Prints the public
address, NAT kind, UDP and TCP reachability, the rendezvous or relay a daemon here would use,
and advice; ``--json`` prints one JSON object instead.

Exit status: 0 when a peer observed us, 1 when none answered (no peer, UDP blocked), 2 for
bad settings.
"""

from __future__ import annotations

import json
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from ...transport.endpoint import Endpoint, PeerAddress
from ...transport.errors import TransportError
from ...transport.identity import Identity
from ..config.node_config import NodeConfig
from ..endpoint import TCP_DIALBACK_KIND
from ..errors import NodeError
from ..membership.addresses import local_hosts
from ..membership.dht import Dht
from ..membership.peers import PeerTable
from ..membership.reachability import Reachability
from ..membership.records import QuicAddress, Reach
from ..service.statedir import load_identity


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


async def _tcp_dialback(
    endpoint: Endpoint, peer: PeerAddress, port: int, timeout: float
) -> bool | None:
    """Whether ``peer`` could open a TCP connection to our public address at ``port``; None
    when it would not say (an older node, a refusal)."""
    try:
        reply = await endpoint.request(
            peer, TCP_DIALBACK_KIND, {"port": port}, timeout=timeout + 2.0
        )
    except TransportError:
        return None
    value = reply.header.get("reachable")
    return value if isinstance(value, bool) else None


def advice(result: dict[str, Any]) -> list[str]:
    """What a volunteer here must (nothing) or may do, from a netcheck result."""
    if result["peers"] == 0:
        return [
            "No peer of this run is known: pass the swarm's address with --initial-peers "
            "(a running node prints it under 'dht' in 'wanswarm status'), and --run if the "
            "run is not the default one.",
        ]
    if result["observed"] is None:
        return [
            "No reachable peer answered. Check --initial-peers (wanswarm status on a running "
            "node prints them) and that outbound UDP is allowed.",
        ]
    udp, tcp = result["quic_port"], result["dht_port"]
    lan = result["lan"][0] if result["lan"] else "this host"
    forward = (
        f"Forward UDP {udp} (QUIC) and TCP {tcp} (DHT) on your router to {lan}, or enable "
        f"UPnP there (the DHT maps its TCP port by UPnP itself)"
        if tcp else f"Forward UDP {udp} (QUIC) on your router to {lan}"
    )
    if result["udp_reachable"]:
        lines = ["Nothing to do: peers dial this node directly."]
        if result["tcp_reachable"] is False and tcp:
            lines.append(f"The DHT's TCP port {tcp} is not reachable from outside: forward it "
                         "too, so that peers can open DHT connections to you.")
        return lines
    if result["nat"] == "cone":
        return [
            "Nothing to do: peers reach this node by UDP hole punching, introduced by the "
            f"rendezvous {result['rendezvous']}.",
            f"Optional: {forward}, so that peers dial you directly and you can serve as a "
            "rendezvous and relay for others.",
        ]
    if result["nat"] == "symmetric":
        return [
            "Works, slower: this NAT picks a new port for every destination, so peers that "
            f"cannot dial you go through the relay {result['rendezvous']}.",
            f"Recommended: {forward}; or, where the router offers it, an endpoint-independent "
            "('full cone', 'EIM') NAT mode.",
        ]
    if result["rendezvous"]:
        return [
            "Works: behind a NAT whose kind the check could not tell (a probe was lost), "
            f"peers reach this node through the rendezvous {result['rendezvous']} by hole "
            "punching or, failing that, a relay. Run netcheck again for the NAT kind.",
            f"Optional: {forward}, so that peers dial you directly.",
        ]
    return [f"Peers cannot dial this host and no rendezvous answered: {forward}."]


async def netcheck(config: NodeConfig, identity: Identity, dht: Dht) -> dict[str, Any]:
    """One check (module docstring) over ``dht`` (spawned, not yet ready); the result as a
    JSON-ready dict."""
    endpoint = Endpoint(identity, config.transport)
    host = config.transport.host
    port = config.transport.port
    if port and not _port_free(host, port):
        port = 0  # a daemon holds it: check from another port (the mapping may differ)
    try:
        await dht.wait_ready()
        read = await dht.read_membership()
        table = PeerTable(identity.peer_id)
        table.apply(read.servers, read.rtts, time.monotonic(), time.time())
        await endpoint.start(host, port)
        bound_host, bound_port = endpoint.address
        published: list[tuple[QuicAddress, Reach]] = []

        def hosts() -> list[str]:
            toward = [p.record.quic.host for p in table.peers() if p.record.quic is not None]
            return local_hosts(bound_host, toward)

        reach = Reachability(
            endpoint, table,
            local_hosts=hosts,
            bound_port=bound_port,
            publish=lambda quic, r: published.append((quic, r)),
            period_s=config.node.reach_period,
            timeout_s=config.node.reach_timeout,
            rng=random.Random(),
        )
        await reach.check()
        state = reach.state
        tcp_reachable = None
        rendezvous = None
        if published:
            _, announced = published[-1]
            if announced.rendezvous is not None:
                rendezvous = announced.rendezvous.peer_id
            observer = table.address(state.observers[0]) if state.observers else None
            if observer is not None and config.dht.port:
                tcp_reachable = await _tcp_dialback(
                    endpoint, observer, config.dht.port, config.node.reach_timeout
                )
        observed = state.observed
        return {
            "peers": len(table),
            "observed": None if observed is None else f"{observed[0]}:{observed[1]}",
            "nat": state.nat,
            "udp_reachable": state.reachable,
            "tcp_reachable": tcp_reachable,
            "rendezvous": rendezvous,
            "lan": [h for h in hosts() if not h.startswith("127.")],
            "quic_port": config.transport.port or bound_port,
            "checked_from_port": bound_port,
            "dht_port": config.dht.port,
        }
    finally:
        await endpoint.close()
        await dht.shutdown(config.dht.rpc_timeout)


def render(result: dict[str, Any]) -> str:
    tcp = {True: "yes", False: "no", None: "not checked"}[result["tcp_reachable"]]
    lines = [
        f"peers known       {result['peers']}",
        f"public address    {result['observed'] or 'unknown'}",
        f"NAT               {result['nat']}",
        f"UDP reachable     {'yes' if result['udp_reachable'] else 'no'}",
        f"TCP reachable     {tcp} (DHT port {result['dht_port'] or 'random'})",
        f"rendezvous/relay  {result['rendezvous'] or '-'}",
        f"LAN addresses     {', '.join(result['lan']) or '-'}",
    ]
    lines += [f"advice            {line}" if i == 0 else f"                  {line}"
              for i, line in enumerate(result["advice"])]
    return "\n".join(lines) + "\n"


def run_netcheck(config: NodeConfig, *, as_json: bool) -> int:
    """The ``wanswarm netcheck`` command; returns the exit status."""
    import uvloop

    with tempfile.TemporaryDirectory(prefix="wanswarm-netcheck-") as scratch:
        try:
            identity, identity_path = load_identity(Path(scratch))
            # a throwaway identity on a random DHT port; forked before the loop starts
            dht_config = config.dht.model_copy(update={"port": 0, "announce_maddrs": ()})
            dht = Dht.spawn(dht_config, config.node.run, identity, identity_path)
            try:
                result = uvloop.run(netcheck(config, identity, dht))
            finally:
                if dht.is_alive():
                    dht.shutdown_blocking()
        except (NodeError, TransportError) as exc:
            print(f"wanswarm netcheck: {exc}")
            return 1
    result["advice"] = advice(result)
    print(json.dumps(result) if as_json else render(result), end="\n" if as_json else "")
    return 0 if result["observed"] is not None else 1


__all__ = ["advice", "netcheck", "render", "run_netcheck"]
