"""One MLflow run per job: the driver creates (or reattaches to) it; rank 0 logs into it through the job's
tracking actor (raytrn.tracking.actor).

The driver only checks that the server answers (:func:`plan_run`: no MLflow import, nothing written); the
job's tracking actor creates or reattaches the run in its own process while the workers start, so a new
store's schema set-up and the MLflow import are off the path to the first step. The run id is stored next
to the checkpoints (``<storage>/<run name>/raytrn-mlflow.json``), so a resumed job logs into the same run.
When the tracking server is unreachable at start the job still trains (unless ``tracking.required``): the
run is *pending*, the tracking actor buffers the metrics and creates/reattaches the run once the server
answers.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from raytrn import jsonfile, storage
from raytrn.checkpoint.rundir import RunDir
from raytrn.compat import dataset_input
from raytrn.config import JobSpec
from raytrn.errors import ConfigError
from raytrn.tracking.client import mlflow_client, redact, redact_uri, split_credentials, sqlite_path, unreachable
from raytrn.tracking.links import ui_command
from raytrn.tracking.models import DatasetRef

log = logging.getLogger(__name__)
_MAX_PARAM_LEN = 6000


@dataclass(kw_only=True)
class TrackedRun:
    uri: str
    run_id: str | None  # None: not created yet (the tracking actor creates it), or pending
    experiment_id: str | None
    resumed: bool
    #: What the run is created/reattached with (by the tracking actor; later when pending).
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    reachable: bool = True  # False: the server did not answer at start

    @property
    def pending(self) -> bool:
        return self.run_id is None

    def ui_command(self) -> str:
        """The summary's ``mlflow ui`` line: the run's own page in the MLflow UI (and, for a local store, the
        ``mlflow ui`` command that serves it)."""
        return ui_command(self.uri, self.experiment_id, self.run_id)


def plan_run(
    job: JobSpec, tags: dict[str, str] | None = None, extra_params: dict[str, Any] | None = None
) -> TrackedRun | None:
    """What the job's run is created (or reattached) with, once the server was found to answer: a run with
    no id yet, for :func:`attach`. Cheap (a socket and ``/health``, no MLflow import) and writes nothing.

    Unreachable server: a ConfigError when ``tracking.required``, else a warning and ``reachable=False``
    (the run stays pending until the server answers).
    """
    if not job.tracking.enabled:
        return None
    uri = job.tracking.mlflow_uri
    assert uri is not None  # resolved by config.resolve_paths
    tags = {k: redact(k, v) for k, v in (tags or {}).items()}
    params = {**job.flat(), **(extra_params or {})}
    problem = unreachable(uri)
    if problem:
        if job.tracking.required:
            raise ConfigError(
                f"tracking.mlflow_uri={redact_uri(uri)}: {problem}; start the server (see mlflow/README.md or "
                "`raytrn mlflow serve`), fix the URI, or set tracking.required=false to train and deliver the "
                "metrics when the server is back"
            )
        log.warning(
            "MLflow at %s is unreachable (%s): training anyway; metrics are buffered and the run is created "
            "when the server answers (tracking.required=true makes this an error)",
            redact_uri(uri),
            problem,
        )
        print(f"raytrn: WARNING: MLflow at {redact_uri(uri)} unreachable ({problem}); buffering metrics", flush=True)
    return TrackedRun(
        uri=uri, run_id=None, experiment_id=None, resumed=False, tags=tags, params=params, reachable=not problem
    )


def attach(
    job: JobSpec, tags: dict[str, str], params: dict[str, Any], *, manifest: Any = None, validation: Any = None
) -> TrackedRun:
    """Create or reattach the run (server reachable), log params and tags, and the ``manifest``'s dataset as
    the run's input when given; the tracking actor's call."""
    # mlflow lazily here and below: the driver imports this module and must not pay for MLflow (see above).
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException

    uri = job.tracking.mlflow_uri
    assert uri is not None
    client = mlflow_client(uri, create_store=True)
    try:
        exp_id = ensure_experiment(client, job.tracking.experiment, uri)
        marker = RunDir.of(job).mlflow_marker
        run_id = job.tracking.run_id or _previous_run(client, marker, uri)
        resumed = run_id is not None
        if run_id is not None:
            _check_run(client, run_id, uri, marker, explicit=job.tracking.run_id is not None)
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = client.create_run(exp_id, run_name=job.run_name).info.run_id
        storage.write_text(marker, json.dumps({"run_id": run_id, "tracking_uri": marker_uri(uri)}))

        logged = client.get_run(run_id).data.params
        new_params, changed = [], []
        for key, value in params.items():
            text = param_text(key, value)
            if key not in logged:
                new_params.append(Param(key, text))
            elif logged[key] != text:  # MLflow params are immutable: record the change as a tag
                changed.append(RunTag(f"resume.changed.{key}", f"{logged[key]} -> {text}"[:_MAX_PARAM_LEN]))
        for i in range(0, len(new_params), 100):
            client.log_batch(run_id, params=new_params[i : i + 100])
        all_tags = [RunTag(k, v) for k, v in tags.items()] + changed
        for i in range(0, len(all_tags), 100):
            client.log_batch(run_id, tags=all_tags[i : i + 100])
    except MlflowException as e:
        raise ConfigError(f"tracking.mlflow_uri={redact_uri(uri)}: MLflow refused: {e.message}") from None
    run = TrackedRun(uri=uri, run_id=run_id, experiment_id=exp_id, resumed=resumed, tags=tags, params=params)
    for data, context in ((manifest, "train"), (validation, "validation")):
        if data is not None:
            _log_dataset(run, data, context)
    return run


def param_text(key: str, value: Any) -> str:
    """A param's value as raytrn logs it (secrets redacted, cut to MLflow's limit)."""
    return redact(key, value)[:_MAX_PARAM_LEN]


def end_run(run: TrackedRun | None, status: str, *, job: JobSpec | None = None) -> str | None:
    """Mark the run FINISHED, FAILED or KILLED; returns its id (a pending run may have been created later)."""
    if run is None:
        return None
    run_id = run.run_id
    if run_id is None and job is not None:  # created after an outage at start (marker written by attach)?
        saved = _read_marker(RunDir.of(job).mlflow_marker)
        if saved.get("tracking_uri") == marker_uri(run.uri):
            run_id = saved.get("run_id")
    if run_id is None:
        log.warning("MLflow at %s was unreachable for the whole job: nothing was recorded", redact_uri(run.uri))
        return None
    problem = unreachable(run.uri)
    if problem:
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, problem)
        return run_id
    try:
        mlflow_client(run.uri).set_terminated(run_id, status=status)
    except Exception as e:  # tracking must never turn a finished training into a failure
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, e)
    return run_id


# -- experiments, runs to reattach ------------------------------------------------------------------


def ensure_experiment(client: Any, name: str, uri: str) -> str:
    """The experiment's id; created when it does not exist (local stores keep artifacts beside the db)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise ConfigError(
            f"tracking.experiment={name!r} is deleted in {redact_uri(uri)}; restore it "
            f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or use another name"
        )
    if exp is not None:
        return str(exp.experiment_id)
    artifacts = None
    if db := sqlite_path(uri):
        artifacts = "file://" + os.path.join(os.path.dirname(db), "artifacts")
    log.info("creating MLflow experiment %r", name)
    return str(client.create_experiment(name, artifact_location=artifacts))


def _check_run(client: Any, run_id: str, uri: str, marker: str, *, explicit: bool) -> None:
    """A run to reattach must exist and not be deleted."""
    from mlflow.exceptions import MlflowException

    where = "tracking.run_id" if explicit else f"{marker} (written when this job first ran)"
    fix = (
        "set tracking.run_id to an existing run, or remove it to create a new run"
        if explicit
        else f"restore the run, delete {marker} to start a new MLflow run for this job, or set a new tracking.run_name"
    )
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ConfigError(f"{where}: MLflow run {run_id} does not exist in {redact_uri(uri)}; {fix}") from None
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(f"{where}: MLflow run {run_id} is deleted in {redact_uri(uri)}; {fix}")


def _read_marker(marker: str) -> dict[str, Any]:
    text = storage.read_text(marker)
    if not text:
        return {}
    try:
        data = jsonfile.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def marker_uri(uri: str) -> str:
    """The tracking URI as the marker next to the checkpoints records it: without credentials (a file anyone who
    reads the checkpoint storage reads)."""
    return split_credentials(uri)[0]


def _previous_run(client: Any, marker: str, uri: str) -> str | None:
    """The run this job logged into before (same tracking URI), from the marker next to its checkpoints."""
    saved = _read_marker(marker)
    if saved.get("tracking_uri") not in (marker_uri(uri), uri):  # raytrn < this one wrote the URI as it was
        return None  # never tracked, or tracked in another store: a new run here
    return saved.get("run_id")


def _log_dataset(run: TrackedRun, manifest: Any, context: str) -> None:
    """A dataset as the run's input (``train``, ``validation``): the manifest's location, with its fingerprint as
    digest (:class:`raytrn.tracking.models.DatasetRef`: what a LoggedModel's metrics are linked to)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    assert run.run_id is not None
    client = mlflow_client(run.uri)
    ref = DatasetRef.of(manifest, context)
    inputs = client.get_run(run.run_id).inputs
    existing = (inputs.dataset_inputs if inputs else None) or []
    if any(d.dataset.digest == ref.digest for d in existing):
        return
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": a local path, taken as one
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(manifest.manifest_path)
    dataset = MetaDataset(source=source, name=ref.name, digest=ref.digest)  # type: ignore[abstract]
    try:
        client.log_inputs(run.run_id, datasets=[dataset_input(dataset, context)])
    except Exception as e:
        log.warning("could not log the dataset as the run's input: %s", e)
