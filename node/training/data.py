"""Training data: byte-level windows from the run's corpus.

The corpus (files or globs, or 'stdlib' = this Python's own standard-library sources) is
read once per process into one uint8 tensor: the training files first, then the
validation files. A file is held out for validation when a hash of its relative path
falls below ``validation_fraction``, so the split is the same on every machine that has
the same files. (When that leaves one side empty, e.g. a single-file corpus, each file's
tail of ``validation_fraction`` of its bytes is held out instead.)

A window is ``seq_len + 1`` consecutive bytes; inputs are its first ``seq_len`` bytes and
targets the last ``seq_len`` (the next byte at every position). Windows may span the
boundary between two files of the same split, as in nanoGPT.

- ``TrainStream(spec, seed)``: an endless, deterministic stream of training micro-batches
  ``(inputs, targets)``, each int64 ``(B, T)``; each trainer uses its own seed.
- ``validation_set(spec)``: a fixed, seeded set of ``data.validation_windows`` windows.

That is ``data.format = "bytes"`` (the default). The streamed formats (text, JSON lines,
Parquet, Hugging Face datasets on disk, tokenized by the run's tokenizer) are datasets.py's;
both functions hand over to it for them, so that their callers need not know the format.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.runspec import STDLIB_CORPUS, DataSpec, RunSpec

logger = logging.getLogger(__name__)

_GLOB_MAGIC = frozenset("*?[")


class CorpusError(ValueError):
    """The corpus cannot be used: missing files, nothing matched, or too few bytes."""


@dataclass(frozen=True)
class CorpusFile:
    """One file of the corpus: its name relative to the corpus root and where it went."""

    name: str
    n_bytes: int
    validation_bytes: int  # bytes of this file in the validation split (all, none, or a tail)


@dataclass(frozen=True, eq=False)
class Corpus:
    """The whole corpus in memory: ``data[:n_train]`` trains, ``data[n_train:]`` validates."""

    data: torch.Tensor  # (N,) uint8
    n_train: int
    files: tuple[CorpusFile, ...]

    @property
    def train(self) -> torch.Tensor:
        """The training bytes, (n_train,) uint8 (a view)."""
        return self.data[: self.n_train]

    @property
    def validation(self) -> torch.Tensor:
        """The validation bytes, (N - n_train,) uint8 (a view)."""
        return self.data[self.n_train :]

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex characters of SHA-256 over the split and every byte. The spec names the
        corpus ('stdlib', globs), not its content, which differs between Python versions
        and machines: peers can compare fingerprints to know they train on the same data."""
        digest = hashlib.sha256(f"{self.n_train}:{self.data.numel()}:".encode())
        digest.update(self.data.numpy().data)  # the buffer itself, no copy
        return digest.hexdigest()[:16]


def stdlib_root() -> Path:
    """Directory of this Python's standard library (``sysconfig``'s 'stdlib' path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[tuple[Path, str]]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages differ between machines; the standard library does not.
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath, filename)
                found.append((path, path.relative_to(root).as_posix()))
    return found


def _pattern_files(pattern: str, root: Path) -> list[tuple[Path, str]]:
    """Files named by one corpus entry, with names relative to the pattern's fixed prefix."""
    is_glob = any(c in _GLOB_MAGIC for c in pattern)
    full = Path(pattern) if Path(pattern).is_absolute() else root / pattern
    if not is_glob:
        if not full.is_file():
            raise CorpusError(f"corpus file {pattern!r} not found (looked at {full})")
        name = pattern if not Path(pattern).is_absolute() else full.name
        return [(full, Path(name).as_posix())]
    # Names are relative to the part of the pattern before the first glob character, so
    # that the validation split does not depend on where the corpus sits on disk.
    fixed_parts: list[str] = []
    for part in Path(pattern).parts:
        if any(c in _GLOB_MAGIC for c in part):
            break
        fixed_parts.append(part)
    base = (root / Path(*fixed_parts)) if fixed_parts else root
    matches = sorted(p for p in glob.glob(str(full), recursive=True) if os.path.isfile(p))
    if not matches:
        raise CorpusError(f"corpus pattern {pattern!r} matched no files (searched {full})")
    return [(Path(p), Path(p).relative_to(base).as_posix()) for p in matches]


def _is_validation_name(name: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"wanswarm-split:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def resolve_corpus(data: DataSpec, root: Path | None = None) -> list[tuple[Path, str]]:
    """The corpus files as (path, relative name), sorted by name, duplicates removed."""
    return _resolve(data.corpus, root)


def _resolve(entries: tuple[str, ...], root: Path | None) -> list[tuple[Path, str]]:
    if entries == (STDLIB_CORPUS,):
        files = _stdlib_files()
    else:
        base = Path.cwd() if root is None else root
        files = [f for entry in entries for f in _pattern_files(entry, base)]
    unique: dict[Path, tuple[Path, str]] = {}
    for path, name in files:
        unique.setdefault(path.resolve(), (path, name))
    return sorted(unique.values(), key=lambda item: (item[1], str(item[0])))


@functools.lru_cache(maxsize=4)
def _load_corpus_cached(entries: tuple[str, ...], fraction: float, root: Path | None) -> Corpus:
    files = _resolve(entries, root)
    if not files:
        raise CorpusError(f"corpus {list(entries)} has no files")
    blobs: list[tuple[str, bytes]] = []
    for path, name in files:
        try:
            blobs.append((name, path.read_bytes()))
        except OSError as exc:
            raise CorpusError(f"cannot read corpus file {path}: {exc.strerror or exc}") from exc
    total = sum(len(b) for _, b in blobs)
    if total == 0:
        raise CorpusError(f"corpus {list(entries)} is empty (0 bytes in {len(files)} files)")
    held_out = {name for name, _ in blobs if _is_validation_name(name, fraction)}
    by_file = (
        0 < len(held_out) < len(blobs)
        and 0 < sum(len(b) for n, b in blobs if n in held_out) < total
    )
    cuts = []
    records = []
    for name, blob in blobs:
        if by_file:
            cut = 0 if name in held_out else len(blob)
        else:
            cut = len(blob) - int(len(blob) * fraction)
        cuts.append(cut)
        records.append(CorpusFile(name=name, n_bytes=len(blob), validation_bytes=len(blob) - cut))
    # One buffer, filled in place: training bytes of every file, then validation bytes.
    buffer = bytearray(total)
    n_train = sum(cuts)
    train_at, val_at = 0, n_train
    for (_, blob), cut in zip(blobs, cuts, strict=True):
        buffer[train_at : train_at + cut] = blob[:cut]
        buffer[val_at : val_at + len(blob) - cut] = blob[cut:]
        train_at += cut
        val_at += len(blob) - cut
    blobs.clear()
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)  # (N,) shares the buffer
    logger.info(
        "corpus: %d files, %.1f MB (%d train bytes, %d validation bytes, split by %s)",
        len(records),
        total / 1e6,
        n_train,
        total - n_train,
        "file" if by_file else "file tail",
    )
    return Corpus(data=tensor, n_train=n_train, files=tuple(records))


def load_corpus(data: DataSpec, root: Path | None = None) -> Corpus:
    """Read the corpus once per process (cached); relative patterns resolve against ``root``
    (default: the current directory). Raises CorpusError naming what is wrong."""
    resolved = None if root is None else Path(root).resolve()
    return _load_corpus_cached(data.corpus, data.validation_fraction, resolved)


def _derive_seed(tag: str, spec: RunSpec, seed: int) -> int:
    # Only what decides the bytes: runs that differ in model width or optimizer but share
    # the data, seq_len and seed see the same windows, so their losses compare directly.
    key = f"{spec.data.model_dump_json()}|{spec.model.seq_len}|{spec.seed}"
    digest = hashlib.sha256(f"wanswarm-{tag}:{key}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _windows(
    source: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    window = source[starts[:, None] + offsets[None, :]].long()  # (B, T+1)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T), (B, T)


def _check_room(split: torch.Tensor, seq_len: int, what: str) -> None:
    if split.numel() < seq_len + 1:
        raise CorpusError(
            f"the {what} split has {split.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            "add files to the corpus or lower model.seq_len"
        )


class TrainStream(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Endless deterministic training micro-batches for one trainer.

    Each ``next()`` draws ``batch.micro_batch_size`` window starts uniformly from the
    training split with a generator seeded by ``seed`` and the spec's data fields, and returns
    ``(inputs, targets)``, both int64 ``(B, T)``.
    """

    def __init__(
        self,
        spec: RunSpec,
        seed: int,
        corpus: Corpus | None = None,
        position_path: Path | None = None,
    ) -> None:
        # Streamed formats: datasets.WindowStream does the work (position_path: where it
        # keeps the trainer's position, to resume after a restart; unused for 'bytes').
        self._streamed: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.micro_batches = 0  # drawn so far
        if spec.data.format != "bytes":
            from .datasets import WindowStream

            self._streamed = WindowStream(spec, seed, position_path)
            return
        if corpus is None:
            from .datasets import check_fingerprint

            check_fingerprint(spec.data)  # DataError naming the difference
        self.corpus = load_corpus(spec.data) if corpus is None else corpus
        self.seq_len = spec.model.seq_len
        self.batch_size = spec.batch.micro_batch_size
        _check_room(self.corpus.train, self.seq_len, "training")
        self.generator = torch.Generator().manual_seed(_derive_seed("train", spec, seed))
        self.micro_batches = 0  # drawn so far

    def __iter__(self) -> TrainStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._streamed is not None:
            self.micro_batches += 1
            return next(self._streamed)
        train = self.corpus.train
        high = train.numel() - self.seq_len  # last valid start + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)  # (B,)
        self.micro_batches += 1
        return _windows(train, starts, self.seq_len)


def validation_set(
    spec: RunSpec, corpus: Corpus | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's fixed validation windows ``(inputs, targets)``, each int64 ``(N, T)``.

    N = ``data.validation_windows``; starts are drawn from the validation split with a
    generator seeded by ``spec.seed`` and the data fields, so every peer evaluates the same bytes.
    """
    if spec.data.format != "bytes":
        from .datasets import streamed_validation_set

        return streamed_validation_set(spec)
    corpus = load_corpus(spec.data) if corpus is None else corpus
    seq_len = spec.model.seq_len
    _check_room(corpus.validation, seq_len, "validation")
    generator = torch.Generator().manual_seed(_derive_seed("validation", spec, spec.seed))
    high = corpus.validation.numel() - seq_len
    starts = torch.randint(0, high, (spec.data.validation_windows,), generator=generator)  # (N,)
    return _windows(corpus.validation, starts, seq_len)
