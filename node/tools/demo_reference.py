"""The single-process reference curve the demo draws its swarm against.

:class:`ReferenceRun` trains the reference (``reference_training.train_reference``: the
whole model in one process, one thread, data seed 0) to the demo's token budget in a child
process started when the swarm starts training, so it runs alongside (one more thread
next to the daemons). The child appends one JSON line per validation point to a file; the
demo reads what is there when it draws. The reference is deterministic for a run spec, a
token budget and a number of validation windows, so a finished curve is kept in the user's
cache directory (``$XDG_CACHE_HOME/wanswarm/reference``, else ``~/.cache/...``) and a later
demo with the same three reads it instead of training again.

``python -m wanswarm.node.tools.demo_reference --tokens N --val-windows W --out FILE
[--spec TOML]`` is the child's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..config.runspec import RunSpec

Point = dict[str, float]  # tokens, val_loss, train_loss


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wanswarm" / "reference"


def read_points(path: Path) -> tuple[list[Point], bool]:
    """The points a reference file holds so far and whether it is complete. A torn last
    line (the child writing it) or a foreign line is passed over."""
    points: list[Point] = []
    done = False
    try:
        text = path.read_text()
    except OSError:
        return points, done
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if item.get("done") is True:
            done = True
        elif all(isinstance(item.get(k), int | float) for k in ("tokens", "val_loss")):
            points.append(
                {
                    "tokens": float(item["tokens"]),
                    "val_loss": float(item["val_loss"]),
                    "train_loss": float(item.get("train_loss", float("nan"))),
                }
            )
    return points, done


class ReferenceRun:
    """The reference curve for ``spec`` trained to ``tokens``: from the cache, or from a
    child process (see the module docstring)."""

    def __init__(
        self, spec: RunSpec, spec_path: Path | None, tokens: int, val_windows: int, work: Path
    ) -> None:
        self.spec_path = spec_path
        self.tokens = tokens
        self.val_windows = val_windows
        self.cached = cache_dir() / f"{spec.run_id}-t{tokens}-w{val_windows}.jsonl"
        self.path = work / "reference.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = work / "reference.log"

    @property
    def from_cache(self) -> bool:
        return read_points(self.cached)[1]

    def start(self) -> None:
        """Start the child unless the cache has the curve."""
        if self.from_cache:
            return
        cmd = [
            sys.executable,
            "-m",
            "wanswarm.node.tools.demo_reference",
            "--tokens",
            str(self.tokens),
            "--val-windows",
            str(self.val_windows),
            "--out",
            str(self.path),
        ]
        if self.spec_path is not None:
            cmd += ["--spec", str(self.spec_path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log_file, "wb") as sink:
            self.proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    def points(self) -> tuple[list[Point], bool]:
        """The curve so far and whether it is complete."""
        if self.proc is None:
            return read_points(self.cached)
        return read_points(self.path)

    async def wait(self, min_tokens: float, timeout: float) -> tuple[list[Point], bool]:
        """Wait (at most ``timeout`` s) for the child to finish or pass ``min_tokens``; the
        curve then, and whether it is complete. A complete curve goes into the cache."""
        deadline = time.monotonic() + timeout
        while True:
            points, done = self.points()
            reached = bool(points) and points[-1]["tokens"] >= min_tokens
            if done or reached or time.monotonic() > deadline:
                break
            if self.proc is not None and self.proc.poll() is not None:
                break  # it failed: what it wrote is all there is
            await asyncio.sleep(1.0)
        if done and self.proc is not None:
            try:
                self.cached.parent.mkdir(parents=True, exist_ok=True)
                partial = self.cached.with_name(self.cached.name + ".partial")
                partial.write_text(self.path.read_text())
                partial.replace(self.cached)
            except OSError:
                pass  # no cache: the next demo trains it again
        return points, done

    def stop(self) -> None:
        """End the child (it may still be training past what the demo needed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    """The child: train the reference, one JSON line per validation point, then ``done``."""
    import torch

    from ..config.runspec import default_run_spec, load_run_spec
    from .reference_training import CurvePoint, train_reference

    parser = argparse.ArgumentParser(description="the demo's reference curve (JSON lines)")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--val-windows", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = default_run_spec() if args.spec is None else load_run_spec(args.spec)
    with open(args.out, "w") as out:

        def write(item: dict[str, Any]) -> None:
            out.write(json.dumps(item) + "\n")
            out.flush()

        def on_point(point: CurvePoint) -> None:
            write(
                {"tokens": point.tokens, "val_loss": point.val_loss, "train_loss": point.train_loss}
            )

        train_reference(
            spec, args.tokens, 0, on_point=on_point, val_windows=args.val_windows
        )
        write({"done": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
