"""The loop's checkpoint component: where a worker group starts from, and when and how it saves.

- :meth:`Checkpointer.find` (a collective, before anything is built): where the group starts, by the backend's
  resume format (:mod:`raytrn.checkpoint.resume`: an in-memory snapshot or the newest committed checkpoint whose
  files check out; for the frozen XLA path's formats Ray Train's latest); its counters tell the data feed where to
  start.
- :meth:`Checkpointer.restore`: that state into the built training, by the same format (or ``model.init_from``'s
  weights for a new run, and under LoRA for every start).
- :meth:`Checkpointer.after_step`: its own cadence (``checkpoint.every_n_steps``, the last step) and a preemption
  notice or SIGTERM (a synchronous save at the same step on every rank, then the group trains no further); every
  complete checkpoint is reported to Ray Train and tagged on the run.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ray.train

from raytrn.backends.base import Backend
from raytrn.checkpoint.messages import PassedOver
from raytrn.checkpoint.pins import pin, pin_ttl_s
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.resume import Start
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.store import Saved
from raytrn.compat import NOTICE_COMMITTED
from raytrn.config import JobSpec
from raytrn.models.hf import load_weights
from raytrn.sigterm import sigterm_received
from raytrn.tracking.models import LINKED
from raytrn.train.entry import posts_submitted
from raytrn.train.preemption import Notice, exit_after_sigterm, wait_for_teardown
from raytrn.train.schedule import Schedule
from raytrn.train.snapshots import MemorySnapshots
from raytrn.train.step import Training

log = logging.getLogger(__name__)


class Checkpointer:
    """Finds, restores and saves a worker's training state (every rank has one)."""

    def __init__(
        self,
        job: JobSpec,
        backend: Backend,
        schedule: Schedule,
        *,
        rank: int,
        world_size: int,
        logger: Any = None,
        memory: MemorySnapshots | None = None,
    ) -> None:
        self.job, self.backend, self.schedule = job, backend, schedule
        #: How this backend's checkpoints are found and restored (:mod:`raytrn.checkpoint.resume`).
        self.resume = backend.resume_format()
        #: The in-memory tier's side of this rank (None or disabled: durable checkpoints only).
        self.memory = memory if memory is not None and memory.restorable else None
        self.rank, self.world_size = rank, world_size
        #: Rank 0's tracking handle (checkpoint tags); None elsewhere or without tracking.
        self.logger = logger
        #: After :meth:`restore`: where this group's state came from (``storage``, or None: a new run; its step is
        #: the progress's) and the load's seconds (what the job's board records for a restart).
        self.restored_from: str | None = None
        self.restore_s = 0.0
        #: Rank 0: why the newer in-memory snapshots were passed over (none: the newest was used, or none exists).
        self.passed_over: tuple[PassedOver, ...] = ()

    # -- start ---------------------------------------------------------------------------------
    def find(self) -> Start:
        """The checkpoint this group resumes from, by the backend's resume format (a collective: every rank, at the
        start, before the model builds: the data feed starts where its counters say while the model builds)."""
        start = self.resume.find(self.job, rank=self.rank, world_size=self.world_size, memory=self.memory)
        self.passed_over = self.memory.passed_over if self.memory is not None else ()
        return start

    def restore(self, t: Training, start: Start) -> bool:
        """Load ``start``'s state into ``t`` (and ``model.init_from``'s weights for a new run; under LoRA for every
        start: checkpoints hold the adapters only). Returns True when the saved state's data position differs from
        what :meth:`find` read (the feed must start again from ``start.progress``)."""
        started = time.perf_counter()
        loaded = self.resume.load(t, start, memory=self.memory, rank=self.rank)
        self.restore_s = time.perf_counter() - started
        if loaded is not None:
            self.restored_from = "memory" if start.snapshot is not None else "storage"
        job = self.job
        if job.model.init_from and (loaded is None or job.model.lora is not None):
            self._load_init_from(t)
        if self.logger is not None and start.resume is not None:  # its tag may never have been sent (a group
            step = start.resume.commit.step  # killed right after its save)
            self.logger.checkpoint_saved(step, RunDir.of(job).pointer(step), _retention(job))
        if loaded is None:
            return False
        progress = start.progress
        moved = (loaded.step, loaded.epoch, loaded.epoch_samples) != (
            progress.step,
            progress.epoch,
            progress.epoch_samples,
        )
        if moved:  # the full state is the authority
            log.warning(
                "checkpoint: meta.json and the saved state disagree on the step or data position; using the state"
            )
            progress.epoch, progress.epoch_samples = loaded.epoch, loaded.epoch_samples
        progress.step, progress.tokens_seen, progress.cost_usd = loaded.step, loaded.tokens_seen, loaded.cost_usd
        progress.restored(loaded)
        if self.logger is not None:  # the last logged step's metrics may never have left a group killed right after
            # that step's snapshot or save; the tracking actor drops the steps it has
            if progress.logged_metrics:
                self.logger.log_metrics(progress.logged_metrics, progress.last_logged_step)
            if progress.logged_val_metrics:
                self.logger.log_missing(progress.logged_val_metrics, progress.last_logged_val_step)
        return moved

    def _load_init_from(self, t: Training) -> None:
        """``model.init_from``'s weights into the laid-out model (every rank reads the slices it holds)."""
        job = self.job
        started = time.perf_counter()
        n = load_weights(t.model, str(job.model.init_from), tied=job.model.tie_word_embeddings, source=job.source)
        if self.rank == 0:
            log.info(
                "model.init_from: %d tensors from %s in %.1f s", n, job.model.init_from, time.perf_counter() - started
            )

    # -- saving --------------------------------------------------------------------------------
    def due(self, step: int, *, last: bool) -> bool:
        """Whether ``step`` is a checkpoint step (``checkpoint.every_n_steps``, and the last)."""
        return last or step % self.job.checkpoint.interval == 0

    def step_ended(self) -> None:
        """Every step, before it is logged: the in-memory snapshot being written is waited for and completed (a
        collective while one is in flight)."""
        if self.memory is not None:
            self.memory.written()

    def after_step(
        self,
        t: Training,
        progress: Progress,
        metrics: dict[str, Any],
        *,
        last: bool,
        notice: Notice | None = None,
        scores: dict[str, float] | None = None,
        cost_usd: Callable[[], float | None],
    ) -> bool:
        """Save when due, or at once on a preemption ``notice`` (every rank got the same one: it was agreed by a
        collective). True after a notice: the group trains no further (:meth:`stop_after_notice`). ``cost_usd``: the
        run's cost so far, stored with the checkpoint (rank 0's; None elsewhere)."""
        preempted = notice is not None and not last
        durable = self.due(progress.step, last=last) or preempted
        synchronous = last or preempted or not self.job.checkpoint.async_
        memory = self.memory  # the in-memory tier, when it snapshots this step
        if memory is not None and not memory.due(progress.step, final=last or preempted, checkpoint=durable):
            memory = None
        if not durable and memory is None:
            return False
        cost = cost_usd()
        if cost is not None:
            progress.cost_usd = cost
        if memory is not None:  # staged before a durable save, written beside it
            memory.save(t, progress)
        if not durable:
            return False
        started = time.perf_counter()
        report = {**metrics, **(scores or {}), "step": progress.step, "tokens_seen": progress.tokens_seen}
        # keep_best: the run's checkpoint tags mark what retention deleted (Ray Train keeps every pointer then)
        deleted = t.checkpoints.deleted if self.job.checkpoint.keep_best else None
        # Synchronous at the end and on a notice: the checkpoint must exist before the group goes.
        for saved in t.checkpoints.save(t, progress, self.schedule, report, final=last or preempted):
            self._report(saved, deleted)  # every worker (Ray Train counts the reports)
        if memory is not None and synchronous:  # the same step's snapshot, written beside the save: complete too, now
            memory.written()  # (a restart from here reads the state from memory, not storage)
        if self.logger is not None and not (last or preempted):  # what a periodic save costs the loop: the save
            blocked = {"checkpoint_blocking_s": time.perf_counter() - started}  # time `raytrn estimate` reads back
            self.logger.log_metrics(blocked, progress.step, training=False)
        return preempted

    def _report(self, saved: Saved, deleted: set[int] | None) -> None:
        """Record a complete checkpoint with Ray Train: rank 0 passes the directory ``saved`` fills (the counters,
        and where the state is); every worker calls report."""
        if self.rank != 0 or saved.write is None:
            ray.train.report(saved.report, checkpoint=None)
            return
        if self.job.reads_checkpoints_off_loop:  # the evaluator reads it off the loop: kept
            pin(RunDir.of(self.job), saved.step, ttl_s=pin_ttl_s(self.job))  # from retention until it is done
        name = RunDir.pointer_name(saved.step)
        with tempfile.TemporaryDirectory(prefix="raytrn-ckpt-") as d:
            saved.write(d)
            ray.train.report(saved.report, checkpoint=ray.train.Checkpoint.from_directory(d), checkpoint_dir_name=name)
        if self.logger is not None:  # the run's checkpoint tags (those keep_last deleted are marked so by the actor)
            logged = {k: float(v) for k, v in saved.report.items() if k in LINKED}  # its LoggedModel's metrics
            self.logger.checkpoint_saved(
                saved.step, RunDir.of(self.job).pointer(saved.step), _retention(self.job), deleted=deleted,
                metrics=logged,
            )  # fmt: skip
        if self.memory is not None:  # (the stores of nodes the group left, once nothing on them can be wanted)
            self.memory.committed(saved.step)

    def stop_after_notice(self, notice: Notice, step: int) -> None:
        """After a preemption notice's checkpoint at ``step``: once rank 0's posts are in the tracking actor's hands
        (without tracking: submitted), every rank reports :data:`NOTICE_COMMITTED` to Ray Train (raytrn's controller
        then restarts the group without the draining node at once, not at the notice's deadline:
        :func:`raytrn.compat.controller.hosted_trainer`); then a worker sent SIGTERM exits, the others wait for the
        teardown, training no further."""
        if self.rank == 0:
            log.warning(
                "preemption notice (%s): checkpointed step %d; Ray Train restarts the group without the node",
                notice.describe(),
                step,
            )
        # the steps' metrics and the group's goodput (the board's posts), before the group goes
        if self.logger is None:
            posts_submitted()
        else:
            try:
                self.logger.handed_over()
            except Exception as e:  # (the restart goes on: the actor's own failure is the driver's to report)
                log.warning("preemption notice: this worker's posts were not handed over: %s", e)
        ray.train.report({NOTICE_COMMITTED: step}, checkpoint=None)  # every rank (Ray Train counts the reports)
        if sigterm_received():  # this worker was told to go: it does, now that its state is committed
            exit_after_sigterm(self.logger, self.job.tracking.flush_timeout_s, step)
        wait_for_teardown()  # the restart's teardown ends this process; the steps until then would be trained again


def _retention(job: JobSpec) -> int | None:
    """What the run's checkpoint tags are marked deleted by: ``keep_last`` (Ray Train's retention of its pointers
    follows it), or, with ``keep_best``, only the steps raytrn's retention reports deleting (None here)."""
    return None if job.checkpoint.keep_best else job.checkpoint.keep_last
