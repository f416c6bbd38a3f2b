"""Stage checkpoints in the state directory: safetensors + a JSON manifest, written atomically.

Layout (docs/checkpoints.md)::

    <state_dir>/checkpoints/<run_id>-stage<s>-epoch<E>/
        state.safetensors   every tensor: ``model.<name>`` (the stage's state_dict) and
                            ``opt.state.<param_index>.<key>`` (the optimizer's state tensors)
        manifest.json       format, version, run_id, stage, epoch, created (unix time),
                            optimizer (non-tensor state: param_groups hyperparameters),
                            sha256 and size of state.safetensors

A checkpoint is written into a hidden temporary directory (files and directory fsynced), then
renamed into place and the parent fsynced, so a crash leaves either the previous set of
checkpoints or the new one, never a half-written checkpoint under a checkpoint's name. Only
the newest ``keep`` checkpoints of a run's stage stay.

Reading is for files that may be damaged or foreign: JSON and safetensors only (nothing that
can execute code), the manifest validated against a strict schema, the state file's size and
SHA-256 checked before it is parsed. :func:`latest` skips what does not verify (logging why)
and never raises for it; a checkpoint that verifies but does not fit the stage's tensors is
refused with :class:`CheckpointError` when it is installed.

The optimizer naming is torch's own ``Optimizer.state_dict()`` indexing (parameters numbered
across param_groups in order), which the solo and the collaborative optimizer share, so a
checkpoint of either installs into the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ..errors import NodeError
from ..logs import get_logger

log = get_logger(__name__)

FORMAT: Final = "wanswarm-checkpoint"
FORMAT_VERSION: Final = 1
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.safetensors"
MANIFEST_FILE = "manifest.json"
MODEL_PREFIX = "model."
OPT_PREFIX = "opt.state."
MAX_MANIFEST_BYTES = 1 << 20  # param_groups of a few groups: kilobytes
_RUN_ID = re.compile(r"^[0-9A-Za-z_]{1,64}$")  # it names directories: no '/', '.', '-'
_HASH_CHUNK = 1 << 20

ResumeSource = Literal["checkpoint", "peers", "fresh"]
InstallState = Callable[[int, dict[str, torch.Tensor], dict[str, Any]], None]


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
        ge=0, description="Optimizer steps the state has taken (collaboration epoch)."
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


# ---------------------------------------------------------------------------- naming


def checkpoint_name(run_id: str, stage: int, epoch: int) -> str:
    """``<run_id>-stage<s>-epoch<E>``, the directory of one checkpoint."""
    return f"{run_id}-stage{stage}-epoch{epoch}"


def _name_pattern(run_id: str, stage: int) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(run_id)}-stage{stage}-epoch(0|[1-9][0-9]{{0,17}})$")


def _check_run_id(run_id: str) -> None:
    if not _RUN_ID.match(run_id):
        raise CheckpointError(
            f"run id {run_id!r} cannot name a checkpoint (letters, digits and '_' only)"
        )


def list_checkpoints(state_dir: Path, run_id: str, stage: int) -> list[tuple[int, Path]]:
    """``(epoch, path)`` of every directory named like a checkpoint of this stage, newest first."""
    _check_run_id(run_id)
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
    _check_run_id(run_id)
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
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
    return Checkpoint(path=path, manifest=manifest, tensors=tensors)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def latest(state_dir: Path, run_id: str, stage: int) -> Checkpoint | None:
    """The newest checkpoint of this stage that verifies, or None; damaged ones are skipped."""
    for _, path in list_checkpoints(state_dir, run_id, stage):
        try:
            return read_checkpoint(path, run_id, stage)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def resume_source(
    peers_answered: bool, peer_epoch: int, checkpoint_epoch: int | None
) -> ResumeSource:
    """Where a starting server's state comes from: its own checkpoint when it is newer than
    what the peers gave (or no peer answered), else the peers, else a fresh initialization."""
    if checkpoint_epoch is not None and (not peers_answered or checkpoint_epoch > peer_epoch):
        return "checkpoint"
    return "peers" if peers_answered else "fresh"


@dataclass
class CheckpointSchedule:
    """When the next periodic checkpoint is due (pure: the caller passes ``now``).

    Due once ``period_s`` has passed since the last one and the epoch has moved since (the
    state within an epoch only gains gradient accumulators, which checkpoints do not hold).
    A period of 0 disables periodic checkpoints."""

    period_s: float
    last_time: float = -math.inf
    last_epoch: int | None = None

    def due(self, now: float, epoch: int) -> bool:
        return (
            self.period_s > 0 and now - self.last_time >= self.period_s and epoch != self.last_epoch
        )

    def mark(self, now: float, epoch: int) -> None:
        self.last_time, self.last_epoch = now, epoch


class Checkpointer:
    """A stage server's checkpoints: when the next is due, and a writer thread that writes them.

    The device thread exports the state (private CPU copies) and calls ``submit``; the disk
    work happens on the writer thread, one checkpoint at a time, so serving never waits on it.
    ``written``, ``failures`` and ``epoch`` are written by the writer thread (and ``epoch`` by
    ``resume``, before any write)."""

    EMPTY_STATUS: ClassVar[dict[str, int]] = {
        "checkpoint_epoch": -1,
        "checkpoints_written": 0,
        "checkpoint_failures": 0,
    }

    def __init__(
        self, state_dir: Path, run_id: str, stage: int, *, period_s: float, keep: int
    ) -> None:
        _check_run_id(run_id)
        self.state_dir, self.run_id, self.stage, self.keep = state_dir, run_id, stage, keep
        self.schedule = CheckpointSchedule(period_s)
        self.written = 0
        self.failures = 0
        # epoch of the newest checkpoint written (or resumed from, set by the owner)
        self.epoch = -1
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"stage{stage}-checkpoint"
        )
        self._writing: Future[None] | None = None

    def due(self, now: float, epoch: int) -> bool:
        """A periodic checkpoint is due and the previous one is written."""
        return self.schedule.due(now, epoch) and (self._writing is None or self._writing.done())

    def submit(
        self, now: float, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> Future[None]:
        """Queue a write of this state; the future never raises (failures are logged and
        counted)."""
        self.schedule.mark(now, epoch)
        self._writing = self._writer.submit(self._write, epoch, tensors, meta)
        return self._writing

    def _write(self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            path = write_checkpoint(
                self.state_dir, self.run_id, self.stage, epoch, tensors, meta, keep=self.keep
            )
        except (OSError, CheckpointError) as exc:
            self.failures += 1
            log.warning("stage %d: checkpoint of epoch %d not written: %s", self.stage, epoch, exc)
            return
        self.written += 1
        self.epoch = epoch
        log.info("stage %d: checkpoint of epoch %d written to %s in %.2fs",
                 self.stage, epoch, path, time.perf_counter() - started)

    def resume(self, install: InstallState, peers_answered: bool, peer_epoch: int) -> ResumeSource:
        """Install our newest checkpoint with ``install`` (the optimizer's ``import_state``, on
        the device thread) when :func:`resume_source` picks it; returns where the state came from.
        A checkpoint that does not fit the stage is logged and left alone."""
        fallback: ResumeSource = "peers" if peers_answered else "fresh"
        found = latest(self.state_dir, self.run_id, self.stage)
        if found is None:
            return fallback
        if resume_source(peers_answered, peer_epoch, found.epoch) != "checkpoint":
            log.info(
                "stage %d: the peers' epoch %d is not older than our checkpoint's (%d): "
                "keeping theirs",
                self.stage,
                peer_epoch,
                found.epoch,
            )
            return fallback
        try:
            install(found.epoch, found.tensors, found.optimizer_meta)
        except CheckpointError as exc:
            log.warning("stage %d: not resuming from %s: %s", self.stage, found.path, exc)
            return fallback
        self.epoch = found.epoch
        log.info(
            "stage %d: resumed from checkpoint %s (epoch %d%s)",
            self.stage,
            found.path.name,
            found.epoch,
            f", peers had {peer_epoch}" if peers_answered else ", no peer answered",
        )
        return "checkpoint"

    def status(self) -> dict[str, int]:
        return {
            "checkpoint_epoch": self.epoch,
            "checkpoints_written": self.written,
            "checkpoint_failures": self.failures,
        }

    def close(self) -> None:
        """Let a write in flight finish (blocking), then stop the writer."""
        self._writer.shutdown(wait=True)


# ---------------------------------------------------------------------------- tensors


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private, contiguous CPU copies (safe to write from another thread while training goes on)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict under ``model.<name>`` (live views: copying into them installs)."""
    return {MODEL_PREFIX + name: t for name, t in module.state_dict().items()}


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state as ``opt.state.<param_index>.<key>`` (live)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    out = {}
    for param, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{OPT_PREFIX}{index[id(param)]}.{key}"] = value
    return out


def optimizer_meta(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's non-tensor state, JSON-able: param_groups without their parameters."""
    groups = []
    for group in opt.param_groups:
        entry = {}
        for key, value in group.items():
            if key != "params":
                entry[key] = list(value) if isinstance(value, tuple) else value
        entry["num_params"] = len(group["params"])
        groups.append(entry)
    return {"param_groups": groups}


def check_fits(expected: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """``CheckpointError`` unless ``tensors`` has exactly the names, shapes and dtypes of
    ``expected``."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{name} {tuple(tensors[name].shape)}/{tensors[name].dtype} "
        f"(want {tuple(t.shape)}/{t.dtype})"
        for name, t in expected.items()
        if name in tensors and (tensors[name].shape != t.shape or tensors[name].dtype != t.dtype)
    ]
    problems = []
    if missing:
        problems.append(
            f"missing {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    if unexpected:
        problems.append(
            f"unexpected {', '.join(unexpected[:3])}"
            + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        )
    if wrong:
        problems.append(
            f"mismatched {'; '.join(wrong[:3])}"
            + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        )
    if problems:
        raise CheckpointError("checkpoint does not fit this stage: " + "; ".join(problems))


def checked_param_groups(
    opt: torch.optim.Optimizer, meta: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The hyperparameters of ``meta`` for each of ``opt``'s param_groups, validated (same
    groups, sizes, keys and value types; finite numbers), tuples restored; else
    ``CheckpointError``."""
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise CheckpointError(
            f"checkpoint's optimizer has other param_groups (want {len(opt.param_groups)})"
        )
    out = []
    for i, (saved, live) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if not isinstance(saved, dict):
            raise CheckpointError(f"param_groups[{i}] is not an object")
        if saved.get("num_params") != len(live["params"]):
            raise CheckpointError(
                f"param_groups[{i}] has {saved.get('num_params')} parameters, "
                f"want {len(live['params'])}"
            )
        keys = set(live) - {"params"}
        if set(saved) - {"num_params"} != keys:
            raise CheckpointError(
                f"param_groups[{i}] has keys {sorted(set(saved) - {'num_params'})}, "
                f"want {sorted(keys)}"
            )
        values = {}
        for key in keys:
            values[key] = _coerce(saved[key], live[key], f"param_groups[{i}].{key}")
        out.append(values)
    return out


def _coerce(value: Any, like: Any, where: str) -> Any:
    """``value`` (from JSON) as the type of the live ``like``; ``CheckpointError`` when it
    cannot be."""
    if isinstance(like, bool) or like is None:
        if type(value) is not type(like):
            raise CheckpointError(f"{where}: {value!r} is not like {like!r}")
        return value
    if isinstance(like, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{where}: {value!r} is not an integer")
        return value
    if isinstance(like, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise CheckpointError(f"{where}: {value!r} is not a finite number")
        return float(value)
    if isinstance(like, str):
        if not isinstance(value, str):
            raise CheckpointError(f"{where}: {value!r} is not a string")
        return value
    if isinstance(like, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(like):
            raise CheckpointError(f"{where}: {value!r} does not have {len(like)} items")
        items = [
            _coerce(v, w, f"{where}[{j}]") for j, (v, w) in enumerate(zip(value, like, strict=True))
        ]
        return tuple(items) if isinstance(like, tuple) else items
    raise CheckpointError(f"{where}: cannot restore a value of type {type(like).__name__}")


def checked_epoch(epoch: Any) -> int:
    """A checkpoint's epoch as an int >= 0, else ``CheckpointError``."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise CheckpointError(f"epoch must be an integer >= 0, got {epoch!r}")
    return epoch
