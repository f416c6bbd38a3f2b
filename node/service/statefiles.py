"""Small files of the state directory: read within a size bound, written atomically.

The daemon keeps a few conveniences beside its identity (``lifetime.json``,
``peers.json``, ``stage.json``). None of them is a reason not to start: a missing file is
the default, an unreadable, oversized or malformed one is the default with a warning, and a
failed write is a warning. A write goes to a temporary file in the same directory, is
fsynced and renamed over the old one, so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ..logs import get_logger

log = get_logger(__name__)

M = TypeVar("M", bound=BaseModel)


def load_model(path: Path, model: type[M], max_bytes: int, otherwise: str) -> M | None:
    """``path`` parsed as ``model``'s JSON; None when absent, or (with a warning that ends in
    ``otherwise``, what the caller does instead) unreadable, over ``max_bytes`` or
    malformed."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s); %s", path, exc, otherwise)
        return None
    if len(data) > max_bytes:
        log.warning("%s is over %d bytes; %s", path, max_bytes, otherwise)
        return None
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        log.warning("%s is malformed (%s); %s", path, exc.errors()[0]["msg"], otherwise)
        return None


def write_atomically(path: Path, data: bytes) -> OSError | None:
    """Replace ``path`` with ``data`` (temporary file, fsync, rename); the error, if any, for
    the caller to report (the temporary file is removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return exc
    return None
