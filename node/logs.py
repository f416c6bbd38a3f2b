"""Logging for the node: every line carries the node's peer id and stage, as text or JSON.

Modules log through :func:`get_logger` (a ``LoggerAdapter`` over ``logging.getLogger(__name__)``)
which adds ``peer`` and ``stage`` from the process-wide :class:`LogContext`. The handler that
:func:`setup_logging` installs also fills them in for third-party records (hivemind's), so
that every line names the node it comes from; that matters once several daemons write to one
journal or one ``docker compose logs``. Nothing is configured at import time: the daemon and
the CLI call :func:`setup_logging` once.

Under systemd (``$JOURNAL_STREAM`` names the device and inode of our stderr) every line
starts with its syslog priority, ``<3>`` error to ``<7>`` debug (sd-daemon(3)), so that
``journalctl -p warning`` filters them, and text lines carry no timestamp of their own: the
journal stamps each line already.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field


class LogConfig(BaseModel):
    """Log output of the daemon (stderr; journald and Docker collect it from there)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Least severe level written."
    )
    format: Literal["text", "json"] = Field(
        default="text",
        description="'text' for people, 'json' (one object per line) for log collectors.",
    )


@dataclass
class LogContext:
    """Who is logging: set once the identity is loaded, and again when the stage changes."""

    peer: str | None = None
    stage: int | None = None


_CONTEXT = LogContext()
# libraries whose INFO lines describe their internals: WARNING and above unless DEBUG
QUIET_LIBRARIES = ("hivemind", "quic")


def set_log_context(*, peer: str | None = None, stage: int | None = None) -> None:
    """Record the node's peer id and stage for every later log line of this process."""
    if peer is not None:
        _CONTEXT.peer = peer
    _CONTEXT.stage = stage


def log_context() -> LogContext:
    return _CONTEXT


class NodeLogger(logging.LoggerAdapter[logging.Logger]):
    """Adds the node's ``peer`` and ``stage`` to each record (explicit ``extra`` wins)."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("peer", _CONTEXT.peer)
        extra.setdefault("stage", _CONTEXT.stage)
        kwargs["extra"] = extra
        return msg, kwargs


def get_logger(name: str) -> NodeLogger:
    """``logging.getLogger(name)`` wrapped so that its records carry peer and stage."""
    return NodeLogger(logging.getLogger(name), {})


class _ContextFilter(logging.Filter):
    """Fills ``peer``/``stage`` into records that did not come through a :class:`NodeLogger`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "peer"):
            record.peer = _CONTEXT.peer
        if not hasattr(record, "stage"):
            record.stage = _CONTEXT.stage
        return True


def short_peer(peer_id: str | None) -> str:
    """A peer id shortened for people: ``…`` and its last 8 characters (they differ per key)."""
    if not peer_id:
        return "-"
    return "…" + peer_id[-8:] if len(peer_id) > 12 else peer_id


# syslog priorities (RFC 5424 §6.2.1) of our levels, as sd-daemon(3)'s "<N>" line prefixes
_PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
               logging.CRITICAL: 2}


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level (levels between ours round to the more severe)."""
    for level in sorted(_PRIORITIES, reverse=True):
        if levelno >= level:
            return _PRIORITIES[level]
    return 7


def writes_to_journal(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """Whether ``stream`` is the journal's stream systemd gave us (``$JOURNAL_STREAM`` is
    ``<device>:<inode>`` of it; a redirected stderr does not match)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _journal_lines(text: str, levelno: int) -> str:
    """Every line of ``text`` with the priority prefix (journald reads one entry per line)."""
    prefix = f"<{syslog_priority(levelno)}>"
    return "\n".join(prefix + line for line in text.split("\n"))


class TextFormatter(logging.Formatter):
    """``2024-05-01 12:00:00.123 INFO [peer=…Ab12Cd34 stage=1] wanswarm.node.daemon: joined``;
    for the journal (``journal=True``): ``<6>INFO [peer=…] ...``, no timestamp."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        stage = getattr(record, "stage", None)
        line = (
            f"{record.levelname:<7} "
            f"[peer={short_peer(getattr(record, 'peer', None))} "
            f"stage={'-' if stage is None else stage}] {record.name}: {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if self.journal:
            return _journal_lines(line, record.levelno)
        stamp = datetime.datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M:%S")
        return f"{stamp}.{int(record.msecs):03d} {line}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line with ts, level, logger, peer, stage, process, msg (and exc);
    for the journal (``journal=True``) behind its priority prefix."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": logging.getLevelName(record.levelno),
            "logger": record.name,
            "peer": getattr(record, "peer", None),
            "stage": getattr(record, "stage", None),
            "process": record.processName,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        text = json.dumps(entry, ensure_ascii=False, default=str)  # one line: \n is escaped
        return f"<{syslog_priority(record.levelno)}>{text}" if self.journal else text


def setup_logging(config: LogConfig, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) in the configured format.

    Replaces the root logger's handlers (so calling it twice does not duplicate lines).
    hivemind's and aioquic's loggers are kept at WARNING unless the level is DEBUG: their
    INFO lines are about their own internals, not about the swarm (aioquic's were four in
    five of a demo daemon's lines: "Stream 36 reset by peer" for every finished request,
    the version and ALPN of every connection).
    """
    out = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(out)
    handler.addFilter(_ContextFilter())
    journal = writes_to_journal(out)
    handler.setFormatter(
        JsonFormatter(journal) if config.format == "json" else TextFormatter(journal)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    level = logging.DEBUG if config.level == "DEBUG" else logging.WARNING
    for library in QUIET_LIBRARIES:
        logging.getLogger(library).setLevel(level)
