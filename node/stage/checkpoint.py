"""The stage checkpoint format: safetensors + a JSON manifest, written atomically, read warily.

Layout (docs/checkpoints.md)::

    <state_dir>/checkpoints/<run_id>-stage<s>-epoch<E>/
        state.safetensors   every tensor of the stage's exported state, under the names of
                            state_tensors.py (``model.<name>``, ``opt.state.<index>.<key>``)
        manifest.json       format, version, run_id, stage, epoch, created (unix time),
                            optimizer (non-tensor state: param_groups hyperparameters),
                            sha256 and size of state.safetensors

A checkpoint is written into a hidden temporary directory (files and directory fsynced), then
renamed into place and the parent fsynced, so a crash leaves either the previous set of
checkpoints or the new one, never a half-written checkpoint under a checkpoint's name. Only
the newest ``keep`` checkpoints of a run's stage stay.

Reading is for files that may be damaged or foreign: JSON and safetensors only (nothing that
can execute code), the manifest validated against a strict schema (an epoch above
``MAX_EPOCH`` is refused), the state file's size and SHA-256 checked before it is parsed, and
every floating-point tensor finite. :func:`latest` skips what does not verify (logging why)
and never raises for it; a checkpoint that verifies but does not fit the stage's tensors is
refused with :class:`CheckpointError` when it is installed (state_tensors.py's checks).
A state with a NaN or an infinity is never written either: it would win every restart.

This module is the files on disk; when a stage server writes them, its writer thread and
the resume decision are checkpointer.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ..errors import NodeError
from ..logs import get_logger
from .state_plan import MAX_EPOCH

log = get_logger(__name__)

FORMAT: Final = "wanswarm-checkpoint"
FORMAT_VERSION: Final = 1
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # param_groups of a few groups: kilobytes
_RUN_ID = re.compile(r"^[0-9A-Za-z_]{1,64}$")  # it names directories: no '/', '.', '-'
_HASH_CHUNK = 1 << 20


class CheckpointError(NodeError):
    """A checkpoint that is damaged, foreign, or does not fit the stage (names, shapes, dtypes)."""


class Manifest(BaseModel):
    """``manifest.json``: what the checkpoint is and how to verify its tensor file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["wanswarm-checkpoint"] = Field(description="Marks the file as ours.")
    version: Literal[1] = Field(description="Manifest format version.")
    run_id: str = Field(pattern=_RUN_ID.pattern, description="Run id (hash of the run spec).")
    stage: int = Field(ge=0, le=1_000_000, description="Pipeline stage the tensors belong to.")
    epoch: int = Field(
        ge=0, le=MAX_EPOCH,
        description="Optimizer steps the state has taken (collaboration epoch).",
    )
    created: float = Field(ge=0.0, description="Unix time the checkpoint was written.")
    state_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of state.safetensors."
    )
    state_bytes: int = Field(ge=0, description="Size of state.safetensors in bytes.")
    tensors: int = Field(ge=0, description="Number of tensors in state.safetensors.")
    optimizer: dict[str, Any] = Field(
        description="Optimizer state that is not a tensor (param_groups)."
    )


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint read back: its manifest and its tensors (on the CPU)."""

    path: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def epoch(self) -> int:
        return self.manifest.epoch

    @property
    def optimizer_meta(self) -> dict[str, Any]:
        return self.manifest.optimizer


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [
        name
        for name, t in tensors.items()
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
    ]


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """``CheckpointError`` naming the tensors of ``what`` that hold a NaN or an infinity."""
    bad = nonfinite(tensors)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{what}: non-finite values in {', '.join(bad[:3])}{more}")


# ---------------------------------------------------------------------------- naming


def checkpoint_name(run_id: str, stage: int, epoch: int) -> str:
    """``<run_id>-stage<s>-epoch<E>``, the directory of one checkpoint."""
    return f"{run_id}-stage{stage}-epoch{epoch}"


def _name_pattern(run_id: str, stage: int) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(run_id)}-stage{stage}-epoch(0|[1-9][0-9]{{0,17}})$")


def check_run_id(run_id: str) -> None:
    """``CheckpointError`` unless ``run_id`` can name a checkpoint directory."""
    if not _RUN_ID.match(run_id):
        raise CheckpointError(
            f"run id {run_id!r} cannot name a checkpoint (letters, digits and '_' only)"
        )


def list_checkpoints(state_dir: Path, run_id: str, stage: int) -> list[tuple[int, Path]]:
    """``(epoch, path)`` of every directory named like a checkpoint of this stage, newest first."""
    check_run_id(run_id)
    root = state_dir / CHECKPOINTS_DIR
    pattern = _name_pattern(run_id, stage)
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot list checkpoints in %s: %s", root, exc.strerror or exc)
        return []
    found = []
    for entry in entries:
        match = pattern.match(entry.name)
        if match is not None:
            found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


# ---------------------------------------------------------------------------- writing


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror or exc)


def write_checkpoint(
    state_dir: Path,
    run_id: str,
    stage: int,
    epoch: int,
    tensors: Mapping[str, torch.Tensor],
    optimizer_meta: Mapping[str, Any],
    *,
    keep: int,
    now: float | None = None,
) -> Path:
    """Write one checkpoint atomically, then keep only the newest ``keep`` of this stage.

    ``tensors`` must be contiguous and must not share storage (``snapshot`` gives such
    copies); ``optimizer_meta`` must be JSON-able. An existing checkpoint of the same epoch
    with the same tensor bytes is left as it is; one with other bytes is replaced. Raises
    ``CheckpointError`` for arguments that cannot be written and ``OSError`` for the disk.
    """
    check_run_id(run_id)
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
    if isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH:
        raise CheckpointError(f"epoch {epoch} is outside 0..{MAX_EPOCH}")
    check_finite(tensors, f"the state of epoch {epoch}")
    try:
        data = save(dict(tensors))
    except (ValueError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"cannot serialize the stage's tensors: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    manifest = Manifest(
        format=FORMAT,
        version=FORMAT_VERSION,
        run_id=run_id,
        stage=stage,
        epoch=epoch,
        created=time.time() if now is None else now,
        state_sha256=digest,
        state_bytes=len(data),
        tensors=len(tensors),
        optimizer=dict(optimizer_meta),
    )
    try:
        manifest_bytes = json.dumps(
            manifest.model_dump(mode="json"), indent=1, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"optimizer state is not JSON-able: {exc}") from exc
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"manifest of {len(manifest_bytes)} bytes exceeds {MAX_MANIFEST_BYTES}"
        )

    root = state_dir / CHECKPOINTS_DIR
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = checkpoint_name(run_id, stage, epoch)
    final = root / name
    if final.is_dir() and _same_state(final, digest):
        log.debug("checkpoint %s is unchanged", name)
        return final
    tmp = root / f".tmp-{name}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        _write_file(tmp / STATE_FILE, data)
        _write_file(tmp / MANIFEST_FILE, manifest_bytes)
        _fsync_dir(tmp)
        if final.exists():
            # same epoch, other bytes (state loaded from peers at this epoch): swap it out.
            # A crash between these two renames loses this epoch's checkpoint, not older ones.
            old = root / f".old-{name}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
            _remove_tree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        _remove_tree(tmp)
        raise
    prune(state_dir, run_id, stage, keep)
    return final


def _same_state(path: Path, digest: str) -> bool:
    try:
        raw = json.loads((path / MANIFEST_FILE).read_bytes()[:MAX_MANIFEST_BYTES])
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("state_sha256") == digest


def prune(state_dir: Path, run_id: str, stage: int, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints of this stage, and temporary leftovers
    of interrupted writes of this stage; returns what was deleted."""
    removed = [path for _, path in list_checkpoints(state_dir, run_id, stage)[keep:]]
    prefix = checkpoint_name(run_id, stage, 0)[: -len("0")]  # "<run_id>-stage<s>-epoch"
    root = state_dir / CHECKPOINTS_DIR
    try:
        for entry in root.iterdir():
            for hidden in (".tmp-", ".old-"):
                if entry.name.startswith(hidden + prefix):
                    removed.append(entry)
    except OSError as exc:
        log.warning("cannot list checkpoints in %s: %s", root, exc.strerror or exc)
    for path in removed:
        _remove_tree(path)
    return removed


# ---------------------------------------------------------------------------- reading


def read_checkpoint(path: Path, run_id: str, stage: int) -> Checkpoint:
    """Read and verify one checkpoint directory; ``CheckpointError`` says what is wrong."""
    try:
        with open(path / MANIFEST_FILE, "rb") as f:
            raw_bytes = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(
            f"{path.name}: no readable manifest ({exc.strerror or exc})"
        ) from None
    if len(raw_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path.name}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        raw = json.loads(raw_bytes)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"{path.name}: manifest is not JSON ({type(exc).__name__})") from None
    if (
        isinstance(raw, dict)
        and isinstance(raw.get("version"), int)
        and raw["version"] > FORMAT_VERSION
    ):
        raise CheckpointError(
            f"{path.name}: manifest version {raw['version']} is newer than this release"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "manifest"
        raise CheckpointError(f"{path.name}: invalid manifest ({where}: {first['msg']})") from None
    if manifest.run_id != run_id or manifest.stage != stage:
        raise CheckpointError(
            f"{path.name}: holds run {manifest.run_id} stage {manifest.stage}, "
            f"not run {run_id} stage {stage}"
        )
    match = _name_pattern(run_id, stage).match(path.name)
    if match is None or int(match.group(1)) != manifest.epoch:
        raise CheckpointError(f"{path.name}: manifest says epoch {manifest.epoch}")
    state = path / STATE_FILE
    try:
        info = state.stat()
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path.name}: {STATE_FILE} is not a regular file")
        size = info.st_size
        if size != manifest.state_bytes:
            raise CheckpointError(
                f"{path.name}: {STATE_FILE} has {size} bytes, "
                f"the manifest says {manifest.state_bytes}"
            )
        if _sha256(state) != manifest.state_sha256:
            raise CheckpointError(f"{path.name}: {STATE_FILE} does not match its SHA-256")
        tensors = load_file(state, device="cpu")
    except OSError as exc:
        raise CheckpointError(
            f"{path.name}: cannot read {STATE_FILE} ({exc.strerror or exc})"
        ) from None
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path.name}: {STATE_FILE} is not a safetensors file ({exc})"
        ) from None
    if len(tensors) != manifest.tensors:
        raise CheckpointError(
            f"{path.name}: {len(tensors)} tensors, the manifest says {manifest.tensors}"
        )
    check_finite(tensors, path.name)
    return Checkpoint(path=path, manifest=manifest, tensors=tensors)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def latest(
    state_dir: Path, run_id: str, stage: int, *, max_epoch: int = MAX_EPOCH
) -> Checkpoint | None:
    """The newest checkpoint of this stage at an epoch <= ``max_epoch`` that verifies, or None;
    damaged ones are skipped, later ones are passed over (an implausible epoch)."""
    for epoch, path in list_checkpoints(state_dir, run_id, stage):
        if epoch > max_epoch:
            log.warning("passing over checkpoint %s: epoch %d is beyond the plausible %d",
                        path.name, epoch, max_epoch)
            continue
        try:
            return read_checkpoint(path, run_id, stage)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None
