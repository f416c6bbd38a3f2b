"""The donor side of state transfer: every server of a stage serves its state's manifest
and chunks (the protocol is described in ``state_transfer.py``).

A donor's work is bounded whoever asks: a snapshot (a copy of the state) at most once per
``snapshot_reuse_s``; each snapshot hashed for at most ``PLANS_PER_SNAPSHOT`` chunk sizes,
out of the fixed set of powers of two the wire accepts (a further size is answered
``busy`` rather than evicting a plan, so cycling sizes cannot make the donor re-hash); one
manifest request per peer at a time (more are ``busy``); each peer may fetch at most
``max_bytes_per_peer`` snapshot sizes of one snapshot (a fair share of the donor's copying
and bandwidth: asking for the same chunk over and over is ``busy`` past it).

A snapshot can take long: the stage server exports its state only when no averaging round
runs in the background (an export during one would wait for it on the device thread, which
serves every forward and backward). So a request holds on for ``snapshot_wait_s`` at most
and is then answered ``preparing``; the snapshot goes on being taken, one at a time, and
the downloader asks again (``preparing_retry_s``)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import (
    ValidationError,
)

from ...transport.codecs import dtype_to_wire
from ...transport.endpoint import Endpoint, Request, Response
from ...transport.errors import CodecError, RemoteError
from ..protocol import parse_request, to_header
from .state_plan import (
    MAX_MANIFEST_BYTES,
    MAX_TENSORS,
    PLANS_PER_SNAPSHOT,
    PREFIX_PATTERN,
    Chunk,
    ChunkReply,
    ChunkRequest,
    Manifest,
    ManifestReply,
    ManifestRequest,
    Snapshot,
    StateErrorCode,
    StateTransferConfig,
    TensorEntry,
    byte_view,
    chunk_digests,
    chunk_kind,
    gather_chunk,
    manifest_kind,
    plan_chunks,
    refuse_state,
)

logger = logging.getLogger(__name__)

# ---- donor -----------------------------------------------------------------------------------


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a snapshot task's failure as seen: every request that waited may have timed out
    (and said ``preparing``) before it failed, and the next one starts a new task."""
    if not task.cancelled():
        task.exception()


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
    served: Counter[str] = field(default_factory=Counter)  # bytes sent of it, by peer


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
        if not re.match(PREFIX_PATTERN, kind_prefix):
            raise ValueError(f"kind_prefix {kind_prefix!r} must match {PREFIX_PATTERN}")
        self.config = config or StateTransferConfig()
        self.kind_prefix = kind_prefix
        self._snapshot = snapshot
        self._clock = clock
        self._rng = rng or random.Random()
        self._retained: list[_Retained] = []
        self._lock = asyncio.Lock()
        self._active_chunks = 0
        self._manifest_peers: set[str] = set()  # peers with a manifest request in flight
        self._taking: asyncio.Future[_Retained] | None = None  # a snapshot being taken
        self._closed = False
        self.counts: Counter[str] = Counter()  # manifests, chunks, chunk_bytes, snapshots, errors.*
        endpoint.register(manifest_kind(kind_prefix), self.handle_manifest)
        endpoint.register(chunk_kind(kind_prefix), self.handle_chunk)

    def close(self) -> None:
        """Stop donating (requests answer ``gone``) and drop the retained snapshots."""
        self._closed = True
        self._retained.clear()
        if self._taking is not None:
            self._taking.cancel()

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
        if request.peer_id in self._manifest_peers:
            raise refuse_state(StateErrorCode.BUSY, "one manifest request per peer at a time")
        self._manifest_peers.add(request.peer_id)
        try:
            retained = await self._current()
            async with self._lock:
                plan = retained.plans.get(req.chunk_bytes)
                if plan is None:
                    if len(retained.plans) >= PLANS_PER_SNAPSHOT:
                        # evicting a plan would let a peer cycling sizes make us re-hash forever
                        sizes = sorted(retained.plans)
                        raise refuse_state(
                            StateErrorCode.BUSY,
                            f"this snapshot is served in chunks of {sizes} bytes only",
                        )
                    plan = await asyncio.to_thread(self._plan, retained, req.chunk_bytes)
                    retained.plans[req.chunk_bytes] = plan
        finally:
            self._manifest_peers.discard(request.peer_id)
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
            raise refuse_state(
                StateErrorCode.UNKNOWN_SNAPSHOT,
                f"snapshot {req.snapshot_id} of epoch {req.epoch} is not held (expired?)",
            )
        plan = retained.plans.get(req.chunk_bytes)
        if plan is None:
            raise refuse_state(
                StateErrorCode.UNKNOWN_SNAPSHOT, f"no manifest with chunk_bytes={req.chunk_bytes}"
            )
        chunks = plan[0]
        if req.index >= len(chunks):
            raise refuse_state(
                StateErrorCode.BAD_REQUEST, f"index {req.index} out of range: {len(chunks)} chunks"
            )
        if self._active_chunks >= self.config.max_concurrent_chunks:
            raise refuse_state(StateErrorCode.BUSY, "too many chunk requests at once")
        chunk = chunks[req.index]
        total = sum(e.nbytes for e in retained.entries)
        allowed = self.config.max_bytes_per_peer * total
        if retained.served[request.peer_id] + chunk.nbytes > allowed:
            self.counts["over_budget"] += 1
            raise refuse_state(
                StateErrorCode.BUSY,
                f"you fetched {retained.served[request.peer_id]} bytes of this snapshot "
                f"({self.config.max_bytes_per_peer:g}x its {total} bytes allowed)",
            )
        retained.served[request.peer_id] += chunk.nbytes
        self._active_chunks += 1
        try:
            retained.last_used = self._clock()
            data = gather_chunk(retained.views, chunk)
        finally:
            self._active_chunks -= 1
        self.counts["chunks"] += 1
        self.counts["chunk_bytes"] += chunk.nbytes
        reply = ChunkReply(index=req.index, nbytes=chunk.nbytes)
        return Response(header=to_header(reply), tensors=[data])

    def _check_open(self, request: Request) -> None:
        if self._closed:
            raise refuse_state(StateErrorCode.GONE, f"no longer donating {self.kind_prefix}")
        if request.tensors:
            raise refuse_state(StateErrorCode.BAD_REQUEST, "state requests carry no tensors")

    def _prune(self, now: float) -> None:
        cfg = self.config
        self._retained = [
            r
            for r in self._retained
            if now - r.last_used <= cfg.snapshot_idle_ttl_s
            and now - r.taken_at <= cfg.snapshot_max_age_s
        ]

    async def _current(self) -> _Retained:
        """The snapshot to hand a new downloader: the newest retained one while it is young
        enough, else a new one. Taking one may wait for the stage's background round (the
        server's ``snapshot`` never exports during one), so it runs as a task of its own: a
        request waits ``snapshot_wait_s`` for it and is answered ``preparing`` past that,
        and the snapshot, once taken, is retained for the requests that ask again."""
        cfg = self.config
        async with self._lock:
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
            if self._taking is None:
                self._taking = asyncio.ensure_future(self._take())
                self._taking.add_done_callback(_retrieve)
            taking = self._taking
        try:
            return await asyncio.wait_for(asyncio.shield(taking), cfg.snapshot_wait_s)
        except asyncio.CancelledError:
            if self._closed and taking.cancelled():  # close() ended the snapshot, not us
                raise refuse_state(
                    StateErrorCode.GONE, f"no longer donating {self.kind_prefix}"
                ) from None
            raise
        except TimeoutError:
            self.counts["preparing"] += 1
            raise refuse_state(
                StateErrorCode.PREPARING,
                "taking a snapshot of the state (waiting for the stage's averaging round "
                f"to end): ask again in {cfg.preparing_retry_s:g} s",
            ) from None

    async def _take(self) -> _Retained:
        """A new snapshot, retained (the least recently used one evicted past
        ``max_retained``)."""
        try:
            try:
                snap = await self._snapshot()
            except Exception as exc:
                logger.warning("cannot snapshot %s for a downloader: %r", self.kind_prefix, exc)
                raise refuse_state(
                    StateErrorCode.NOT_READY, f"no snapshot: {type(exc).__name__}"
                ) from exc
            retained = await asyncio.to_thread(self._retain, snap, self._clock())
            if self._closed:
                raise refuse_state(StateErrorCode.GONE, f"no longer donating {self.kind_prefix}")
            self.counts["snapshots"] += 1
            if len(self._retained) >= self.config.max_retained:  # evict the least recently used
                self._retained.remove(min(self._retained, key=lambda r: r.last_used))
            self._retained.append(retained)
            return retained
        finally:
            self._taking = None

    def _retain(self, snap: Snapshot, now: float) -> _Retained:
        entries, views = [], []
        try:
            meta = json.loads(json.dumps(dict(snap.meta), allow_nan=False))
            for name, tensor in snap.tensors.items():
                t = tensor.detach().to("cpu").contiguous()
                dtype = dtype_to_wire(t.dtype)
                entries.append(
                    TensorEntry(name=name, dtype=dtype, shape=tuple(t.shape), nbytes=t.nbytes)
                )
                views.append(byte_view(t))
            if len(entries) > MAX_TENSORS:
                raise ValueError(f"{len(entries)} tensors exceed {MAX_TENSORS}")
        except (CodecError, TypeError, ValueError, ValidationError) as exc:
            logger.error("the state of %s cannot be donated: %s", self.kind_prefix, exc)
            raise refuse_state(StateErrorCode.INTERNAL, "state cannot be sent") from exc
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
            logger.error(
                "no manifest of %s in chunks of %d: %s", self.kind_prefix, chunk_bytes, exc
            )
            raise refuse_state(StateErrorCode.INTERNAL, "state cannot be described") from exc
        body = manifest.model_dump_json().encode()
        if len(body) > MAX_MANIFEST_BYTES:
            raise refuse_state(
                StateErrorCode.INTERNAL, f"manifest of {len(body)} bytes is too large"
            )
        return chunks, body
