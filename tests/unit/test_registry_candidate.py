"""``tracking.register: best`` across runs that share a registered model (a sweep's trials, reruns): every run
registers its own best checkpoints, but the alias ``candidate`` only moves to a version whose ``val_loss`` on the same
validation set is lower than the candidate's. On a real MLflow store (sqlite), through raytrn.tracking.models."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrn.config import load_job
from raytrn.tracking.logger import AsyncLogger
from raytrn.tracking.models import STEP_TAG as STEP
from raytrn.tracking.models import VAL_LOSS_TAG, VAL_SET_TAG, CheckpointModels, DatasetRef
from tests.conftest import mlflow_store

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
NAME = "unit-candidate"


def _register(uri: str, experiment: str, job, validation: str, checkpoints: dict[int, float]) -> str:
    """One run: each checkpoint (step -> val_loss) committed, and registered when it is the run's best so far, as
    the tracking actor does. Returns the run's id."""
    client = MlflowClient(uri)
    run_id = client.create_run(experiment).info.run_id
    logger = AsyncLogger(uri, run_id)
    models = CheckpointModels(
        logger, job, lambda: (run_id, experiment), datasets={"validation": DatasetRef("validation", validation)}
    )
    try:
        for step, val_loss in checkpoints.items():
            models.committed(step, f"/ckpt/checkpoint_{step:08d}", {"val_loss": val_loss, "loss": 9.0})
            if models.improves(step):
                models.register(step, NAME)
        assert models.flush(60) and models.failed == 0
    finally:
        models.close(10)
        logger.close(30)
    return run_id


def test_candidate_moves_only_to_a_better_version_on_the_same_validation_set(tmp_path) -> None:
    uri = mlflow_store(tmp_path / "mlflow.db")
    job = load_job(
        REPO / "jobs" / "tiny.yaml",
        [f"checkpoint.storage={tmp_path / 'ckpt'}", f"tracking.mlflow_uri={uri}", "tracking.register=best",
         f"tracking.registered_model={NAME}"],
    )  # fmt: skip
    client = MlflowClient(uri)
    experiment = client.create_experiment("candidate", artifact_location=f"file://{tmp_path / 'art'}")

    def candidate() -> tuple[str, str, str]:
        v = client.get_model_version_by_alias(NAME, "candidate")
        return v.run_id, v.tags[VAL_LOSS_TAG], v.tags[STEP]

    a = _register(uri, experiment, job, "val-1", {5: 2.0, 10: 1.8})
    assert candidate() == (a, "1.8", "10")
    # Another run on the same validation set: its best (2.5) is registered, the alias stays on run a's 1.8.
    worse = _register(uri, experiment, job, "val-1", {5: 2.5})
    assert candidate() == (a, "1.8", "10")
    # A third: its first best (2.6) is registered and stays aside too; its later 1.5 takes the alias.
    b = _register(uri, experiment, job, "val-1", {5: 2.6, 10: 1.5})
    versions = {v.version: v for v in client.search_model_versions(f"name = '{NAME}'")}
    assert sorted((v.run_id, v.tags[STEP], v.tags[VAL_LOSS_TAG]) for v in versions.values()) == sorted(
        [(a, "5", "2.0"), (a, "10", "1.8"), (worse, "5", "2.5"), (b, "5", "2.6"), (b, "10", "1.5")]
    )
    assert {v.tags[VAL_SET_TAG] for v in versions.values()} == {"val-1"}
    assert candidate() == (b, "1.5", "10")
    # A tie does not move it either: the earlier version stays.
    _register(uri, experiment, job, "val-1", {5: 1.5})
    assert candidate() == (b, "1.5", "10")
    # Another validation set: the losses do not compare, the newest best takes the alias.
    c = _register(uri, experiment, job, "val-2", {5: 3.0})
    assert candidate() == (c, "3.0", "5")
    # Under register: last the final model always takes it.
    last = job.model_copy(update={"tracking": job.tracking.model_copy(update={"register_": "last"})})
    d = _register(uri, experiment, last, "val-2", {5: 4.0})
    assert candidate()[0] == d
