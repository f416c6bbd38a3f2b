"""The local status page: this node, the swarm it sees and its contribution, in a browser.

Off unless ``metrics.page_port`` is set; binds ``metrics.host`` (127.0.0.1 by default). Four
fixed paths, GET (and HEAD) only::

    /                      the page (static/index.html)
    /status.json           what the page shows: the status report, every stage's servers,
                           what the node waits for, the history of its figures, lifetime totals
    /static/<file>         page.js, page.css and the vendored uPlot (MIT, static/LICENSE.uPlot)

The page fetches ``/status.json`` every two seconds and redraws without a reload; its plots
are drawn by uPlot, vendored here so that the page needs no network beyond this node.

Why a small asyncio server rather than prometheus-client's (the metrics server): that one is
a WSGI server in a thread of its own, so answering ``/status.json`` there would read the
daemon's state from another thread. This one runs on the daemon's event loop, where the status
report is built, with the loop's own deadlines. A request is bounded (``MAX_REQUEST_BYTES``
of request line and headers, ``REQUEST_TIMEOUT_S`` to send them); anything else is answered
400/404/405 and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any, Final

from ..errors import NodeError
from ..logs import get_logger
from ..status import StatusReport, stage_summary, waiting_for

log = get_logger(__name__)

MAX_REQUEST_BYTES: Final = 8192
REQUEST_TIMEOUT_S: Final = 5.0
HISTORY_LEN: Final = 1800  # samples kept for the plots (30 minutes at one per second)
STATIC_FILES: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/static/page.css": ("page.css", "text/css; charset=utf-8"),
    "/static/uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/static/uPlot.min.css": ("uPlot.min.css", "text/css; charset=utf-8"),
}
_REASONS: Final = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                   500: "Internal Server Error"}
# the plotted series: name -> where the value comes from in a report
SERIES: Final = ("loss", "val_loss", "tokens_per_s", "queue", "served_per_s", "in_bps", "out_bps")


class History:
    """A bounded series of the node's figures, one sample per observed report."""

    def __init__(self, maxlen: int = HISTORY_LEN) -> None:
        self.t: deque[float] = deque(maxlen=maxlen)
        self.series: dict[str, deque[float | None]] = {k: deque(maxlen=maxlen) for k in SERIES}
        self._last: tuple[float, int, int, int] | None = None  # (t, served, in, out)

    def add(self, report: StatusReport, now_unix: float) -> None:
        server = report.components.get("stage_server") or {}
        trainer = report.components.get("trainer") or {}
        served = int(server.get("applied", 0) or 0)
        bytes_in, bytes_out = report.bytes_in or 0, report.bytes_out or 0
        rates: dict[str, float | None] = {"served_per_s": None, "in_bps": None, "out_bps": None}
        if self._last is not None and now_unix > self._last[0]:
            dt = now_unix - self._last[0]
            rates["served_per_s"] = max(0, served - self._last[1]) / dt
            rates["in_bps"] = max(0, bytes_in - self._last[2]) * 8 / dt
            rates["out_bps"] = max(0, bytes_out - self._last[3]) * 8 / dt
        self._last = (now_unix, served, bytes_in, bytes_out)
        queue = server.get("queue")
        values: dict[str, float | None] = {
            "loss": _number(trainer.get("loss_ewma")),
            "val_loss": _number(trainer.get("val_loss")),
            "tokens_per_s": _number(trainer.get("tokens_per_s")),
            "queue": _number(queue),
            **rates,
        }
        self.t.append(round(now_unix, 3))
        for name in SERIES:
            self.series[name].append(values[name])

    def as_dict(self) -> dict[str, list[float | None]]:
        return {"t": list(self.t), **{k: list(v) for k, v in self.series.items()}}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def page_data(report: StatusReport, history: History) -> dict[str, Any]:
    """The JSON the page renders (``/status.json``)."""
    return {
        "status": report.model_dump(mode="json"),
        "stages": [s.model_dump() for s in stage_summary(report)],
        "waiting_for": waiting_for(report),
        "history": history.as_dict(),
        "now_unix": round(time.time(), 3),
    }


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class PageServer:
    """Serves the page on ``host:port`` from the daemon's loop; ``status`` builds a report."""

    def __init__(self, host: str, port: int, status: Callable[[], StatusReport]) -> None:
        self.host, self.port = host, port
        self.status = status
        self.history = History()
        self.requests = 0
        self._server: asyncio.AbstractServer | None = None
        self._cache: dict[str, bytes] = {}

    def observe(self, report: StatusReport) -> None:
        self.history.add(report, time.time())

    async def start(self) -> tuple[str, int]:
        try:
            self._server = await asyncio.start_server(
                self._on_client, self.host, self.port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            raise NodeError(
                f"cannot serve the status page on {self.host}:{self.port}: "
                f"{exc.strerror or exc}"
            ) from None
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    await self._server.wait_closed()
            self._server = None

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.LimitOverrunError, asyncio.IncompleteReadError):
                    await self._send(writer, 400, b"bad request\n", "text/plain", head=False)
                    return
                method, path = _request_line(head)
                if method not in ("GET", "HEAD"):
                    await self._send(writer, 405 if method else 400, b"GET only\n",
                                     "text/plain", head=False)
                    return
                status, body, ctype = self._answer(path)
                await self._send(writer, status, body, ctype, head=method == "HEAD")
        except (TimeoutError, ConnectionError) as exc:
            log.debug("status page client dropped: %s", exc or type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, path: str) -> tuple[int, bytes, str]:
        self.requests += 1
        path = path.split("?", 1)[0]
        if path == "/status.json":
            try:
                data = page_data(self.status(), self.history)
            except Exception as exc:  # a bug in a status provider must not take the page down
                log.exception("status page: building the status failed")
                return 500, f"{type(exc).__name__}\n".encode(), "text/plain"
            return 200, json.dumps(data, allow_nan=False, default=str).encode(), (
                "application/json"
            )
        entry = STATIC_FILES.get(path)
        if entry is None:
            return 404, b"not found\n", "text/plain"
        name, ctype = entry
        if name not in self._cache:
            self._cache[name] = _static(name)
        return 200, self._cache[name], ctype

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str, *, head: bool
    ) -> None:
        headers = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
            f"Content-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Cache-Control: no-store\r\n"
            "X-Content-Type-Options: nosniff\r\n"
            "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(headers.encode() + (b"" if head else body))
        await writer.drain()


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path) of ``GET /x HTTP/1.1``; ('', '') when malformed."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return "", ""
    return parts[0], parts[1]


__all__ = ["History", "PageServer", "page_data"]
