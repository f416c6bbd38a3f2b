"""State transfer, the pure parts: errors, settings, the chunk plan, the wire messages and
manifest, donor grouping and the chunk scheduler. No clock and no sockets here; the donor
(``state_donor.py``) and the download (``state_transfer.py``, whose docstring describes the
protocol) pump them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from ...transport.codecs import WIRE_DTYPES, dtype_to_wire
from ...transport.endpoint import PeerAddress
from ...transport.errors import RemoteError
from ..errors import NodeError

STATE_VERSION: Final[int] = 1
MIN_CHUNK_BYTES: Final[int] = 4096
MAX_CHUNK_BYTES: Final[int] = 64 << 20
DEFAULT_CHUNK_BYTES: Final[int] = 4 << 20
MAX_TENSORS: Final[int] = 65536
MAX_CHUNKS: Final[int] = 1 << 20
MAX_MANIFEST_BYTES: Final[int] = 16 << 20
_MAX_BYTES: Final[int] = 1 << 50
PLANS_PER_SNAPSHOT: Final[int] = 4  # chunk sizes one snapshot is hashed for, at most
# No stage's epoch may exceed this (an epoch is at least one round of micro-batches across the
# swarm: 10^9 of them is decades of training). Manifests, chunk requests, checkpoints and
# import_state refuse more, so an absurd epoch never reaches the optimizer or hivemind's tracker.
MAX_EPOCH: Final[int] = 10**9
PREFIX_PATTERN: Final[str] = r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,47}$"


class StateTransferError(NodeError):
    """No donor could deliver the stage's state; the message names what was tried.

    ``quorum``: what the donors' manifests decided, when any were gathered before the
    download failed (None: no donor answered, or none could be asked)."""

    def __init__(self, message: str, *, quorum: QuorumDecision | None = None) -> None:
        super().__init__(message)
        self.quorum = quorum


class UntrustedStateError(StateTransferError):
    """Donors answered, but no state they offered can be trusted: none fits the stage's
    layout, none is held by a quorum of the reachable replicas, or its values are absurd."""


class StateErrorCode(StrEnum):
    """Error codes a donor answers with (``RemoteError.code``)."""

    BAD_REQUEST = "bad_request"  # malformed header, index out of range, tensors attached
    BUSY = "busy"  # too many chunk requests at once: retry later or elsewhere
    NOT_READY = "not_ready"  # the donor could not take a snapshot (still loading itself)
    PREPARING = "preparing"  # a snapshot is being taken (the stage's step is finishing): ask again
    UNKNOWN_SNAPSHOT = "unknown_snapshot"  # expired or evicted: fetch a new manifest
    GONE = "gone"  # the donor no longer serves this stage (it moved or is leaving)
    INTERNAL = "internal"  # the donor's own state cannot be sent (unsupported dtype, ...)


def refuse_state(code: StateErrorCode, message: str) -> RemoteError:
    return RemoteError(str(code), message[:300])


def manifest_kind(prefix: str) -> str:
    return f"{prefix}.manifest"


def chunk_kind(prefix: str) -> str:
    return f"{prefix}.chunk"


def stage_kind_prefix(stage: int) -> str:
    """The request-kind prefix under which the servers of ``stage`` donate its state."""
    return f"state.s{stage}"


def state_digest(data: Any) -> str:
    """BLAKE2b-256 of a buffer (hex)."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


# ---- configuration ----------------------------------------------------------------------


class StateTransferConfig(BaseModel):
    """Settings of both sides of state transfer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_bytes: int = Field(
        default=DEFAULT_CHUNK_BYTES, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES,
        description="Bytes per chunk of the flattened state (the last chunk may be shorter); "
        "a power of two.",
    )
    max_parallel_per_donor: int = Field(
        default=4, ge=1, le=64, description="Chunk requests in flight to one donor at once."
    )
    timeout_s: float = Field(
        default=600.0, gt=0.0, le=86400.0, description="Deadline of a whole download, seconds."
    )
    manifest_timeout_s: float = Field(
        default=30.0, gt=0.0, le=3600.0,
        description="Deadline of one manifest request (the donor snapshots and hashes its state).",
    )
    snapshot_wait_s: float = Field(
        default=2.0, ge=0.0, le=60.0,
        description="Donor: how long a manifest request waits for a snapshot being taken "
        "before it is answered 'preparing' (the snapshot goes on for the next request).",
    )
    snapshot_prepare_timeout_s: float = Field(
        default=300.0, gt=0.0, le=3600.0,
        description="Donor: a snapshot waits this long at most for the stage's background "
        "averaging round or delayed step to end (a snapshot is never taken during one).",
    )
    preparing_retry_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Client: pause before asking again a donor that answered 'preparing'.",
    )
    preparing_patience_s: float = Field(
        default=180.0, ge=0.0, le=3600.0,
        description="Client: how long to keep asking a donor that answers 'preparing' (it "
        "waits for its stage's averaging round: up to averaging.averaging_timeout, more for "
        "a hung one). Donors whose answer can no longer change the quorum are not waited for.",
    )
    chunk_timeout_s: float = Field(
        default=60.0, gt=0.0, le=3600.0,
        description="Deadline of one chunk request; past it the donor is banned from this "
        "download. Must cover chunk_bytes * max_parallel_per_donor at the slowest useful rate.",
    )
    max_state_bytes: int = Field(
        default=64 << 30, ge=0, le=_MAX_BYTES,
        description="Largest state a client accepts (it allocates the tensors up front).",
    )
    endgame_factor: float = Field(
        default=3.0, ge=1.0, le=100.0,
        description="When no chunk is left to hand out, an idle donor duplicates a chunk that "
        "another donor has held for this many times the median chunk time (a straggler).",
    )
    busy_backoff_s: float = Field(
        default=0.2, ge=0.0, le=60.0, description="Pause of a worker after a 'busy' answer."
    )
    max_busy: int = Field(
        default=50,
        ge=1,
        le=10000,
        description="'busy' answers in a row after which a donor is banned.",
    )
    open_refusals: int = Field(
        default=3, ge=0, le=100,
        description="An opening server whose donors answered without a state it can trust "
        "(no quorum holds one, or it fails the checks) asks again this many times, "
        "snapshot_reuse_s + preparing_retry_s apart, staying 'joining'; then it takes a "
        "stand-in: the state most donors hold at the lower median of their epochs, checked "
        "as a quorum's is (the per-step catch-up does the same after as many refusals).",
    )
    snapshot_reuse_s: float = Field(
        default=10.0, ge=0.0, le=3600.0,
        description="A donor hands its newest snapshot to a new downloader while it is younger "
        "than this instead of taking another (snapshots copy the whole state).",
    )
    snapshot_idle_ttl_s: float = Field(
        default=120.0, gt=0.0, le=86400.0,
        description="A retained snapshot no request touched for this long is dropped.",
    )
    snapshot_max_age_s: float = Field(
        default=3600.0,
        gt=0.0,
        le=86400.0,
        description="A retained snapshot is dropped at this age.",
    )
    max_retained: int = Field(
        default=2, ge=1, le=8,
        description="Snapshots a donor keeps at once. When all are in use, a new downloader "
        "gets the newest one rather than evicting one that is being downloaded.",
    )
    max_concurrent_chunks: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Chunk requests a donor serves at once; more are 'busy'.",
    )
    max_bytes_per_peer: float = Field(
        default=3.0,
        ge=1.0,
        le=100.0,
        description=(
            "Bytes one peer may fetch of one snapshot, in snapshot sizes (a download, "
            "its endgame duplicates and retries); past it that peer's chunk requests of "
            "the snapshot are 'busy', so no peer can make a donor copy its state over and "
            "over."
        ),
    )
    max_epoch_lead: int = Field(
        default=16, ge=0, le=MAX_EPOCH,
        description="How many epochs our own checkpoint may lead the state the stage's replicas "
        "gave on restart; one further ahead is passed over (a donor group's epoch is always "
        "its quorum's, the majority's).",
    )

    @model_validator(mode="after")
    def _power_of_two(self) -> StateTransferConfig:
        if not is_chunk_size(self.chunk_bytes):
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must be a power of two; donors serve no other "
                "sizes"
            )
        return self


def is_chunk_size(n: int) -> bool:
    """A chunk size donors serve: a power of two from MIN_CHUNK_BYTES to MAX_CHUNK_BYTES (a fixed
    set of 15, so that nobody can make a donor hash its state for arbitrary sizes)."""
    return MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES and n & (n - 1) == 0


# ---- the snapshot and its chunk plan (pure) ----------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A stage's state at one instant; ``Snapshot(*optimizer.export_state())``.

    The donor never copies ``tensors``: whoever builds a Snapshot must not modify them
    afterwards (export_state returns copies).
    """

    epoch: int
    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of tensor number ``tensor`` (manifest order)."""

    tensor: int
    start: int
    end: int


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of the flattened state, and the tensor pieces they cover."""

    index: int
    start: int
    end: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_chunks(nbytes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Cut the concatenation of tensors of ``nbytes`` bytes into chunks of ``chunk_bytes``.

    Every byte lies in exactly one chunk; zero-byte tensors lie in none.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if any(n < 0 for n in nbytes):
        raise ValueError("tensor sizes must be non-negative")
    offsets = [0]
    for n in nbytes:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    chunks: list[Chunk] = []
    t = 0
    for index, start in enumerate(range(0, total, chunk_bytes)):
        end = min(start + chunk_bytes, total)
        segments: list[Segment] = []
        pos = start
        while pos < end:
            while offsets[t + 1] <= pos:  # skip tensors that end before pos (and empty ones)
                t += 1
            stop = min(end, offsets[t + 1])
            segments.append(Segment(t, pos - offsets[t], stop - offsets[t]))
            pos = stop
        chunks.append(Chunk(index, start, end, tuple(segments)))
    return chunks


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def chunk_digests(views: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> list[str]:
    """The digest of each chunk of the state whose tensors' bytes are ``views``."""
    out = []
    for chunk in chunks:
        h = hashlib.blake2b(digest_size=32)
        for seg in chunk.segments:
            h.update(views[seg.tensor][seg.start : seg.end].numpy().data)
        out.append(h.hexdigest())
    return out


def gather_chunk(views: Sequence[torch.Tensor], chunk: Chunk) -> torch.Tensor:
    """The bytes of ``chunk`` as one uint8 tensor (a view when it lies in one tensor)."""
    parts = [views[s.tensor][s.start : s.end] for s in chunk.segments]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def scatter_chunk(views: Sequence[torch.Tensor], chunk: Chunk, data: torch.Tensor) -> None:
    """Write the bytes of ``chunk`` into the tensors' byte views."""
    pos = 0
    for s in chunk.segments:
        n = s.end - s.start
        views[s.tensor][s.start : s.end].copy_(data[pos : pos + n])
        pos += n


# ---- wire models --------------------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_Dim = Annotated[int, Field(ge=0, le=_MAX_BYTES)]
_Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
_Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]


def _chunk_size(n: int) -> int:
    if not is_chunk_size(n):
        raise ValueError(f"chunk_bytes {n} is not a power of two")
    return n


_ChunkBytes = Annotated[
    int, Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES), AfterValidator(_chunk_size)
]


class ManifestRequest(_Wire):
    """``{prefix}.manifest``: no tensors."""

    v: Literal[1] = Field(default=1, description="State transfer version (STATE_VERSION).")
    chunk_bytes: _ChunkBytes = Field(description="Chunk size (a power of two).")


class ManifestReply(_Wire):
    """Answer to ``{prefix}.manifest``: tensors ``[manifest JSON as uint8 (nbytes,)]``."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    nbytes: int = Field(ge=2, le=MAX_MANIFEST_BYTES, description="Bytes of the manifest JSON.")


class ChunkRequest(_Wire):
    """``{prefix}.chunk``: no tensors."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    epoch: _Epoch = Field(description="Epoch of the manifest this chunk belongs to.")
    snapshot_id: int = Field(ge=0, lt=2**63, description="Donor's id of that snapshot.")
    chunk_bytes: _ChunkBytes = Field(description="Plan's chunk size.")
    index: int = Field(ge=0, lt=MAX_CHUNKS, description="Chunk number in the plan.")


class ChunkReply(_Wire):
    """Answer to ``{prefix}.chunk``: tensors ``[chunk bytes as uint8 (nbytes,)]``."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    index: int = Field(ge=0, lt=MAX_CHUNKS, description="Chunk number.")
    nbytes: int = Field(ge=1, le=MAX_CHUNK_BYTES, description="Bytes of the chunk.")


class TensorEntry(_Wire):
    """One tensor of the state, in flattening order."""

    name: str = Field(min_length=1, max_length=512, description="State dict key.")
    dtype: str = Field(description="Wire dtype name (transport.codecs.WIRE_DTYPES).")
    shape: tuple[_Dim, ...] = Field(max_length=16, description="Tensor shape.")
    nbytes: int = Field(ge=0, le=_MAX_BYTES, description="Bytes: numel * itemsize.")

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype[:40]!r}")
        numel = math.prod(self.shape)
        if numel * WIRE_DTYPES[self.dtype].itemsize != self.nbytes:
            raise ValueError(f"{self.name[:60]!r}: nbytes does not match shape and dtype")
        return self


class Manifest(_Wire):
    """What one donor's snapshot holds, and how its chunks hash (travels as JSON)."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    epoch: _Epoch = Field(description="Optimizer epoch of the snapshot.")
    snapshot_id: int = Field(ge=0, lt=2**63, description="Donor's id of the snapshot.")
    chunk_bytes: _ChunkBytes = Field(description="Chunk size.")
    total_bytes: int = Field(ge=0, le=_MAX_BYTES, description="Bytes of the flattened state.")
    tensors: tuple[TensorEntry, ...] = Field(
        max_length=MAX_TENSORS, description="Tensors, in order."
    )
    digests: tuple[_Digest, ...] = Field(
        max_length=MAX_CHUNKS, description="BLAKE2b-256 per chunk."
    )
    meta: dict[str, Any] = Field(description="The optimizer's JSON meta.")

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("tensor names repeat")
        if sum(t.nbytes for t in self.tensors) != self.total_bytes:
            raise ValueError("total_bytes is not the sum of the tensors' bytes")
        if len(self.digests) != -(-self.total_bytes // self.chunk_bytes):
            raise ValueError("one digest per chunk is needed")
        return self

    def content_key(self) -> str:
        """Equal for snapshots whose bytes, layout and meta are equal (the snapshot id aside)."""
        return state_digest(self.model_dump_json(exclude={"snapshot_id"}).encode())

    def layout_key(self) -> str:
        """Equal for states that flatten the same way (tensors and chunk size)."""
        return state_digest(self.model_dump_json(include={"tensors", "chunk_bytes"}).encode())


@dataclass(frozen=True)
class DonorGroup:
    """Donors that hold the same snapshot content; they share one download."""

    manifest: Manifest
    members: tuple[tuple[PeerAddress, int], ...]  # (donor, its snapshot_id)


def group_manifests(manifests: Iterable[tuple[PeerAddress, Manifest]]) -> list[DonorGroup]:
    """Donors grouped by snapshot content: newest epoch first, then most donors."""
    groups: dict[str, list[tuple[PeerAddress, Manifest]]] = {}
    for donor, manifest in manifests:
        groups.setdefault(manifest.content_key(), []).append((donor, manifest))
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1][0][1].epoch, -len(kv[1]), kv[0]))
    return [
        DonorGroup(members[0][1], tuple((d, m.snapshot_id) for d, m in members))
        for _, members in ordered
    ]


# ---- trust: the stage's layout, the quorum (pure) -----------------------------------------

StateLayout = Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (wire dtype, shape)


def state_layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The layout of a state (``export_state``'s tensors): what a manifest must match."""
    return {name: (dtype_to_wire(t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def layout_mismatch(manifest: Manifest, expected: StateLayout) -> str | None:
    """Why the manifest's tensors are not exactly ``expected`` (names, dtypes, shapes), or None.

    Checked on the manifest alone, before anything is allocated: a donor naming a tensor the
    stage does not have, or one of another size, is refused without costing memory."""
    got = {e.name: (e.dtype, tuple(e.shape)) for e in manifest.tensors}
    missing = [n for n in expected if n not in got]
    unexpected = [n for n in got if n not in expected]
    wrong = [
        f"{n[:60]} {got[n][0]}{list(got[n][1])[:8]} (want {expected[n][0]}{list(expected[n][1])})"
        for n in expected
        if n in got and got[n] != expected[n]
    ]
    problems = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("mismatched", wrong)):
        if items:
            more = f" and {len(items) - 2} more" if len(items) > 2 else ""
            problems.append(f"{what} {', '.join(i[:120] for i in items[:2])}{more}")
    return "; ".join(problems) or None


def quorum_size(reachable: int) -> int:
    """Donors that must agree out of ``reachable``: a strict majority (2 of 2, 2 of 3, 3 of 4);
    a lone replica is its own quorum."""
    return reachable // 2 + 1


@dataclass(frozen=True)
class QuorumDecision:
    """Which donor group's state may be installed (``group``; None: none may)."""

    group: DonorGroup | None
    reachable: int  # donors whose manifest fits the stage
    needed: int
    median_epoch: int | None  # of the reachable donors (the lower median)
    outvoted: tuple[DonorGroup, ...]  # groups that must not serve
    reason: str  # why no group was chosen ("" when one was)


def describe_group(group: DonorGroup) -> str:
    ids = ", ".join(d.peer_id[:12] for d, _ in group.members[:4])
    more = f" and {len(group.members) - 4} more" if len(group.members) > 4 else ""
    return (
        f"epoch {group.manifest.epoch} digest {group.manifest.content_key()[:16]} "
        f"from {len(group.members)} donor(s) [{ids}{more}]"
    )


def choose_quorum(groups: Sequence[DonorGroup]) -> QuorumDecision:
    """The group held by a quorum of the reachable donors, or none.

    A group counts its donors by snapshot content (epoch, layout, chunk digests, meta: what
    ``group_manifests`` compares). It must hold a strict majority of the donors that answered
    with a manifest fitting the stage, so a single donor wins only when it is the only one
    reachable. The newest epoch no longer wins by itself: a peer with a valid identity cannot
    hand a newcomer a state, or an epoch, that no other replica vouches for. The chosen epoch
    is therefore the majority's (the median of the reachable donors' epochs), and every
    manifest's epoch is at most ``MAX_EPOCH`` (its schema).
    """
    reachable = sum(len(g.members) for g in groups)
    needed = quorum_size(reachable)
    if reachable == 0:
        return QuorumDecision(None, 0, needed, None, (), "no donor offered a state that fits")
    epochs = sorted(g.manifest.epoch for g in groups for _ in g.members)
    median = epochs[(reachable - 1) // 2]
    winner = next((g for g in groups if len(g.members) >= needed), None)
    offered = "; ".join(describe_group(g) for g in groups)
    if winner is None:
        reason = (
            f"no state is held by a quorum ({needed} of {reachable} reachable donors must "
            f"agree): {offered}"
        )
        return QuorumDecision(None, reachable, needed, median, tuple(groups), reason)
    others = tuple(g for g in groups if g is not winner)
    return QuorumDecision(winner, reachable, needed, median, others, "")


def choose_stand_in(decision: QuorumDecision) -> DonorGroup | None:
    """Where no quorum agrees (``decision.group`` None), the group to take anyway when the
    caller has waited long enough for one (a catch-up's backstop, an opening server's last
    resort): the groups at the lower median of the reachable donors' epochs (one donor, one
    vote, as the quorum counts them), of those the one held by most donors, ties to the
    lowest content digest. Every replica behind that hears the same donors picks the same
    one, so replicas whose bits drifted apart (honest ones, a round one of them missed)
    agree again after it. A donor claiming an epoch away from the others' median is not
    taken; among states at the median epoch, nothing tells an honest one from a forged one
    that fits the stage and passes the value checks: that is the exposure a stand-in adds
    (docs/hostile.md)."""
    if decision.group is not None or decision.median_epoch is None:
        return None
    at_median = [g for g in decision.outvoted if g.manifest.epoch == decision.median_epoch]
    if not at_median:
        return None
    return min(at_median, key=lambda g: (-len(g.members), g.manifest.content_key()))


# ---- the download schedule (pure) --------------------------------------------------------


class ChunkScheduler:
    """Which chunk each donor fetches next; sans-I/O (times are arguments).

    Donors pull work (``take``), so faster donors serve more chunks. When nothing is left
    to hand out, a donor may duplicate a chunk that one other donor has held for at least
    ``straggler_s`` ("endgame"), so a stalled donor holds up the last chunks for about
    that long instead of until its deadline, and a healthy tail is not fetched twice.
    ``ban`` re-offers a donor's in-flight chunks; accepted chunks stay done.
    """

    def __init__(self, n_chunks: int, donors: Iterable[str], *, done: Iterable[int] = ()) -> None:
        self.n_chunks = n_chunks
        self.donors = list(dict.fromkeys(donors))
        self.done: set[int] = set(done)
        self.banned: set[str] = set()
        self.in_flight: dict[int, dict[str, float]] = {}  # chunk -> {donor: since}
        self._pending = [i for i in range(n_chunks) if i not in self.done]
        heapq.heapify(self._pending)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.n_chunks

    @property
    def exhausted(self) -> bool:
        """Every donor is banned and chunks are missing."""
        return not self.complete and all(d in self.banned for d in self.donors)

    def take(self, donor: str, now: float, straggler_s: float) -> int | None:
        """The next chunk for ``donor`` to fetch, or None (nothing it can usefully do now)."""
        if donor in self.banned or donor not in self.donors:
            return None
        while self._pending:
            index = heapq.heappop(self._pending)
            if index not in self.done and not self.in_flight.get(index):
                self.in_flight[index] = {donor: now}
                return index
        stragglers = [
            (since, index)
            for index, holders in self.in_flight.items()
            if len(holders) == 1 and donor not in holders
            for since in holders.values()
            if now - since >= straggler_s
        ]
        if not stragglers:
            return None
        index = min(stragglers)[1]
        self.in_flight[index][donor] = now
        return index

    def next_straggler(self, donor: str, now: float, straggler_s: float) -> float | None:
        """Seconds until ``take`` may give ``donor`` a straggler, None if no chunk may become
        one."""
        waits = [
            since + straggler_s - now
            for holders in self.in_flight.values()
            if len(holders) == 1 and donor not in holders
            for since in holders.values()
        ]
        return max(0.0, min(waits)) if waits else None

    def accept(self, donor: str, index: int) -> bool:
        """A verified chunk arrived; True when it was not done yet."""
        self.in_flight.pop(index, None)
        if index in self.done:
            return False
        self.done.add(index)
        return True

    def release(self, donor: str, index: int) -> None:
        """``donor`` no longer fetches ``index`` (busy, failed, banned)."""
        holders = self.in_flight.get(index)
        if holders is None:
            return
        holders.pop(donor, None)
        if not holders:
            del self.in_flight[index]
            if index not in self.done:
                heapq.heappush(self._pending, index)

    def ban(self, donor: str) -> None:
        """``donor`` failed: it gets no more chunks and its in-flight ones are re-offered."""
        self.banned.add(donor)
        for index in [i for i, h in self.in_flight.items() if donor in h]:
            self.release(donor, index)
