"""``raytrn runs compare --sweep`` (and ``raytrn sweep``'s end): a sweep's trials ranked by its metric, their varied
fields as columns, and their plots. The runs' table is :mod:`raytrn.tracking.compare`, whose helpers this uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from raytrn.errors import RaytrnError
from raytrn.tracking.client import redact_uri
from raytrn.tracking.compare import _client, _first_line, _fmt_value, _save_png, find_run
from raytrn.tracking.logger import LOGGED_STEP_TAG


class Ending(Enum):
    """How a trial ended, as the sweep decided it (its run's MLflow status is :attr:`TrialRow.status`)."""

    RAN = "ran"  # to its end, or still running
    STOPPED_EARLY = "stopped early"  # by the scheduler (ASHA)
    FAILED = "failed"


@dataclass(kw_only=True)
class TrialRow:
    """One trial of a sweep: its varied values, how it ended (``ending``, with its ``detail``: the scheduler's
    decision, the error), how far it got, and its final metric."""

    tag: str
    run_id: str
    status: str
    steps: int | None
    values: dict[str, str]
    metric: float | None
    ending: Ending = Ending.RAN
    detail: str = ""

    @property
    def note(self) -> str:
        """The table's note: ``stopped early (ASHA at step 20)``, ``failed: …``, or nothing."""
        match self.ending:
            case Ending.STOPPED_EARLY:
                return "stopped early" + (f" ({self.detail})" if self.detail else "")
            case Ending.FAILED:
                return f"failed: {self.detail}"
            case Ending.RAN:
                return ""


@dataclass(kw_only=True)
class SweepComparison:
    """A sweep's trials ranked by its metric (best first; trials without it last)."""

    name: str
    parent_run_id: str | None
    metric: str
    mode: str
    fields: list[str]
    rows: list[TrialRow] = field(default_factory=list)
    tracking_uri: str | None = None
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # run id -> (step, metric)

    def ranked(self) -> list[TrialRow]:
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(
            self.rows,
            key=lambda r: (r.metric is None or math.isnan(r.metric), sign * (r.metric or 0.0), r.tag),
        )

    def render(self) -> str:
        if not self.rows:
            return f"sweep {self.name} has no trials"
        short = _short_names(self.fields)
        header = ["rank", "trial", "id", "status", "steps", *short, self.metric, "note"]
        lines = []
        for i, r in enumerate(self.ranked(), 1):
            cells = [
                str(i),
                r.tag,
                r.run_id[:8] if r.run_id else "-",
                r.status,
                "-" if r.steps is None else str(r.steps),
            ]
            cells += [r.values.get(f, "-") for f in self.fields]
            cells += ["-" if r.metric is None else _fmt_value(r.metric), r.note]
            lines.append(cells)
        numeric = {0, 4, *range(5, 5 + len(self.fields) + 1)}
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

        def fmt(row: list[str]) -> str:
            out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            return "  ".join(out).rstrip()

        title = f"sweep {self.name}: {len(self.rows)} trial(s) ranked by {self.metric} ({self.mode}; best first)"
        return "\n".join([title, fmt(header), *(fmt(row) for row in lines)])


def _short_names(fields: list[str]) -> list[str]:
    """Column headers for varied fields: the last part of the dotted name, more where two would clash."""
    out = []
    for f in fields:
        parts = f.split(".")
        name = parts[-1]
        if sum(1 for g in fields if g.split(".")[-1] == name) > 1:
            name = ".".join(parts[-2:])
        out.append(name)
    return out


def compare_sweep(*, tracking_uri: str, sweep: str | None = None, parent: str | None = None) -> SweepComparison:
    """The trials of a sweep from MLflow: its parent run found by name (tag ``raytrn.sweep``) or id, its children by
    ``mlflow.parentRunId``; the metric and the varied fields are the parent's params."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        if parent is not None:  # a whole id, or its first characters among the sweeps' parent runs
            experiments = [e.experiment_id for e in client.search_experiments()]
            run = find_run(client, parent, flag="--parent", experiment_ids=experiments, where="sweep's parent run",
                           filter_string="tags.`raytrn.kind` = 'sweep'",
                           hint="--sweep NAME takes a sweep by its name")  # fmt: skip
            if run.data.tags.get("raytrn.kind") != "sweep":
                raise RaytrnError(f"--parent {parent}: run {run.info.run_name} is not a raytrn sweep's parent run")
        else:
            experiments = [e.experiment_id for e in client.search_experiments()]
            found = client.search_runs(
                experiments,
                filter_string=f"tags.`raytrn.sweep` = '{_quoted(sweep or '')}' and tags.`raytrn.kind` = 'sweep'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if not found:
                raise RaytrnError(
                    f"--sweep {sweep}: no sweep of that name at {redact_uri(tracking_uri)} (its parent run is named after it; "
                    "`raytrn runs compare --experiment NAME` lists the runs)"
                )
            run = found[0]
        params = run.data.params
        metric, mode = params.get("sweep.metric", "loss"), params.get("sweep.mode", "min")
        fields = [k.removeprefix("space.") for k in params if k.startswith("space.")]
        fields.sort(key=lambda f: list(params).index(f"space.{f}"))
        children = client.search_runs(
            [run.info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'",
            max_results=5000,
        )
        cmp = SweepComparison(
            name=run.info.run_name or run.data.tags.get("raytrn.sweep", "?"), parent_run_id=run.info.run_id,
            metric=metric, mode=mode, fields=fields, tracking_uri=tracking_uri,
        )  # fmt: skip
        for child in children:
            history = sorted((m.step, m.value) for m in client.get_metric_history(child.info.run_id, metric))
            trained = client.get_metric_history(child.info.run_id, "loss")
            steps = _steps_reached(trained, history, child.data.tags.get(LOGGED_STEP_TAG))
            ending, detail = _ending(child.data.tags.get("raytrn.stopped_early"), child.data.tags.get("raytrn.error"))
            cmp.histories[child.info.run_id] = history
            cmp.rows.append(
                TrialRow(
                    tag=child.data.tags.get("raytrn.trial", child.info.run_name or "?"),
                    run_id=child.info.run_id,
                    status=child.info.status,
                    steps=steps,
                    values={f: _fmt_param(child.data.params.get(f)) for f in fields},
                    metric=history[-1][1] if history else None,
                    ending=ending,
                    detail=detail,
                )
            )
    except MlflowException as e:
        raise RaytrnError(f"cannot read MLflow at {redact_uri(tracking_uri)}: {_first_line(e)}") from None
    return cmp


def _steps_reached(trained: Sequence[Any], history: Sequence[tuple[int, float]], logged: str | None) -> int | None:
    """The last step a trial's run shows it reached: of its ``loss`` points, its sweep metric's points and its
    logged-step tag. A trial ASHA stops is killed with its tracking actor, so the loss of the report it was stopped
    on may never reach MLflow; the sweep logs that report's metric at its step (``end_trial_run``)."""
    steps = [int(m.step) for m in trained] + [int(step) for step, _ in history]
    if logged and logged.isdigit():
        steps.append(int(logged))
    return max(steps, default=None)


def _ending(stopped: str | None, error: str | None) -> tuple[Ending, str]:
    """How a trial's run ended, from its tags: stopped early (the tag is the scheduler's reason: its decision is
    what comes before the first colon), failed (the error's first line), or ran."""
    if stopped:
        return Ending.STOPPED_EARLY, stopped.split(":", 1)[0] if ":" in stopped else ""
    if error:
        return Ending.FAILED, error.splitlines()[0][:80]
    return Ending.RAN, ""


def _quoted(text: str) -> str:
    return text.replace("'", "\\'")


def _fmt_param(text: str | None) -> str:
    if text is None or text == "None":
        return "-"
    try:
        value = float(text)
    except ValueError:
        return text
    return text if value.is_integer() and "." not in text and "e" not in text.lower() else f"{value:.4g}"


def plot_sweep(cmp: SweepComparison, path: str) -> str:
    """A PNG: the metric against step for every trial, and the final metric against each varied field (one panel
    each; log scale where the values span more than 10x). Finished trials are dots, stopped ones crosses."""
    if not cmp.rows:
        raise RaytrnError(f"sweep {cmp.name} has no trials; nothing to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RaytrnError("--plot needs matplotlib: pip install matplotlib") from None
    panels = 1 + len(cmp.fields)
    fig = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    for r in cmp.ranked():
        points = cmp.histories.get(r.run_id) or []
        if points:
            values = ", ".join(
                f"{k}={r.values.get(f, '-')}" for k, f in zip(_short_names(cmp.fields), cmp.fields, strict=True)
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None,
                    label=f"{r.tag} {values}")  # fmt: skip
    ax.set_title(f"{cmp.metric} vs step")
    ax.set_xlabel("step")
    ax.set_ylabel(cmp.metric)
    ax.grid(True, alpha=0.3)
    if any(cmp.histories.values()):
        ax.legend(fontsize="x-small")
    for ax, f, short in zip(axes[1:], cmp.fields, _short_names(cmp.fields), strict=True):
        xs, ys, stopped = [], [], []
        for r in cmp.rows:
            if r.metric is None:
                continue
            xs.append(r.values.get(f, "-"))
            ys.append(r.metric)
            stopped.append(r.ending is Ending.STOPPED_EARLY)
        numbers = _as_numbers(xs)
        x = numbers if numbers is not None else xs
        for mark, pick in (("o", False), ("x", True)):
            sel = [i for i, s in enumerate(stopped) if s == pick]
            if sel:
                ax.scatter([x[i] for i in sel], [ys[i] for i in sel], marker=mark,
                           label="stopped early" if pick else "ran to the end")  # fmt: skip
        if numbers and min(numbers) > 0 and max(numbers) / min(numbers) > 10:
            ax.set_xscale("log")
        ax.set_title(f"final {cmp.metric} vs {short}")
        ax.set_xlabel(f)
        ax.set_ylabel(cmp.metric)
        ax.grid(True, alpha=0.3)
        if ys:
            ax.legend(fontsize="x-small")
    fig.suptitle(f"sweep {cmp.name}")
    return _save_png(fig, path)


def _as_numbers(values: list[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None
