"""A checkpoint's LoggedModel links the run's own metric rows (raytrn.tracking.models): a resumed run that drops the
steps an earlier invocation logged links that invocation's row, never a second row of the same step in the run's
history. On a real MLflow store (sqlite)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrn.config import load_job
from raytrn.tracking.actor import TrackingActor
from tests.conftest import mlflow_store

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_a_resumed_run_links_the_earlier_invocations_row_not_a_second_one(tmp_path) -> None:
    uri = mlflow_store(tmp_path / "mlflow.db")
    job = load_job(
        REPO / "jobs" / "tiny.yaml",
        [f"checkpoint.storage={tmp_path / 'ckpt'}", f"tracking.mlflow_uri={uri}", "tracking.experiment=links"],
    )
    client = MlflowClient(uri)
    experiment = client.create_experiment("links", artifact_location=f"file://{tmp_path / 'art'}")
    run_id = client.create_run(experiment).info.run_id

    first = TrackingActor(uri, run_id, job=job)  # the first invocation: steps 1-6, checkpoint 3, then killed
    for step in range(1, 7):
        first.log_metrics({"loss": 10.0 - step}, step)
    first.checkpoint_saved(3, "/ckpt/step_3", None, metrics={"loss": 7.0})
    assert first.close(30) == 0 and first.models is not None and first.models.flush(30)

    second = TrackingActor(uri, run_id, job=job)  # resumed from 3: steps 4-6 again (dropped), checkpoint 6
    for step in range(4, 8):
        second.log_metrics({"loss": 10.0 - step + 0.001}, step)  # (retrained: the last bits differ)
    second.checkpoint_saved(6, "/ckpt/step_6", None, metrics={"loss": 4.001})
    # step 7's checkpoint from a group that retrained it after a restart in this invocation: the run kept the first
    # group's row (3.001); the retrained value differs in the last bits
    second.checkpoint_saved(7, "/ckpt/step_7", None, metrics={"loss": 3.0015})
    assert second.models is not None and second.models.flush(30) and second.close(30) == 0

    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert sorted(history) == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 4.0), (7, 3.001)]
    models = {m.tags["raytrn.step"]: m for m in client.search_logged_models([experiment])}
    linked = {step: [(x.key, x.value) for x in m.metrics or []] for step, m in models.items()}
    # step 6's model: the run's row of step 6 (the first invocation's), step 7's: the second invocation's row
    assert linked == {"3": [("loss", 7.0)], "6": [("loss", 4.0)], "7": [("loss", 3.001)]}


def test_the_rows_of_an_outages_backlog_are_remembered_until_delivered(tmp_path, monkeypatch) -> None:
    """A long outage: thousands of rows wait in the logger while checkpoints commit. Their rows (timestamp, value)
    stay known until the server has them, however many: a checkpoint linked when the server is back links the
    run's row, not a second one (seen with a 10 s outage on a fast machine: 7 steps logged twice). Once delivered,
    only the newest ``_REMEMBERED`` stay: the server has the others."""
    from raytrn.tracking import logger as logger_mod

    monkeypatch.setattr(logger_mod, "_REMEMBERED", 4)
    uri = mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("backlog")).info.run_id
    up: list[str | None] = [None]  # the server "down": the run id not known yet, everything buffered
    log = logger_mod.AsyncLogger(uri, None, resolve_run=lambda: up[0], batch_window_s=0.05)
    for step in range(1, 21):
        log.log_metrics({"loss": 100.0 - step, "lr": 0.1}, step)
    first = log.row_of("loss", 1)
    assert first is not None and first[1] == 99.0 and log.row_of("lr", 20) is not None
    up[0] = run_id
    assert log.flush(30)
    log.log_metrics({"loss": 1.0}, 21)
    assert log.row_of("loss", 1) is None and log.row_of("loss", 21) is not None  # delivered: the newest 4 kept
    assert log.close(30) == 0
    assert [(m.step, m.timestamp) for m in client.get_metric_history(run_id, "loss")][0] == (1, first[0])
