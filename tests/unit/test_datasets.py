"""Streamed datasets (datasets.py), tokenizers (tokenizer.py) and data fingerprints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from wanswarm.node.config.runspec import RunSpec
from wanswarm.node.training.data import TrainStream, validation_set
from wanswarm.node.training.datasets import (
    DataError,
    WindowStream,
    clear_fingerprint_cache,
    data_fingerprint,
)
from wanswarm.node.training.tokenizer import TokenizerError, load_tokenizer, train_bpe

TEXTS = [f"record {i:04d} says " + "abcdefgh"[i % 8] * (20 + i % 13) for i in range(400)]


def _spec(corpus: Path, fmt: str = "jsonl", **data: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "data-test",
            "model": {"seq_len": 32, "n_layers": 1},
            "stages": {"blocks_per_stage": [1]},
            "batch": {"micro_batch_size": 2, "target_batch_size": 2},
            "data": {"format": fmt, "corpus": [str(corpus)], "validation_windows": 4, **data},
        }
    )


def _jsonl(path: Path, texts: list[str] = TEXTS) -> Path:
    path.write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in texts))
    return path


def _ids(batch: tuple[torch.Tensor, torch.Tensor]) -> set[int]:
    text = bytes(batch[0].flatten().tolist()).decode()
    return {int(m) for m in re.findall(r"record (\d{4})", text)}


def test_stream_is_deterministic_and_shards_are_disjoint(tmp_path: Path) -> None:
    spec = _spec(_jsonl(tmp_path / "d.jsonl"), shards=2)
    a, b, c = WindowStream(spec, 0), WindowStream(spec, 0), WindowStream(spec, 1)
    first = [next(a) for _ in range(40)]
    for x, y in first[:5]:
        assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert all(torch.equal(p[0], next(b)[0]) for p in first)
    assert a.position.epoch == 0 and a.position.shard_pass == 0  # still in its own shard
    seen_a = set().union(*(_ids(p) for p in first))
    seen_c = set().union(*(_ids(next(c)) for _ in range(40)))
    assert seen_a and seen_c and not seen_a & seen_c
    held_out = _ids(validation_set(spec))
    assert held_out and not held_out & (seen_a | seen_c)


def test_stream_resumes_from_its_saved_position(tmp_path: Path) -> None:
    spec = _spec(_jsonl(tmp_path / "d.jsonl"))
    reference = WindowStream(spec, 5)
    batches = [next(reference)[0] for _ in range(12)]
    position = tmp_path / "position.json"
    first = WindowStream(spec, 5, position_path=position, save_every_s=0.0)
    for _ in range(7):
        next(first)
    assert json.loads(position.read_text())["run_id"] == spec.run_id
    resumed = TrainStream(spec, 5, position_path=position)  # a restarted trainer
    for expected in batches[7:]:
        assert torch.equal(next(resumed)[0], expected)
    other_seed = WindowStream(spec, 6, position_path=position)  # not its position: start over
    assert other_seed.position.record == 0


def test_formats_read_the_same_records(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow", reason="needs pyarrow: pip install 'wanswarm[data]'")
    import pyarrow.parquet as pq

    reference = next(WindowStream(_spec(_jsonl(tmp_path / "d.jsonl")), 3))[0]
    table = pyarrow.table({"text": TEXTS})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=50)
    assert torch.equal(
        next(WindowStream(_spec(tmp_path / "d.parquet", "parquet"), 3))[0], reference
    )
    datasets = pytest.importorskip(
        "datasets", reason="needs datasets: pip install 'wanswarm[data]'"
    )
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "hf"))
    assert torch.equal(next(WindowStream(_spec(tmp_path / "hf", "hf_disk"), 3))[0], reference)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world\n" * 2000)
    x, _ = next(WindowStream(_spec(tmp_path / "txt", "text"), 0))
    assert bytes(x[0].tolist()).decode() in ("hello world\n" * 4)[: 32 + 12] * 2


def _error(spec: RunSpec) -> str:
    with pytest.raises(DataError) as info:
        stream = WindowStream(spec, 0)
        for _ in range(100):  # until the reader reaches the bad record
            next(stream)
    return str(info.value)


def test_malformed_files_name_the_file_and_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", TEXTS[:3])
    with path.open("a") as f:
        f.write('{"body": "no text field"}\n')
    assert f"{path}:4: no 'text' field" in _error(_spec(path))
    path.write_text('{"text": "ok"}\n{"text": \n')
    assert f"{path}:2: not valid JSON" in _error(_spec(path))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nbroken \xff\xfe line\n")
    assert f"{bad}:2: invalid UTF-8" in _error(_spec(bad, "text"))
    pyarrow = pytest.importorskip("pyarrow", reason="needs pyarrow: pip install 'wanswarm[data]'")
    import pyarrow.parquet as pq

    whole = tmp_path / "whole.parquet"
    pq.write_table(pyarrow.table({"text": TEXTS}), whole)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert f"{truncated}: not a readable Parquet file" in _error(_spec(truncated, "parquet"))
    assert "no column 'body'" in _error(_spec(whole, "parquet", text_field="body"))


def test_fingerprint_mismatch_is_refused_naming_the_difference(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl")
    pinned = str(data_fingerprint(_spec(path).data))
    spec = _spec(path, fingerprint=pinned)
    next(WindowStream(spec, 0))  # the same data: accepted
    _jsonl(path, TEXTS[:-1])  # one record fewer
    clear_fingerprint_cache()  # a trainer reads its files once per process; we changed them
    message = _error(spec)
    assert "the local data differs from the run's" in message and "bytes here" in message
    with pytest.raises(DataError, match="differs"):
        validation_set(spec)
    assert spec.run_id != _spec(path).run_id  # the fingerprint is part of the run id


def test_bpe_tokenizer_trains_loads_and_is_pinned(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="needs tokenizers: pip install 'wanswarm[data]'")
    out = tmp_path / "tok.json"
    made = train_bpe(iter(TEXTS), 300, out)
    again = train_bpe(iter(TEXTS), 300, tmp_path / "again.json")
    assert made["tokenizer_sha256"] == again["tokenizer_sha256"]  # deterministic file
    path = _jsonl(tmp_path / "d.jsonl")
    fields = {"tokenizer": str(out), "tokenizer_sha256": made["tokenizer_sha256"]}
    spec = _spec(path, eos_token="<|endoftext|>", **fields)
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"vocab_size": made["vocab_size"]})}
    )
    tokenizer = load_tokenizer(spec)
    assert tokenizer.vocab_size == made["vocab_size"] == 300
    x, _ = next(WindowStream(spec, 0))
    assert int(x.max()) < 300 and int(x.min()) >= 0
    wrong = spec.model_copy(
        update={"data": spec.data.model_copy(update={"tokenizer_sha256": "0" * 64})}
    )
    with pytest.raises(TokenizerError, match="another tokenizer"):
        load_tokenizer(wrong)


def test_a_node_whose_data_differs_is_refused_at_join(tmp_path: Path) -> None:
    from wanswarm.node.errors import JoinError
    from wanswarm.node.swarm_node import check_local_data

    path = _jsonl(tmp_path / "d.jsonl")
    spec = _spec(path, fingerprint=str(data_fingerprint(_spec(path).data)))
    check_local_data(spec)  # the run's data: the trainer may start
    _jsonl(path, TEXTS[:-1])
    clear_fingerprint_cache()
    with pytest.raises(JoinError, match="this node's data is not the run's: .*differs"):
        check_local_data(spec)
