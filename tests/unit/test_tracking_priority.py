"""The tracking actor yields the CPU to training only once its run exists: MLflow's answer (the run, or its refusal,
which stops the job) is on the start's path. At nice 10 from its first line, on 2 cores busy with the run's own
training, the actor had not created (nor been refused) the run 240 s later (stop 94)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from tests.unit.test_tracking import _job

pytestmark = pytest.mark.unit


def _construct(job: Any, answers: Any) -> None:
    """In a child process (its niceness is its own): the actor's niceness while it creates the run, and after."""
    from raytrn.tracking import actor as actor_module
    from raytrn.tracking.mlflow_run import plan_run

    attach = actor_module.attach
    seen: dict[str, Any] = {}

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen["creating"] = os.nice(0)
        return attach(*args, **kwargs)

    actor_module.attach = recording
    planned = plan_run(job)
    actor = actor_module.TrackingActor(planned.uri, None, job, planned.tags, planned.params, background=True)
    try:
        actor.ready()
        seen["refused"] = None
    except Exception as e:
        seen["refused"] = type(e).__name__
    seen["after"] = os.nice(0)
    actor.close(5)
    answers.put(seen)


@pytest.mark.parametrize("refused", [False, True], ids=["created", "refused"])
def test_the_run_is_created_at_the_drivers_priority_then_the_actor_yields(tmp_path: Path, refused: bool) -> None:
    job = _job(tmp_path, "tracking.experiment=deleted-one" if refused else "tracking.experiment=kept")
    if refused:
        client = MlflowClient(job.tracking.mlflow_uri)
        client.delete_experiment(client.create_experiment("deleted-one"))
    ctx = multiprocessing.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=_construct, args=(job, answers))
    child.start()
    try:
        seen = answers.get(timeout=120)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    base = os.nice(0)
    assert seen["creating"] == base  # MLflow's answer at the driver's priority
    assert seen["refused"] == ("ConfigError" if refused else None)
    assert seen["after"] == min(base + 10, 19)  # then in the background
