"""The loop's components, built by one builder (:func:`build_components`) and registered with the step protocol.

The loop builds its checkpointer first (where the run stands decides what is built), then the training, then the
rest here: the metrics reporter and the collaborators it is given (rank 0's cost and MLflow handle, the node's
system sampler, the memory probe), the non-finite guard, the evaluation, the preemption agreement, the hang watch
and the goodput clock, and the board's record of this group's start (the only remote calls: here, once). Each
per-step concern is one component of :mod:`raytrn.train.protocol`; adding one is its module and one line in
:func:`build_components`'s list.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import ray

from raytrn.backends import Backend, host_malloc
from raytrn.checkpoint.lease import LeaseLost
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.store import Checkpoints
from raytrn.config.sizes import data_parallel_rank, data_parallel_size
from raytrn.runtime import process_started_at
from raytrn.tracking.actor import RemoteLogger
from raytrn.tracking.system import SystemSampler
from raytrn.train.build import skips_on_device
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.evaluate import Evaluation
from raytrn.train.goodput import GoodputClock
from raytrn.train.guard import NonFiniteGuard
from raytrn.train.memory_probe import MemoryProbe
from raytrn.train.metrics import Efficiency, MetricsReporter, TuneReport
from raytrn.train.plan import WorkerPlan
from raytrn.train.preemption import PreemptionWatch
from raytrn.train.protocol import StepEnd, StepProtocol
from raytrn.train.snapshots import MemorySnapshots
from raytrn.train.step import Training
from raytrn.train.stopping import StopRequests
from raytrn.train.watchdog import HangWatch, on_hang_exit


class SnapshotWrite:
    """The ``snapshot`` phase: the in-memory snapshot being written is waited for and completed, before the step is
    logged (a collective while one is in flight)."""

    phase: ClassVar[str] = "snapshot"
    long: ClassVar[bool] = True
    blocking: ClassVar[str | None] = "checkpoint"

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def step_ended(self, end: StepEnd) -> None:
        self.checkpointer.step_ended()


class Agreement:
    """The ``agreement`` phase: the preemption notice, rank 0's stop request and a lease take-over, agreed by every
    rank in one all-reduce (:class:`raytrn.train.preemption.PreemptionWatch`). A take-over stops the run at once,
    before the step is logged or saved (:class:`raytrn.checkpoint.lease.LeaseLost`)."""

    phase: ClassVar[str] = "agreement"
    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(self, watch: PreemptionWatch, stops: StopRequests) -> None:
        self.watch, self.stops = watch, stops

    def step_ended(self, end: StepEnd) -> None:
        agreed = self.watch.agree(self.stops.stop_at(end.step), self.stops.abort is not None)
        if agreed.abort:  # every rank: the run is another job's now
            raise LeaseLost(self.stops.abort or "this job's lease on the run was taken over by another job")
        end.notice, end.stop_at = agreed.notice, agreed.stop_at


class CheckpointSave:
    """The ``checkpoint`` phase: a save when due, or at once after a notice (``end.stopping``: the group trains no
    further); ``cost_usd``: the run's cost so far, stored with it (rank 0's; None elsewhere)."""

    phase: ClassVar[str] = "checkpoint"
    long: ClassVar[bool] = True
    blocking: ClassVar[str | None] = "checkpoint"

    def __init__(
        self, checkpointer: Checkpointer, t: Training, progress: Progress, cost_usd: Callable[[], float | None]
    ) -> None:
        self.checkpointer, self.t, self.progress, self.cost_usd = checkpointer, t, progress, cost_usd

    def step_ended(self, end: StepEnd) -> None:
        end.stopping = self.checkpointer.after_step(
            self.t, self.progress, end.logged, last=end.last, notice=end.notice, scores=end.scores,
            cost_usd=self.cost_usd,
        )  # fmt: skip


class CheckpointMetrics:
    """A log step's metrics of the checkpoints: saves skipped because the storage failed (this worker group; 0 while
    every save commits), and rounds of retention that deleted nothing because a listing or read failed (rank 0)."""

    def __init__(self, checkpoints: Checkpoints) -> None:
        self.checkpoints = checkpoints

    def metrics(self) -> dict[str, float]:
        return {
            "checkpoint_failures": float(self.checkpoints.failed),
            "checkpoint_retention_skipped": float(self.checkpoints.retention_skipped),
        }


@dataclass
class Components:
    """What the loop drives: the step protocol (``steps``) and the components it calls itself (before a step, around
    it, at the end)."""

    steps: StepProtocol
    metrics: MetricsReporter
    guard: NonFiniteGuard
    clock: GoodputClock
    hangs: HangWatch
    sampler: SystemSampler | None = None

    def close(self) -> None:
        self.hangs.close()
        if self.sampler is not None:
            self.sampler.close()


def build_components(
    plan: WorkerPlan,
    t: Training,
    backend: Backend,
    progress: Progress,
    checkpointer: Checkpointer,
    memory: MemorySnapshots,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    tracker: RemoteLogger | None,
) -> Components:
    """The loop's components for this worker, after the restore (``progress``: the loop's, where the group starts;
    ``tracker``: the job's tracking handle, None without tracking: rank 0 logs, each node's first worker samples)."""
    job, board = plan.job, plan.board
    logger = tracker if rank == 0 else None
    posts = board.progress if board is not None and rank == 0 else None
    restored = group = None
    if board is not None and rank == 0:  # the board counts the groups (a restart's steps trained again first)
        restored = board.restarts.restored(
            checkpointer.restored_from, progress.step, checkpointer.restore_s, checkpointer.passed_over
        )
        group = board.restarts.group_started(progress.step, world_size)
    efficiency = None
    if rank == 0:  # the run's cost so far: the checkpoint's, or what was logged since (a restart lost steps)
        logged = logger.last_value("cost_usd") if logger is not None else None
        efficiency = Efficiency(
            job, world_size, spent_usd=progress.cost_usd, logged_usd=logged, started_at=process_started_at()
        )
    if logger is not None:  # (steps a restarted group repeats are dropped by the tracking actor)
        logger.set_tags({"worker.malloc": host_malloc.describe(os.environ)})  # as the workers run
    sampler = None
    if tracker is not None and local_rank == 0 and job.tracking.system_metrics:
        node = ray.get_runtime_context().get_node_id()
        interval = job.tracking.system_metrics_interval_s
        sampler = SystemSampler.start(tracker, node, interval, device_memory=backend.device_memory)

    # NaN/inf steps: skipped; too many in a row: a rollback (once per job) or the run stops (raytrn.train.guard)
    guard = NonFiniteGuard.on_board(
        job, board.rollbacks if board is not None else None, enabled=backend.skips_nonfinite_steps,
        deferred=skips_on_device(t.optimizer),
    )  # fmt: skip
    probe = MemoryProbe(job, backend, start_step=progress.step, enabled=backend.probes_memory)
    metrics = MetricsReporter(
        plan, t, progress, rank=rank, world_size=world_size, logger=logger, posts=posts, efficiency=efficiency,
        probe=probe, sources=(CheckpointMetrics(t.checkpoints), guard, memory),
    )  # fmt: skip
    dp, dp_rank = data_parallel_size(job, world_size), data_parallel_rank(job, rank, world_size)
    evaluation = Evaluation(job, plan.validation, progress, dp=dp, dp_rank=dp_rank, logger=logger, t=t, backend=backend)
    # a spot notice ends this group at a checkpoint (raytrn.train.preemption); `raytrn stop`: at an agreed step
    agreement = Agreement(PreemptionWatch(world_size), StopRequests(board.stops if board and rank == 0 else None))
    hangs = HangWatch(on_hang_exit(job, rank, tracker), timeout_s=job.run.hang_timeout_s)  # no step: stacks, exit
    # where the group's time goes (rank 0 posts it to the board: the run's goodput ledger, raytrn.tracking.goodput)
    clock = GoodputClock(
        posts, world_size=world_size, restore_s=checkpointer.restore_s, start_step=progress.step, restored=restored,
        group=group,
    )  # fmt: skip
    steps = StepProtocol(
        [
            guard,
            SnapshotWrite(checkpointer),
            agreement,
            metrics,
            hangs,
            evaluation,
            *([TuneReport(progress)] if plan.report_metrics else []),
            CheckpointSave(checkpointer, t, progress, metrics.cost_usd),
        ],
        working=hangs.working,
        blocking=clock.blocking,
    )
    return Components(steps=steps, metrics=metrics, guard=guard, clock=clock, hangs=hangs, sampler=sampler)
