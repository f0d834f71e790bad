"""A group killed right after a step's snapshot or save may never have sent that step's metrics: rank 0 hands them
to a thread of its process (:mod:`raytrn.tracking.sender`), which a SIGKILL ends with them. The restarted group
resumed after that step, so no later group ever logged it, and the run's loss history had a hole (CI of stop 88:
``[..., 19, 21, ...]`` under the memory tier, the snapshot of step 20 sealed, its loss never sent). Now every
checkpoint and snapshot carries its last logged step's training metrics (:attr:`Progress.logged_metrics`), and the
restored group's rank 0 sends them again, and its evaluation's (:attr:`Progress.logged_val_metrics`); the tracking
actor drops a step it has. One process: the loop's own
Checkpointer, a real DCP checkpoint, the real tracking actor's class over a real MLflow store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint.progress import Progress, read_meta, write_meta
from raytrn.tracking.actor import TrackingActor
from raytrn.train.build import build_training
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.schedule import Schedule
from tests.unit.test_dcp import job, trained
from tests.unit.test_tracking import _run

pytestmark = pytest.mark.unit

STEP2 = {"loss": 5.25, "grad_norm": 1.5, "lr": 3e-3, "tokens_seen": 64.0, "world_size": 1.0}


def _saved_at_step_2(tmp_path: Path) -> Any:
    """A run whose step 2 is checkpointed with step 2's metrics as its last logged ones."""
    j = job(tmp_path)
    t = trained(j)
    progress = Progress(step=2, tokens_seen=64)
    progress.logged(1, {"loss": 6.0})
    progress.logged(2, STEP2)
    progress.logged_val(2, {"val_loss": 4.0, "val_perplexity": 54.5})
    [done] = t.checkpoints.save(t, progress, Schedule.from_job(j), {}, final=False)
    assert done.step == 2
    return j


def _restored_by(j: Any, actor: TrackingActor) -> Progress:
    checkpointer = Checkpointer(j, CpuBackend(), Schedule.from_job(j), rank=0, world_size=1, logger=actor)
    start = checkpointer.find()
    checkpointer.restore(build_training(j, CpuBackend(), world_size=1), start)
    assert checkpointer.restored_from == "storage"
    return start.progress


def _history(uri: str, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def test_a_restored_group_logs_the_step_its_killed_predecessor_never_sent(tmp_path: Path) -> None:
    j = _saved_at_step_2(tmp_path)
    uri, run_id = _run(tmp_path)
    killed = TrackingActor(uri, run_id)
    killed.log_metrics({"loss": 6.0}, 1)  # step 2's post died with its process
    assert killed.close(30) == 0
    actor = TrackingActor(uri, run_id)  # the same run, as the restarted group's driver sees it
    progress = _restored_by(j, actor)
    assert (progress.step, progress.last_logged_step, progress.logged_metrics) == (2, 2, STEP2)
    assert actor.close(30) == 0
    assert _history(uri, run_id) == [(1, 6.0), (2, 5.25)]
    assert _history(uri, run_id, "val_loss") == [(2, 4.0)]  # its evaluation's too
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.metrics["grad_norm"] == 1.5 and run.data.metrics["lr"] == 3e-3


def test_a_step_the_run_has_is_not_logged_again(tmp_path: Path) -> None:
    j = _saved_at_step_2(tmp_path)
    uri, run_id = _run(tmp_path)
    actor = TrackingActor(uri, run_id)
    for step, loss in ((1, 6.0), (2, 5.25), (3, 4.5)):  # the killed group got further than its checkpoint
        actor.log_metrics({"loss": loss}, step)
    actor.log_missing({"val_loss": 4.0}, 2)
    _restored_by(j, actor)
    assert actor.close(30) == 0
    assert _history(uri, run_id) == [(1, 6.0), (2, 5.25), (3, 4.5)]
    assert _history(uri, run_id, "val_loss") == [(2, 4.0)]


def test_the_last_logged_metrics_survive_meta_json_and_garbage_in_it_is_left_out(tmp_path: Path) -> None:
    progress = Progress(step=7)
    progress.logged(5, {"loss": 2, "lr": 1e-4, "name": "x", "flag": True})
    progress.logged(4, {"loss": 9.0})  # an older step (a rollback's retrained one): the newer stays
    assert (progress.last_logged_step, progress.logged_metrics) == (5, {"loss": 2.0, "lr": 1e-4})
    write_meta(str(tmp_path), progress)
    meta = read_meta(str(tmp_path))
    assert meta is not None and meta.progress == progress
    for garbage in ([1, 2], "loss", {"loss": "nan?", 3: 1.0, "ok": None}, None):
        assert Progress.from_dict({"step": 3, "logged_metrics": garbage}).logged_metrics == {}
    progress.logged_val(5, {"val_loss": 3.0})
    older = Progress(step=9, last_logged_step=3, logged_metrics={"loss": 1.0}, last_logged_val_step=6,
                     logged_val_metrics={"val_loss": 1.5})  # fmt: skip
    older.restored(progress)  # meta.json's counters and the state's: the newer logged steps, with their metrics
    assert (older.last_logged_step, older.logged_metrics) == (5, {"loss": 2.0, "lr": 1e-4})
    assert (older.last_logged_val_step, older.logged_val_metrics) == (6, {"val_loss": 1.5})
    progress.restored(Progress(last_logged_step=2, logged_metrics={"loss": 0.5}))
    assert progress.logged_metrics == {"loss": 2.0, "lr": 1e-4}
