"""DHT records of a run: strict, versioned schemas and their signed envelope.

Keys (ARCHITECTURE §3), each a dictionary with one sub-key per peer, the sub-key being the
owner's peer id:

- ``{run}.servers`` -> :class:`ServerRecord`: state, stage, throughput, queue, QUIC address;
- ``{run}.rtt``     -> :class:`RttRecord`: the RTTs the owner measured to the peers it talks to.

A record's value is compact JSON (language-neutral, bounded by :data:`MAX_RECORD_BYTES`) with a
version ``v``. Readers accept the versions they know, drop newer ones (logged once) and drop
anything malformed (logged): a record from the network is data, never a crash.

Ownership: the stored value carries an Ed25519 signature by the key behind the sub-key's peer id
over (key id, sub-key, value, expiration); see :func:`signing_message`, :func:`seal`,
:func:`unseal`. The hivemind validator that applies them lives in dht.py (the adapter).

Withdrawal: hivemind keeps, per sub-key, the value with the latest expiration and refuses an
earlier one, so a record cannot be shortened. A leaving node therefore stores a tombstone,
state ``left``, with an expiration just past its last one; readers drop ``left`` records at
once and the tombstone itself expires within one record lifetime.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..errors import RecordError, UnsupportedRecordVersion

RECORD_VERSION: Final = 1
MAX_RECORD_BYTES = 8192
MAX_RTT_ENTRIES = 64
MAX_STAGES = 4096

PeerIdStr = Annotated[str, StringConstraints(pattern=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")]
# A node's lifecycle as its record announces it, the one vocabulary every module uses:
# joining (chose a stage, loading it; not serving yet), online, draining (leaving; no work
# is sent to it), left (the tombstone written on leave).
ServerState = Literal["joining", "online", "draining", "left"]
LISTED_STATES: frozenset[ServerState] = frozenset({"joining", "online", "draining"})


def servers_key(run: str) -> str:
    return f"{run}.servers"


def rtt_key(run: str) -> str:
    return f"{run}.rtt"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class QuicAddress(_Record):
    """Where a peer's QUIC endpoint listens."""

    host: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    port: int = Field(ge=1, le=65535)


NatKind = Literal["public", "cone", "symmetric", "unknown"]
MAX_LAN_ADDRESSES = 4


class PeerRef(_Record):
    """Another peer and its QUIC address (a rendezvous a NATed node keeps a connection to)."""

    peer_id: PeerIdStr
    quic: QuicAddress


class Reach(_Record):
    """How a peer can be reached (reachability.py measures it, docs/nat.md explains it).

    ``nat``: ``public`` (peers see our own interface address), ``cone`` (behind NAT, the same
    public mapping toward every peer), ``symmetric`` (a mapping per destination), ``unknown``
    (not measured yet). ``reachable``: a peer dialled our announced address from a port we had
    never sent to, and got through. ``lan``: our interface addresses, for peers behind the same
    NAT (home routers rarely hairpin). ``rendezvous``: the reachable peer we keep a connection
    to; peers that cannot dial us ask it to introduce them or to relay.
    """

    nat: NatKind = "unknown"
    reachable: bool = False
    lan: tuple[QuicAddress, ...] = Field(default=(), max_length=MAX_LAN_ADDRESSES)
    rendezvous: PeerRef | None = None


class OwnedRecord(_Record):
    """Fields every record starts with: schema version and owner (must equal the sub-key)."""

    v: Literal[1] = RECORD_VERSION
    peer_id: PeerIdStr


class ServerRecord(OwnedRecord):
    """One peer's entry under ``{run}.servers``."""

    state: ServerState
    stage: int | None = Field(default=None, ge=0, lt=MAX_STAGES)
    server: bool = True
    trainer: bool = True
    # rebalancing may move this server (false: pinned to its stage by the operator, node.stage)
    movable: bool = True
    throughput: float = Field(default=0.0, ge=0, le=1e12, allow_inf_nan=False)
    queue: int = Field(default=0, ge=0, le=1_000_000)
    quic: QuicAddress | None = None
    reach: Reach | None = None
    version: Annotated[str, StringConstraints(max_length=32)] = ""
    # the run spec's hash (runspec.RunSpec.run_id); empty: not announced yet
    run_id: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{16})?$")] = ""


class RttEntry(_Record):
    """RTTs the owner measured to one peer, milliseconds."""

    srtt_ms: float = Field(ge=0, le=600_000, allow_inf_nan=False)
    min_ms: float | None = Field(default=None, ge=0, le=600_000, allow_inf_nan=False)


class RttRecord(OwnedRecord):
    """One peer's entry under ``{run}.rtt``."""

    rtts: dict[PeerIdStr, RttEntry] = Field(default_factory=dict, max_length=MAX_RTT_ENTRIES)


R = TypeVar("R", bound=OwnedRecord)


@dataclass
class MembershipRead:
    """One complete read of a run's records: peer id -> (record, expiration) and peer id -> RTTs.

    ``dropped`` holds one reason (malformed, forged, unsupported_version) per record skipped.
    """

    servers: dict[str, tuple[ServerRecord, float]] = field(default_factory=dict)
    rtts: dict[str, RttRecord] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def encode_record(record: OwnedRecord) -> bytes:
    """The record's wire form: compact JSON. Raises RecordError when it exceeds the bound."""
    raw = record.model_dump_json().encode("utf-8")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{type(record).__name__} is {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    return raw


def decode_record(kind: type[R], raw: object) -> R:
    """Parse and validate a record from the network.

    Raises UnsupportedRecordVersion for a newer ``v`` and RecordError for anything else that
    does not match the schema (wrong type, oversize, extra or missing fields, bad values).
    """
    if not isinstance(raw, bytes):
        raise RecordError(f"record value is {type(raw).__name__}, not bytes")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"record is {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        head = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"record is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise RecordError("record is not a JSON object")
    version = head.get("v")
    if isinstance(version, int) and not isinstance(version, bool) and version > RECORD_VERSION:
        raise UnsupportedRecordVersion(f"record version {version} is newer than {RECORD_VERSION}")
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise RecordError(
            f"{kind.__name__} invalid: {where}: {first['msg']} ({exc.error_count()} errors)"
        ) from None


# --------------------------------------------------------------------------- signatures

SIGNATURE_MAGIC = b"\xffwss1"
SIGNATURE_BYTES = 64  # Ed25519
_DOMAIN = b"wanswarm dht record v1\x00"


def signing_message(key_id: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """What the owner signs: the record's DHT key id, sub-key, value and expiration.

    The expiration is signed so that nobody can extend (replay with a later expiration) or
    shorten someone else's record. Fields are length-prefixed so no two records share a message.
    """
    parts = [key_id, subkey, value]
    body = b"".join(struct.pack(">I", len(p)) + p for p in parts)
    return _DOMAIN + body + struct.pack(">d", expiration)


def seal(value: bytes, signature: bytes) -> bytes:
    """The stored form: the value, a marker and the 64-byte signature."""
    if len(signature) != SIGNATURE_BYTES:
        raise RecordError(f"signature must be {SIGNATURE_BYTES} bytes (got {len(signature)})")
    return value + SIGNATURE_MAGIC + signature


def unseal(blob: bytes) -> tuple[bytes, bytes]:
    """Split a stored value into (value, signature); RecordError if it carries no signature."""
    tail = len(SIGNATURE_MAGIC) + SIGNATURE_BYTES
    if len(blob) < tail or blob[-tail : -SIGNATURE_BYTES] != SIGNATURE_MAGIC:
        raise RecordError("record carries no signature")
    return blob[:-tail], blob[-SIGNATURE_BYTES:]
