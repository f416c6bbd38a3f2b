"""Data: corpus loading and split, deterministic training stream, fixed validation set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from wanswarm.node.config.runspec import DataSpec, RunSpec
from wanswarm.node.training.data import (
    CorpusError,
    TrainStream,
    load_corpus,
    resolve_corpus,
    validation_set,
)


def make_files(root: Path, n: int = 40, size: int = 300) -> None:
    for i in range(n):
        sub = root / ("pkg" if i % 2 else "lib")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:02d}.py").write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))


def spec_for(corpus: list[str], **data: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "d",
            "model": {"d_model": 16, "n_heads": 2, "n_layers": 3, "seq_len": 32},
            "stages": {"blocks_per_stage": [1, 1, 1]},
            "batch": {"micro_batch_size": 4, "target_batch_size": 8},
            "data": {
                "corpus": corpus,
                "validation_fraction": 0.2,
                "validation_windows": 10,
                **data,
            },
        }
    )


def test_split_by_file_is_deterministic_and_complete(tmp_path: Path) -> None:
    make_files(tmp_path)
    spec = spec_for(["**/*.py"])
    corpus = load_corpus(spec.data, tmp_path)
    assert corpus.data.dtype == torch.uint8 and corpus.data.numel() == 40 * 300
    held = [f for f in corpus.files if f.validation_bytes]
    assert 0 < len(held) < 40
    assert all(f.validation_bytes in (0, f.n_bytes) for f in corpus.files)
    assert corpus.validation.numel() == sum(f.validation_bytes for f in corpus.files)
    assert [f.name for f in corpus.files] == sorted(f.name for f in corpus.files)
    assert corpus.files[0].name == "lib/f00.py"
    # Names are relative to the pattern's fixed prefix: moving the corpus keeps the split.
    moved = tmp_path / "elsewhere"
    make_files(moved)
    again = load_corpus(spec_for(["elsewhere/**/*.py"]).data, tmp_path)
    assert [f.validation_bytes for f in again.files] == [f.validation_bytes for f in corpus.files]


def test_single_file_holds_out_its_tail(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_bytes(bytes(range(200)) * 5)
    corpus = load_corpus(spec_for(["one.txt"]).data, tmp_path)
    assert corpus.files[0].validation_bytes == 200
    assert bytes(corpus.validation.tolist()) == bytes(range(200))


def test_cached_per_process(tmp_path: Path) -> None:
    make_files(tmp_path)
    data = spec_for(["lib/*.py"]).data
    assert load_corpus(data, tmp_path) is load_corpus(data, tmp_path)
    # Validation windows do not change the corpus: no second read.
    other = spec_for(["lib/*.py"], validation_windows=3).data
    assert load_corpus(other, tmp_path) is load_corpus(data, tmp_path)


def test_fingerprint_follows_content(tmp_path: Path) -> None:
    make_files(tmp_path / "a")
    make_files(tmp_path / "b")
    first = load_corpus(spec_for(["a/**/*.py"]).data, tmp_path).fingerprint
    assert first == load_corpus(spec_for(["b/**/*.py"]).data, tmp_path).fingerprint
    make_files(tmp_path / "c")
    (tmp_path / "c" / "lib" / "f00.py").write_bytes(b"changed" * 50)
    changed = load_corpus(spec_for(["c/**/*.py"]).data, tmp_path)
    assert len(first) == 16 and changed.fingerprint != first


def test_train_stream(tmp_path: Path) -> None:
    make_files(tmp_path)
    spec = spec_for(["**/*.py"])
    corpus = load_corpus(spec.data, tmp_path)
    train = bytes(corpus.train.tolist())
    a, b, c = (
        TrainStream(spec, 1, corpus),
        TrainStream(spec, 1, corpus),
        TrainStream(spec, 2, corpus),
    )
    for _ in range(5):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert xa.shape == ya.shape == (4, 32) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        for row_x, row_y in zip(xa.tolist(), ya.tolist(), strict=True):
            assert bytes(row_x + row_y[-1:]) in train
    assert a.micro_batches == 5


def test_validation_set_is_fixed_and_held_out(tmp_path: Path) -> None:
    make_files(tmp_path)
    spec = spec_for(["**/*.py"])
    corpus = load_corpus(spec.data, tmp_path)
    x1, y1 = validation_set(spec, corpus)
    x2, y2 = validation_set(spec, corpus)
    assert x1.shape == (10, 32) and torch.equal(x1, x2) and torch.equal(y1, y2)
    held = bytes(corpus.validation.tolist())
    for row_x, row_y in zip(x1.tolist(), y1.tolist(), strict=True):
        assert bytes(row_x + row_y[-1:]) in held
    # Another optimizer setting, same data: the same validation windows.
    other = RunSpec.model_validate({**spec.model_dump(), "optimizer": {"lr": 0.01}})
    assert other.run_id != spec.run_id
    assert torch.equal(validation_set(other, corpus)[0], x1)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="'missing.txt' not found"):
        load_corpus(spec_for(["missing.txt"]).data, tmp_path)
    with pytest.raises(CorpusError, match="matched no files"):
        load_corpus(spec_for(["nothing/*.py"]).data, tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="is empty"):
        load_corpus(spec_for(["empty.txt"]).data, tmp_path)
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    short = spec_for(["short.txt"])
    with pytest.raises(CorpusError, match="validation split has 20 bytes"):
        validation_set(short, load_corpus(short.data, tmp_path))


def test_stdlib_corpus_is_found() -> None:
    files = resolve_corpus(DataSpec())
    names = {name for _, name in files}
    assert len(files) > 100
    assert "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in name for name in names)
