"""The control API: a Unix socket in the state directory for ``wanswarm status``, ``leave``,
``pause`` and ``resume``.

Wire format, version 1: one request per connection, one JSON object per line, validated by
pydantic on both sides::

    -> {"v": 1, "op": "status"}
    <- {"v": 1, "ok": true, "result": {...StatusReport...}}
    -> {"v": 1, "op": "leave"}
    <- {"v": 1, "ok": true, "result": {"accepted": true, "already_leaving": false, ...}}
    -> {"v": 1, "op": "pause"}          (or "resume")
    <- {"v": 1, "ok": true, "result": {"paused": true, "components": ["stage_server", ...]}}
    <- {"v": 1, "ok": false, "error": {"code": "bad_request", "message": "..."}}

The socket is created mode 0600 inside the 0700 state directory: only the daemon's user may
talk to it. Every read has a deadline and a size bound; a bad request gets an error answer
and the daemon carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .errors import ControlProtocolError, DaemonNotRunning, StateDirError
from .logs import get_logger
from .status import StatusReport

log = get_logger(__name__)

CONTROL_VERSION: Final = 1
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL
MAX_SOCKET_PATH_BYTES = 107


class ControlConfig(BaseModel):
    """The local control socket used by 'wanswarm status' and 'wanswarm leave'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    socket: Path | None = Field(
        default=None,
        description="Path of the Unix socket (at most 107 bytes). Unset: <state_dir>/control.sock.",
    )
    request_timeout: float = Field(
        default=5.0, gt=0, le=300, description="Seconds a request or its answer may take."
    )
    max_request_bytes: int = Field(
        default=64 * 1024, ge=256, le=16 * 1024 * 1024, description="Largest request line accepted."
    )


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StatusRequest(_Message):
    v: Literal[1] = CONTROL_VERSION
    op: Literal["status"] = "status"


class LeaveRequest(_Message):
    v: Literal[1] = CONTROL_VERSION
    op: Literal["leave"] = "leave"


class PauseRequest(_Message):
    """Take no work (stay in the swarm, keep state); ``resume`` takes it again."""

    v: Literal[1] = CONTROL_VERSION
    op: Literal["pause", "resume"] = "pause"


Request = Annotated[StatusRequest | LeaveRequest | PauseRequest, Field(discriminator="op")]
_REQUEST: TypeAdapter[StatusRequest | LeaveRequest | PauseRequest] = TypeAdapter(Request)


class LeaveAck(_Message):
    """The daemon's answer to ``leave``: it has started (or was already on) the leave path."""

    accepted: bool
    already_leaving: bool
    pid: int
    shutdown_timeout_s: float


class PauseAck(_Message):
    """The daemon's answer to ``pause``/``resume``: its new state and the components told."""

    paused: bool
    components: list[str]
    pid: int


class ErrorBody(_Message):
    code: Literal["bad_request", "unsupported_version", "internal"]
    message: str


class OkResponse(_Message):
    v: Literal[1] = CONTROL_VERSION
    ok: Literal[True] = True
    result: dict[str, Any]


class ErrorResponse(_Message):
    v: Literal[1] = CONTROL_VERSION
    ok: Literal[False] = False
    error: ErrorBody


Response = Annotated[OkResponse | ErrorResponse, Field(discriminator="ok")]
_RESPONSE: TypeAdapter[OkResponse | ErrorResponse] = TypeAdapter(Response)


class ControlHandler(Protocol):
    """What the daemon exposes over the socket."""

    def status(self) -> StatusReport: ...

    def request_leave(self, reason: str) -> LeaveAck: ...

    def pause(self, paused: bool) -> dict[str, Any]: ...


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise StateDirError(
            f"control socket path {path} is {len(os.fsencode(path))} bytes, over the "
            f"{MAX_SOCKET_PATH_BYTES}-byte limit of Unix sockets; set control.socket (or "
            f"node.state_dir) to a shorter path"
        )


def _socket_answers(path: Path, timeout: float) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except OSError:
            return False
    return True


class ControlServer:
    """Serves control requests for ``handler`` on ``path`` until closed."""

    def __init__(self, config: ControlConfig, path: Path, handler: ControlHandler) -> None:
        self.config = config
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None
        self.requests_served = 0

    async def start(self) -> None:
        """Bind the socket (mode 0600), replacing a stale one left by a crashed daemon."""
        check_socket_path(self.path)
        if self.path.exists() or self.path.is_symlink():
            if _socket_answers(self.path, timeout=1.0):
                raise StateDirError(
                    f"another daemon answers on {self.path}; stop it or choose another state dir"
                )
            self.path.unlink()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._server = await asyncio.start_unix_server(
            self._on_client, path=os.fspath(self.path), limit=self.config.max_request_bytes
        )
        os.chmod(self.path, 0o600)

    async def serve(self) -> None:
        """Run until cancelled (a TaskGroup task)."""
        if self._server is None:
            raise RuntimeError("ControlServer.start() must run before serve()")
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.request_timeout):
                    await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.config.request_timeout):
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.LimitOverrunError:
                    response: OkResponse | ErrorResponse = _error(
                        "bad_request", f"request longer than {self.config.max_request_bytes} bytes"
                    )
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial.strip():
                        return  # connected and closed without asking (e.g. a liveness probe)
                    response = self._answer(exc.partial)
                else:
                    response = self._answer(line)
                writer.write(response.model_dump_json().encode() + b"\n")
                await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("control client dropped: %s", exc or type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, line: bytes) -> OkResponse | ErrorResponse:
        try:
            head = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return _error("bad_request", "request is not a JSON object on one line")
        if (
            isinstance(head, dict)
            and isinstance(head.get("v"), int)
            and head["v"] != CONTROL_VERSION
        ):
            return _error(
                "unsupported_version",
                f"control version {head['v']}; this daemon speaks {CONTROL_VERSION}",
            )
        try:
            request = _REQUEST.validate_python(head)
        except ValidationError as exc:
            return _error("bad_request", f"invalid request: {exc.errors()[0]['msg']}")
        self.requests_served += 1
        try:
            if isinstance(request, StatusRequest):
                return OkResponse(result=self.handler.status().model_dump(mode="json"))
            if isinstance(request, PauseRequest):
                return OkResponse(result=self.handler.pause(request.op == "pause"))
            return OkResponse(
                result=self.handler.request_leave("control request").model_dump(mode="json")
            )
        except Exception as exc:  # a bug in a status provider must not take the socket down
            log.exception("control request %s failed", request.op)
            return _error("internal", f"{type(exc).__name__}: {exc}")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; an exited process its parent has not reaped yet (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # "pid (comm) state ...": comm may hold spaces or parentheses, the state follows
            # the last ')'
            return fh.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no procfs: fall back to signal 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _error(
    code: Literal["bad_request", "unsupported_version", "internal"], message: str
) -> ErrorResponse:
    return ErrorResponse(error=ErrorBody(code=code, message=message))


class ControlClient:
    """Blocking client for the CLI (no event loop needed to ask one question)."""

    def __init__(
        self, path: Path, timeout: float = 5.0, max_response_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes

    def status(self) -> StatusReport:
        result = self._call(StatusRequest())
        try:
            return StatusReport.model_validate(result)
        except ValidationError as exc:
            raise ControlProtocolError(
                f"daemon sent an invalid status: {exc.errors()[0]['msg']}"
            ) from None

    def leave(self) -> LeaveAck:
        result = self._call(LeaveRequest())
        try:
            return LeaveAck.model_validate(result)
        except ValidationError as exc:
            raise ControlProtocolError(
                f"daemon sent an invalid leave answer: {exc.errors()[0]['msg']}"
            ) from None

    def pause(self, paused: bool = True) -> PauseAck:
        result = self._call(PauseRequest(op="pause" if paused else "resume"))
        try:
            return PauseAck.model_validate(result)
        except ValidationError as exc:
            raise ControlProtocolError(
                f"daemon sent an invalid pause answer: {exc.errors()[0]['msg']}"
            ) from None

    def wait_until_gone(self, pid: int, timeout: float, on_progress: Callable[[str], None]) -> bool:
        """After ``leave``: report the daemon's progress until its socket closes and ``pid`` exits.

        Polls (status every 0.2 s, then the pid every 0.1 s) up to ``timeout``; True once gone.
        A daemon that stops answering is closing its components (its control loop ends
        with its drain): that is reported and its pid waited for, not taken for a failure.
        """
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                report = self.status()
            except DaemonNotRunning:
                break  # the socket closes at the end of the leave path
            except ControlProtocolError as exc:
                on_progress(f"not answering ({exc}); waiting for it to exit")
                break
            line: str = report.state
            if report.drain_deadline_s is not None:
                line += f", {report.drain_deadline_s:.0f}s of drain left"
            if line != last:
                on_progress(line)
                last = line
            time.sleep(0.2)  # polling a deadline-bounded condition
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return True
            time.sleep(0.1)
        return False

    def _call(self, request: StatusRequest | LeaveRequest | PauseRequest) -> dict[str, Any]:
        check_socket_path(self.path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(os.fspath(self.path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DaemonNotRunning(
                    f"no daemon is running (nothing listens on {self.path}: {exc.strerror})"
                ) from None
            except PermissionError:
                raise DaemonNotRunning(
                    f"cannot open {self.path}: permission denied (run as the daemon's user)"
                ) from None
            try:
                sock.sendall(request.model_dump_json().encode() + b"\n")
                data = self._read_line(sock)
            except TimeoutError:
                raise ControlProtocolError(
                    f"daemon did not answer within {self.timeout}s"
                ) from None
            except ConnectionError as exc:
                raise DaemonNotRunning(f"daemon closed the control connection: {exc}") from None
        try:
            response = _RESPONSE.validate_json(data)
        except ValidationError as exc:
            raise ControlProtocolError(
                f"daemon sent an invalid response: {exc.errors()[0]['msg']}"
            ) from None
        if isinstance(response, ErrorResponse):
            raise ControlProtocolError(
                f"daemon refused the request: {response.error.code}: {response.error.message}"
            )
        return response.result

    def _read_line(self, sock: socket.socket) -> bytes:
        chunks, size = [], 0
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
            if size > self.max_response_bytes:
                raise ControlProtocolError(
                    f"daemon response exceeds {self.max_response_bytes} bytes"
                )
        if not chunks:
            raise DaemonNotRunning("daemon closed the control connection without answering")
        return b"".join(chunks)
