"""State transfer: a peer that joins or moves downloads its stage's state from the stage's peers.

A stage's state is what the stage optimizer exports (``export_state() -> (epoch, tensors,
meta)``): an epoch, ordered named tensors (parameters and optimizer buffers) and JSON meta.
Every server of a stage runs a :class:`StateDonor`; a newcomer calls :func:`download_state`
with the addresses of the stage's servers. Two request kinds per stage (docs/state_transfer.md)::

    {prefix}.manifest  {v, chunk_bytes}                  -> [manifest JSON as uint8]
    {prefix}.chunk     {v, epoch, snapshot_id,           -> [chunk bytes as uint8]
                        chunk_bytes, index}

The flattened state is the tensors' raw bytes concatenated in manifest order; chunk ``i``
is the byte range ``[i * chunk_bytes, min((i + 1) * chunk_bytes, total))`` of it, so a
large tensor splits over several chunks and small ones share one. The manifest lists the
tensors (name, dtype, shape, bytes), the epoch and a BLAKE2b-256 digest per chunk, taken
from one snapshot that the donor keeps while it is being downloaded, so every chunk of a
download comes from the same instant.

The client fetches every donor's manifest, groups donors whose manifests are identical
(same epoch, layout, digests and meta) and downloads from the newest group, its donors
sharing the chunks. A donor that fails, times out or sends a chunk whose digest is wrong
is banned and its chunks go to the others; verified chunks are kept (resume). If every
donor of a group fails, the next group (an older epoch) is tried, keeping the chunks
whose digests it shares; when none is left, :class:`StateTransferError`.

The pure parts (chunk plan, manifest checks, donor grouping, :class:`ChunkScheduler`) take
no clock and no sockets; the async parts only pump them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import json
import logging
import math
import random
import re
import statistics
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from ..transport.codecs import WIRE_DTYPES, dtype_to_wire
from ..transport.endpoint import Endpoint, PeerAddress, Request, Response
from ..transport.errors import CodecError, RemoteError, TransportError
from .errors import NodeError
from .protocol import parse_request, to_header

logger = logging.getLogger(__name__)

STATE_VERSION: Final[int] = 1
MIN_CHUNK_BYTES: Final[int] = 4096
MAX_CHUNK_BYTES: Final[int] = 64 << 20
DEFAULT_CHUNK_BYTES: Final[int] = 4 << 20
MAX_TENSORS: Final[int] = 65536
MAX_CHUNKS: Final[int] = 1 << 20
MAX_MANIFEST_BYTES: Final[int] = 16 << 20
_MAX_BYTES: Final[int] = 1 << 50
_THREAD_BYTES: Final[int] = 1 << 20  # hash larger buffers in a worker thread
_PLANS_PER_SNAPSHOT: Final[int] = 4
_PREFIX_PATTERN: Final[str] = r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,47}$"


class StateTransferError(NodeError):
    """No donor could deliver the stage's state; the message names what was tried."""


class StateErrorCode(StrEnum):
    """Error codes a donor answers with (``RemoteError.code``)."""

    BAD_REQUEST = "bad_request"  # malformed header, index out of range, tensors attached
    BUSY = "busy"  # too many chunk requests at once: retry later or elsewhere
    NOT_READY = "not_ready"  # the donor could not take a snapshot (still loading itself)
    UNKNOWN_SNAPSHOT = "unknown_snapshot"  # expired or evicted: fetch a new manifest
    GONE = "gone"  # the donor no longer serves this stage (it moved or is leaving)
    INTERNAL = "internal"  # the donor's own state cannot be sent (unsupported dtype, ...)


def _refuse(code: StateErrorCode, message: str) -> RemoteError:
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
        description="Bytes per chunk of the flattened state (the last chunk may be shorter).",
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
        default=50, ge=1, le=10000, description="'busy' answers in a row after which a donor is banned."
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
        default=3600.0, gt=0.0, le=86400.0, description="A retained snapshot is dropped at this age."
    )
    max_retained: int = Field(
        default=2, ge=1, le=8,
        description="Snapshots a donor keeps at once. When all are in use, a new downloader "
        "gets the newest one rather than evicting one that is being downloaded.",
    )
    max_concurrent_chunks: int = Field(
        default=16, ge=1, le=1024, description="Chunk requests a donor serves at once; more are 'busy'."
    )


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
_Epoch = Annotated[int, Field(ge=0, lt=2**63)]


class ManifestRequest(_Wire):
    """``{prefix}.manifest``: no tensors."""

    v: Literal[1] = Field(default=1, description="State transfer version (STATE_VERSION).")
    chunk_bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES, description="Chunk size.")


class ManifestReply(_Wire):
    """Answer to ``{prefix}.manifest``: tensors ``[manifest JSON as uint8 (nbytes,)]``."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    nbytes: int = Field(ge=2, le=MAX_MANIFEST_BYTES, description="Bytes of the manifest JSON.")


class ChunkRequest(_Wire):
    """``{prefix}.chunk``: no tensors."""

    v: Literal[1] = Field(default=1, description="State transfer version.")
    epoch: _Epoch = Field(description="Epoch of the manifest this chunk belongs to.")
    snapshot_id: int = Field(ge=0, lt=2**63, description="Donor's id of that snapshot.")
    chunk_bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES, description="Plan's chunk size.")
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
    chunk_bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES, description="Chunk size.")
    total_bytes: int = Field(ge=0, le=_MAX_BYTES, description="Bytes of the flattened state.")
    tensors: tuple[TensorEntry, ...] = Field(max_length=MAX_TENSORS, description="Tensors, in order.")
    digests: tuple[_Digest, ...] = Field(max_length=MAX_CHUNKS, description="BLAKE2b-256 per chunk.")
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
        """Seconds until ``take`` may give ``donor`` a straggler, None if no chunk may become one."""
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


# ---- donor -----------------------------------------------------------------------------------


@dataclass
class _Retained:
    """A snapshot a donor hands out, kept while downloads of it may be under way."""

    snapshot_id: int
    epoch: int
    entries: tuple[TensorEntry, ...]
    views: list[torch.Tensor]
    meta: dict[str, Any]
    taken_at: float
    last_used: float
    plans: dict[int, tuple[list[Chunk], bytes]] = field(default_factory=dict)  # chunk_bytes ->


class StateDonor:
    """Serves this server's stage state under ``kind_prefix`` (see the module docstring).

    ``snapshot`` is awaited when a downloader asks for a manifest and no retained snapshot
    is young enough; it must return state taken at one instant that nobody modifies
    afterwards. A server that moves calls :meth:`close` and starts a donor under its new
    stage's prefix; the old kinds then answer ``gone``.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        snapshot: Callable[[], Awaitable[Snapshot]],
        *,
        kind_prefix: str,
        config: StateTransferConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not re.match(_PREFIX_PATTERN, kind_prefix):
            raise ValueError(f"kind_prefix {kind_prefix!r} must match {_PREFIX_PATTERN}")
        self.config = config or StateTransferConfig()
        self.kind_prefix = kind_prefix
        self._snapshot = snapshot
        self._clock = clock
        self._rng = rng or random.Random()
        self._retained: list[_Retained] = []
        self._lock = asyncio.Lock()
        self._active_chunks = 0
        self._closed = False
        self.counts: Counter[str] = Counter()  # manifests, chunks, chunk_bytes, snapshots, errors.*
        endpoint.register(manifest_kind(kind_prefix), self.handle_manifest)
        endpoint.register(chunk_kind(kind_prefix), self.handle_chunk)

    def close(self) -> None:
        """Stop donating (requests answer ``gone``) and drop the retained snapshots."""
        self._closed = True
        self._retained.clear()

    @property
    def retained_epochs(self) -> list[int]:
        return [r.epoch for r in self._retained]

    async def handle_manifest(self, request: Request) -> Response:
        try:
            return await self._manifest(request)
        except RemoteError as exc:
            self.counts[f"errors.{exc.code}"] += 1
            raise

    async def handle_chunk(self, request: Request) -> Response:
        try:
            return await self._chunk(request)
        except RemoteError as exc:
            self.counts[f"errors.{exc.code}"] += 1
            raise

    async def _manifest(self, request: Request) -> Response:
        self._check_open(request)
        req = parse_request(ManifestRequest, request.header)
        async with self._lock:
            retained = await self._current()
            plan = retained.plans.get(req.chunk_bytes)
            if plan is None:
                plan = await asyncio.to_thread(self._plan, retained, req.chunk_bytes)
                if len(retained.plans) >= _PLANS_PER_SNAPSHOT:
                    del retained.plans[next(iter(retained.plans))]
                retained.plans[req.chunk_bytes] = plan
        retained.last_used = self._clock()
        body = plan[1]
        self.counts["manifests"] += 1
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        return Response(header=to_header(ManifestReply(nbytes=len(body))), tensors=[payload])

    async def _chunk(self, request: Request) -> Response:
        self._check_open(request)
        req = parse_request(ChunkRequest, request.header)
        self._prune(self._clock())
        retained = next((r for r in self._retained if r.snapshot_id == req.snapshot_id), None)
        if retained is None or retained.epoch != req.epoch:
            raise _refuse(
                StateErrorCode.UNKNOWN_SNAPSHOT,
                f"snapshot {req.snapshot_id} of epoch {req.epoch} is not held (expired?)",
            )
        plan = retained.plans.get(req.chunk_bytes)
        if plan is None:
            raise _refuse(
                StateErrorCode.UNKNOWN_SNAPSHOT, f"no manifest with chunk_bytes={req.chunk_bytes}"
            )
        chunks = plan[0]
        if req.index >= len(chunks):
            raise _refuse(
                StateErrorCode.BAD_REQUEST, f"index {req.index} out of range: {len(chunks)} chunks"
            )
        if self._active_chunks >= self.config.max_concurrent_chunks:
            raise _refuse(StateErrorCode.BUSY, "too many chunk requests at once")
        self._active_chunks += 1
        try:
            retained.last_used = self._clock()
            chunk = chunks[req.index]
            data = gather_chunk(retained.views, chunk)
        finally:
            self._active_chunks -= 1
        self.counts["chunks"] += 1
        self.counts["chunk_bytes"] += chunk.nbytes
        reply = ChunkReply(index=req.index, nbytes=chunk.nbytes)
        return Response(header=to_header(reply), tensors=[data])

    def _check_open(self, request: Request) -> None:
        if self._closed:
            raise _refuse(StateErrorCode.GONE, f"no longer donating {self.kind_prefix}")
        if request.tensors:
            raise _refuse(StateErrorCode.BAD_REQUEST, "state requests carry no tensors")

    def _prune(self, now: float) -> None:
        cfg = self.config
        self._retained = [
            r for r in self._retained
            if now - r.last_used <= cfg.snapshot_idle_ttl_s and now - r.taken_at <= cfg.snapshot_max_age_s
        ]

    async def _current(self) -> _Retained:
        """The snapshot to hand a new downloader (called under the lock)."""
        cfg = self.config
        now = self._clock()
        self._prune(now)
        if self._retained:
            newest = self._retained[-1]
            if now - newest.taken_at < cfg.snapshot_reuse_s:
                return newest
            if len(self._retained) >= cfg.max_retained and all(
                now - r.last_used < cfg.snapshot_reuse_s for r in self._retained
            ):
                return newest  # every slot is being downloaded: do not evict one
        try:
            snap = await self._snapshot()
        except Exception as exc:
            logger.warning("cannot snapshot %s for a downloader: %r", self.kind_prefix, exc)
            raise _refuse(StateErrorCode.NOT_READY, f"no snapshot: {type(exc).__name__}") from exc
        retained = await asyncio.to_thread(self._retain, snap, now)
        self.counts["snapshots"] += 1
        if len(self._retained) >= cfg.max_retained:  # evict the least recently used
            self._retained.remove(min(self._retained, key=lambda r: r.last_used))
        self._retained.append(retained)
        return retained

    def _retain(self, snap: Snapshot, now: float) -> _Retained:
        entries, views = [], []
        try:
            meta = json.loads(json.dumps(dict(snap.meta), allow_nan=False))
            for name, tensor in snap.tensors.items():
                t = tensor.detach().to("cpu").contiguous()
                dtype = dtype_to_wire(t.dtype)
                entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(t.shape), nbytes=t.nbytes))
                views.append(byte_view(t))
            if len(entries) > MAX_TENSORS:
                raise ValueError(f"{len(entries)} tensors exceed {MAX_TENSORS}")
        except (CodecError, TypeError, ValueError, ValidationError) as exc:
            logger.error("the state of %s cannot be donated: %s", self.kind_prefix, exc)
            raise _refuse(StateErrorCode.INTERNAL, "state cannot be sent") from exc
        return _Retained(
            snapshot_id=self._rng.getrandbits(63), epoch=int(snap.epoch), entries=tuple(entries),
            views=views, meta=meta, taken_at=now, last_used=now,
        )

    def _plan(self, retained: _Retained, chunk_bytes: int) -> tuple[list[Chunk], bytes]:
        chunks = plan_chunks([e.nbytes for e in retained.entries], chunk_bytes)
        try:
            manifest = Manifest(
                epoch=retained.epoch, snapshot_id=retained.snapshot_id, chunk_bytes=chunk_bytes,
                total_bytes=sum(e.nbytes for e in retained.entries), tensors=retained.entries,
                digests=tuple(chunk_digests(retained.views, chunks)), meta=retained.meta,
            )
        except ValidationError as exc:
            logger.error("no manifest of %s in chunks of %d: %s", self.kind_prefix, chunk_bytes, exc)
            raise _refuse(StateErrorCode.INTERNAL, "state cannot be described") from exc
        body = manifest.model_dump_json().encode()
        if len(body) > MAX_MANIFEST_BYTES:
            raise _refuse(StateErrorCode.INTERNAL, f"manifest of {len(body)} bytes is too large")
        return chunks, body


# ---- client ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkEvent:
    """One step of a download, in the order it happened (DownloadReport.events)."""

    what: Literal["request", "accept", "duplicate", "busy", "fail"]
    index: int
    donor: str
    at: float  # seconds since the download started


@dataclass
class DownloadReport:
    """What a download did: which donors served what, who was banned and why."""

    epoch: int | None = None
    total_bytes: int = 0
    manifest_failures: dict[str, str] = field(default_factory=dict)  # donor -> reason
    groups_tried: list[tuple[int, list[str]]] = field(default_factory=list)  # (epoch, donors)
    bans: dict[str, str] = field(default_factory=dict)  # donor -> reason
    chunks_from: Counter[str] = field(default_factory=Counter)  # accepted chunks per donor
    kept_chunks: int = 0  # chunks carried into a later group (same layout and digest)
    events: list[ChunkEvent] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"manifest from {d[:12]}: {r}" for d, r in self.manifest_failures.items()]
        for epoch, donors in self.groups_tried:
            failed = ", ".join(f"{d[:12]}: {self.bans.get(d, 'gave up')}" for d in donors)
            parts.append(f"epoch {epoch} from [{failed}]")
        return "; ".join(parts) or "nothing"


Progress = Callable[[int, int], None]


class StateDownload:
    """One download of a stage's state; :meth:`run` returns it, :attr:`report` says how."""

    def __init__(
        self,
        endpoint: Endpoint,
        donors: Sequence[PeerAddress],
        *,
        kind_prefix: str,
        config: StateTransferConfig | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.donors = list(dict.fromkeys(donors))
        self.kind_prefix = kind_prefix
        self.config = config or StateTransferConfig()
        self.progress = progress
        self.report = DownloadReport()
        self._started = self._deadline = 0.0
        self._layout: str | None = None
        self._tensors: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._have: dict[int, str] = {}  # chunk index -> digest, for the current layout

    async def run(self) -> Snapshot:
        cfg = self.config
        if not self.donors:
            raise StateTransferError(f"no donors to download {self.kind_prefix} from")
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._deadline = self._started + cfg.timeout_s
        try:
            async with asyncio.timeout_at(self._deadline):
                results = await asyncio.gather(*(self._manifest(d) for d in self.donors))
                usable = [(d, m) for d, m in zip(self.donors, results, strict=True) if m is not None]
                for group in group_manifests(usable):
                    snapshot = await self._download(group)
                    if snapshot is not None:
                        return snapshot
        except TimeoutError:
            raise StateTransferError(
                f"{self.kind_prefix}: no complete state within {cfg.timeout_s:.3g} s "
                f"({len(self._have)} chunks held); tried {self.report.summary()}"
            ) from None
        raise StateTransferError(f"{self.kind_prefix}: every donor failed; tried {self.report.summary()}")

    def _timeout(self, limit: float) -> float:
        return max(0.001, min(limit, self._deadline - asyncio.get_running_loop().time()))

    async def _manifest(self, donor: PeerAddress) -> Manifest | None:
        """The donor's manifest, or None (the reason goes to the report)."""
        cfg = self.config
        try:
            reply = await self.endpoint.request(
                donor, manifest_kind(self.kind_prefix),
                to_header(ManifestRequest(chunk_bytes=cfg.chunk_bytes)),
                timeout=self._timeout(cfg.manifest_timeout_s),
            )
            head = ManifestReply.model_validate(reply.header)
            body = _single_uint8(reply.tensors, head.nbytes)
            manifest = Manifest.model_validate_json(body.numpy().tobytes())
        except TransportError as exc:
            self.report.manifest_failures[donor.peer_id] = f"{type(exc).__name__}: {exc}"[:200]
            return None
        except (ValidationError, ValueError) as exc:
            self.report.manifest_failures[donor.peer_id] = f"bad manifest: {str(exc)[:160]}"
            return None
        if manifest.chunk_bytes != cfg.chunk_bytes or manifest.total_bytes > cfg.max_state_bytes:
            self.report.manifest_failures[donor.peer_id] = (
                f"manifest of {manifest.total_bytes} bytes in chunks of {manifest.chunk_bytes} "
                f"(asked {cfg.chunk_bytes}, limit {cfg.max_state_bytes})"
            )
            return None
        return manifest

    def _prepare(self, manifest: Manifest) -> set[int]:
        """Buffers for the manifest's layout; the chunks already held that it shares."""
        layout = manifest.layout_key()
        if layout != self._layout:
            self._layout = layout
            self._tensors = [
                torch.empty(tuple(e.shape), dtype=WIRE_DTYPES[e.dtype]) for e in manifest.tensors
            ]
            self._views = [byte_view(t) for t in self._tensors]
            self._have = {}
        self._have = {i: d for i, d in self._have.items() if manifest.digests[i] == d}
        return set(self._have)

    async def _download(self, group: DonorGroup) -> Snapshot | None:
        """The group's snapshot, or None when every donor of the group failed."""
        manifest = group.manifest
        chunks = plan_chunks([e.nbytes for e in manifest.tensors], manifest.chunk_bytes)
        kept = self._prepare(manifest)
        self.report.kept_chunks += len(kept)
        self.report.groups_tried.append((manifest.epoch, [d.peer_id for d, _ in group.members]))
        sched = ChunkScheduler(len(chunks), (d.peer_id for d, _ in group.members), done=kept)
        done_bytes = sum(chunks[i].nbytes for i in kept)
        self._report_progress(done_bytes, manifest.total_bytes)
        wake = asyncio.Condition()
        over = asyncio.Event()
        live = 0

        loop = asyncio.get_running_loop()
        took: deque[float] = deque(maxlen=16)  # seconds of the latest verified chunks

        def straggler_s() -> float:
            """How long a chunk may be out before an idle donor duplicates it."""
            if len(took) < 3:
                return self.config.chunk_timeout_s
            return min(self.config.endgame_factor * statistics.median(took), self.config.chunk_timeout_s)

        async def worker(donor: PeerAddress, snapshot_id: int) -> None:
            nonlocal done_bytes, live
            peer, busy = donor.peer_id, 0
            try:
                while True:
                    async with wake:
                        while (index := sched.take(peer, loop.time(), straggler_s())) is None:
                            if sched.complete or peer in sched.banned:
                                return
                            wait = sched.next_straggler(peer, loop.time(), straggler_s())
                            with contextlib.suppress(TimeoutError):  # re-check for stragglers
                                async with asyncio.timeout(None if wait is None else wait + 1e-3):
                                    await wake.wait()
                    self._event("request", index, peer)
                    chunk, started = chunks[index], loop.time()
                    data, error = await self._fetch(donor, snapshot_id, manifest, chunk)
                    async with wake:
                        if data is not None:
                            busy = 0
                            took.append(loop.time() - started)
                            if sched.accept(peer, index):
                                scatter_chunk(self._views, chunk, data)
                                self._have[index] = manifest.digests[index]
                                self.report.chunks_from[peer] += 1
                                self._event("accept", index, peer)
                                done_bytes += chunk.nbytes
                                self._report_progress(done_bytes, manifest.total_bytes)
                            else:
                                self._event("duplicate", index, peer)
                        elif error == StateErrorCode.BUSY and busy + 1 < self.config.max_busy:
                            busy += 1
                            sched.release(peer, index)
                            self._event("busy", index, peer)
                        else:
                            self._event("fail", index, peer)
                            if peer not in sched.banned:
                                logger.info("state donor %s banned: %s", peer, error)
                                self.report.bans[peer] = error
                            sched.ban(peer)
                        wake.notify_all()
                        if sched.complete or sched.exhausted:
                            over.set()
                    if error == StateErrorCode.BUSY:
                        await asyncio.sleep(self.config.busy_backoff_s)  # back-off, not a wait on state
            finally:
                live -= 1
                if live == 0:
                    over.set()

        async with asyncio.TaskGroup() as tg:
            tasks = []
            if not sched.complete:
                for donor, snapshot_id in group.members:
                    for _ in range(self.config.max_parallel_per_donor):
                        live += 1
                        tasks.append(tg.create_task(worker(donor, snapshot_id)))
            if tasks:
                await over.wait()
            for task in tasks:
                task.cancel()  # a banned donor's requests still in flight
        if not sched.complete:
            return None
        self.report.epoch = manifest.epoch
        self.report.total_bytes = manifest.total_bytes
        names = [e.name for e in manifest.tensors]
        return Snapshot(manifest.epoch, dict(zip(names, self._tensors, strict=True)), manifest.meta)

    async def _fetch(
        self, donor: PeerAddress, snapshot_id: int, manifest: Manifest, chunk: Chunk
    ) -> tuple[torch.Tensor | None, str]:
        """The chunk's verified bytes, or None and why not (a StateErrorCode or a reason)."""
        request = ChunkRequest(
            epoch=manifest.epoch, snapshot_id=snapshot_id, chunk_bytes=manifest.chunk_bytes,
            index=chunk.index,
        )
        try:
            reply = await self.endpoint.request(
                donor, chunk_kind(self.kind_prefix), to_header(request),
                timeout=self._timeout(self.config.chunk_timeout_s),
            )
        except RemoteError as exc:
            return None, exc.code if exc.code == StateErrorCode.BUSY else f"{exc}"[:200]
        except TransportError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:200]
        try:
            head = ChunkReply.model_validate(reply.header)
            if head.index != chunk.index:
                raise ValueError(f"reply for chunk {head.index}, asked {chunk.index}")
            data = _single_uint8(reply.tensors, chunk.nbytes)
        except (ValidationError, ValueError) as exc:
            return None, f"bad chunk reply: {str(exc)[:160]}"
        arr = data.numpy().data
        digest = (
            await asyncio.to_thread(state_digest, arr) if chunk.nbytes > _THREAD_BYTES else state_digest(arr)
        )
        if digest != manifest.digests[chunk.index]:
            return None, f"chunk {chunk.index} does not match its digest"
        return data, ""

    def _event(self, what: Any, index: int, donor: str) -> None:
        at = asyncio.get_running_loop().time() - self._started
        self.report.events.append(ChunkEvent(what, index, donor, at))

    def _report_progress(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


def _single_uint8(tensors: Sequence[Any], nbytes: int) -> torch.Tensor:
    """The one uint8 tensor of ``nbytes`` bytes a reply must carry; ValueError otherwise."""
    if len(tensors) != 1:
        raise ValueError(f"expected 1 tensor, got {len(tensors)}")
    t = tensors[0]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != (nbytes,):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"expected uint8 ({nbytes},), got {got}")
    return t.contiguous()


async def download_state(
    endpoint: Endpoint,
    donors: Sequence[PeerAddress],
    *,
    kind_prefix: str,
    config: StateTransferConfig | None = None,
    timeout_s: float | None = None,
    chunk_bytes: int | None = None,
    max_parallel_per_donor: int | None = None,
    progress: Progress | None = None,
) -> Snapshot:
    """Download a stage's state from ``donors`` (see the module docstring).

    The keyword settings override ``config``; ``progress(done_bytes, total_bytes)`` is
    called as chunks arrive. Raises StateTransferError when no donor can deliver.
    """
    overrides = {
        k: v for k, v in (("timeout_s", timeout_s), ("chunk_bytes", chunk_bytes),
                          ("max_parallel_per_donor", max_parallel_per_donor)) if v is not None
    }
    base = config or StateTransferConfig()
    cfg = StateTransferConfig.model_validate({**base.model_dump(), **overrides}) if overrides else base
    download = StateDownload(endpoint, donors, kind_prefix=kind_prefix, config=cfg, progress=progress)
    return await download.run()
