"""``raytrn runs compare``: the runs of one MLflow experiment side by side, and their curves.

One row per run (newest first): a few key params, status, duration and the final value (latest step)
of each chosen metric, with the best value per metric marked ``*``. Lower is better for every metric
except the throughput-like ones in :data:`HIGHER_IS_BETTER`; unknown metrics count as lower-is-better.
An experiment without runs (or none matching the filter) is not an error: the table says so.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from raytrn.config import resolve_mlflow_uri as resolve_tracking_uri
from raytrn.errors import RaytrnError
from raytrn.tracking.client import mlflow_client, redact_uri, sqlite_path
from raytrn.tracking.logger import LOGGED_STEP_TAG

DEFAULT_METRICS = ("loss", "tokens_per_s", "usd_per_1m_tokens", "mfu")
#: Shown first by default when a run of the experiment has them (the held-out loss says more than the training loss).
VALIDATION_METRICS = ("val_loss",)
HIGHER_IS_BETTER = frozenset({"tokens_per_s", "mfu", "tokens_per_usd", "tokens_seen"})
#: ``--estimates``: how far ``raytrn estimate`` was from each run (signed fractions: best is closest to 0).
ESTIMATE_METRICS = ("estimate_error_tokens_per_s", "estimate_error_memory")
CLOSEST_TO_ZERO = frozenset(ESTIMATE_METRICS)
# (param key, column header): what tells runs of a sweep apart.
KEY_PARAMS = (
    ("model.preset", "preset"),
    ("scaling.accelerator", "accel"),
    ("scaling.max_workers", "workers"),
    ("data.seq_len", "seq_len"),
    ("optim.lr", "lr"),
    ("model.lora.rank", "lora_r"),
)
OPTIONAL_PARAMS = frozenset({"model.lora.rank"})
PLOT_METRICS = ("loss", "tokens_per_s")
_CONNECT_TIMEOUT_S = 5.0


@dataclass(kw_only=True)
class RunRow:
    """One run's line of the table."""

    run_id: str
    name: str
    status: str
    duration_s: float | None
    params: dict[str, str]
    metrics: dict[str, float]  # final value (latest step) of each chosen metric the run has


@dataclass(kw_only=True)
class Comparison:
    """The runs of one experiment (newest first) and the metrics chosen to compare them."""

    tracking_uri: str
    experiment: str
    filter_string: str
    metrics: list[str]
    rows: list[RunRow] = field(default_factory=list)

    def empty_message(self) -> str:
        if self.filter_string:
            return f"no runs of experiment {self.experiment} match the filter {self.filter_string!r}"
        return f"experiment {self.experiment} has no runs"

    def best(self, metric: str) -> float | None:
        """The best final value of ``metric`` over the runs (None when no run has it)."""
        values = [r.metrics[metric] for r in self.rows if metric in r.metrics and not math.isnan(r.metrics[metric])]
        if not values:
            return None
        if metric in CLOSEST_TO_ZERO:
            return min(values, key=abs)
        return max(values) if metric in HIGHER_IS_BETTER else min(values)

    def render(self) -> str:
        """A plain-text aligned table; ``*`` marks the best value of each metric."""
        if not self.rows:
            return self.empty_message()
        # The optional params (a sweep's or a fine-tune's) only when some run has them.
        params = [
            (k, label) for k, label in KEY_PARAMS if k not in OPTIONAL_PARAMS or any(k in r.params for r in self.rows)
        ]
        header = ["run", "id", "status", "duration"] + [label for _, label in params] + list(self.metrics)
        best = {m: self.best(m) for m in self.metrics}
        lines = []
        for r in self.rows:
            cells = [r.name or "-", r.run_id[:8], r.status, _fmt_duration(r.duration_s)]
            cells += [r.params.get(key, "-") for key, _ in params]
            for m in self.metrics:
                v = r.metrics.get(m)
                cells.append(("-" if v is None else _fmt_value(v)) + ("*" if v is not None and v == best[m] else " "))
            lines.append(cells)
        numeric = set(range(4, len(header)))  # params and metrics: right-aligned
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

        def fmt(row: list[str]) -> str:
            out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            return "  ".join(out).rstrip()

        legend = ", ".join(f"{m} {_better(m)}" for m in self.metrics)
        title = f"experiment {self.experiment} ({len(self.rows)} run{'s' if len(self.rows) != 1 else ''})"
        return "\n".join([title, fmt(header), *(fmt(row) for row in lines), f"* best ({legend} is better)"])


def _better(metric: str) -> str:
    return "closer to 0" if metric in CLOSEST_TO_ZERO else "higher" if metric in HIGHER_IS_BETTER else "lower"


def _fmt_value(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if abs(v) >= 1e3:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def _client(tracking_uri: str) -> Any:
    """A reading client: the server must answer and a local store must exist."""
    _check_reachable(tracking_uri)
    db = sqlite_path(tracking_uri)
    if db is not None:  # reading must not create an empty database as a side effect
        if not os.path.exists(db):
            raise RaytrnError(
                f"no MLflow database at {db} (tracking URI {redact_uri(tracking_uri)}); "
                "pass --tracking-uri or set $MLFLOW_TRACKING_URI to where your runs are logged"
            )
    return mlflow_client(tracking_uri)


def _check_reachable(uri: str) -> None:
    """Fail fast on an http(s) server that is not there (MLflow would retry for minutes)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise RaytrnError(
            f"cannot reach the MLflow tracking server at {redact_uri(uri)} ({e}); "
            "check --tracking-uri / $MLFLOW_TRACKING_URI and that the server is running"
        ) from None


def compare_runs(
    *,
    tracking_uri: str,
    experiment: str,
    filter_string: str = "",
    metrics: Sequence[str] | None = None,
    max_runs: int = 20,
    estimates: bool = False,
) -> Comparison:
    """Collect the newest ``max_runs`` runs of ``experiment`` matching ``filter_string`` (MLflow syntax,
    e.g. ``params.`optim.lr` = '0.001'``) with the final value of each of ``metrics`` (default: ``val_loss`` when a
    run has it, then :data:`DEFAULT_METRICS`), and ``estimates``: :data:`ESTIMATE_METRICS` after them."""
    from mlflow.exceptions import MlflowException

    if max_runs < 1:
        raise RaytrnError(f"--max-runs {max_runs}: must be at least 1")
    chosen = None if metrics is None else [m.strip() for m in metrics if m.strip()]
    if chosen is not None and not chosen:
        raise RaytrnError("--metrics: give at least one metric name, e.g. --metrics loss,tokens_per_s")
    client = _client(tracking_uri)
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise RaytrnError(
                f"no experiment named {experiment} at {redact_uri(tracking_uri)}; experiments there: {', '.join(names) or '(none)'}"
            )
    except MlflowException as e:
        raise RaytrnError(f"cannot read MLflow at {redact_uri(tracking_uri)}: {_first_line(e)}") from None
    try:
        runs = client.search_runs(
            [exp.experiment_id],
            filter_string=filter_string,
            max_results=max_runs,
            order_by=["attributes.start_time DESC"],
        )
    except MlflowException as e:
        hint = ""
        if "." in filter_string and "`" not in filter_string:
            hint = " (dotted names need backticks, e.g. params.`optim.lr` = '0.001')"
        raise RaytrnError(f"--filter {filter_string!r}: {_first_line(e)}{hint}") from None

    if chosen is None:
        shown = [m for m in VALIDATION_METRICS if any(m in run.data.metrics for run in runs)]
        chosen = [*shown, *DEFAULT_METRICS]
    if estimates:  # the estimate's errors after whatever else is compared
        chosen = [*chosen, *(m for m in ESTIMATE_METRICS if m not in chosen)]
    metrics = chosen
    now_ms = time.time() * 1000
    rows = []
    for run in runs:
        info, data = run.info, run.data
        end = info.end_time or (now_ms if info.status == "RUNNING" else None)
        rows.append(
            RunRow(
                run_id=info.run_id,
                name=info.run_name or "",
                status=info.status,
                duration_s=(end - info.start_time) / 1000 if end and info.start_time else None,
                params={k: data.params[k] for k, _ in KEY_PARAMS if data.params.get(k) not in (None, "None")},
                # run.data.metrics holds each metric's value at its latest step
                metrics={m: float(data.metrics[m]) for m in metrics if m in data.metrics},
            )
        )
    return Comparison(
        tracking_uri=tracking_uri, experiment=experiment, filter_string=filter_string, metrics=metrics, rows=rows
    )


def _first_line(e: Exception) -> str:
    msg = getattr(e, "message", None) or str(e)
    return str(msg).strip().splitlines()[0] if str(msg).strip() else type(e).__name__


def plot(comparison: Comparison, path: str, metrics: Sequence[str] | None = None) -> str:
    """Write a PNG with one panel per metric (default loss, val_loss when compared, and tokens_per_s vs step), one
    line per run.

    Written to a temp file and renamed, so a reader never sees half a PNG. Returns the absolute path.
    """
    if not comparison.rows:
        raise RaytrnError(comparison.empty_message() + "; nothing to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RaytrnError("--plot needs matplotlib: pip install matplotlib") from None
    from mlflow.exceptions import MlflowException

    if metrics is None:
        metrics = [PLOT_METRICS[0], *(m for m in VALIDATION_METRICS if m in comparison.metrics), *PLOT_METRICS[1:]]
    client = _client(comparison.tracking_uri)
    fig = Figure(figsize=(6 * len(metrics), 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state or backend selection
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=True):
        plotted = 0
        for row in comparison.rows:
            try:
                history = client.get_metric_history(row.run_id, metric)
            except MlflowException as e:
                raise RaytrnError(f"cannot read {metric} of run {row.run_id}: {_first_line(e)}") from None
            if not history:
                continue
            points = sorted((m.step, m.timestamp, m.value) for m in history)
            ax.plot([p[0] for p in points], [p[2] for p in points], label=f"{row.name or row.run_id[:8]}")
            plotted += 1
        ax.set_title(f"{metric} vs step")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        if plotted:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no run logged {metric}", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"experiment {comparison.experiment}")
    return _save_png(fig, path)


# -- sweeps ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrialRow:
    """One trial of a sweep: its varied values, how it ended, how far it got, and its final metric."""

    tag: str
    run_id: str
    status: str
    steps: int | None
    values: dict[str, str]
    metric: float | None
    note: str = ""


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
        if parent is not None:
            try:
                run = client.get_run(parent)
            except MlflowException:
                raise RaytrnError(f"--parent {parent}: no such run at {redact_uri(tracking_uri)}") from None
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
            stopped = child.data.tags.get("raytrn.stopped_early")
            cmp.histories[child.info.run_id] = history
            cmp.rows.append(
                TrialRow(
                    tag=child.data.tags.get("raytrn.trial", child.info.run_name or "?"),
                    run_id=child.info.run_id,
                    status=child.info.status,
                    steps=steps,
                    values={f: _fmt_param(child.data.params.get(f)) for f in fields},
                    metric=history[-1][1] if history else None,
                    note=_note(stopped, child.data.tags.get("raytrn.error")),
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


def _note(stopped: str | None, error: str | None) -> str:
    if stopped:
        return "stopped early" + (f" ({stopped.split(':', 1)[0]})" if ":" in stopped else "")
    if error:
        return f"failed: {error.splitlines()[0][:80]}"
    return ""


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
            stopped.append("stopped" in r.note)
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


def _save_png(fig: Any, path: str) -> str:
    """Write ``fig`` to ``path`` through a temp file and a rename (a reader never sees half a PNG)."""
    path = os.path.abspath(os.path.expanduser(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".raytrn-plot-", suffix=".png")
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def register(subparsers: Any) -> None:
    """Add ``runs compare`` to the ``raytrn`` command line."""
    p_runs = subparsers.add_parser("runs", help="look at the MLflow runs of past jobs")
    runs_sub = p_runs.add_subparsers(dest="runs_command", metavar="SUBCOMMAND")
    runs_sub.required = True
    p = runs_sub.add_parser(
        "compare",
        help="the runs of an experiment side by side (final metrics, key params), optionally plotted",
        description="Print one line per run of an MLflow experiment (newest first): key params, status, "
        "duration and the final value of each metric, best marked '*' (lower is better except for "
        f"{', '.join(sorted(HIGHER_IS_BETTER))}; unknown metrics count as lower-is-better). An experiment "
        "without runs prints a message and exits 0.",
    )
    p.add_argument("--experiment", default="raytrn", metavar="NAME", help="MLflow experiment (default raytrn)")
    p.add_argument(
        "--filter",
        dest="filter_string",
        default="",
        metavar="EXPR",
        help="MLflow search filter; backtick dotted params, e.g. \"params.`optim.lr` = '0.001'\"",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="M1,M2",
        help=f"comma-separated metrics to compare (default: val_loss when a run has it, then {','.join(DEFAULT_METRICS)})",
    )
    p.add_argument(
        "--estimates",
        action="store_true",
        help=f"also {' and '.join(ESTIMATE_METRICS)}: how far raytrn estimate was from each run (signed fractions "
        "of the estimate; best: closest to 0)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="also write loss and tokens_per_s vs step to this PNG")
    p.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)",
    )
    p.add_argument("--max-runs", type=int, default=20, metavar="N", help="newest N runs (default 20)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--sweep",
        metavar="NAME",
        help="the trials of this sweep (raytrn sweep), ranked by its metric, its varied fields as columns; --plot "
        "draws the metric of every trial against step and the final metric against each varied field",
    )
    which.add_argument("--parent", metavar="RUN_ID", help="the same, for the sweep whose parent run this is")
    p.set_defaults(func=_cmd_runs_compare)


def _cmd_runs_compare(args: argparse.Namespace) -> int:
    if args.sweep or args.parent:
        for flag, value in (
            ("--filter", args.filter_string),
            ("--metrics", args.metrics),
            ("--estimates", args.estimates),
        ):
            if value:
                raise RaytrnError(f"{flag} does not apply to --sweep/--parent (a sweep is ranked by its own metric)")
        sweep = compare_sweep(
            tracking_uri=resolve_tracking_uri(args.tracking_uri), sweep=args.sweep, parent=args.parent
        )
        print(sweep.render())
        if args.plot and sweep.rows:
            print(f"plot: {plot_sweep(sweep, args.plot)}")
        return 0
    comparison = compare_runs(
        tracking_uri=resolve_tracking_uri(args.tracking_uri),
        experiment=args.experiment,
        filter_string=args.filter_string,
        metrics=args.metrics.split(",") if args.metrics is not None else None,
        max_runs=args.max_runs,
        estimates=args.estimates,
    )
    print(comparison.render())
    if args.plot and comparison.rows:
        print(f"plot: {plot(comparison, args.plot)}")
    return 0
