"""The request/response API the node codes against.

One :class:`Endpoint` per node: it listens on the node's QUIC port, serves the request
kinds registered with :meth:`Endpoint.register`, and sends requests to peers. Each
exchange is one bidirectional QUIC stream (framing.py): the requester sends a header
and the tensor payloads, then FIN; the server answers with a response or an error
message, then FIN. Connections are authenticated, one per peer pair, shared by all
concurrent requests and re-established when they fail (connections.py).

Failure modes, all subclasses of TransportError:

- ``RequestTimeout``: no complete response before the request's deadline (the stream is
  reset, which cancels the handler on the server);
- ``ConnectError``: the peer is unreachable or the connection died;
- ``PeerIdMismatch`` / ``AuthenticationError``: the peer is not who we expected;
- ``RemoteError(code)``: the server answered with an error: the handler raised
  ``RemoteError`` (e.g. ``busy``), ``internal`` for any other handler exception,
  ``unknown_kind``, or the ProtocolError code for a request it refused (``bad_frame``,
  ``too_large``, ``non_finite``, ...);
- ``ProtocolError`` (FramingError, PayloadError, CodecError): the response was malformed.

Tensors (tensors.py): a request or a response carries plain tensors (encoded with its
codec), EncodedTensors or ReceivedTensors (relayed as they came in: a trainer passes one
stage's output to the next without decoding and re-encoding it). A server's handler gets
its request's tensors decoded and checked: a payload with bad values is refused with its
error code before the handler runs. A requester gets the response's tensors decoded and
checked too, or, with ``lazy=True``, as ReceivedTensors that were checked against their
headers on receipt and decode (checking the values) on first access.

A request is re-sent at most once, and only when it went out on a connection made
before it that then died with no byte of reply (a peer that restarted, a path that
went away while idle); the node's request ids are idempotent.

NAT traversal (traversal.py, docs/nat.md). Every endpoint serves the built-in kinds
``_observe``, ``_observe_probe``, ``_dialback``, ``_introduce``, ``_introduction``,
``_relay`` and ``_relay_offer`` (node kinds cannot start with ``_``). A peer whose
``PeerAddress`` is not ``reachable`` and names a ``rendezvous`` is reached through it:
connection reversal, hole punching or a relay channel; :meth:`Endpoint.paths` tells which.
The node tells the endpoint whether it is itself reachable (``reachable``) and which
rendezvous to keep a connection with (:meth:`Endpoint.keep`).

Size: this module is the node's one facade over the transport, so it stays one module past
600 lines; the NAT methods at its end are thin delegates to traversal.py, kept here so that
the node depends on a single object.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import torch
from pydantic import ValidationError

from .budget import InboundBudget
from .codecs import CodecSpec, EncodedTensor
from .config import TransportConfig
from .connections import Connections
from .errors import (
    ConnectError,
    FecError,
    FramingError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    TransportError,
)
from .exchange import Inbound, Message, Outgoing, send_message
from .framing import WIRE_VERSION, MessageHeader, encode_header, error_header
from .identity import Identity
from .peer_address import PeerAddress, Resolver
from .quic_link import QuicLink
from .redundancy import LossEstimator
from .stream import QuicStream, StreamCode
from .tensors import ReceivedTensor, Sendable, decode_all, encode_all
from .transfers import TransferHub
from .traversal import BuiltinHandler, Traversal

__all__ = ["Endpoint", "Handler", "PathStats", "PeerAddress", "Request", "Response"]

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """A request as its handler gets it: the tensors decoded and checked on receipt.

    ``remote`` is the requester's address as we see it: the UDP source address of its
    connection, or for a relayed connection ``("relay:<relay peer id>", n)``.
    """

    peer_id: str
    kind: str
    header: dict[str, Any]
    tensors: list[torch.Tensor]
    remote: tuple[str, int] = ("", 0)
    # the tensors as they arrived (empty for a request built in-process): their payloads
    # tell each tensor's largest |value| on the host (``peaks``)
    received: list[ReceivedTensor] = field(default_factory=list)

    def peaks(self) -> list[float | None]:
        """Each tensor's largest |value| as its payload bounds it, computed on the host
        (:attr:`ReceivedTensor.peak`), None where unknown (not a float tensor, or a
        request built in-process): a handler checks values against a bound with it
        without asking the device that holds the decoded tensor."""
        if len(self.received) != len(self.tensors):
            return [None] * len(self.tensors)
        return [t.peak for t in self.received]


@dataclass
class Response:
    """A handler's answer, or what ``Endpoint.request`` returns.

    Sent: plain tensors go out encoded with ``codec`` (None = "none"), EncodedTensor and
    ReceivedTensor items as they are. Returned by a request: decoded tensors, or
    ReceivedTensors with ``lazy=True``.
    """

    header: dict[str, Any]
    tensors: list[Sendable] = field(default_factory=list)
    codec: CodecSpec | None = None


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class PathStats:
    """What the transport measured on the path to one peer."""

    smoothed_rtt: float
    min_rtt: float
    rtt_var: float
    loss_rate: float
    delivery_rate_bps: float
    bytes_sent: int
    bytes_received: int
    connected: bool
    max_udp_payload: int = 0  # largest datagram we send it (raised by path MTU probing)


@dataclass(frozen=True)
class _Registration:
    handler: Handler
    allow_nonfinite: bool
    max_bytes: int | None  # None: limit(kind), else the endpoint's default
    device: str | None = None  # where the request's tensors are decoded (None: the CPU)


class _StaleConnection(Exception):
    """The request's connection predates it and died with no byte of reply."""


class _Outgrown(Exception):
    """The path's MTU shrank under the request (path_mtu.py): one of its transfers had to
    stop, and the peer answered ``error`` (transfer_failed): it could not receive the
    request, its handler never ran, so the request may go again."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(str(error))
        self.error = error


class Endpoint:
    """Authenticated request/response over QUIC. See the module docstring."""

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        *,
        default_request_bytes: int | None = None,
    ) -> None:
        """``default_request_bytes``: the most payload bytes a request of a kind with no
        declared limit (``register(max_bytes=)`` or :meth:`limit`) may announce; None is
        ``limits.max_message_bytes``. A daemon sets it to 0: its kinds that take tensors
        declare their sizes, every other kind takes none."""
        self.identity = identity
        self.config = config
        self.budget = InboundBudget(config.limits.max_inbound_bytes)
        self._default_bytes = (
            config.limits.max_message_bytes if default_request_bytes is None
            else default_request_bytes
        )
        self._limits: dict[str, int] = {}
        self._connections = Connections(identity, config, self._on_link)
        self._handlers: dict[str, _Registration] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._hubs: dict[QuicLink, TransferHub] = {}
        self._loss: dict[str, LossEstimator] = {}
        self._ids = itertools.count(1)
        self._counts: Counter[str] = Counter()
        self._closed_bytes = Counter[str]()
        self._started = False
        self._closing = False
        self._traversal = Traversal(identity, config, self._connections, self._ask)
        for kind, builtin in self._traversal.handlers().items():  # they take no tensors
            self._handlers[kind] = _Registration(_builtin(builtin), False, max_bytes=0)

    # lifecycle

    async def start(self, host: str | None = None, port: int | None = None) -> None:
        """Bind the QUIC port (defaults from the config; port 0 picks a free one)."""
        await self._connections.start(
            self.config.host if host is None else host,
            self.config.port if port is None else port,
        )
        self._started = True

    @property
    def address(self) -> tuple[str, int]:
        return self._connections.address

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def close(self) -> None:
        """Stop taking requests, let in-flight handlers finish (``shutdown_timeout_s``),
        cancel the rest, close every connection."""
        if self._closing:
            return
        self._closing = True
        await self._traversal.close(timeout=1.0)
        if self._serving:
            _, late = await asyncio.wait(
                list(self._serving), timeout=self.config.shutdown_timeout_s
            )
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        await self._connections.close(timeout=min(1.0, self.config.shutdown_timeout_s))

    async def __aenter__(self) -> Self:
        if not self._started:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # serving

    def register(
        self,
        kind: str,
        handler: Handler,
        *,
        allow_nonfinite: bool = False,
        max_bytes: int | None = None,
        device: str | None = None,
    ) -> None:
        """Serve requests of ``kind``; tensors with NaN/Inf are refused unless allowed.
        ``max_bytes``: the most payload bytes (all tensors, encoded) one request may
        announce, refused as ``too_large`` from its header alone; None takes the limit
        set with :meth:`limit`, else the endpoint's default. ``device``: decode the
        request's float tensors there (a stage server's GPU: the dequantize kernel writes
        straight into device memory; None: the CPU); integer ones stay on the CPU. Kinds
        starting with ``_`` are the endpoint's own."""
        if kind.startswith("_"):
            raise ValueError(f"{kind!r}: kinds starting with '_' are reserved")
        _check_kind(kind)
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._handlers[kind] = _Registration(handler, allow_nonfinite, max_bytes, device)

    def unregister(self, kind: str, handler: Handler) -> None:
        """Stop serving ``kind`` if ``handler`` still serves it (a later registration of the
        same kind, by whoever replaced this one, stays); requests of it then answer as an
        unknown kind."""
        registration = self._handlers.get(kind)
        if registration is not None and registration.handler == handler:
            del self._handlers[kind]

    def limit(self, kind: str, max_bytes: int) -> None:
        """Declare the most payload bytes a request of ``kind`` may announce (whoever
        registers its handler, before or after); ``register(max_bytes=)`` overrides it."""
        _check_kind(kind)
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._limits[kind] = max_bytes

    def max_request_bytes(self, kind: str) -> int | None:
        """The payload limit of requests of ``kind``; None if no handler serves it."""
        registration = self._handlers.get(kind)
        if registration is None:
            return None
        if registration.max_bytes is not None:
            return registration.max_bytes
        return self._limits.get(kind, self._default_bytes)

    def _admit(self, header: MessageHeader, nbytes: int) -> None:
        """A request's header, before anything is reserved or allocated: its kind is
        served and its payload within the kind's limit (else refused, unread)."""
        limit = self.max_request_bytes(header.kind)
        if limit is None:
            raise FramingError(f"no handler for {header.kind!r}", code="unknown_kind")
        if nbytes > limit:
            self._count(f"refused_size.{header.kind}")
            raise FramingError(
                f"a {header.kind!r} request carries at most {limit} payload bytes, "
                f"this one announces {nbytes}",
                code="too_large",
            )

    def _on_link(self, link: QuicLink) -> None:
        """An authenticated connection (either direction): serve its streams."""
        peer_id = link.peer_id or ""
        loss = self._loss.get(peer_id)
        if loss is None:
            loss = self._loss[peer_id] = LossEstimator(self.config.fec)
        self._hubs[link] = TransferHub(link, self.config, loss, self.budget)
        link.on_stream = lambda stream: self._on_stream(link, stream)
        link.on_closed.append(self._forget_link)
        self._traversal.on_link(link)

    def _forget_link(self, link: QuicLink) -> None:
        self._hubs.pop(link, None)
        self._closed_bytes["bytes_in"] += link.bytes_received
        self._closed_bytes["bytes_out"] += link.bytes_sent

    def _on_stream(self, link: QuicLink, stream: QuicStream) -> None:
        if self._closing:
            stream.abort(StreamCode.REFUSED)
            return
        task = asyncio.get_running_loop().create_task(self._serve(link, stream))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, link: QuicLink, stream: QuicStream) -> None:
        peer_id = link.peer_id or "?"
        hub = self._hubs.get(link)
        if hub is None:  # the connection closed under us
            stream.abort(StreamCode.CANCELLED)
            return
        inbound = Inbound(stream, hub, self.config, "request", admit=self._admit)
        outgoing: Outgoing | None = None
        request_id = 0
        try:
            try:
                async with asyncio.timeout(self.config.request_receive_timeout_s):
                    message = await inbound.message()
                request_id = message.header.request_id
                registration = self._handlers.get(message.header.kind)
                if registration is None:
                    raise RemoteError("unknown_kind", f"no handler for {message.header.kind!r}")
                received = _received(message, registration.allow_nonfinite, peer_id)
                tensors = await decode_all(received, registration.device)
                request = Request(
                    peer_id, message.header.kind, message.header.header, tensors,
                    remote=link.remote_address, received=received,
                )
                response = await self._run_handler(registration.handler, request, inbound.task)
            except TimeoutError:
                self._count("errors_sent.timeout")
                stream.abort(StreamCode.CANCELLED)
                return
            except ProtocolError as exc:
                logger.info("refused a request from %s: %s", peer_id, exc)
                await self._send_error(stream, request_id, exc.code, str(exc), refuse=True)
                return
            except FecError as exc:
                await self._send_error(stream, request_id, "transfer_failed", str(exc))
                return
            except RemoteError as exc:
                await self._send_error(stream, request_id, exc.code, exc.message)
                return
            try:
                encoded = await self._encode(response.tensors, response.codec)
                async with asyncio.timeout(self.config.response_send_timeout_s):
                    outgoing = await send_message(
                        stream, hub, self.config, type="response", request_id=request_id,
                        kind="", header=response.header, encoded=encoded, end=True,
                    )
                    if outgoing.transfers:  # serve repair requests until the requester ends
                        inbound.senders.update({t.transfer_id: t for t in outgoing.transfers})
                        await inbound.end()
            except (ProtocolError, FecError, ValueError, TypeError) as exc:
                logger.error("cannot send the response to %s: %s", peer_id, exc)
                await self._send_error(stream, request_id, "internal", "unsendable response")
            except TimeoutError:
                self._count("errors_sent.timeout")
                stream.abort(StreamCode.CANCELLED)
        except ConnectError:
            return  # the requester went away: reset, or the connection closed
        except Exception:
            logger.exception("serving a request from %s failed", peer_id)
            stream.abort(StreamCode.CANCELLED)
        finally:
            if outgoing is not None:
                outgoing.finish()
            inbound.close()

    async def _run_handler(
        self, handler: Handler, request: Request, reading: asyncio.Task[None]
    ) -> Response:
        """Run the handler while its stream is read on: a reset by the requester, its
        connection closing or bytes that do not belong there cancel it. RemoteError
        passes through; any other failure of the handler becomes ``internal``."""
        work = asyncio.ensure_future(handler(request))
        watched: list[asyncio.Future[Any]] = [work, reading]
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and reading.exception() is None:
                await asyncio.wait([work])  # the requester ended its direction cleanly
            if not work.done():
                work.cancel()
                await asyncio.wait([work])
                error = reading.exception()
                raise error if isinstance(error, TransportError) else ConnectError("stream failed")
        finally:
            if not work.done():  # we were cancelled (the endpoint is closing)
                work.cancel()
        try:
            response = work.result()
        except RemoteError:
            raise
        except Exception as exc:
            logger.exception("handler for %r raised", request.kind)
            raise RemoteError("internal", type(exc).__name__) from exc
        if not isinstance(response, Response):
            logger.error("handler for %r returned %r, not a Response", request.kind, response)
            raise RemoteError("internal", "handler returned no Response")
        self._count("requests_served")
        return response

    async def _send_error(
        self, stream: QuicStream, request_id: int, code: str, message: str, *, refuse: bool = False
    ) -> None:
        self._count(f"errors_sent.{code}")
        frame = encode_header(error_header(request_id, code, message), self.config.limits)
        try:
            async with asyncio.timeout(self.config.response_send_timeout_s):
                await stream.write(frame, end=True)
        except (TimeoutError, ConnectError):
            stream.abort(StreamCode.CANCELLED)
            return
        if refuse:
            stream.abort(StreamCode.REFUSED)  # stop reading what is left of a bad request

    # requesting

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
    ) -> Response:
        """Send a request and wait for its response.

        ``codec`` encodes the plain tensors (None = "none"); EncodedTensor items go as
        they are, ReceivedTensor items as they came in. The response's tensors come
        decoded (torch.Tensor) or, with ``lazy``, as ReceivedTensors, checked against
        their headers here and decoded on first access (tensors.py says what is checked
        when). ``allow_nonfinite`` accepts NaN/Inf in the response's tensors.
        """
        if self._closing or not self._started:
            raise ConnectError("endpoint is not running")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._count("requests_sent")
        try:
            async with asyncio.timeout_at(deadline):
                encoded = await self._encode(tensors, codec)
                request_id = next(self._ids)
                for attempt in range(2):
                    started = loop.time()
                    link = await self._connections.get(peer)
                    try:
                        message = await self._exchange(
                            link, request_id, kind, header, encoded, started
                        )
                        break
                    except _StaleConnection:
                        if attempt == 1:
                            raise link.closed_error() from None
                        logger.info("connection to %s was dead; re-sending request %d",
                                    peer.peer_id, request_id)
                    except _Outgrown as exc:
                        if attempt == 1:
                            raise exc.error from None
                        self._count("requests_resent.path_shrank")
                        logger.info("the path to %s shrank under request %d; re-sending it "
                                    "in smaller datagrams", peer.peer_id, request_id)
                received = _received(message, allow_nonfinite, peer.peer_id)
                if lazy:
                    tensors_out: list[Sendable] = list(received)
                else:
                    tensors_out = list(await decode_all(received))
        except TimeoutError:
            self._count("errors.timeout")
            raise RequestTimeout(
                f"{kind} request to {peer.peer_id} got no complete response in {timeout:.3g} s"
            ) from None
        except RemoteError as exc:
            self._count(f"errors_received.{exc.code}")
            raise
        except TransportError as exc:
            self._count(f"errors.{type(exc).__name__}")
            raise
        return Response(header=message.header.header, tensors=tensors_out)

    async def _exchange(
        self,
        link: QuicLink,
        request_id: int,
        kind: str,
        header: dict[str, Any],
        encoded: list[EncodedTensor],
        started: float,
    ) -> Message:
        hub = self._hubs.get(link)
        if hub is None:
            raise link.closed_error()
        stream = link.open_stream()
        outgoing: Outgoing | None = None
        inbound: Inbound | None = None
        done = False
        try:
            with link.expecting_traffic():
                try:
                    outgoing = await send_message(
                        stream, hub, self.config, type="request", request_id=request_id,
                        kind=kind, header=header, encoded=encoded, end=False,
                    )
                except ConnectError:
                    if link.is_closed or not stream.can_receive:
                        raise
                    # the server stopped our upload (STOP_SENDING): its answer says why
                senders = {t.transfer_id: t for t in outgoing.transfers} if outgoing else {}
                inbound = Inbound(stream, hub, self.config, "response", senders)
                message = await inbound.message()
            stream.end()  # after the completions of the response's transfers
            done = True
        except ConnectError:
            stale = link.created_at < started and stream.bytes_received == 0
            if stale and link.is_closed:
                raise _StaleConnection() from None
            raise
        finally:
            if outgoing is not None:
                outgoing.finish()
            if inbound is not None:
                inbound.close()
            if not done:
                stream.abort(StreamCode.CANCELLED)
        if message.header.type == "error":
            error = RemoteError(
                message.header.error_code or "error", message.header.error_message or ""
            )
            if error.code == "transfer_failed" and outgoing is not None and any(
                t.outgrown for t in outgoing.transfers
            ):
                raise _Outgrown(error)
            raise error
        return message

    async def ping(self, peer: PeerAddress, *, timeout: float) -> float:
        """Round-trip time of a QUIC PING to ``peer`` in seconds (connecting if needed)."""
        try:
            async with asyncio.timeout(timeout):
                link = await self._connections.get(peer)
                return await link.ping()
        except TimeoutError:
            raise RequestTimeout(
                f"ping to {peer.peer_id} timed out after {timeout:.3g} s"
            ) from None

    async def _ask(
        self, target: PeerAddress | QuicLink, kind: str, header: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """A built-in request without tensors, to a peer or over one connection; the
        response header."""
        if isinstance(target, PeerAddress):
            return (await self.request(target, kind, header, timeout=timeout)).header
        self._count("requests_sent")
        try:
            async with asyncio.timeout(timeout):
                loop = asyncio.get_running_loop()
                message = await self._exchange(
                    target, next(self._ids), kind, header, [], loop.time()
                )
        except TimeoutError:
            raise RequestTimeout(
                f"{kind} request to {target.peer_id} got no response in {timeout:.3g} s"
            ) from None
        except _StaleConnection:
            raise target.closed_error() from None
        return message.header.header

    # NAT traversal

    @property
    def reachable(self) -> bool:
        """Whether peers can connect to us at our announced address (the node's
        dial-back says so): introduced peers then reverse instead of punching."""
        return self._traversal.reachable

    @reachable.setter
    def reachable(self, value: bool) -> None:
        self._traversal.reachable = value

    async def observe(self, peer: PeerAddress, *, timeout: float) -> tuple[str, int]:
        """Our address as ``peer`` sees it (the UDP source of our connection to it)."""
        self._check_running()
        return await self._traversal.observe(peer, timeout)

    async def observe_mapping(
        self, peer: PeerAddress, *, timeout: float
    ) -> tuple[tuple[str, int], tuple[str, int] | None]:
        """Our address as ``peer`` sees it on its QUIC port, and as it saw probe packets
        from our QUIC socket to its alternate port (another destination: a NAT that maps
        per destination gives them another port), or None when it could not tell.
        ``timeout`` must exceed the peer's ``traversal.probe_wait_s``."""
        self._check_running()
        return await self._traversal.observe_mapping(peer, timeout)

    async def dial_back(self, peer: PeerAddress, *, timeout: float) -> bool:
        """Whether ``peer`` could open a new connection to our observed address from a
        port we never sent to. ``timeout`` must exceed the peer's
        ``traversal.dialback_timeout_s``; RemoteError when the peer refuses (rate
        limit, ``busy``)."""
        self._check_running()
        return await self._traversal.dial_back(peer, timeout)

    async def keep(
        self, peer: PeerAddress, *, timeout: float, resolve: Resolver | None = None
    ) -> None:
        """Use ``peer`` as our rendezvous: keep a connection to it open (re-made when it
        dies, PINGed every ``traversal.keepalive_interval_s``) and accept introductions
        and relay channels through it. ConnectError if the first connection is not up
        within ``timeout`` s; it goes on being tried until :meth:`release`. Before each
        re-dial after a failure, ``resolve(peer_id)`` gives the peer's newest address
        (a restarted rendezvous on another port); calling ``keep`` again updates it."""
        self._check_running()
        await self._traversal.keep(peer, timeout, resolve)

    def release(self, peer_id: str) -> None:
        """Stop keeping ``peer_id`` as a rendezvous."""
        self._traversal.release(peer_id)

    @property
    def rendezvous(self) -> list[PeerAddress]:
        """The rendezvous peers we keep."""
        return self._traversal.rendezvous

    def paths(self) -> dict[str, str]:
        """How the connection to each connected peer was made: "direct", "reversed",
        "punched" or "relayed"."""
        paths: dict[str, str] = {}
        for peer_id in {link.peer_id for link in self._connections.links()}:
            link = self._connections.link_for(peer_id or "")
            if peer_id and link is not None:
                paths[peer_id] = link.path
        return paths

    def traversal_counts(self) -> dict[str, int]:
        """Counters of the traversal machinery: relay forwarding and drops, punch and
        non-QUIC packets, relay channels we are an end of."""
        socket = self._connections.socket
        counts: Counter[str] = Counter()
        counts.update({f"socket.{k}": v for k, v in socket.counts.items()})
        counts.update({f"relay_end.{k}": v for k, v in socket.relay_ends.counts.items()})
        if self._traversal.relay is not None:
            relay = self._traversal.relay
            counts.update({f"relay.{k}": v for k, v in relay.counts.items()})
            counts["relay.channels"] = len(relay.channels)
        counts["relay_end.channels"] = len(socket.relay_ends)
        probe_port = self._traversal.probe_port
        if probe_port is not None:
            counts.update({f"probe_port.{k}": v for k, v in probe_port.counts.items()})
        return dict(counts)

    def _check_running(self) -> None:
        if self._closing or not self._started:
            raise ConnectError("endpoint is not running")

    # measurements

    def path_stats(self, peer_id: str) -> PathStats | None:
        link = self._connections.link_for(peer_id)
        if link is None:
            return None
        stats = link.stats()
        fec = self._loss.get(peer_id)
        # FEC transfers measure datagram loss directly; else QUIC's packet loss counts
        loss_rate = fec.loss_rate if fec is not None and fec.samples else stats.loss_rate
        return PathStats(
            smoothed_rtt=stats.smoothed_rtt,
            min_rtt=stats.min_rtt,
            rtt_var=stats.rtt_var,
            loss_rate=loss_rate,
            delivery_rate_bps=stats.delivery_rate_bps,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            connected=stats.connected,
            max_udp_payload=stats.max_udp_payload,
        )

    def totals(self) -> dict[str, int]:
        """Counters: bytes_in/bytes_out (UDP), requests_sent/served, errors by code, the
        inbound budget's bytes reserved now and at peak, and its 'busy' refusals."""
        totals = Counter(self._counts)
        totals.update(self._closed_bytes)
        for link in self._connections.socket.links:
            totals["bytes_in"] += link.bytes_received
            totals["bytes_out"] += link.bytes_sent
        for key in ("bytes_in", "bytes_out", "requests_sent", "requests_served"):
            totals.setdefault(key, 0)
        totals["inbound_reserved"] = self.budget.used
        totals["inbound_peak"] = self.budget.peak
        totals["inbound_busy"] = self.budget.counts["refused"]
        return dict(totals)

    def _count(self, key: str) -> None:
        self._counts[key] += 1

    # tensors

    async def _encode(
        self, tensors: Sequence[Sendable], codec: CodecSpec | None
    ) -> list[EncodedTensor]:
        if len(tensors) > self.config.limits.max_tensors:
            raise FramingError(f"{len(tensors)} tensors exceed max_tensors")
        return await encode_all(tensors, codec)


def _check_kind(kind: str) -> None:
    try:
        MessageHeader(version=WIRE_VERSION, type="request", request_id=0, kind=kind)
    except ValidationError as exc:
        raise ValueError(f"{kind!r} cannot be a request kind on the wire: {exc}") from None


def _builtin(handler: BuiltinHandler) -> Handler:
    """A built-in traversal handler as an endpoint handler (it takes no tensors)."""

    async def serve(request: Request) -> Response:
        if request.tensors:
            raise RemoteError("bad_request", "this request takes no tensors")
        return Response(await handler(request.peer_id, request.remote, request.header))

    return serve


def _received(message: Message, allow_nonfinite: bool, sender: str) -> list[ReceivedTensor]:
    """The message's tensors as received: checked against their headers, not decoded."""
    return [
        ReceivedTensor(plan, message.payloads[i], allow_nonfinite=allow_nonfinite, sender=sender)
        for i, plan in enumerate(message.plans)
    ]
