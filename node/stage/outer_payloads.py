"""DiLoCo's outer payloads over our QUIC transport: the gather carries a digest, members fetch.

An outer round (diloco.py) needs every group member's compressed pseudo-gradient at every
other member. hivemind's matchmaking forms the group and its gather hands every member the
others' metadata, but a gathered value rides in a libp2p message (4 MiB) relayed through
the group's leader, which caps a replica's payload at 768 KiB. :class:`QuicOuterCarrier`
keeps matchmaking for the group and puts a descriptor in the gather instead of the bytes::

    {round, anchor, weight, payload_len, payload_sha256, transport_id, accuses}

and every member then fetches each other member's payload from that member's stage server
over the node's QUIC endpoint (WAN congestion control, FEC, the ``--wan`` emulator), one
request kind per stage::

    outer.s{stage}.payload  {v, run, sha256}  ->  {v, nbytes} + [payload as uint8]

The fetched bytes must have the descriptor's length and SHA-256: every member that takes a
round computes the mean from the same bytes as every other, as with the gather. What is
decided from the gathered descriptors alone (another round or anchor, a malformed
descriptor, a length that is not the stage's, two members naming one transport id) is
decided the same way everywhere: the member is left out of the mean. What depends on the
network (a member not in our peer table, a fetch that fails, times out or brings other
bytes) is not: a replica that cannot fetch every payload it needs takes the round as missed
(its residual restored, a newer outer state adopted from the stage, diloco.py), never a mean
of fewer members than the others took, which would split the replicas' anchors. What a
failed fetch teaches does go into the gathered data, of later rounds: a descriptor names in
``accuses`` the members whose payload its replica could not fetch in its last
``ACCUSE_ROUNDS`` rounds, and a member that more than half of the others name is left out
everywhere alike (:func:`without_accused`), so a member that withholds its payload stalls
one round of its group, not all of them.

Serving (:class:`PayloadServer`): a replica offers its payload as it starts its gather,
keyed by digest, and keeps the last ``HELD`` offers. Only the members of the offer's own
group (known when our gather ends; a request that comes first waits for it) may fetch it,
each at most ``SERVES_PER_MEMBER`` times; anyone else is refused without a byte of payload
sent.

Threads: :meth:`QuicOuterCarrier.start_gather` is called on the device thread; the round runs
as one coroutine on the node's event loop (waits for hivemind's gather, then fetches), and
the device thread polls its future. The server's handler runs on the event loop too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ...transport.endpoint import Endpoint, PeerAddress, Request, Response
from ...transport.errors import RemoteError, TransportError
from ...transport.tensors import off_loop
from ..logs import get_logger
from ..protocol import BadReply, parse_reply, parse_request, refuse, to_header
from .averaging import AveragingConfig

log = get_logger(__name__)

HELD = 2  # offers kept: the round under way and the one before (a slow member's fetch)
SERVES_PER_MEMBER = 2  # times one member may fetch one offer (a retry after a lost reply)
POLL_S = 0.05  # how often the round's coroutine looks at hivemind's gather
# a fetch refused or lost for a passing reason is tried once more (SERVES_PER_MEMBER allows
# it) when this much of its time is left
RETRY_CODES = frozenset({"busy", "transfer_failed"})
RETRY_MIN_S = 1.0
RETRY_PAUSE_S = 0.2
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SKIPPED = "not fetched: another member's fetch failed"
# a member whose payload we could not fetch is named in our descriptors for this many rounds
# (until a fetch from it succeeds); one named by more than half of the others is left out
ACCUSE_ROUNDS = 8
MAX_ACCUSED = 16  # names in one descriptor's ``accuses``
_MAX_ID = 128  # characters of a transport peer id


class PayloadErrorCode(StrEnum):
    """Error codes a payload server answers with (``RemoteError.code``)."""

    BAD_REQUEST = "bad_request"
    UNKNOWN = "unknown_payload"  # not held: another run, expired, never offered
    NOT_MEMBER = "not_member"  # the requester is not in the offer's group
    BUSY = "busy"  # the member fetched this offer SERVES_PER_MEMBER times already


def payload_kind(stage: int) -> str:
    return f"outer.s{stage}.payload"


def sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


class PayloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Literal[1] = 1
    run: str = Field(min_length=1, max_length=256)
    sha256: str = Field(pattern=_SHA256.pattern)


class PayloadReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Literal[1] = 1
    nbytes: int = Field(ge=0)


@dataclass
class _Offer:
    """One payload this replica offers its round's group."""

    run: str
    sha256: str
    data: torch.Tensor  # uint8, the payload's bytes
    members: set[str] | None = None  # transport ids allowed to fetch; None until our gather ends
    known: asyncio.Event = field(default_factory=asyncio.Event)
    served: Counter[str] = field(default_factory=Counter)


class PayloadServer:
    """Serves this replica's recent outer payloads under ``payload_kind(stage)`` (on the
    endpoint's event loop). ``member_wait_s``: how long a request that arrives before our
    gather told us the group waits for it."""

    def __init__(self, endpoint: Endpoint, stage: int, member_wait_s: float) -> None:
        self.kind = payload_kind(stage)
        self._endpoint = endpoint
        self._member_wait_s = member_wait_s
        self._offers: list[_Offer] = []
        self.counts: Counter[str] = Counter()  # served, served_bytes, errors.<code>
        endpoint.register(self.kind, self.handle, max_bytes=0)

    def close(self) -> None:
        self._endpoint.unregister(self.kind, self.handle)
        self._offers.clear()

    def offer(self, run: str, payload: bytes, digest: str | None = None) -> _Offer:
        """Hold ``payload`` (SHA-256 ``digest``, computed when not given) for the group of
        the round being gathered (event loop)."""
        digest = sha256_hex(payload) if digest is None else digest
        offer = _Offer(run, digest, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        # the same bytes again (a retried round) take a fresh group
        kept = ([o for o in self._offers if (o.run, o.sha256) != (run, digest)] + [offer])[-HELD:]
        for old in self._offers:
            if not any(old is k for k in kept):
                old.known.set()  # a request waiting for its group: the offer is gone
        self._offers = kept
        return offer

    @staticmethod
    def allow(offer: _Offer, members: set[str]) -> None:
        """The group's transport ids, once our gather ended (empty: the gather failed)."""
        offer.members = members
        offer.known.set()

    async def handle(self, request: Request) -> Response:
        try:
            return await self._serve(request)
        except RemoteError as exc:
            self.counts[f"errors.{exc.code}"] += 1
            raise

    async def _serve(self, request: Request) -> Response:
        if request.tensors:
            raise refuse(PayloadErrorCode.BAD_REQUEST, "payload requests carry no tensors")
        req = parse_request(PayloadRequest, request.header)  # bad_request when malformed
        offer = self._find(req)
        peer = request.peer_id
        if offer.members is None:
            try:
                await asyncio.wait_for(offer.known.wait(), self._member_wait_s)
            except TimeoutError:
                pass
            offer = self._find(req)  # still held?
        if offer.members is None or peer not in offer.members:
            raise refuse(PayloadErrorCode.NOT_MEMBER,
                         "only the members of this payload's round may fetch it")
        if offer.served[peer] >= SERVES_PER_MEMBER:
            raise refuse(PayloadErrorCode.BUSY,
                         f"this payload was sent to you {SERVES_PER_MEMBER} times already")
        offer.served[peer] += 1
        self.counts["served"] += 1
        self.counts["served_bytes"] += offer.data.numel()
        reply = PayloadReply(nbytes=offer.data.numel())
        return Response(header=to_header(reply), tensors=[offer.data])

    def _find(self, req: PayloadRequest) -> _Offer:
        for offer in self._offers:
            if offer.run == req.run and offer.sha256 == req.sha256:
                return offer
        raise refuse(PayloadErrorCode.UNKNOWN, "no such payload held (another run, or expired)")


@dataclass(frozen=True)
class PayloadLink:
    """What a QUIC carrier needs of its node: the endpoint, its event loop, and the stage's
    servers' addresses (``addresses()``, called on the loop)."""

    endpoint: Endpoint
    loop: asyncio.AbstractEventLoop
    addresses: Callable[[], Sequence[PeerAddress]]

    @property
    def max_payload_bytes(self) -> int:
        return self.endpoint.config.limits.max_message_bytes


def check_descriptors(
    gathered: dict[str, Any], ours: dict[str, Any], payload_len: int
) -> dict[str, dict[str, Any]]:
    """The members whose payloads this round needs, by hivemind peer: those
    :func:`well_formed` keeps and :func:`without_accused` does not leave out. Decided from
    the gathered data alone (the same everywhere)."""
    return without_accused(well_formed(gathered, ours, payload_len))


def well_formed(
    gathered: dict[str, Any], ours: dict[str, Any], payload_len: int
) -> dict[str, dict[str, Any]]:
    """The members whose descriptor is well formed, at our round and anchor, of the stage's
    length, and names a transport id no other member names, by hivemind peer."""
    ids = Counter(
        d.get("transport_id") for d in gathered.values()
        if isinstance(d, dict) and isinstance(d.get("transport_id"), str)
    )
    kept = {}
    for peer, d in gathered.items():
        if not isinstance(d, dict):
            continue
        tid, digest, length = d.get("transport_id"), d.get("payload_sha256"), d.get("payload_len")
        accuses = d.get("accuses", [])  # absent: a node from before accusations
        if (
            d.get("round") != ours["round"] or d.get("anchor") != ours["anchor"]
            or not isinstance(tid, str) or not 0 < len(tid) <= _MAX_ID or ids[tid] != 1
            or not isinstance(digest, str) or not _SHA256.match(digest)
            or type(length) is not int or length != payload_len
            or not isinstance(accuses, list) or len(accuses) > MAX_ACCUSED
            or not all(isinstance(a, str) and 0 < len(a) <= _MAX_ID for a in accuses)
        ):
            continue
        kept[peer] = d
    return kept


def without_accused(kept: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``kept`` less the members that more than half of the others accuse (name in their
    ``accuses``: they could not fetch its payload in a recent round). A member that
    withholds its payload makes every replica of its group miss one round; from the next,
    the others name it and leave it out, so it stalls no more rounds while an honest
    majority names it. A minority of liars cannot leave an honest member out."""
    accusers: Counter[str] = Counter()
    for d in kept.values():
        for accused in set(d.get("accuses", [])) - {d["transport_id"]}:
            accusers[accused] += 1
    others = len(kept) - 1
    return {peer: d for peer, d in kept.items() if 2 * accusers[d["transport_id"]] <= others}


class QuicOuterCarrier:
    """The payload half of an outer round over QUIC; ``inner`` (a HivemindCarrier) forms the
    group and gathers the descriptors. Offers ``start_gather`` (module docstring)."""

    name = "quic"

    def __init__(self, inner: Any, link: PayloadLink, stage: int, run: str,
                 config: AveragingConfig, round_timeout: float) -> None:
        """``round_timeout``: the gather's (``averaging.round_timeout_s``); the fetches get
        what remains of it after the gather, and at least half of it."""
        self._inner = inner
        self._link = link
        self._run = run
        self._fetches_at_once = config.outer_fetches_at_once
        # transport id -> rounds left to name it in our descriptors (ACCUSE_ROUNDS)
        self._accused: dict[str, int] = {}
        self.max_payload_bytes = link.max_payload_bytes
        self.counts: Counter[str] = Counter()  # fetched, fetched_bytes, fetch_failed.<why>
        # a member's request may come before our own gather ended (at most its timeout)
        self._server = _on_loop(link.loop, lambda: PayloadServer(
            link.endpoint, stage, member_wait_s=round_timeout + config.matchmaking_time
        ))

    @property
    def server(self) -> PayloadServer:
        return self._server

    # the rest of OuterCarrier: hivemind's
    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        found: tuple[dict[str, Any], list[torch.Tensor]] | None = self._inner.newer_state(timeout)
        return found

    def set_priority(self, value: float) -> None:
        self._inner.set_priority(value)

    def shutdown(self) -> None:
        try:
            _on_loop(self._link.loop, self._server.close)
        except (RuntimeError, TimeoutError) as exc:  # the loop already stopped
            log.info("outer payload server not closed: %r", exc)
        self._inner.shutdown()

    def gather(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        pending = self.start_gather(data, timeout)
        return pending.wait(2 * timeout + 15.0)

    def start_gather(self, data: dict[str, Any], timeout: float) -> _FuturePending:
        """Offer ``data["payload"]``, gather the group's descriptors and fetch their payloads,
        in the background; the result has every needed member's ``payload`` bytes."""
        future = asyncio.run_coroutine_threadsafe(self._round(data, timeout), self._link.loop)
        return _FuturePending(future)

    async def _round(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        started = time.monotonic()
        payload: bytes = data["payload"]
        digest = await off_loop(len(payload), lambda: sha256_hex(payload))
        described = {k: v for k, v in data.items() if k != "payload"}
        accuses = sorted(self._accused)[:MAX_ACCUSED]
        self._accused = {t: n - 1 for t, n in self._accused.items() if n > 1}
        described.update(payload_len=len(payload), payload_sha256=digest,
                         transport_id=self._link.endpoint.peer_id, accuses=accuses)
        offer = self._server.offer(self._run, payload, digest)
        try:
            pending = await asyncio.to_thread(self._inner.start_gather, described, timeout)
            deadline = time.monotonic() + timeout + 10.0  # hivemind ends it by its own timeout
            while not pending.done():
                if time.monotonic() > deadline:
                    log.info("%s: hivemind's gather outlived its timeout", self._run)
                    return None
                await asyncio.sleep(POLL_S)
            gathered = pending.result()
            if gathered is None:
                return None
            kept = well_formed(gathered, described, len(payload))
            needed = without_accused(kept)
            # the members may fetch ours while we fetch theirs
            self._server.allow(offer, {d["transport_id"] for d in needed.values()})
            me = self._link.endpoint.peer_id
            if not any(d["transport_id"] == me for d in needed.values()):
                # the others could not fetch our payload in recent rounds: they leave us out
                # (and refuse us theirs); we miss the round and adopt the newer state
                log.warning("%s: most of the round's members could not fetch our payload in "
                            "recent rounds and leave us out; round missed", self._run)
                self.counts["left_out_accused_self"] += 1
                return None
            if len(needed) < len(kept):
                self.counts["left_out_accused"] += len(kept) - len(needed)
                log.info("%s: %d member(s) left out, accused by most of the others of "
                         "withholding their payload", self._run, len(kept) - len(needed))
            left = max(timeout - (time.monotonic() - started), timeout / 2)
            return await self._fetch_all(gathered, needed, payload, described, left)
        finally:
            if offer.members is None:  # no group: nobody may fetch it
                self._server.allow(offer, set())

    async def _fetch_all(self, gathered: dict[str, Any], needed: dict[str, dict[str, Any]],
                         payload: bytes, ours: dict[str, Any], timeout: float
                         ) -> dict[str, Any] | None:
        """``gathered`` with each needed member's bytes as ``payload``; None when one of them
        could not be fetched (the replica then misses the round: module docstring).

        The fetches follow a rotation every member derives alike from the descriptors:
        members ordered by transport id, the member at position ``i`` fetches from
        ``i + 1``, ``i + 2``, ... in turn, ``fetches_at_once`` at a time (by default all).
        With fewer, each member's uplink serves about that many fetches at once, not
        ``group - 1``; in the lab that was slower, not faster (docs/averaging.md)."""
        book = {a.peer_id: a for a in self._link.addresses()}
        me = self._link.endpoint.peer_id
        order = sorted(d["transport_id"] for d in needed.values())
        by_id = {d["transport_id"]: peer for peer, d in needed.items()}
        start = order.index(me)  # _round returned already if we were left out
        rotation = [order[(start + k) % len(order)] for k in range(len(order))]
        targets: list[tuple[str, PeerAddress]] = []
        for tid in rotation:
            if tid == me:
                continue
            address = book.get(tid)
            if address is None:
                log.info("%s: round member %s is not among the stage's servers we know; "
                         "round missed", self._run, tid[:12])
                self.counts["fetch_failed.unknown_member"] += 1
                return None
            targets.append((by_id[tid], address))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        slots = asyncio.Semaphore(self._fetches_at_once)
        failed = asyncio.Event()

        async def one(peer: str, address: PeerAddress) -> bytes | str:
            async with slots:
                if failed.is_set():  # one fetch failed: the round is missed anyway
                    return _SKIPPED
                got = await self._fetch(address, needed[peer], deadline - loop.time())
                if isinstance(got, str):
                    failed.set()
                return got

        fetches = {peer: asyncio.ensure_future(one(peer, address)) for peer, address in targets}
        if fetches:
            await asyncio.wait(fetches.values())
        results = {peer: task.result() for peer, task in fetches.items()}
        failures = [(peer, got) for peer, got in results.items()
                    if isinstance(got, str) and got != _SKIPPED]
        for peer, got in results.items():
            tid = needed[peer]["transport_id"]
            if isinstance(got, bytes):
                self._accused.pop(tid, None)
            elif got != _SKIPPED:  # named in our next ACCUSE_ROUNDS descriptors
                self._accused[tid] = ACCUSE_ROUNDS
        if failures:
            peer, why = failures[0]
            log.info("%s: the payload of %s could not be fetched (%s); round missed",
                     self._run, needed[peer]["transport_id"][:12], why)
            return None
        out = dict(gathered)
        for peer, got in results.items():
            assert isinstance(got, bytes)
            out[peer] = {**needed[peer], "payload": got}
        for peer, d in needed.items():
            if d["transport_id"] == me and d["payload_sha256"] == ours["payload_sha256"]:
                out[peer] = {**d, "payload": payload}
        return out

    async def _fetch(self, address: PeerAddress, d: dict[str, Any], timeout: float
                     ) -> bytes | str:
        """The member's verified payload, or why not."""
        request = to_header(PayloadRequest(run=self._run, sha256=d["payload_sha256"]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in range(2):  # once more after a transient failure, while time is left
            try:
                reply = await self._link.endpoint.request(
                    address, self._server.kind, request, timeout=deadline - loop.time()
                )
                break
            except (RemoteError, TransportError) as exc:
                code = exc.code if isinstance(exc, RemoteError) else "transport"
                transient = code in RETRY_CODES or not isinstance(exc, RemoteError)
                if attempt == 0 and transient and deadline - loop.time() > RETRY_MIN_S:
                    self.counts["fetch_retried"] += 1
                    log.info("%s: fetching from %s failed (%s); once more", self._run,
                             address.peer_id[:12], code)
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                self.counts[f"fetch_failed.{code}"] += 1
                return f"{code}: {exc}"[:200]
        length = d["payload_len"]
        try:
            head = parse_reply(PayloadReply, reply.header)
            if head.nbytes != length or len(reply.tensors) != 1:
                raise ValueError(f"{head.nbytes} bytes in {len(reply.tensors)} tensors")
            data = reply.tensors[0]
            if (not isinstance(data, torch.Tensor) or data.dtype != torch.uint8
                    or tuple(data.shape) != (length,)):
                raise ValueError(f"expected uint8 ({length},)")
        except (BadReply, ValueError) as exc:
            self.counts["fetch_failed.bad_reply"] += 1
            return f"bad reply: {str(exc)[:160]}"
        raw = data.contiguous().numpy().tobytes()
        digest = await off_loop(length, lambda: sha256_hex(raw))
        if digest != d["payload_sha256"]:
            self.counts["fetch_failed.digest"] += 1
            return "the bytes do not match the gathered digest"
        self.counts["fetched"] += 1
        self.counts["fetched_bytes"] += length
        return raw


class _FuturePending:
    """A round running on the event loop, seen from the device thread (PendingGather)."""

    def __init__(self, future: concurrent.futures.Future[dict[str, Any] | None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> dict[str, Any] | None:
        try:
            return self._future.result(timeout=0)
        except Exception as exc:  # the round's coroutine failed: a missed round, logged
            log.warning("outer round failed: %r", exc)
            return None

    def wait(self, timeout: float) -> dict[str, Any] | None:
        concurrent.futures.wait([self._future], timeout=timeout)
        if not self._future.done():
            self._future.cancel()
            return None
        return self.result()


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
    """``fn()`` on ``loop``: directly when called there, else through it (5 s at most)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return fn()

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=5.0)
