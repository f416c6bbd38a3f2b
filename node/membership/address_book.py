"""Peers remembered across restarts: ``<state_dir>/peers.json``.

A node that restarts joins through ``dht.initial_peers``. A node started without any (the
swarm's first node, the compose file's bootstrap) or whose initial peers have all gone would
come back alone: its DHT has nobody to ask, the others' routing tables dropped it when it
died, and nothing makes them look again. The compose swarm showed it: a SIGKILLed bootstrap
restarted with its identity, address and checkpoint, and after three minutes it still knew 0
peers and its trainer waited for servers that were all running.

So the daemon keeps an address book, as Bitcoin's ``peers.dat`` and libp2p's peerstore do.
Every membership period it records the DHT addresses of the peers it is connected to that
are also members of its run, their membership records validated: a stranger that merely
connected is not remembered, so identities made up by the thousand cannot push the run's
members out. The file is written when a peer or an address is new, and otherwise once every
``SAVE_PERIOD_S`` to keep the dates fresh. On start the daemon dials the remembered peers
before it reads the swarm. Every ``SAVE_PERIOD_S / 2`` it dials its initial peers that it
is not connected to (a restarted bootstrap cannot dial a home behind NAT: the home dials
it), and, while it knows no member at all, the remembered peers and the peers connected
to it (node/daemon.py: ``_keep_address_book``). Dialing one is a libp2p connect plus a
DHT ping: a peer that answers puts us back in its routing table.

Bounds (the file can be edited by hand, and its addresses came from the network): at most
``MAX_PEERS`` peers, the most recently seen first; ``MAX_ADDRS`` addresses of at most
``MAX_ADDR_CHARS`` characters each per peer; a file over ``MAX_FILE_BYTES`` is ignored;
peers not seen for ``FORGET_AFTER_S`` are dropped. A missing or malformed file is an empty
book with a warning, never a reason not to start.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ..logs import get_logger
from ..service.statefiles import load_model, write_atomically

log = get_logger(__name__)

PEERS_FILE: Final = "peers.json"
MAX_PEERS: Final = 64
MAX_ADDRS: Final = 4
MAX_ADDR_CHARS: Final = 256
MAX_FILE_BYTES: Final = 128 * 1024
FORGET_AFTER_S: Final = 7 * 24 * 3600.0
SAVE_PERIOD_S: Final = 60.0
# peer ids are base58 (Ed25519 and RSA keys of libp2p: 46-53 characters)
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")
# a multiaddr of one of libp2p's transports this daemon dials, without a /p2p/ suffix
_ADDR = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/[^\s/]+/(tcp|udp)/\d{1,5}(/[^\s]*)?")

PeerIdStr = Annotated[str, StringConstraints(pattern=_PEER_ID.pattern)]
AddrStr = Annotated[str, StringConstraints(max_length=MAX_ADDR_CHARS)]


class KnownPeer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_id: PeerIdStr
    addrs: tuple[AddrStr, ...] = Field(min_length=1, max_length=MAX_ADDRS)
    last_seen_unix: float = Field(ge=0)


class PeersFile(BaseModel):
    """The file's content (version 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int = 1
    peers: tuple[KnownPeer, ...] = Field(default=(), max_length=MAX_PEERS)


def usable_addrs(addrs: Iterable[str]) -> tuple[str, ...]:
    """The addresses worth keeping for a peer: well-formed, direct ones before relayed ones,
    at most ``MAX_ADDRS``; a trailing ``/p2p/<id>`` is cut (the peer id is kept apart)."""
    kept: list[str] = []
    for addr in addrs:
        if not isinstance(addr, str) or len(addr) > MAX_ADDR_CHARS:
            continue
        if "/p2p-circuit" not in addr:
            head, sep, tail = addr.rpartition("/p2p/")
            if sep and _PEER_ID.fullmatch(tail):
                addr = head
        if _ADDR.fullmatch(addr) and addr not in kept:
            kept.append(addr)
    kept.sort(key=lambda a: "/p2p-circuit" in a)
    return tuple(kept[:MAX_ADDRS])


def load_peers(path: Path) -> PeersFile:
    found = load_model(path, PeersFile, MAX_FILE_BYTES, "no peers remembered")
    return found if found is not None else PeersFile()


class AddressBook:
    """The remembered peers of one state directory."""

    def __init__(self, state_dir: Path, own_peer_id: str) -> None:
        self.path = state_dir / PEERS_FILE
        self.own_peer_id = own_peer_id
        self._peers: dict[str, KnownPeer] = {
            p.peer_id: p for p in load_peers(self.path).peers if p.peer_id != own_peer_id
        }
        self._dirty = False

    def __len__(self) -> int:
        return len(self._peers)

    def remember(
        self, seen: Mapping[str, Sequence[str]], members: Iterable[str], now: float | None = None
    ) -> int:
        """Record the peers of ``seen`` (peer id -> addresses, as the DHT's libp2p daemon is
        connected to them) that are in ``members``. Returns how many were recorded."""
        now = time.time() if now is None else now
        wanted = set(members)
        recorded = 0
        for peer_id, addrs in seen.items():
            if peer_id == self.own_peer_id or peer_id not in wanted:
                continue
            if not _PEER_ID.fullmatch(peer_id):
                continue
            usable = usable_addrs(addrs)
            if not usable:
                continue
            before = self._peers.get(peer_id)
            if (before is None or before.addrs != usable
                    or now - before.last_seen_unix >= SAVE_PERIOD_S):
                self._dirty = True  # a new peer or address now, a fresher date once a period
            self._peers[peer_id] = KnownPeer(peer_id=peer_id, addrs=usable, last_seen_unix=now)
            recorded += 1
        self._prune(now)
        return recorded

    def candidates(
        self, connected: Iterable[str] = (), now: float | None = None, limit: int = MAX_PEERS
    ) -> list[tuple[str, tuple[str, ...]]]:
        """Remembered peers to dial, the most recently seen first, without ``connected``."""
        now = time.time() if now is None else now
        skip = set(connected)
        fresh = [
            p for p in self._peers.values()
            if p.peer_id not in skip and now - p.last_seen_unix <= FORGET_AFTER_S
        ]
        fresh.sort(key=lambda p: -p.last_seen_unix)
        return [(p.peer_id, p.addrs) for p in fresh[:limit]]

    def save(self) -> None:
        """Write the book (temporary file, fsync, rename) if it changed since the last save."""
        if not self._dirty:
            return
        peers = sorted(self._peers.values(), key=lambda p: -p.last_seen_unix)[:MAX_PEERS]
        content = PeersFile(peers=tuple(peers)).model_dump_json().encode()
        error = write_atomically(self.path, content)
        if error is None:
            self._dirty = False
        else:
            log.warning("cannot write %s: %s", self.path, error)

    def _prune(self, now: float) -> None:
        for peer_id in [
            p.peer_id for p in self._peers.values() if now - p.last_seen_unix > FORGET_AFTER_S
        ]:
            del self._peers[peer_id]
        if len(self._peers) > MAX_PEERS:
            self._dirty = True
            keep = sorted(self._peers.values(), key=lambda p: -p.last_seen_unix)[:MAX_PEERS]
            self._peers = {p.peer_id: p for p in keep}


def split_maddr(maddr: str) -> tuple[str, tuple[str, ...]] | None:
    """``(peer id, (address,))`` of one ``.../p2p/<id>`` multiaddr, or None."""
    head, sep, tail = maddr.rpartition("/p2p/")
    if not sep or not _PEER_ID.fullmatch(tail):
        return None
    usable = usable_addrs([head])
    return (tail, usable) if usable else None
