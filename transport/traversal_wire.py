"""The messages of the built-in traversal requests, the replay guard for introductions, and
the probe packets and table of the observer's alternate port.

Each message is the JSON header of an ordinary request or response (framing.py): a
pydantic model, ``extra="forbid"``, every string bounded, peer ids checked to be Ed25519
node ids. A header that fails to parse is refused with ``bad_request``. The kinds::

    _observe       A -> any    {}                             -> {host, port, alt_port}
    _observe_probe A -> any    {nonce}                        -> {host, port}
    _dialback      A -> any    {}                             -> {reachable}
    _introduce     A -> R      {target, reachable}            -> {host, port}
    _introduction  R -> B      {peer, host, port, reachable,  -> {}
                                nonce, ts}
    _relay         A -> R      {target}                       -> {token}
    _relay_offer   R -> B      {peer, token, nonce, ts}       -> {}

``host, port`` in replies are addresses as the answering node sees them (the UDP source of
the connection); nobody names an address for someone else to send to. ``nonce`` is 16
random bytes in hex, ``ts`` the rendezvous' wall clock (seconds since the epoch); the
target refuses an introduction or offer older than its window, or one whose nonce it has
seen (:class:`ReplayGuard`). ``token`` is a relay channel's 8-byte token in hex (relay.py).

The alternate port (a STUN-style "change port" test, RFC 5780 §4.3, with one observer):
``alt_port`` is a second UDP port of the observer's host, or null when it has none. The
requester sends a few probe packets from its QUIC socket to it, then asks ``_observe_probe``
with their 16-byte ``nonce`` (hex) which source address they came from. A NAT that maps
per destination gives the probes another mapping than the QUIC connection. The alternate
port only receives (:class:`ProbeTable` remembers nonce -> source), it never sends::

    probe packet = 0x23 | nonce[16]

(not QUIC: the fixed bit 0x40 and the long-header bit 0x80 are clear, as in relay.py's
relay and punch packets).

Pure: no I/O; the replay guard and the probe table take ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import IdentityError, RemoteError
from .identity import public_key_from_peer_id

__all__ = [
    "BUILTIN_KINDS",
    "DIALBACK",
    "INTRODUCE",
    "INTRODUCTION",
    "OBSERVE",
    "OBSERVE_PROBE",
    "PROBE_BYTE",
    "PROBE_BYTES",
    "PROBE_NONCE_BYTES",
    "RELAY",
    "RELAY_OFFER",
    "DialbackReply",
    "Empty",
    "Introduce",
    "Introduction",
    "ObserveReply",
    "ObservedReply",
    "ProbeQuery",
    "ProbeTable",
    "RelayOffer",
    "RelayReply",
    "RelayRequest",
    "ReplayGuard",
    "decode_probe",
    "encode_probe",
    "parse",
]

OBSERVE = "_observe"
OBSERVE_PROBE = "_observe_probe"
DIALBACK = "_dialback"
INTRODUCE = "_introduce"
INTRODUCTION = "_introduction"
RELAY = "_relay"
RELAY_OFFER = "_relay_offer"
BUILTIN_KINDS = (OBSERVE, OBSERVE_PROBE, DIALBACK, INTRODUCE, INTRODUCTION, RELAY, RELAY_OFFER)

NONCE_HEX = 32
PROBE_BYTE = 0x23
PROBE_NONCE_BYTES = 16
PROBE_BYTES = 1 + PROBE_NONCE_BYTES
TOKEN_HEX = 16
_HEX = r"^[0-9a-f]*$"

Address = tuple[str, int]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def _peer_id(value: str) -> str:
    try:
        public_key_from_peer_id(value)
    except (IdentityError, ValueError) as exc:
        raise ValueError("not a peer id") from exc
    return value


class Empty(_Message):
    """A request with no fields (``_observe``, ``_dialback``)."""


class _Host(_Message):
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)


class ObservedReply(_Host):
    """Our address as the answering peer sees it."""


class ObserveReply(_Host):
    """``_observe``: our address as the answering peer sees it, and the peer's alternate
    port (null: it has none) for an ``_observe_probe``."""

    alt_port: int | None = Field(default=None, ge=1, le=65535)


class ProbeQuery(_Message):
    """A -> observer: from which address did the probe packets with ``nonce`` come?"""

    nonce: str = Field(min_length=NONCE_HEX, max_length=NONCE_HEX, pattern=_HEX)


class DialbackReply(_Message):
    reachable: bool


class Introduce(_Message):
    """A -> R: introduce me to ``target``; ``reachable``: a connection to me gets through."""

    target: str = Field(min_length=1, max_length=64)
    reachable: bool

    _check_target = field_validator("target")(_peer_id)


class Introduction(_Host):
    """R -> B: ``peer`` wants you; R sees it at ``host:port``."""

    peer: str = Field(min_length=1, max_length=64)
    reachable: bool
    nonce: str = Field(min_length=NONCE_HEX, max_length=NONCE_HEX, pattern=_HEX)
    ts: float

    _check_peer = field_validator("peer")(_peer_id)


class RelayRequest(_Message):
    """A -> R: open a relay channel to ``target``."""

    target: str = Field(min_length=1, max_length=64)

    _check_target = field_validator("target")(_peer_id)


class RelayOffer(_Message):
    """R -> B: ``peer`` asks for a relay channel; yours has ``token``."""

    peer: str = Field(min_length=1, max_length=64)
    token: str = Field(min_length=TOKEN_HEX, max_length=TOKEN_HEX, pattern=_HEX)
    nonce: str = Field(min_length=NONCE_HEX, max_length=NONCE_HEX, pattern=_HEX)
    ts: float

    _check_peer = field_validator("peer")(_peer_id)


class RelayReply(_Message):
    """R -> A: your end of the channel has ``token``."""

    token: str = Field(min_length=TOKEN_HEX, max_length=TOKEN_HEX, pattern=_HEX)


M = TypeVar("M", bound=_Message)


def parse(model: type[M], header: dict[str, Any]) -> M:
    """The message in a request or response header; RemoteError ``bad_request`` if it is
    not one (the handlers' refusal, sent back to the requester)."""
    try:
        return model.model_validate(header)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "header"
        raise RemoteError("bad_request", f"{model.__name__}: {where}: {first['msg']}") from None


class ReplayGuard:
    """Refuses introductions that are stale or seen before.

    A message is fresh if its ``ts`` is within ``max_age_s`` of ``now`` (either side:
    clocks differ); its nonce is then remembered until it could no longer be fresh.
    At most ``max_entries`` nonces are held, the oldest forgotten first: the callers'
    rate limits keep fewer than that inside one window.
    """

    def __init__(self, max_age_s: float, max_entries: int = 4096) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, nonce: str, ts: float, now: float) -> str | None:
        """None if fresh (and now seen); else the refusal code, ``stale`` or ``replayed``."""
        while self._seen:
            oldest, until = next(iter(self._seen.items()))
            if until > now:
                break
            del self._seen[oldest]
        if not abs(now - ts) <= self.max_age_s:  # also refuses NaN
            return "stale"
        if nonce in self._seen:
            return "replayed"
        self._seen[nonce] = now + 2 * self.max_age_s
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return None


def encode_probe(nonce: bytes) -> bytes:
    if len(nonce) != PROBE_NONCE_BYTES:
        raise ValueError(f"a probe nonce is {PROBE_NONCE_BYTES} bytes")
    return bytes([PROBE_BYTE]) + nonce


def decode_probe(data: bytes) -> bytes | None:
    """The nonce of a probe packet; None for anything else (wrong kind or length)."""
    if len(data) != PROBE_BYTES or data[0] != PROBE_BYTE:
        return None
    return bytes(data[1:])


class ProbeTable:
    """Which source address each probe nonce came from, at the alternate port.

    The first source of a nonce is kept (a nonce is the requester's secret, so a second
    source is a copy or a forgery); an entry lives ``ttl_s`` and is forgotten once looked
    up. At most ``max_entries`` are held, the oldest forgotten first: a flood of probes
    costs bounded memory and at worst makes a lookup come back empty.
    """

    def __init__(self, max_entries: int = 1024, ttl_s: float = 30.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._seen: OrderedDict[bytes, tuple[Address, float]] = OrderedDict()

    def record(self, nonce: bytes, source: Address, now: float) -> bool:
        """Remember ``source`` for ``nonce``; False if the nonce was already known."""
        self._expire(now)
        if nonce in self._seen:
            return False
        self._seen[nonce] = (source, now + self.ttl_s)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return True

    def take(self, nonce: bytes, now: float) -> Address | None:
        """The source recorded for ``nonce`` (and forget it); None if there is none."""
        self._expire(now)
        entry = self._seen.pop(nonce, None)
        return None if entry is None else entry[0]

    def _expire(self, now: float) -> None:
        while self._seen:
            _, (_, until) = next(iter(self._seen.items()))
            if until > now:
                break
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)
