"""The demo's loss curve (node/tools/demo_plot.py) is a valid PNG with both curves drawn,
and the reference curve file (node/tools/demo_reference.py) is read back as written."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from wanswarm.node.config.runspec import default_run_spec
from wanswarm.node.tools.demo_plot import write_loss_curve
from wanswarm.node.tools.demo_reference import ReferenceRun, read_points

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _curves() -> dict[str, list[tuple[float, float]]]:
    tokens = [i * 20_000.0 for i in range(26)]
    return {
        "swarm_train": [(t, 5.6 - 3.2 * t / (t + 150_000)) for t in tokens[1:]],
        "swarm_val": [(4_000.0, 5.61), (500_000.0, 2.31)],
        "reference_val": [(t, 5.63 - 3.4 * t / (t + 140_000)) for t in tokens],
        "reference_train": [(t, float("nan") if t == 0 else 5.6 - 3.3 * t / (t + 140_000))
                            for t in tokens],
    }


def test_the_loss_curve_is_a_png_showing_both_curves(tmp_path: Path) -> None:
    plt_image = pytest.importorskip("matplotlib.image")
    path = write_loss_curve(tmp_path / "curve.png", title="test", **_curves())
    assert path == tmp_path / "curve.png"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    assert not list(tmp_path.glob("*.partial"))
    image = plt_image.imread(str(path))  # (H, W, 4) floats in [0, 1]
    assert image.shape[:2] == (500, 800)
    rgb = image[:, :, :3]
    assert rgb.std() > 0.05  # not blank

    def pixels_near(color: tuple[float, float, float]) -> int:
        return int((abs(rgb - color).max(axis=2) < 0.06).sum())

    # matplotlib's tab:blue (the swarm) and tab:orange (the reference), line and legend
    blue = pixels_near((0x1F / 255, 0x77 / 255, 0xB4 / 255))
    orange = pixels_near((0xFF / 255, 0x7F / 255, 0x0E / 255))
    assert blue > 500 and orange > 500, (blue, orange)


def test_without_a_reference_the_swarm_is_still_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    curves = _curves()
    path = write_loss_curve(
        tmp_path / "sub" / "c.png", swarm_train=curves["swarm_train"], swarm_val=[],
        reference_val=[],
    )
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_reference_points_are_read_back_torn_lines_passed_over(tmp_path: Path) -> None:
    path = tmp_path / "reference.jsonl"
    lines = [
        json.dumps({"tokens": 0, "val_loss": 5.63, "train_loss": float("nan")}),
        json.dumps({"tokens": 8192, "val_loss": 5.42, "train_loss": 5.61}),
        "[1, 2]",
        json.dumps({"tokens": "many", "val_loss": 1.0}),
        '{"tokens": 16384, "val_lo',  # being written
    ]
    path.write_text("\n".join(lines))
    points, done = read_points(path)
    assert not done and [p["tokens"] for p in points] == [0.0, 8192.0]
    assert points[1] == {"tokens": 8192.0, "val_loss": 5.42, "train_loss": 5.61}
    path.write_text("\n".join(lines[:2] + [json.dumps({"done": True})]) + "\n")
    assert read_points(path)[1] is True
    assert read_points(tmp_path / "missing.jsonl") == ([], False)


def test_a_finished_reference_is_cached_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = default_run_spec()
    work = tmp_path / "work"
    work.mkdir()
    run = ReferenceRun(spec, None, 16384, 8, work)
    assert not run.from_cache
    assert run.cached == tmp_path / "cache" / "wanswarm" / "reference" / (
        f"{spec.run_id}-t16384-w8.jsonl"
    )
    # what the child writes, as if it had run (a finished stand-in process)
    run.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    run.proc.wait(10)
    half = [json.dumps({"tokens": 0, "val_loss": 5.6, "train_loss": float("nan")})]
    run.path.write_text("\n".join(half) + "\n")
    points, done = asyncio.run(run.wait(16384, timeout=0.0))
    assert len(points) == 1 and not done and not run.cached.exists()  # not cached: unfinished
    full = half + [json.dumps({"tokens": 16384, "val_loss": 5.2, "train_loss": 5.4}),
                   json.dumps({"done": True})]
    run.path.write_text("\n".join(full) + "\n")
    points, done = asyncio.run(run.wait(16384, timeout=5.0))
    assert done and [p["tokens"] for p in points] == [0.0, 16384.0]
    again = ReferenceRun(spec, None, 16384, 8, work)
    assert again.from_cache
    again.start()  # nothing to train: the cache has it
    assert again.proc is None and again.points() == (points, True)
    assert not ReferenceRun(spec, None, 32768, 8, work).from_cache  # another budget
