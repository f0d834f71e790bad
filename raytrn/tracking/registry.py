"""A run's (or an experiment's) checkpoint models ranked by a metric (``raytrn runs compare --models``), and the
registry's aliases (``raytrn models promote``).

The models are the LoggedModels :mod:`raytrn.tracking.models` creates, one a committed checkpoint; their metrics are
those linked to them (``loss``, ``val_loss``, ``val_perplexity``, the lm-eval scores of :mod:`raytrn.evals`). A loss,
a perplexity or a standard error is better lower; an lm-eval score (``task/metric``) and the throughput-like metrics
of :mod:`raytrn.tracking.compare` higher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from raytrn.errors import RaytrnError
from raytrn.tracking.client import redact_uri
from raytrn.tracking.compare import _client, _first_line, _fmt_value, find_experiment, find_run, higher_is_better
from raytrn.tracking.models import DELETED_TAG, REGISTERED_NAME_TAG, REGISTERED_TAG, STEP_TAG

#: Columns shown beside the ranking metric, when some model has them (lm-eval scores are added after these).
SHOWN = ("loss", "val_loss")
_MAX_SCORES = 3


@dataclass(kw_only=True)
class ModelRow:
    name: str
    model_id: str
    step: int
    run_id: str
    deleted: bool
    registered: str  # "name v3 (candidate)", or ""
    metrics: dict[str, float]


@dataclass(kw_only=True)
class ModelTable:
    experiment: str
    metric: str
    run_id: str | None
    rows: list[ModelRow] = field(default_factory=list)

    def ranked(self) -> list[ModelRow]:
        sign = -1.0 if higher_is_better(self.metric) else 1.0

        def key(r: ModelRow) -> tuple[bool, float, int]:
            v = r.metrics.get(self.metric)
            missing = v is None or math.isnan(v)
            return missing, 0.0 if missing else sign * float(v), -r.step  # type: ignore[arg-type]

        return sorted(self.rows, key=key)

    def render(self) -> str:
        where = f"run {self.run_id}" if self.run_id else f"experiment {self.experiment}"
        if not self.rows:
            return f"{where} has no checkpoint models (a run logs one per committed checkpoint)"
        scores = sorted({k for r in self.rows for k in r.metrics if "/" in k and not k.endswith("stderr")})
        columns = [self.metric] + [m for m in (*SHOWN, *scores[:_MAX_SCORES]) if m != self.metric]
        columns = [c for c in columns if c == self.metric or any(c in r.metrics for r in self.rows)]
        header = ["rank", "model", "step", "run", "checkpoint", "registered", *columns]
        lines = []
        for i, r in enumerate(self.ranked(), 1):
            cells = [str(i), r.name, str(r.step), r.run_id[:8], "deleted" if r.deleted else "kept", r.registered or "-"]
            cells += ["-" if c not in r.metrics else _fmt_value(r.metrics[c]) for c in columns]
            lines.append(cells)
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        numeric = {0, 2, *range(6, len(header))}

        def fmt(row: list[str]) -> str:
            return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in
                             enumerate(zip(row, widths, strict=True))).rstrip()  # fmt: skip

        order = "higher" if higher_is_better(self.metric) else "lower"
        title = f"{where}: {len(self.rows)} checkpoint model(s), ranked by {self.metric} ({order} is better)"
        return "\n".join([title, fmt(header), *(fmt(row) for row in lines)])


def compare_models(
    *, tracking_uri: str, experiment: str, run_id: str | None = None, metric: str = "val_loss", max_models: int = 200
) -> ModelTable:
    """The checkpoint models of ``run_id`` (or of every run of ``experiment``), ranked by ``metric``."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    exp = find_experiment(client, experiment, tracking_uri)
    experiment_ids = [exp.experiment_id]
    if run_id:  # a whole id, or its first characters (the tables print 8)
        run = find_run(client, run_id, flag="--models", experiment_ids=experiment_ids,
                       where=f"run of experiment {experiment}")  # fmt: skip
        run_id, experiment_ids = run.info.run_id, [run.info.experiment_id]
    try:
        filter_string = f"source_run_id = '{run_id}'" if run_id else None
        models = list(client.search_logged_models(experiment_ids, filter_string=filter_string,
                                                  max_results=max_models))  # fmt: skip
    except MlflowException as e:
        raise RaytrnError(f"cannot read MLflow at {redact_uri(tracking_uri)}: {_first_line(e)}") from None
    table = ModelTable(experiment=experiment, metric=metric, run_id=run_id)
    aliases: dict[tuple[str, str], list[str]] = {}
    for m in models:
        step = m.tags.get(STEP_TAG, "")
        if not step.isdigit():
            continue  # not a raytrn checkpoint's model
        registered = ""
        name, version = m.tags.get(REGISTERED_NAME_TAG), m.tags.get(REGISTERED_TAG)
        if name and version:
            if (name, version) not in aliases:
                aliases[(name, version)] = _aliases(client, name, version)
            shown = aliases[(name, version)]
            registered = f"{name} v{version}" + (f" ({', '.join(shown)})" if shown else "")
        latest: dict[str, Any] = {}
        for x in m.metrics or []:  # the latest value of each (a checkpoint has one of each)
            latest[x.key] = x.value
        table.rows.append(ModelRow(name=m.name, model_id=m.model_id, step=int(step), run_id=m.source_run_id or "",
                                   deleted=DELETED_TAG in m.tags, registered=registered, metrics=latest))  # fmt: skip
    return table


def _aliases(client: Any, name: str, version: str) -> list[str]:
    try:
        return sorted(client.get_model_version(name, version).aliases)
    except Exception:  # deleted since: shown without aliases
        return []


def promote(*, tracking_uri: str, name: str, version: str, alias: str) -> str:
    """Point ``alias`` of the registered model ``name`` at ``version``; a line saying what changed."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:  # a version is a str from a server, an int from a local store: compared as str here
        found = client.search_model_versions(f"name = '{name}'")
        versions = sorted({str(v.version) for v in found}, key=int)
    except MlflowException as e:
        raise RaytrnError(f"cannot read the model registry at {redact_uri(tracking_uri)}: {_first_line(e)}") from None
    if not versions:
        raise RaytrnError(f"no registered model {name!r} at {redact_uri(tracking_uri)} (tracking.registered_model)")
    version = str(int(version)) if version.isdigit() else version
    if version not in versions:
        raise RaytrnError(f"{name!r} has no version {version}; its versions: {', '.join(versions)}")
    try:
        before: str | None = str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        before = None
    try:
        client.set_registered_model_alias(name, alias, version)
    except MlflowException as e:
        raise RaytrnError(f"--alias {alias!r}: MLflow refused it: {_first_line(e)}") from None
    was = f" (was version {before})" if before and before != version else ""
    return f"{name} version {version} is now {alias!r}{was}"
