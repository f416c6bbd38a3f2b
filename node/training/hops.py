"""One hop: a request to a server of one stage, re-routed to another when it fails.

Every hop picks a server of its stage with the router (routing.py: expected completion
time, stochastic wiring, bans with back-off) among the candidates of the trainer's server
view (servers.py). A timeout, a lost connection, a reply that breaks the protocol or an
error answer bans that server and the hop goes elsewhere, at most ``max_attempts`` times;
then ``HopFailed`` abandons its micro-batch. A ``cache_miss`` is no failure (the server is
healthy but no longer holds the input): the caller's next attempt carries the input. While
a stage has no online server, an attempt waits ``no_server_wait_s`` (jittered) instead.

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
from typing import Any, Protocol, TypeVar

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
from .routing import Router
from .servers import ServerView
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


class HopFailed(NodeError):
    """A hop failed on every attempt; its micro-batch is abandoned."""


class HopCounts(Protocol):
    """The counters hops write (fields of the trainer's ``TrainerCounters``)."""

    retried_hops: int
    cache_misses: int
    payload_bytes_sent: int
    payload_bytes_received: int
    hops: Counter[int]  # successful hops per stage
    errors: Counter[str]  # failed attempts by code/exception


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
    ) -> tuple[_R, str]:
        """Send one hop to a server of ``stage``, re-routing on failure; returns (result, peer).

        ``make(peer, attempt)`` builds the request for the server picked, ``payload(peer)``
        says how many bytes it would carry there, ``check`` turns the response into the
        result (raising ``BadReply`` if it breaks the protocol). A server that answers
        ``cache_miss`` is added to ``carry_to`` when given (else it counts as failing).

        HopFailed at once when the server refused a payload that we relayed and that is
        bad indeed (``_check_relayed``): no other server would take it either.
        """
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        last = "no attempt"
        B = self.spec.batch.micro_batch_size
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.counters.retried_hops += 1
            candidates = self.view.candidates(stage)
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
            assert pick is not None  # candidates is not empty
            server = self.view.server(pick.peer_id)
            header, tensors = make(server.peer_id, attempt)
            self.router.started(server.peer_id)
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
                continue
            self.router.finished(server.peer_id, ok=True, now=loop.time(), rng=self.rng)
            self.counters.hops[stage] += 1
            self.counters.payload_bytes_sent += sum(sendable_nbytes(t) for t in tensors)
            self.counters.payload_bytes_received += sum(
                sendable_nbytes(t) for t in response.tensors
            )
            return result, server.peer_id
        raise HopFailed(
            f"{kind} on stage {stage} failed {self.config.max_attempts} times; last: {last}"
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
