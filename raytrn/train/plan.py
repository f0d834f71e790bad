"""The worker plan: everything a training worker needs from the driver, typed and built once.

The driver (:mod:`raytrn.train.trainer`) builds one :class:`WorkerPlan` before the worker group starts; Ray Train
pickles it to every worker of every group (restarts and resizes included), and :func:`raytrn.train.loop.run` reads
it. Nothing here runs on its own: it is the contract between the driver and the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrn.checkpoint.memory_clients import SnapshotKeeper
from raytrn.config import JobSpec
from raytrn.data.manifest import Manifest
from raytrn.tracking.roles import BoardClients
from raytrn.train.schedule import Schedule

#: Ray Train hands the training function a dict (its ``train_loop_config``): the plan is its one entry.
PLAN_KEY = "plan"


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    """What the driver fixed for the job's workers."""

    job: JobSpec
    #: The training data: every worker streams its own rows of the job's one global order (:mod:`raytrn.data.order`).
    manifest: Manifest
    #: The learning-rate schedule pinned by the run's first invocation (:func:`raytrn.train.schedule.resolve_schedule`).
    schedule: Schedule
    #: The validation set (:mod:`raytrn.train.evaluate`): the same rows every evaluation, at any size. None: no eval.
    validation: Manifest | None = None
    #: The job's progress board by role (its Ray actor: the tracking actor when tracking is on).
    board: BoardClients | None = None
    #: The job's tracking actor (a Ray actor handle) and its MLflow URI; None when tracking is off.
    tracker: Any = None
    mlflow_uri: str | None = None
    #: When the driver process started (wall clock): the board's launch-to-first-step time counts from it.
    started_at: float | None = None
    #: In a sweep's trial (:mod:`raytrn.sweep`): the metrics of every log and eval step go to Ray Tune.
    report_metrics: bool = False
    #: The run's in-memory snapshot keeper (:func:`raytrn.checkpoint.memory.start_keeper`: its typed client);
    #: None when the memory tier is off (``checkpoint.memory_every_n_steps``).
    memory: SnapshotKeeper | None = None

    def as_config(self) -> dict[str, WorkerPlan]:
        """The ``train_loop_config`` Ray Train passes to every worker (it must be a dict)."""
        return {PLAN_KEY: self}

    @staticmethod
    def from_config(config: dict[str, Any]) -> WorkerPlan:
        plan = config[PLAN_KEY]
        assert isinstance(plan, WorkerPlan), f"train_loop_config[{PLAN_KEY!r}] is not a WorkerPlan"
        return plan
