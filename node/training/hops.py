"""One hop: a request to a server of one stage, re-routed to another when it fails.

Every hop picks a server of its stage with the router (routing.py: expected completion
time, stochastic wiring, bans with back-off) among the candidates of the trainer's server
view (servers.py). A timeout, a lost connection, a reply that breaks the protocol or an
error answer bans that server and the hop goes elsewhere, at most ``max_attempts`` times;
then ``HopFailed`` abandons its micro-batch. A ``cache_miss`` is no failure (the server is
healthy but no longer holds the input): the caller's next attempt carries the input. While
a stage has no online server, an attempt waits ``no_server_wait_s`` (jittered) instead. When
a failed attempt leaves no server of the stage that this hop has not tried and that is not
banned (every one refused it as busy, failed it, or is serving a ban), the next attempt
waits ``retry_backoff_s``, doubled per attempt: a stage whose only server fails at once
(say, a connection that cannot be made) costs a trainer a few attempts a second, not
hundreds of micro-batches.

A reply whose values no honest server sends (``BadValues``: NaN/Inf, or beyond the run's
``[limits]``; pipeline.py checks every stage output on receipt) is a failure of the server
that sent it like any broken reply: it is banned and the hop goes elsewhere, so the value
is never relayed. ``out_of_range`` from a server (our request or its result exceeds the
bounds) re-routes the hop too.

When a server refuses a payload that the trainer relayed undecoded (a stage output, as it
came from the stage before), the trainer decodes it itself: if it is bad, its sender is
banned and the micro-batch fails (the refusing server did nothing wrong); if not, the
refusing server is treated as failing.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel

from ...transport.codecs import CodecSpec
from ...transport.endpoint import PathStats, PeerAddress, Response
from ...transport.errors import ProtocolError, RemoteError, TransportError
from ...transport.tensors import PAYLOAD_ERROR_CODES, ReceivedTensor, Sendable, sendable_nbytes
from ..config.runspec import RunSpec
from ..errors import NodeError
from ..logs import get_logger
from ..protocol import RETRY_ELSEWHERE, BadReply, BadValues, ErrorCode, Kind, to_header
from ..timing import jittered
from .routing import Candidate, Router
from .servers import ServerView

if TYPE_CHECKING:  # trainer_config imports spot_checks, which imports this module
    from .trainer_config import TrainerConfig

log = get_logger(__name__)

_R = TypeVar("_R")


class RequestSender(Protocol):
    """What the trainer needs from the endpoint."""

    @property
    def peer_id(self) -> str: ...

    async def request(
        self,
        peer: PeerAddress,
        kind: str,
        header: dict[str, Any],
        tensors: Sequence[Sendable] = (),
        *,
        codec: CodecSpec | None = None,
        timeout: float,
        allow_nonfinite: bool = False,
        lazy: bool = False,
    ) -> Response: ...

    def path_stats(self, peer_id: str) -> PathStats | None: ...


# A hop's share of one forward+backward, the work a server's announced throughput counts
# (a backward costs about twice a forward): its measured time is scaled by it.
_WORK_SHARE: dict[str, float] = {
    Kind.FORWARD: 1 / 3,
    Kind.EVAL_LOSS: 1 / 3,
    Kind.BACKWARD: 2 / 3,
    Kind.FORWARD_LOSS: 1.0,
}


class HopFailed(NodeError):
    """A hop failed on every attempt; its micro-batch is abandoned."""


class NoOtherReplica(HopFailed):
    """Every server of the stage is excluded (a spot check found no second replica)."""


class HopCounts(Protocol):
    """The counters hops write (fields of the trainer's ``TrainerCounters``)."""

    retried_hops: int
    backoffs: int  # waits because no server of a stage was left to try at once
    cache_misses: int
    payload_bytes_sent: int
    payload_bytes_received: int
    hops: Counter[int]  # successful hops per stage
    errors: Counter[str]  # failed attempts by code/exception
    compute_s: float  # device seconds the servers reported for our successful hops
    spot_check_compute_s: float  # of which spent on spot checks' second and third replicas


class HopSender:
    """Sends the hops of one trainer (see the module docstring)."""

    def __init__(
        self,
        spec: RunSpec,
        config: TrainerConfig,
        *,
        endpoint: RequestSender,
        view: ServerView,
        router: Router,
        counters: HopCounts,
        rng: random.Random,
    ) -> None:
        self.spec, self.config = spec, config
        self.endpoint = endpoint
        self.view = view
        self.router = router
        self.counters = counters
        self.rng = rng

    async def send(
        self,
        stage: int,
        kind: Kind,
        make: Callable[[str, int], tuple[BaseModel, list[Sendable]]],
        payload: Callable[[str], int],
        check: Callable[[Response], Awaitable[_R]],
        *,
        carry_to: set[str] | None = None,
        exclude: frozenset[str] = frozenset(),
        spot_check: bool = False,
    ) -> tuple[_R, str]:
        """Send one hop to a server of ``stage``, re-routing on failure; returns (result, peer).

        ``make(peer, attempt)`` builds the request for the server picked, ``payload(peer)``
        says how many bytes it would carry there, ``check`` turns the response into the
        result (raising ``BadReply`` if it breaks the protocol). A server that answers
        ``cache_miss`` is added to ``carry_to`` when given (else it counts as failing).

        HopFailed at once when the server refused a payload that we relayed and that is
        bad indeed (``_check_relayed``): no other server would take it either. Servers in
        ``exclude`` are never asked (NoOtherReplica when no other is online); a
        ``spot_check`` hop's compute is counted apart.

        Every success is a measurement of the server's throughput for the router: the
        hop's wall time less the path's RTT and the payload's transfer time.
        """
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        last = "no attempt"
        B = self.spec.batch.micro_batch_size
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.counters.retried_hops += 1
            candidates = self.view.candidates(stage)
            if exclude:
                every = candidates
                candidates = [c for c in every if c.peer_id not in exclude]
                if every and not candidates:
                    raise NoOtherReplica(f"stage {stage} has no server outside {sorted(exclude)}")
            if not candidates:
                last = f"no online server for stage {stage}"
                await asyncio.sleep(jittered(self.config.no_server_wait_s, 0.2, self.rng))
                continue
            sizes = {c.peer_id: payload(c.peer_id) for c in candidates}
            pick = self.router.choose(
                candidates,
                payload_bytes=sizes,
                batch_size=B,
                now=loop.time(),
                rng=self.rng,
                avoid=tried,
            )
            if pick is None:  # every candidate was convicted of lying
                last = f"no trusted server for stage {stage}"
                await asyncio.sleep(jittered(self.config.no_server_wait_s, 0.2, self.rng))
                continue
            server = self.view.server(pick.peer_id)
            header, tensors = make(server.peer_id, attempt)
            self.router.started(server.peer_id)
            sent_at = loop.time()
            try:
                response = await self.endpoint.request(
                    server.target,
                    str(kind),
                    to_header(header),
                    tensors,
                    timeout=self.config.request_timeout_s,
                    lazy=True,
                )
                result = await check(response)
            except RemoteError as exc:
                self.counters.errors[exc.code] += 1
                last = f"{server.peer_id}: {exc}"
                if exc.code in PAYLOAD_ERROR_CODES:
                    await self._check_relayed(tensors, server.peer_id, f"{kind} on stage {stage}")
                if exc.code == ErrorCode.CACHE_MISS and carry_to is not None:
                    self.counters.cache_misses += 1
                    carry_to.add(server.peer_id)  # a healthy server that lost the input
                    self.router.finished(server.peer_id, ok=True, now=loop.time(), rng=self.rng)
                    continue
                if exc.code not in RETRY_ELSEWHERE:
                    log.warning("trainer: %s on stage %d refused: %s", kind, stage, exc)
                self._failed(server.peer_id, tried, loop.time())
                await self._back_off(stage, tried, attempt)
                continue
            except (TransportError, BadReply) as exc:
                self.counters.errors[type(exc).__name__] += 1
                last = f"{server.peer_id}: {type(exc).__name__}: {exc}"
                if isinstance(exc, BadValues):
                    log.warning(
                        "trainer: %s on stage %d: refused the reply of %s: %s",
                        kind, stage, server.peer_id, exc,
                    )
                self._failed(server.peer_id, tried, loop.time())
                await self._back_off(stage, tried, attempt)
                continue
            now = loop.time()
            self.router.finished(server.peer_id, ok=True, now=now, rng=self.rng)
            sent = sum(sendable_nbytes(t) for t in tensors)
            received = sum(sendable_nbytes(t) for t in response.tensors)
            self._measure(pick, B * _WORK_SHARE.get(kind, 1.0), now - sent_at, sent + received)
            self.counters.hops[stage] += 1
            self.counters.payload_bytes_sent += sent
            self.counters.payload_bytes_received += received
            compute = _reported_compute(response)
            self.counters.compute_s += compute
            if spot_check:
                self.counters.spot_check_compute_s += compute
            return result, server.peer_id
        raise HopFailed(
            f"{kind} on stage {stage} failed {self.config.max_attempts} times; last: {last}"
        )

    async def _back_off(self, stage: int, tried: set[str], attempt: int) -> None:
        """After a failed attempt: when no server of ``stage`` is left that this hop has
        not tried and that the router would pick (not banned, not on probation with a
        probe in flight), wait ``retry_backoff_s`` doubled per attempt (jittered, at most
        16x) before the next attempt, instead of spending every attempt within
        milliseconds on servers that just failed or whose queues are full (a replica
        stalled in an averaging round fills its queue). A hop with another server to try
        goes there at once; the last attempt does not wait."""
        if attempt + 1 >= self.config.max_attempts:
            return
        now = asyncio.get_running_loop().time()
        if any(
            c.peer_id not in tried and self.router.is_available(c.peer_id, now)
            for c in self.view.candidates(stage)
        ):
            return
        delay = self.config.retry_backoff_s * min(2**attempt, 16)
        self.counters.backoffs += 1
        await asyncio.sleep(jittered(delay, 0.2, self.rng))

    def _measure(self, pick: Candidate, work: float, elapsed_s: float, nbytes: int) -> None:
        """One measurement of ``pick``'s throughput: ``work`` samples of forward+backward
        in the hop's wall time less the path's RTT and the payload's transfer time (the
        router's defaults where unmeasured)."""
        cfg = self.router.config
        rtt = pick.rtt_s if pick.rtt_s is not None and pick.rtt_s > 0 else cfg.default_rtt_s
        rate = pick.delivery_rate_bps
        rate = rate if rate is not None and rate > 0 else cfg.default_delivery_rate_bps
        self.router.observe(
            pick.peer_id, batch_size=work, service_s=elapsed_s - rtt - nbytes * 8.0 / rate
        )

    def _failed(self, peer_id: str, tried: set[str], now: float) -> None:
        tried.add(peer_id)
        self.router.finished(peer_id, ok=False, now=now, rng=self.rng)

    async def _check_relayed(self, tensors: Sequence[Sendable], refuser: str, what: str) -> None:
        """``refuser`` refused a payload of ``tensors``: decode (and check) the ones we
        relayed undecoded. One that fails was bad when its sender produced it: the sender
        is banned, ``refuser`` did its job, and the micro-batch fails (HopFailed)."""
        loop = asyncio.get_running_loop()
        for t in tensors:
            if not isinstance(t, ReceivedTensor):
                continue
            try:
                await t.decode()
            except ProtocolError as exc:
                self.router.finished(refuser, ok=True, now=loop.time(), rng=self.rng)
                if t.sender:
                    self.router.ban(t.sender, now=loop.time(), rng=self.rng)
                raise HopFailed(
                    f"{what}: {refuser} refused the tensor relayed from {t.sender or '?'}, "
                    f"which is malformed indeed: {exc}"
                ) from None


def _reported_compute(response: Response) -> float:
    """The device seconds a reply's header reports (0 when absent or malformed: the
    figure is for the trainer's accounting, and the reply's own check validates it)."""
    value = response.header.get("compute_s") if isinstance(response.header, dict) else None
    if isinstance(value, int | float) and 0.0 <= value <= 86400.0:
        return float(value)
    return 0.0
