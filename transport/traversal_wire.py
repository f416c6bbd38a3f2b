"""The messages of the built-in traversal requests, and the replay guard for introductions.

Each message is the JSON header of an ordinary request or response (framing.py): a
pydantic model, ``extra="forbid"``, every string bounded, peer ids checked to be Ed25519
node ids. A header that fails to parse is refused with ``bad_request``. The kinds::

    _observe       A -> any    {}                             -> {host, port}
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

Pure: no I/O; the replay guard takes ``now``.
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
    "RELAY",
    "RELAY_OFFER",
    "DialbackReply",
    "Empty",
    "Introduce",
    "Introduction",
    "ObservedReply",
    "RelayOffer",
    "RelayReply",
    "RelayRequest",
    "ReplayGuard",
    "parse",
]

OBSERVE = "_observe"
DIALBACK = "_dialback"
INTRODUCE = "_introduce"
INTRODUCTION = "_introduction"
RELAY = "_relay"
RELAY_OFFER = "_relay_offer"
BUILTIN_KINDS = (OBSERVE, DIALBACK, INTRODUCE, INTRODUCTION, RELAY, RELAY_OFFER)

NONCE_HEX = 32
TOKEN_HEX = 16
_HEX = r"^[0-9a-f]*$"


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
