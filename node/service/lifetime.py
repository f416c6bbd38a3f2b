"""Lifetime totals of a state directory: what this node contributed over all its runs.

``<state_dir>/lifetime.json`` holds micro-batches served, tokens trained, seconds online and
bytes moved, summed over every daemon that used the directory. :class:`LifetimeTotals` adds
the growth of the running daemon's own counters (from its status reports) to what the file
held at start, and writes the file atomically (temporary file, fsync, rename) every
``SAVE_PERIOD_S`` and when the daemon leaves. A missing, unreadable or malformed file is
counted from zero with a warning: it is a convenience, never a reason not to start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from ..logs import get_logger
from ..status import StatusReport
from .statefiles import load_model, write_atomically

log = get_logger(__name__)

LIFETIME_FILE: Final = "lifetime.json"
SAVE_PERIOD_S: Final = 60.0
MAX_FILE_BYTES: Final = 4096


class Lifetime(BaseModel):
    """The file's content (version 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int = 1
    since_unix: float = Field(default=0.0, ge=0, description="When the first daemon started.")
    micro_batches_served: int = Field(default=0, ge=0)
    tokens: int = Field(
        default=0, ge=0, description="Tokens of micro-batches our trainer completed."
    )
    uptime_s: float = Field(default=0.0, ge=0, description="Seconds online, summed.")
    bytes_in: int = Field(default=0, ge=0)
    bytes_out: int = Field(default=0, ge=0)
    runs: int = Field(default=0, ge=0, description="Daemons started on this directory.")


def load_lifetime(path: Path) -> Lifetime:
    found = load_model(path, Lifetime, MAX_FILE_BYTES, "lifetime totals start from zero")
    return found if found is not None else Lifetime()


def save_lifetime(path: Path, totals: Lifetime) -> None:
    error = write_atomically(path, totals.model_dump_json().encode())
    if error is not None:
        log.warning("cannot write %s: %s", path, error)


class _Counter:
    """Growth of a counter that may restart from zero (a stage server rebuilt by a move)."""

    def __init__(self) -> None:
        self.last: int | None = None

    def growth(self, value: int) -> int:
        last, self.last = self.last, value
        if last is None:
            return value
        return value - last if value >= last else value


class LifetimeTotals:
    """The file's totals plus the running daemon's growth since start."""

    def __init__(self, state_dir: Path, clock: float | None = None) -> None:
        self.path = state_dir / LIFETIME_FILE
        start = load_lifetime(self.path)
        now = time.time() if clock is None else clock
        self.totals = start.model_copy(
            update={"runs": start.runs + 1, "since_unix": start.since_unix or round(now, 3)}
        )
        self._served, self._tokens = _Counter(), _Counter()
        self._bytes_in, self._bytes_out = _Counter(), _Counter()
        self._uptime: float | None = None
        self._saved_at = time.monotonic()

    def observe(self, report: StatusReport) -> None:
        """Add what the daemon's counters grew by since the last report."""
        server = report.components.get("stage_server") or {}
        trainer = report.components.get("trainer") or {}
        t = self.totals
        online = report.uptime_s - (self._uptime if self._uptime is not None else report.uptime_s)
        self._uptime = report.uptime_s
        self.totals = t.model_copy(
            update={
                "micro_batches_served": t.micro_batches_served
                + self._served.growth(int(server.get("applied", 0) or 0)),
                "tokens": t.tokens + self._tokens.growth(int(trainer.get("tokens", 0) or 0)),
                "bytes_in": t.bytes_in + self._bytes_in.growth(report.bytes_in or 0),
                "bytes_out": t.bytes_out + self._bytes_out.growth(report.bytes_out or 0),
                "uptime_s": t.uptime_s + (max(0.0, online) if report.state == "online" else 0.0),
            }
        )

    def save_if_due(self) -> None:
        if time.monotonic() - self._saved_at >= SAVE_PERIOD_S:
            self.save()

    def save(self) -> None:
        save_lifetime(self.path, self.totals)
        self._saved_at = time.monotonic()

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.totals.model_dump().items() if k != "v"}


__all__ = ["LIFETIME_FILE", "Lifetime", "LifetimeTotals", "load_lifetime", "save_lifetime"]
