"""Resident memory while a trainer streams a large local dataset (node/training/datasets.py).

Writes a JSON-lines dataset of ``--gb`` gigabytes (default 2) into a fresh directory under
/tmp (records of ~1 KB of varied text), then does what a trainer does with it: checks its
fingerprint, reads the validation windows, and draws training micro-batches (read,
tokenized on the fly, packed into windows) until one whole epoch of the training records
has gone by, saving the position after every micro-batch as a trainer with a state
directory does. Peak resident memory (``ru_maxrss``) is taken at the end, together with its
value before the dataset was touched (the interpreter, torch and numpy). The dataset is
deleted afterwards, also on failure.

    nice -n 10 python benchmarks/data_memory.py [--gb 2] [--tokenizer FILE --vocab-size N]

Last line: one JSON object (dataset bytes, records, tokens, micro-batches, seconds, MB/s,
peak RSS before and after, the 500 MB budget and whether it held).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

BUDGET_MB = 500.0
WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "river stone garden lamp market owl fox kite harbor meadow library silver orange quiet "
    "brave curious counted walked gave kept went home look said number seven eight nine"
).split()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def write_dataset(path: Path, target_bytes: int, seed: int = 0) -> int:
    """JSON lines of ~1 KB stories until ``target_bytes``; returns the record count."""
    rng = random.Random(seed)
    records = 0
    written = 0
    # A pool of lines reused with a per-record prefix: fast to write, still distinct records.
    pool = [" ".join(rng.choice(WORDS) for _ in range(170)) for _ in range(512)]
    with path.open("w", encoding="utf-8", buffering=1 << 20) as f:
        while written < target_bytes:
            line = json.dumps({"text": f"story {records}: {pool[records % len(pool)]}"}) + "\n"
            f.write(line)
            written += len(line)
            records += 1
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="dataset size in GB (1e9 bytes)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizers JSON file (default: bytes)")
    parser.add_argument("--vocab-size", type=int, default=256, help="with --tokenizer")
    args = parser.parse_args()

    import torch  # noqa: F401  (the baseline includes what a trainer has loaded anyway)
    from wanswarm.node.config.runspec import RunSpec
    from wanswarm.node.training.data import TrainStream, validation_set
    from wanswarm.node.training.datasets import data_fingerprint
    from wanswarm.node.training.tokenizer import sha256_file

    root = Path(tempfile.mkdtemp(prefix="wanswarm-data-memory-", dir="/tmp"))
    try:
        data_path = root / "data.jsonl"
        t0 = time.monotonic()
        n_records = write_dataset(data_path, int(args.gb * 1e9))
        write_s = time.monotonic() - t0
        size = data_path.stat().st_size
        data = {"format": "jsonl", "corpus": [str(data_path)], "validation_windows": 64}
        if args.tokenizer is not None:
            data |= {
                "tokenizer": str(args.tokenizer),
                "tokenizer_sha256": sha256_file(args.tokenizer),
            }
        spec = RunSpec.model_validate(
            {
                "name": "data-memory",
                "model": {"seq_len": 1024, "vocab_size": args.vocab_size},
                "batch": {"micro_batch_size": 16, "target_batch_size": 64},
                "data": data,
            }
        )
        spec = spec.model_copy(
            update={
                "data": spec.data.model_copy(
                    update={"fingerprint": str(data_fingerprint(spec.data))}
                )
            }
        )
        baseline = peak_rss_mb()
        t0 = time.monotonic()
        validation_set(spec)
        stream = TrainStream(spec, seed=0, position_path=root / "position.json")
        inner = stream._streamed
        assert inner is not None
        tokens = micro_batches = 0
        while inner.position.epoch == 0:  # type: ignore[attr-defined]
            x, _ = next(stream)
            tokens += x.numel()
            micro_batches += 1
        read_s = time.monotonic() - t0
        peak = peak_rss_mb()
        result = {
            "benchmark": "data_memory",
            "dataset_bytes": size,
            "records": n_records,
            "tokenizer": "bytes" if args.tokenizer is None else str(args.tokenizer),
            "write_s": round(write_s, 1),
            "read_s": round(read_s, 1),
            "read_mb_per_s": round(size / 1e6 / read_s, 1),
            "micro_batches": micro_batches,
            "tokens": tokens,
            "peak_rss_mb_before_data": round(baseline, 1),
            "peak_rss_mb": round(peak, 1),
            "budget_mb": BUDGET_MB,
            "within_budget": peak < BUDGET_MB,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
