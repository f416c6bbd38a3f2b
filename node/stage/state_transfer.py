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

The client fetches every donor's manifest and refuses, before allocating anything, each
one whose tensors are not exactly the stage's own (names, dtypes, shapes: ``expected``),
whose size exceeds ``max_state_bytes`` or whose epoch exceeds ``MAX_EPOCH``. It groups the
rest by content (same epoch, layout, digests and meta) and downloads only from the group
held by a quorum of them (a strict majority: a lone donor only when it is the only one
that answered; ``choose_quorum``), its donors sharing the chunks; the other groups are
logged with their digests and never serve. A donor that fails, times out or sends a chunk
whose digest is wrong is banned and its chunks go to the others; verified chunks are kept
(resume). When the group's donors all fail, :class:`StateTransferError`; when donors
answered but none can be trusted, :class:`UntrustedStateError`.

The pure parts (chunk plan, manifest checks, donor grouping, :class:`ChunkScheduler`) take
no clock and no sockets; the async parts only pump them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import (
    ValidationError,
)

from ...transport.codecs import WIRE_DTYPES
from ...transport.endpoint import Endpoint, PeerAddress
from ...transport.errors import RemoteError, TransportError
from ...transport.tensors import off_loop
from ..protocol import to_header
from .state_plan import (
    Chunk,
    ChunkReply,
    ChunkRequest,
    ChunkScheduler,
    DonorGroup,
    Manifest,
    ManifestReply,
    ManifestRequest,
    QuorumDecision,
    Snapshot,
    StateErrorCode,
    StateLayout,
    StateTransferConfig,
    StateTransferError,
    UntrustedStateError,
    byte_view,
    choose_quorum,
    choose_stand_in,
    chunk_kind,
    describe_group,
    group_manifests,
    layout_mismatch,
    manifest_kind,
    plan_chunks,
    quorum_size,
    scatter_chunk,
    state_digest,
)

logger = logging.getLogger(__name__)

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
    refused: dict[str, str] = field(default_factory=dict)  # donor -> why its state is not used
    quorum: QuorumDecision | None = None
    stand_in: str | None = None  # the group taken without a quorum (``stand_in``), described
    groups_tried: list[tuple[int, list[str]]] = field(default_factory=list)  # (epoch, donors)
    bans: dict[str, str] = field(default_factory=dict)  # donor -> reason
    chunks_from: Counter[str] = field(default_factory=Counter)  # accepted chunks per donor
    kept_chunks: int = 0  # chunks carried into a later group (same layout and digest)
    events: list[ChunkEvent] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"manifest from {d[:12]}: {r}" for d, r in self.manifest_failures.items()]
        parts += [f"{d[:12]} refused: {r}" for d, r in self.refused.items()]
        if self.quorum is not None and self.quorum.reason:
            parts.append(self.quorum.reason)
        for epoch, donors in self.groups_tried:
            failed = ", ".join(f"{d[:12]}: {self.bans.get(d, 'gave up')}" for d in donors)
            parts.append(f"epoch {epoch} from [{failed}]")
        return "; ".join(parts) or "nothing"


Progress = Callable[[int, int], None]
# the quorum's (epoch, meta): whether to download it (download_wanted_state)
Wanted = Callable[[int, dict[str, Any]], bool]


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
        expected: StateLayout | None = None,
        wanted: Wanted | None = None,
        stand_in: bool = False,
    ) -> None:
        self.endpoint = endpoint
        # with no quorum, take choose_stand_in's group instead of refusing (a backstop)
        self.stand_in = stand_in
        self.expected = expected  # the stage's own layout; None accepts any (tests, tools)
        # asked of the quorum's (epoch, meta) before any chunk: False ends the download
        self.wanted = wanted
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
        self._preparing: set[str] = set()  # donors that answered 'preparing', asked again

    async def run(self) -> Snapshot | None:
        """The quorum's state; None only when ``wanted`` declined it (nothing downloaded)."""
        cfg = self.config
        if not self.donors:
            raise StateTransferError(f"no donors to download {self.kind_prefix} from")
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._deadline = self._started + cfg.timeout_s
        decision: QuorumDecision | None = None
        try:
            async with asyncio.timeout_at(self._deadline):
                usable = await self._manifests()
                decision = self._decide(usable)
                group = decision.group or (self._stand_in(decision) if self.stand_in else None)
                if group is not None:
                    quorum = group.manifest
                    if self.wanted is not None and not self.wanted(quorum.epoch, quorum.meta):
                        return None
                    snapshot = await self._download(group)
                    if snapshot is not None:
                        return snapshot
        except TimeoutError:
            raise StateTransferError(
                f"{self.kind_prefix}: no complete state within {cfg.timeout_s:.3g} s "
                f"({len(self._have)} chunks held); tried {self.report.summary()}",
                quorum=decision,
            ) from None
        untrusted = decision is not None and decision.group is None and (
            decision.reachable > 0 or bool(self.report.refused)
        )
        error = UntrustedStateError if untrusted else StateTransferError
        raise error(f"{self.kind_prefix}: no state installed; tried {self.report.summary()}",
                    quorum=decision)

    def _decide(self, usable: list[tuple[PeerAddress, Manifest]]) -> QuorumDecision:
        """The group to download from (choose_quorum); disagreement is logged with digests."""
        decision = choose_quorum(group_manifests(usable))
        self.report.quorum = decision
        for group in decision.outvoted:
            for donor, _ in group.members:
                self.report.refused[donor.peer_id] = "not in the quorum"
        if decision.group is None:
            if decision.reachable:
                logger.warning("%s: %s", self.kind_prefix, decision.reason)
        elif decision.outvoted:
            logger.warning(
                "%s: state donors disagree; using %s; not using %s", self.kind_prefix,
                describe_group(decision.group),
                "; ".join(describe_group(g) for g in decision.outvoted),
            )
        return decision

    def _stand_in(self, decision: QuorumDecision) -> DonorGroup | None:
        """choose_stand_in's group, logged, its donors no longer marked refused."""
        group = choose_stand_in(decision)
        if group is not None:
            logger.warning("%s: no quorum; taking a stand-in (the lower median epoch, most "
                           "donors): %s", self.kind_prefix, describe_group(group))
            self.report.stand_in = describe_group(group)
            for donor, _ in group.members:
                self.report.refused.pop(donor.peer_id, None)
        return group

    def _timeout(self, limit: float) -> float:
        return max(0.001, min(limit, self._deadline - asyncio.get_running_loop().time()))

    async def _manifests(self) -> list[tuple[PeerAddress, Manifest]]:
        """Every donor's manifest that fits, in donor order. A donor still ``preparing`` its
        snapshot is waited for (``_manifest`` asks again) only while its answer could change
        the quorum: once the largest group holds a quorum of all the donors that answered
        or are still preparing, the rest are not waited for."""
        tasks = {asyncio.ensure_future(self._manifest(d)): d for d in self.donors}
        got: dict[PeerAddress, Manifest] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=self.config.preparing_retry_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    if (manifest := task.result()) is not None:
                        got[tasks[task]] = manifest
                waiting = {tasks[t].peer_id for t in pending}
                if waiting and waiting <= self._preparing and self._settled(got, len(waiting)):
                    for peer in waiting:
                        self.report.manifest_failures[peer] = (
                            "still preparing its snapshot; a quorum had answered without it"
                        )
                    break
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return [(d, got[d]) for d in self.donors if d in got]

    @staticmethod
    def _settled(got: dict[PeerAddress, Manifest], waiting: int) -> bool:
        """Whether the largest group of ``got`` wins even if all ``waiting`` donors answer."""
        groups = group_manifests(got.items())
        largest = max((len(g.members) for g in groups), default=0)
        return largest > 0 and largest >= quorum_size(len(got) + waiting)

    async def _manifest(self, donor: PeerAddress) -> Manifest | None:
        """The donor's manifest, or None (the reason goes to the report). A donor that
        answers ``preparing`` is asked again every ``preparing_retry_s`` for up to
        ``preparing_patience_s``."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        since: float | None = None
        try:
            while True:
                try:
                    reply = await self.endpoint.request(
                        donor, manifest_kind(self.kind_prefix),
                        to_header(ManifestRequest(chunk_bytes=cfg.chunk_bytes)),
                        timeout=self._timeout(cfg.manifest_timeout_s),
                    )
                    head = ManifestReply.model_validate(reply.header)
                    body = _single_uint8(reply.tensors, head.nbytes)
                    manifest = Manifest.model_validate_json(body.numpy().tobytes())
                    break
                except TransportError as exc:
                    now = loop.time()
                    if not (isinstance(exc, RemoteError) and exc.code == StateErrorCode.PREPARING
                            and (since is None or now - since < cfg.preparing_patience_s)):
                        self.report.manifest_failures[donor.peer_id] = (
                            f"{type(exc).__name__}: {exc}"[:200]
                        )
                        return None
                if since is None:
                    since = now
                    logger.info(
                        "%s: %s is taking a snapshot of its state (its stage's averaging round "
                        "runs); asking again every %g s for up to %g s", self.kind_prefix,
                        donor.peer_id[:12], cfg.preparing_retry_s, cfg.preparing_patience_s,
                    )
                self._preparing.add(donor.peer_id)
                await asyncio.sleep(cfg.preparing_retry_s)
        except (ValidationError, ValueError) as exc:
            self._refuse(donor, f"bad manifest: {str(exc)[:160]}")
            return None
        finally:
            self._preparing.discard(donor.peer_id)
        if since is not None:
            logger.info("%s: %s's snapshot was ready after %.1f s", self.kind_prefix,
                        donor.peer_id[:12], loop.time() - since)
        if manifest.chunk_bytes != cfg.chunk_bytes or manifest.total_bytes > cfg.max_state_bytes:
            self._refuse(donor, (
                f"manifest of {manifest.total_bytes} bytes in chunks of {manifest.chunk_bytes} "
                f"(asked {cfg.chunk_bytes}, limit {cfg.max_state_bytes})"
            ))
            return None
        if self.expected is not None:
            mismatch = layout_mismatch(manifest, self.expected)
            if mismatch is not None:
                self._refuse(donor, f"not this stage's layout: {mismatch}")
                return None
        return manifest

    def _refuse(self, donor: PeerAddress, reason: str) -> None:
        """``donor`` answered with a state this stage cannot use: none of it is allocated."""
        logger.warning("%s: refusing the state offered by %s: %s",
                       self.kind_prefix, donor.peer_id[:12], reason[:300])
        self.report.refused[donor.peer_id] = reason[:300]

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
            return min(
                self.config.endgame_factor * statistics.median(took), self.config.chunk_timeout_s
            )

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
                        # a back-off, not a wait on state
                        await asyncio.sleep(self.config.busy_backoff_s)
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
        digest = await off_loop(chunk.nbytes, lambda: state_digest(arr))
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
    expected: StateLayout | None = None,
    stand_in: bool = False,
) -> Snapshot:
    """Download a stage's state from ``donors`` (see the module docstring).

    The keyword settings override ``config``; ``progress(done_bytes, total_bytes)`` is
    called as chunks arrive; ``expected`` is the stage's own layout, which every manifest
    must match. Raises StateTransferError when no donor can deliver (UntrustedStateError
    when donors answered but none can be trusted). ``stand_in``: where no quorum agrees,
    take :func:`~.state_plan.choose_stand_in`'s group instead (a caller that waited long
    enough for a quorum).
    """
    overrides = {
        k: v for k, v in (("timeout_s", timeout_s), ("chunk_bytes", chunk_bytes),
                          ("max_parallel_per_donor", max_parallel_per_donor)) if v is not None
    }
    base = config or StateTransferConfig()
    cfg = (
        StateTransferConfig.model_validate({**base.model_dump(), **overrides})
        if overrides
        else base
    )
    download = StateDownload(
        endpoint, donors, kind_prefix=kind_prefix, config=cfg, progress=progress,
        expected=expected, stand_in=stand_in,
    )
    snapshot = await download.run()
    assert snapshot is not None  # only a ``wanted`` declines
    return snapshot


async def download_wanted_state(
    endpoint: Endpoint,
    donors: Sequence[PeerAddress],
    wanted: Wanted,
    *,
    kind_prefix: str,
    config: StateTransferConfig | None = None,
    progress: Progress | None = None,
    expected: StateLayout | None = None,
    stand_in: bool = False,
) -> Snapshot | None:
    """:func:`download_state`, asking ``wanted(epoch, meta)`` of the quorum's state (or the
    stand-in's) once the donors' manifests decided it, before any chunk: None when it
    answers False (a replica that catches up takes only a state ahead of its own)."""
    download = StateDownload(endpoint, donors, kind_prefix=kind_prefix, config=config,
                             progress=progress, expected=expected, wanted=wanted,
                             stand_in=stand_in)
    return await download.run()
