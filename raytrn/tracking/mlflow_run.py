"""One MLflow run per job: the driver creates (or reattaches to) it, rank 0 logs into it.

The run id is fixed before workers start and stored next to the checkpoints
(``<storage>/<run name>/raytrn-mlflow.json``), so a resumed job logs into the same run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from raytrn import storage
from raytrn.config import JobSpec
from raytrn.errors import ConfigError

log = logging.getLogger(__name__)
MARKER = "raytrn-mlflow.json"
_MAX_PARAM_LEN = 6000


@dataclass(kw_only=True)
class TrackedRun:
    uri: str
    run_id: str
    experiment_id: str
    resumed: bool

    def ui_command(self) -> str:
        if self.uri.startswith("sqlite:"):
            exe = os.path.join(os.path.dirname(sys.executable), "mlflow")  # the venv's, even if not activated
            mlflow = exe if os.path.exists(exe) else "mlflow"
            return f"{mlflow} ui --backend-store-uri {self.uri} --port 5000   # then open http://127.0.0.1:5000"
        return f"open {self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"


def start_run(
    job: JobSpec, tags: dict[str, str] | None = None, extra_params: dict[str, Any] | None = None
) -> TrackedRun | None:
    """Create the job's MLflow run, or reattach to the one a previous attempt of this job started."""
    if not job.tracking.enabled:
        return None
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = job.tracking.mlflow_uri
    assert uri is not None  # resolved by config.resolve_paths
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///") :]), exist_ok=True)
    client = MlflowClient(uri)
    try:
        exp = client.get_experiment_by_name(job.tracking.experiment)
    except MlflowException as e:
        raise ConfigError(f"tracking.mlflow_uri={uri!r}: cannot reach MLflow: {e}") from None
    if exp is None:
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = "file://" + os.path.join(os.path.dirname(uri[len("sqlite:///") :]), "artifacts")
        exp_id = client.create_experiment(job.tracking.experiment, artifact_location=artifacts)
    else:
        exp_id = exp.experiment_id

    marker = storage.join(job.checkpoint.storage, job.run_name, MARKER)
    previous = _previous_run(client, marker, uri)
    if previous:
        run_id, resumed = previous, True
        client.update_run(run_id, status="RUNNING")
    else:
        run_id = client.create_run(exp_id, run_name=job.run_name).info.run_id
        resumed = False
        storage.write_text(marker, json.dumps({"run_id": run_id, "tracking_uri": uri}))

    logged = client.get_run(run_id).data.params
    params, changed = [], []
    for key, value in {**job.flat(), **(extra_params or {})}.items():
        text = str(value)[:_MAX_PARAM_LEN]
        if key not in logged:
            params.append(Param(key, text))
        elif logged[key] != text:  # MLflow params are immutable: record the change as a tag
            changed.append(RunTag(f"resume.changed.{key}", f"{logged[key]} -> {text}"))
    all_tags = [RunTag(k, v) for k, v in (tags or {}).items()] + changed
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100])
    if all_tags:
        client.log_batch(run_id, tags=all_tags)
    return TrackedRun(uri=uri, run_id=run_id, experiment_id=exp_id, resumed=resumed)


def end_run(run: TrackedRun | None, status: str) -> None:
    """Mark the run FINISHED, FAILED or KILLED."""
    if run is None:
        return
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(run.uri).set_terminated(run.run_id, status=status)
    except Exception as e:  # tracking must never turn a finished training into a failure
        log.warning("could not mark MLflow run %s %s: %s", run.run_id, status, e)


def _previous_run(client: Any, marker: str, uri: str) -> str | None:
    text = storage.read_text(marker)
    if not text:
        return None
    saved = json.loads(text)
    if saved.get("tracking_uri") != uri:
        return None
    try:
        client.get_run(saved["run_id"])
    except Exception:
        return None  # deleted, or a different store: start a new run
    return saved["run_id"]


class WorkerLogger:
    """Rank 0's handle on the job's run. Logging failures warn once and never stop training."""

    def __init__(self, uri: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(uri)
        self._run_id = run_id
        self._warned = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._call(
            self._client.log_batch, self._run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def checkpoint(self, step: int, location: str) -> None:
        self._call(self._client.set_tag, self._run_id, "checkpoint.latest", location)
        self._call(self._client.set_tag, self._run_id, "checkpoint.latest_step", str(step))

    def world_size(self, step: int, world_size: int) -> None:
        """Append ``step:world_size`` to the run's world size history tag."""
        try:
            history = self._client.get_run(self._run_id).data.tags.get("world_size_history", "")
        except Exception:
            history = ""
        entry = f"{step}:{world_size}"
        self._call(self._client.set_tag, self._run_id, "world_size_history", f"{history},{entry}".lstrip(","))

    def close(self) -> None:
        pass

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            if not self._warned:
                log.warning("MLflow logging failed (training continues): %s", e)
                self._warned = True
