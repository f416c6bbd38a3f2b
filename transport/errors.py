"""Exceptions raised by wanswarm.transport.

Every error that crosses the package boundary is a ``TransportError``; third-party
exceptions (aioquic, raptorq, cryptography) are translated in the adapter modules that
import the library. The tree::

    TransportError
    ├── ConfigError                  a transport setting is unusable
    ├── IdentityError                key file missing, unreadable, too permissive, malformed
    ├── ProtocolError                a peer sent something we refuse (carries a wire error code)
    │   ├── FramingError             bad version, truncated, oversize, inconsistent header
    │   ├── PayloadError             tensor bytes that do not match their spec, non-finite values
    │   └── CodecError               unknown codec or payload layout
    ├── FecError                     erasure coding failed (block undecodable, bad symbol)
    ├── AuthenticationError          handshake failed: signature, replay, wrong peer id
    │   └── PeerIdMismatch           the peer proved an identity other than the expected one
    ├── ConnectError                 could not reach the peer / connection lost
    ├── RequestTimeout               no complete response before the request deadline
    └── RemoteError                  the peer answered with an error code (e.g. busy)

``settle`` marks the exception of a future nobody awaits as seen.
"""

from __future__ import annotations

import asyncio
from typing import Any


class TransportError(Exception):
    """Base class of every error raised by wanswarm.transport."""


class ConfigError(TransportError):
    """A transport setting is unusable."""


class IdentityError(TransportError):
    """A node key file is missing, unreadable, too permissive or malformed."""


class ProtocolError(TransportError):
    """A peer sent something we refuse. ``code`` is the wire error code sent back."""

    code: str = "protocol"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class FramingError(ProtocolError):
    """Bad version, truncated or oversize frame, or an inconsistent header."""

    code = "bad_frame"


class PayloadError(ProtocolError):
    """Tensor bytes that do not match their spec, or non-finite values where forbidden."""

    code = "bad_payload"


class CodecError(ProtocolError):
    """Unknown codec, or a payload whose layout does not match its codec."""

    code = "bad_codec"


class FecError(TransportError):
    """Erasure coding failed: an undecodable block or a malformed symbol."""


class AuthenticationError(TransportError):
    """The identity handshake failed (bad signature, replay, wrong binding)."""


class PeerIdMismatch(AuthenticationError):
    """The peer proved an identity other than the one we expected to reach."""


class ConnectError(TransportError):
    """The peer could not be reached, or the connection was lost."""


class RequestTimeout(TransportError):
    """No complete response arrived before the request's deadline."""


class RemoteError(TransportError):
    """The peer answered with an error code (``busy``, ``bad_frame``, ...)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


def settle(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (its awaiters, if any, got it too), so
    that asyncio does not log it as never retrieved; a done callback."""
    if not future.cancelled():
        future.exception()
