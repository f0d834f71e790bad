"""``raytrn runs compare``: the runs of one MLflow experiment side by side, and their curves.

One row per run (newest first): a few key params, status, duration and the final value (latest step)
of each chosen metric, with the best value per metric marked ``*``. Lower is better for every metric
except the throughput-like ones in :data:`HIGHER_IS_BETTER`; unknown metrics count as lower-is-better.
An experiment without runs (or none matching the filter) is not an error: the table says so.
"""

from __future__ import annotations

import difflib
import math
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from raytrn.errors import RaytrnError
from raytrn.tracking.client import mlflow_client, redact_uri, sqlite_path
from raytrn.tracking.goodput import BADPUT, PRODUCTIVE

DEFAULT_METRICS = ("loss", "tokens_per_s", "usd_per_1m_tokens", "mfu")
#: Shown first by default when a run of the experiment has them (the held-out loss says more than the training loss).
VALIDATION_METRICS = ("val_loss",)
HIGHER_IS_BETTER = frozenset({"tokens_per_s", "mfu", "tokens_per_usd", "tokens_seen", "goodput", "goodput_s"})
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
#: The ledger's metric of each cause (seconds, over the run's invocations).
CAUSE_METRICS = {PRODUCTIVE: "goodput_s", **{name: f"badput_{name}_s" for name in BADPUT}}
#: Shown first: the productive fraction and the wall time the causes add up to.
LEAD_METRICS = ("goodput", "wall_s")

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
    experiment_id: str | None = None
    #: ``--metrics`` that no run has (shown with dashes, and said after the table), and the metrics the runs have.
    missing: list[str] = field(default_factory=list)
    logged: list[str] = field(default_factory=list)

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
        return max(values) if higher_is_better(metric) else min(values)

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
        note = [f"no run has {', '.join(self.missing)} ({_their_metrics(self.logged)})"] if self.missing else []
        return "\n".join([title, fmt(header), *(fmt(row) for row in lines), f"* best ({legend} is better)", *note])


def higher_is_better(metric: str) -> bool:
    """The throughput-like metrics, and an lm-eval score (``task/metric``, raytrn.evals) that is not a loss, a
    perplexity or a standard error."""
    name = metric.rsplit("/", 1)[-1]
    if any(name.endswith(x) for x in ("loss", "perplexity", "ppl", "stderr")):
        return False
    return "/" in metric or metric in HIGHER_IS_BETTER


def _better(metric: str) -> str:
    return "closer to 0" if metric in CLOSEST_TO_ZERO else "higher" if higher_is_better(metric) else "lower"


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
    goodput: bool = False,
) -> Comparison:
    """Collect the newest ``max_runs`` runs of ``experiment`` matching ``filter_string`` (MLflow syntax,
    e.g. ``params.`optim.lr` = '0.001'``) with the final value of each of ``metrics`` (default: ``val_loss`` when a
    run has it, then :data:`DEFAULT_METRICS`; ``goodput``: the goodput ledger's, :mod:`raytrn.tracking.compare_goodput`),
    and ``estimates``: :data:`ESTIMATE_METRICS` after them."""
    from mlflow.exceptions import MlflowException

    if max_runs < 1:
        raise RaytrnError(f"--max-runs {max_runs}: must be at least 1")
    chosen = None if metrics is None else [m.strip() for m in metrics if m.strip()]
    if chosen is not None and not chosen:
        raise RaytrnError("--metrics: give at least one metric name, e.g. --metrics loss,tokens_per_s")
    client = _client(tracking_uri)
    exp = find_experiment(client, experiment, tracking_uri)
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

    logged = sorted({m for run in runs for m in run.data.metrics})
    missing = [] if goodput or chosen is None or not runs else [m for m in chosen if m not in logged]
    if missing and len(missing) == len(chosen or ()):  # nothing to compare: a typo, most likely
        near = next((c[0] for m in missing if (c := difflib.get_close_matches(m, logged, n=1))), None)
        hint = f" (did you mean {near}?)" if near else ""
        which = "that metric" if len(missing) == 1 else "these metrics"
        whose = f"run of experiment {experiment}" + (" matching the filter" if filter_string else "")
        raise RaytrnError(f"--metrics {','.join(missing)}: no {whose} has {which}{hint}; {_their_metrics(logged)}")
    if goodput:
        chosen = goodput_metrics([run.data.metrics for run in runs])
    elif chosen is None:
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
    return Comparison(tracking_uri=tracking_uri, experiment=experiment, filter_string=filter_string, metrics=metrics,
                      rows=rows, experiment_id=str(exp.experiment_id), missing=missing, logged=logged)  # fmt: skip


def _their_metrics(logged: Sequence[str], shown: int = 12) -> str:
    more = f", ... ({len(logged)} in all)" if len(logged) > shown else ""
    return f"their metrics: {', '.join(logged[:shown]) or '(none)'}{more}"


def find_experiment(client: Any, name: str, tracking_uri: str) -> Any:
    """The experiment ``name``; a RaytrnError naming those there are when it does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise RaytrnError(
                f"no experiment named {name} at {redact_uri(tracking_uri)}; experiments there: "
                f"{', '.join(names) or '(none)'} (--experiment NAME)"
            )
    except MlflowException as e:
        raise RaytrnError(f"cannot read MLflow at {redact_uri(tracking_uri)}: {_first_line(e)}") from None
    return exp


def find_run(
    client: Any,
    run_id: str,
    *,
    flag: str,
    experiment_ids: Sequence[str],
    where: str,
    filter_string: str = "",
    hint: str = "the runs' table shows their ids",
) -> Any:
    """The run ``run_id`` names: a whole id, or its first characters as raytrn's tables print them (8), unique among
    the runs of ``experiment_ids`` matching ``filter_string`` (``where`` says which those are). A RaytrnError
    when no run, or more than one, has an id starting so."""
    from mlflow.exceptions import MlflowException

    prefix = run_id.strip().lower()
    try:
        if len(prefix) == 32:  # a whole id (MLflow's are 32 hex digits): wherever the run is
            try:
                return client.get_run(prefix)
            except MlflowException:
                pass
        found, token = [], None
        while True:
            page = client.search_runs(list(experiment_ids), filter_string=filter_string, max_results=1000,
                                      page_token=token)  # fmt: skip
            found += [r for r in page if r.info.run_id.startswith(prefix)]
            token = page.token
            if not token:
                break
    except MlflowException as e:
        raise RaytrnError(f"{flag} {run_id}: cannot search the runs: {_first_line(e)}") from None
    if not prefix or not found:
        raise RaytrnError(f"{flag} {run_id}: no {where} has an id starting {run_id} ({hint})")
    if len(found) > 1:
        some = ", ".join(f"{r.info.run_id[:12]} ({r.info.run_name or '-'})" for r in found[:4])
        raise RaytrnError(f"{flag} {run_id}: {len(found)} runs' ids start with it: {some}; give more of the id")
    return found[0]


def goodput_metrics(run_metrics: Sequence[dict[str, float]]) -> list[str]:
    """The metrics ``--goodput`` compares: ``goodput``, ``wall_s``, then each cause's seconds that some run has (a cause
    no run lost time to is left out)."""
    causes = [m for m in CAUSE_METRICS.values() if any(r.get(m, 0.0) > 0 for r in run_metrics)]
    return [*LEAD_METRICS, *causes]


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
