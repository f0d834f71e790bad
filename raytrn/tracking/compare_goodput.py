"""``raytrn runs compare --goodput``: where each run's wall time went (its goodput ledger, :mod:`raytrn.tracking.goodput`)
side by side, and as a stacked bar per run (``--plot``)."""

from __future__ import annotations

from typing import Any

from raytrn.errors import RaytrnError
from raytrn.tracking.compare import CAUSE_METRICS, _save_png

#: A colour per cause: productive green, start-up and restarts warm, the in-loop costs cool.
COLOURS = {
    "productive": "#2ca02c", "startup": "#d62728", "restart": "#ff7f0e", "resize": "#e377c2", "preemption": "#8c564b",
    "restore": "#bcbd22", "retrained": "#f7b6d2", "warmup": "#9467bd", "data_wait": "#17becf", "checkpoint": "#1f77b4",
    "eval": "#aec7e8", "other": "#c7c7c7", "shutdown": "#7f7f7f",
}  # fmt: skip


def plot_goodput(comparison: Any, path: str) -> str:
    """A PNG with one horizontal bar per run (newest on top), its wall time stacked by cause. Returns the path."""
    rows = [r for r in comparison.rows if r.metrics.get("wall_s")]
    if not rows:
        raise RaytrnError(
            f"no run of experiment {comparison.experiment} has a goodput ledger (raytrn logs one as a run ends); "
            "nothing to plot"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RaytrnError("--plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [f"{r.name or r.run_id[:8]} ({r.metrics.get('goodput', 0.0):.2f})" for r in rows]
    lefts = [0.0] * len(rows)
    for cause, metric in CAUSE_METRICS.items():
        widths = [r.metrics.get(metric, 0.0) for r in rows]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=lefts, color=COLOURS[cause], label=cause)
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    ax.invert_yaxis()  # newest first, as in the table
    ax.set_xlabel("seconds (each run's wall time, by cause; goodput in brackets)")
    ax.legend(ncol=min(7, len(ax.get_legend_handles_labels()[0])), fontsize="small", loc="lower center",
              bbox_to_anchor=(0.5, 1.0))  # fmt: skip
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"experiment {comparison.experiment}: goodput ledger")
    return _save_png(fig, path)
