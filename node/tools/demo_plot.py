"""The demo's loss curve as a PNG: the swarm against the single-process reference.

Drawn with matplotlib's Agg canvas (no display, no pyplot global state: a ``Figure`` of its
own), loss in nats per byte against training tokens:

- the swarm: its trainers' training loss (the mean of their moving averages, polled while
  it trained) as a line, and its validation loss, measured through the swarm at the start
  and the end, as markers;
- the reference (node/tools/reference_training.py: the whole model in one process, same
  data, batch and optimizer, no codecs and no staleness): its validation loss as a line and
  its training loss (the mean of the steps since the previous point) dashed.

matplotlib is imported only when a curve is drawn; without it :func:`write_loss_curve`
raises :class:`PlotUnavailable` and the demo says so instead of drawing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

Points = Sequence[tuple[float, float]]  # (tokens, loss)


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported here."""


def write_loss_curve(
    path: Path,
    *,
    swarm_train: Points,
    swarm_val: Points,
    reference_val: Points,
    reference_train: Points = (),
    title: str = "wanswarm demo",
) -> Path:
    """Draw the curves into the PNG file ``path`` (written atomically); returns ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(f"matplotlib is not installed ({exc})") from None

    fig = Figure(figsize=(8.0, 5.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    def draw(points: Points, label: str, **style: object) -> None:
        finite = [(t / 1e3, v) for t, v in points if v is not None and math.isfinite(v)]
        if finite:
            xs, ys = zip(*finite, strict=True)
            ax.plot(xs, ys, label=label, **style)  # type: ignore[arg-type]

    draw(swarm_train, "swarm: training loss (trainers' moving average)", color="tab:blue")
    draw(
        swarm_val,
        "swarm: validation loss",
        color="tab:blue",
        marker="o",
        markersize=8,
        linestyle="none",
    )
    draw(reference_val, "single-process reference: validation loss", color="tab:orange")
    draw(
        reference_train,
        "single-process reference: training loss",
        color="tab:orange",
        linestyle="--",
        alpha=0.6,
    )
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fig.savefig(partial, format="png")
    partial.replace(path)
    return path


__all__ = ["PlotUnavailable", "write_loss_curve"]
