"""Where and how to reach a peer: :class:`PeerAddress`.

The node learns a peer's address from its record and passes it to the endpoint; how the
endpoint connects follows from the two traversal fields (connections.py, traversal.py):
a ``reachable`` peer is dialled directly, an unreachable one through its ``rendezvous``
(connection reversal, hole punching, then a relay; docs/nat.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PeerAddress", "Resolver"]


@dataclass(frozen=True)
class PeerAddress:
    """A peer's id and QUIC address.

    ``reachable``: the peer's own dial-back found it reachable at ``host:port`` (a new
    connection from an unknown address got through). ``rendezvous``: a reachable peer
    that this one keeps a connection with, and accepts introductions and relaying
    through; None if it has none.
    """

    peer_id: str
    host: str
    port: int
    reachable: bool = True
    rendezvous: PeerAddress | None = None


# a kept peer's newest announced address by peer id (None: not known), asked before a re-dial
Resolver = Callable[[str], PeerAddress | None]
