"""The per-worker training loop that Ray Train runs on every worker.

It reads like the recipe: find where the run stands, start the data feed there, build, restore, then train until
``run.max_steps``. What happens when a step ends is the step protocol's (:mod:`raytrn.train.protocol`): the
components :func:`raytrn.train.components.build_components` builds and registers run in one documented order of
phases (guard, snapshot, agreement, metrics, watchdog, eval, report, checkpoint), each deciding its own cadence (the
metrics their log steps, the evaluation its eval steps, the checkpointer its checkpoint steps and what a preemption
notice means). The loop has no backend or rank ``if``. The host-device syncs: the metrics' loss read at log steps
(where the non-finite guard reads the steps' gradient norms too), the evaluation, the checkpoints, and the
preemption agreement (one tiny all-reduce of a host flag per step); on XLA backends each one is a potential
recompile. Skipping a non-finite step's update reads one flag per step unless the optimizer skips it on the device
(:func:`raytrn.train.build.clip_and_step`).
"""

from __future__ import annotations

from typing import Any

import ray.train

from raytrn.backends import get_backend
from raytrn.config.sizes import data_parallel_rank, data_parallel_size, global_batch
from raytrn.data.feed import DataFeed
from raytrn.errors import RunStopped
from raytrn.ray_output import worker_logging
from raytrn.sigterm import TRAINING, quiet_sigterm
from raytrn.tracking.export import log_final_model
from raytrn.tracking.roles import StopMailbox
from raytrn.train.build import build_training
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.components import build_components
from raytrn.train.metrics import tracking_logger
from raytrn.train.plan import WorkerPlan
from raytrn.train.protocol import StepEnd
from raytrn.train.snapshots import MemorySnapshots
from raytrn.train.step import skip_step, train_step


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the job of the driver's plan (``config``: :meth:`WorkerPlan.as_config`) on this worker, from wherever
    the run stands to ``run.max_steps``."""
    worker_logging()
    plan = WorkerPlan.from_config(config)
    quiet_sigterm(plan.report_metrics)  # a sweep's trial: its scheduler's SIGTERM is the sweep's to say
    job, ctx = plan.job, ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    backend = get_backend(job.scaling.accelerator)
    tracker = tracking_logger(plan)  # the job's tracking actor: rank 0 logs, each node's first worker samples
    logger = tracker if rank == 0 else None
    dp, dp_rank = data_parallel_size(job, world_size), data_parallel_rank(job, rank, world_size)

    # -- start: where the run stands (a collective), the data feed from there while the model builds -------------
    # In-memory snapshots (a collective); only where checkpoints are DCP's (not the frozen XLA path's formats)
    keeper = plan.memory if backend.resume_format().memory_tier else None
    board = plan.board  # the job's progress board, by role (raytrn.tracking.roles): rank 0 posts progress
    rollbacks, mailbox = (board.rollbacks, board.stops) if board is not None else (None, None)
    memory = MemorySnapshots(job, keeper, rank=rank, world_size=world_size, rollbacks=rollbacks)
    checkpointer = Checkpointer(
        job, backend, plan.schedule, rank=rank, world_size=world_size, logger=logger, memory=memory
    )
    start = checkpointer.find()
    progress = start.progress
    feed = DataFeed(job, plan.manifest, dp=dp, dp_rank=dp_rank, global_batch=global_batch(job, dp))
    batches = feed.start(progress, rank, resumed_from=start.location)
    t = build_training(job, backend, world_size=world_size, schedule=plan.schedule, rank=rank)
    if checkpointer.restore(t, start):  # the saved state's data position wins over its manifest's
        batches = feed.start(progress, rank)
    # every per-step concern, in the step protocol's order (raytrn.train.components, raytrn.train.protocol)
    parts = build_components(
        plan, t, backend, progress, checkpointer, memory, rank=rank, world_size=world_size,
        local_rank=ctx.get_local_rank(), tracker=tracker,
    )  # fmt: skip
    metrics, guard, clock = parts.metrics, parts.guard, parts.clock
    end = job.run.max_steps  # the last step: run.max_steps, or an earlier one a stop request names
    device_batches = backend.wrap_batches(batches)

    # -- train ---------------------------------------------------------------------------------------------------
    TRAINING.set()  # from here a SIGTERM is a notice (raytrn.train.preemption)
    stopped: RunStopped | None = None
    try:
        while progress.step < end:
            if guard.skips(progress.step + 1) and progress.step + 1 < end:  # a rollback's: untrained
                skip_step(t, device_batches)
                guard.skipped_batches += 1
                progress.step += 1
                feed.advance(progress)
                parts.hangs.step_done(progress.step)
                continue
            clock.step_started()
            with metrics.measuring(progress.step + 1):  # a worker's memory, once a group (raytrn.train.memory_probe)
                result = train_step(t, device_batches, backend)
            progress.step += 1
            clock.stepped(progress.step, result.data_wait_s)
            feed.advance(progress)
            last = progress.step == end
            step = parts.steps.step_ended(
                StepEnd(
                    progress.step, last=last, saving=checkpointer.due(progress.step, last=last),
                    logging=metrics.should_log(progress.step, last=last), result=result,
                )
            )  # fmt: skip
            if 0 < step.stop_at < end:  # every rank: the same end from the next step on (its checkpoint as the last's)
                end = max(step.stop_at, progress.step + 1)
            clock.iteration_done(final=last or step.stopping)
            if step.stopping and step.notice is not None:  # a preemption notice: the state is committed; train no more
                checkpointer.stop_after_notice(step.notice, progress.step)
    except RunStopped as e:  # every rank, at the same step: no restart can fix it (raytrn.errors.RunStopped)
        stopped = e
    finally:
        TRAINING.clear()
        parts.close()
        clock.post()

    if stopped is None and progress.step == end:
        metrics.finish()  # the estimate's errors against this group's actuals
    if stopped is not None:
        stop_run(mailbox, stopped)  # the driver ends the run FAILED with it; nothing is exported
        return
    if job.tracking.log_model and tracker is not None and t.export is not None:
        if logger is not None:
            logger.flush(job.tracking.flush_timeout_s)  # an outage near the end: wait (bounded) for the server
        log_final_model(job, t.model, t.export, logger)  # every rank: a sharded model's tensors are gathered


def stop_run(stops: StopMailbox | None, stop: RunStopped) -> None:
    """Record why the run stops on the job's progress board (every rank: any one's record suffices), for the
    driver to raise it (its own type: ``CheckpointsFailing``, ``LeaseLost``), FAILED, once the workers returned."""
    if stops is not None:
        stops.stop(stop)
