"""Streamed datasets: local files read record by record, tokenized on the fly, packed into
windows; sharded across trainers, resumable, fingerprinted.

Formats (``data.format``; data.py keeps ``bytes``, the in-memory corpus):

- ``text``: plain UTF-8 text files (directories are walked, every file taken); a record is
  up to ``TEXT_RECORD_BYTES`` of whole lines.
- ``jsonl``: one JSON object per line with a string ``data.text_field`` (directories: their
  ``*.jsonl`` and ``*.json`` files); blank lines are skipped.
- ``parquet``: the string column ``data.text_field`` of Parquet files (``pyarrow``), read one
  row group batch at a time (directories: ``*.parquet``).
- ``hf_disk``: a Hugging Face dataset saved with ``save_to_disk`` (its ``*.arrow`` files, Arrow
  IPC streams, read batch by batch with ``pyarrow``; ``datasets`` is not needed to read).

Memory does not depend on the dataset's size: one record (or one Arrow batch) is held at a
time, plus less than one micro-batch of tokens. A malformed file is a ``DataError`` naming the
file and the line (or row group): invalid UTF-8, a JSON line that does not parse or lacks
the field, a truncated Parquet file.

Split and shards: record ``i`` of file ``name`` is hashed; below ``validation_fraction`` it is
validation, otherwise it belongs to shard ``hash mod data.shards``. A trainer with data seed
``s`` reads shard ``s mod shards`` first, then the next ones in turn, then starts again
(epoch + 1), so trainers with different seeds (mod shards) do not repeat each other within an
epoch. Tokens of consecutive records (each followed by the tokenizer's separator) are packed
into windows of ``seq_len + 1`` tokens; a micro-batch is ``micro_batch_size`` windows.

Position: after each micro-batch, ``Position`` (epoch, shard pass, file, record, token offset)
names the first token not yet handed out; a stream given ``position_path`` writes it there
(atomically, at most once per ``save_every_s``, default 1 s) and starts from it, so a
restarted trainer goes on where it stopped (repeating at most that last second's windows).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.runspec import DataSpec, RunSpec
from ..errors import NodeError
from .fingerprint import Fingerprint, describe_difference, fingerprint_files
from .tokenizer import Tokenizer, load_tokenizer

TEXT_RECORD_BYTES = 64 * 1024
ARROW_BATCH_ROWS = 1024
MAX_LINE_BYTES = 64 << 20  # one JSON line / text line; longer is refused as malformed
_SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "hf_disk": (".arrow",)}
POSITION_VERSION = 1


class DataError(NodeError):
    """The run's data cannot be used: missing, malformed (file and line named), or not the
    run's (its fingerprint differs)."""


def _need_pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise DataError(
            "this run reads Parquet or Arrow data: pip install 'wanswarm[data]'"
        ) from None
    return pyarrow


def data_files(data: DataSpec, root: Path | None = None) -> list[tuple[Path, str]]:
    """The dataset's files as (path, name relative to its corpus entry), in read order."""
    if data.format == "bytes":  # the in-memory corpus: files, globs or 'stdlib'
        from .data import CorpusError, resolve_corpus

        try:
            return resolve_corpus(data, root)
        except CorpusError as exc:
            raise DataError(str(exc)) from None
    base = Path.cwd() if root is None else root
    suffixes = _SUFFIXES.get(data.format)
    found: list[tuple[Path, str]] = []
    for entry in data.corpus:
        path = Path(entry) if Path(entry).is_absolute() else base / entry
        if path.is_file():
            found.append((path, Path(entry).name))
        elif path.is_dir():
            inside = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and (suffixes is None or p.name.endswith(suffixes))
            )
            if not inside:
                raise DataError(f"data.corpus entry {entry!r}: no {data.format} files in {path}")
            found.extend(
                (p, f"{Path(entry).name}/{p.relative_to(path).as_posix()}") for p in inside
            )
        else:
            raise DataError(f"data.corpus entry {entry!r} not found (looked at {path})")
    return found


@functools.lru_cache(maxsize=8)
def _fingerprint(data_json: str, cwd: str) -> Fingerprint:
    data = DataSpec.model_validate_json(data_json)
    try:
        return fingerprint_files(data_files(data, Path(cwd)))
    except OSError as exc:
        raise DataError(f"cannot read the data: {exc}") from None


def data_fingerprint(data: DataSpec) -> Fingerprint:
    """Fingerprint of the dataset's files (cached per process)."""
    return _fingerprint(data.model_dump_json(), os.getcwd())


def clear_fingerprint_cache() -> None:
    """Forget the fingerprints computed so far (the files changed)."""
    _fingerprint.cache_clear()


def check_fingerprint(data: DataSpec) -> None:
    """DataError naming the difference when the local data is not the run spec's."""
    if data.fingerprint is None:
        return
    difference = describe_difference(data.fingerprint, data_fingerprint(data), "the local data")
    if difference:
        raise DataError(difference + f" (data.corpus {list(data.corpus)})")


# ---- records ----------------------------------------------------------------------------


def _text_records(path: Path, start: int) -> Iterator[tuple[int, str]]:
    index, parts, size = 0, [], 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            parts.append(line)
            size += len(raw)
            if size >= TEXT_RECORD_BYTES:
                if index >= start:
                    yield index, "".join(parts)
                index, parts, size = index + 1, [], 0
    if parts and index >= start:
        yield index, "".join(parts)


def _jsonl_records(path: Path, field: str, start: int) -> Iterator[tuple[int, str]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            index = lineno - 1
            if index < start or not raw.strip():
                continue
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: invalid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg}, column {exc.colno})"
                ) from None
            if not isinstance(value, dict) or field not in value:
                raise DataError(f"{where}: no {field!r} field (data.text_field)")
            text = value[field]
            if not isinstance(text, str):
                raise DataError(f"{where}: {field!r} is {type(text).__name__}, not a string")
            yield index, text


def _column_texts(batch: Any, field: str, where: str) -> list[Any]:
    if field not in batch.schema.names:
        raise DataError(f"{where}: no column {field!r} (data.text_field); has {batch.schema.names}")
    return batch.column(field).to_pylist()


def _arrow_rows(
    batches: Iterator[Any], path: Path, field: str, start: int, unit: str
) -> Iterator[tuple[int, str]]:
    pyarrow = _need_pyarrow()
    row = 0
    number = 0
    try:
        for number, batch in enumerate(batches):  # noqa: B007 (number names the failing one)
            if row + batch.num_rows <= start:
                row += batch.num_rows
                continue
            for text in _column_texts(batch, field, f"{path} {unit} {number}"):
                if row >= start:
                    if not isinstance(text, str):
                        raise DataError(f"{path} row {row}: {field!r} is not a string")
                    yield row, text
                row += 1
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path} {unit} {number}: cannot read ({exc})") from None


def _parquet_records(path: Path, field: str, start: int) -> Iterator[tuple[int, str]]:
    pyarrow = _need_pyarrow()
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        names = reader.schema_arrow.names
        if field not in names:
            raise DataError(f"{path}: no column {field!r} (data.text_field); has {names}")
        batches = reader.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=[field])
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    yield from _arrow_rows(batches, path, field, start, "batch")


def _arrow_records(path: Path, field: str, start: int) -> Iterator[tuple[int, str]]:
    pyarrow = _need_pyarrow()
    import pyarrow.ipc as ipc

    try:
        reader = ipc.open_stream(pyarrow.OSFile(str(path), "rb"))
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not an Arrow stream file ({exc})") from None
    yield from _arrow_rows(iter(reader), path, field, start, "batch")


def records(data: DataSpec, path: Path, start: int = 0) -> Iterator[tuple[int, str]]:
    """(record index, text) of one file from record ``start`` on."""
    try:
        if data.format == "text":
            yield from _text_records(path, start)
        elif data.format == "jsonl":
            yield from _jsonl_records(path, data.text_field, start)
        elif data.format == "parquet":
            yield from _parquet_records(path, data.text_field, start)
        elif data.format == "hf_disk":
            yield from _arrow_records(path, data.text_field, start)
        else:
            raise DataError(f"format {data.format!r} is not streamed")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def record_bucket(name: str, index: int) -> float:
    """Where record ``index`` of file ``name`` falls in [0, 1): validation below the fraction."""
    digest = hashlib.blake2b(f"{name}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def shard_of(bucket: float, fraction: float, shards: int) -> int:
    """-1 for validation, else the shard of a record in ``bucket``."""
    if bucket < fraction:
        return -1
    return min(shards - 1, int((bucket - fraction) / (1.0 - fraction) * shards))


# ---- windows ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """The first token not yet handed out: pass ``shard_pass`` of epoch ``epoch`` reads
    shard ``(first_shard + shard_pass) mod shards``; in it, file ``file``, record ``record``,
    token ``token`` of that record (its separator included)."""

    epoch: int = 0
    shard_pass: int = 0
    file: int = 0
    record: int = 0
    token: int = 0


class WindowStream(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Endless training micro-batches ``(inputs, targets)``, each int64 (B, T), from one
    shard order; ``position`` says where the next one starts."""

    def __init__(
        self,
        spec: RunSpec,
        seed: int,
        position_path: Path | None = None,
        tokenizer: Tokenizer | None = None,
        save_every_s: float = 1.0,
    ) -> None:
        self.spec = spec
        self.data = spec.data
        check_fingerprint(self.data)
        self.tokenizer = load_tokenizer(spec) if tokenizer is None else tokenizer
        self.files = data_files(self.data)
        self.first_shard = seed % self.data.shards
        self.window = spec.model.seq_len + 1
        self.batch_size = spec.batch.micro_batch_size
        self.position_path = position_path
        self.save_every_s = save_every_s
        self._saved_at = -math.inf
        self.position = self._saved_position(seed)
        self.seed = seed
        # (record position, tokens, offset of the first unconsumed token)
        self._segments: collections.deque[tuple[Position, np.ndarray, int]] = collections.deque()
        self._buffered = 0
        self._reader = self._read(self.position)
        self.micro_batches = 0

    def _saved_position(self, seed: int) -> Position:
        if self.position_path is None or not self.position_path.is_file():
            return Position()
        try:
            saved = json.loads(self.position_path.read_text(encoding="utf-8"))
            if (saved.get("version"), saved.get("run_id"), saved.get("seed")) == (
                POSITION_VERSION,
                self.spec.run_id,
                seed,
            ):
                return Position(**{k: int(saved[k]) for k in asdict(Position())})
        except (OSError, ValueError, TypeError, KeyError):
            pass  # unreadable or another run's: start from the beginning
        return Position()

    def _read(self, start: Position) -> Iterator[tuple[Position, np.ndarray]]:
        """(position of the record's first token still wanted, its tokens from there)."""
        epoch, shard_pass = start.epoch, start.shard_pass
        first = True
        empty_passes = 0
        while True:
            shard = (self.first_shard + shard_pass) % self.data.shards
            found = False
            for file_index in range(start.file if first else 0, len(self.files)):
                path, name = self.files[file_index]
                from_record = start.record if first and file_index == start.file else 0
                for index, text in records(self.data, path, from_record):
                    bucket = record_bucket(name, index)
                    if shard_of(bucket, self.data.validation_fraction, self.data.shards) != shard:
                        continue
                    found = True
                    tokens = np.concatenate((self.tokenizer.encode(text), self.tokenizer.separator))
                    resumed = first and file_index == start.file and index == start.record
                    skip = start.token if resumed else 0
                    yield Position(epoch, shard_pass, file_index, index, skip), tokens[skip:]
                first = False
            first = False
            empty_passes = 0 if found else empty_passes + 1
            if empty_passes > self.data.shards:  # a whole epoch (and more) without a record
                raise DataError(f"the data {list(self.data.corpus)} has no training records")
            shard_pass += 1
            if shard_pass == self.data.shards:
                epoch, shard_pass = epoch + 1, 0

    def _fill(self, need: int) -> None:
        while self._buffered < need:
            pos, tokens = next(self._reader)
            if tokens.size:
                self._segments.append((pos, tokens, 0))
                self._buffered += int(tokens.size)

    def _take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        at = 0
        while at < n:
            pos, tokens, offset = self._segments[0]
            k = min(n - at, int(tokens.size) - offset)
            out[at : at + k] = tokens[offset : offset + k]
            at += k
            if offset + k == tokens.size:
                self._segments.popleft()
            else:
                self._segments[0] = (pos, tokens, offset + k)
        self._buffered -= n
        return out

    def _next_position(self) -> Position:
        if not self._segments:
            self._fill(1)
        pos, _, offset = self._segments[0]
        return Position(pos.epoch, pos.shard_pass, pos.file, pos.record, pos.token + offset)

    def __iter__(self) -> WindowStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.batch_size * self.window
        self._fill(n)
        flat = torch.from_numpy(self._take(n)).view(self.batch_size, self.window)  # (B, T+1)
        self.micro_batches += 1
        self.position = self._next_position()
        now = time.monotonic()
        if self.position_path is not None and now - self._saved_at >= self.save_every_s:
            self._save_position()
            self._saved_at = now
        return flat[:, :-1].contiguous(), flat[:, 1:].contiguous()  # (B, T), (B, T)

    def _save_position(self) -> None:
        assert self.position_path is not None
        payload = {"version": POSITION_VERSION, "run_id": self.spec.run_id, "seed": self.seed}
        payload.update(asdict(self.position))
        directory = self.position_path.parent
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".position-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(tmp, self.position_path)


def streamed_validation_set(
    spec: RunSpec, tokenizer: Tokenizer | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``data.validation_windows`` windows of the validation records, in file
    order: ``(inputs, targets)``, each int64 (N, T); fewer when the held-out records are
    shorter (at least one, else DataError)."""
    data = spec.data
    check_fingerprint(data)
    tokenizer = load_tokenizer(spec) if tokenizer is None else tokenizer
    window = spec.model.seq_len + 1
    want = data.validation_windows * window
    parts: list[np.ndarray] = []
    have = 0
    for path, name in data_files(data):
        for index, text in records(data, path):
            if shard_of(record_bucket(name, index), data.validation_fraction, data.shards) != -1:
                continue
            tokens = np.concatenate((tokenizer.encode(text), tokenizer.separator))
            parts.append(tokens[: want - have])
            have += min(int(tokens.size), want - have)
            if have == want:
                break
        if have == want:
            break
    n = have // window
    if n == 0:
        raise DataError(
            f"the validation records of {list(data.corpus)} hold {have} tokens, fewer than "
            f"seq_len + 1 = {window}; raise data.validation_fraction or add data"
        )
    flat = torch.from_numpy(np.concatenate(parts)[: n * window]).view(n, window)  # (N, T+1)
    return flat[:, :-1].contiguous(), flat[:, 1:].contiguous()
