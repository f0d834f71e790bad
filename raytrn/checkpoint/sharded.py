"""Sharded, reshardable checkpoints: every rank writes its shards, rank 0 commits them with a manifest.

:class:`DcpCheckpoints` is how cpu, cuda and neuron (TorchNeuron) workers save and restore, in any DDP/FSDP/TP
layout: the write is :mod:`raytrn.checkpoint.dcp` (``torch.distributed.checkpoint``), the commit, retention and
staging :mod:`raytrn.checkpoint.manifest`, the paths :mod:`raytrn.checkpoint.rundir`; ``checkpoint.async``
overlaps the write with training, and retention (``checkpoint.keep_last``/``keep_best``) runs on rank 0 beside the
steps after a commit. The checkpoint to resume is chosen by :mod:`raytrn.checkpoint.finder`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from raytrn.checkpoint import dcp, manifest
from raytrn.checkpoint.agree import all_true, gather
from raytrn.checkpoint.manifest import Candidate, Commit
from raytrn.checkpoint.progress import Progress, read_local_meta, write_meta
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.staging import Staging, staging_or_none
from raytrn.checkpoint.statefile import has_state, load_state
from raytrn.checkpoint.store import Checkpoints, PinnedSchedule, Saved, TrainState
from raytrn.errors import CheckpointError, CheckpointsFailing
from raytrn.ray_output import ROUTINE
from raytrn.storage import is_transient

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: What a failed DCP save raises (on every rank): DCP's CheckpointException is a BaseException.
SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


class DcpCheckpoints(Checkpoints):
    """Sharded DCP checkpoints in the run's ``dcp/step_<N>`` directories, each committed by a manifest once every
    rank's files are written (:mod:`raytrn.checkpoint.manifest`; the write itself: :mod:`raytrn.checkpoint.dcp`).

    A save that fails (storage unavailable past the retries of :mod:`raytrn.storage`) is left uncommitted and
    training goes on, unless it is the last one or a preemption's: those raise.

    Retention after a commit is a round of rank 0's in a thread of its own (a listing, a read per checkpoint, then
    each dropped checkpoint's manifest and its files, one a rank, listed and deleted: storage requests, each a round
    trip on S3): the steps go on beside it, no rank waits for it. It never runs beside a save or a restore: the next
    save, a restore and :meth:`settle` wait for it first (it is usually long done), and the last save's round is
    waited for before that save returns. What a round deleted counts in :attr:`deleted` once it is done (by the
    next save)."""

    manifests = True

    def __init__(self, job: JobSpec, *, rank: int, plain_layout: bool, layout: dict[str, Any] | None = None) -> None:
        self.job, self.rank = job, rank
        self.run = RunDir.of(job)
        #: DDP or one process, TP 1: ``state.pt`` checkpoints of older raytrn versions load as they are.
        self.plain_layout = plain_layout
        self.layout = dict(layout or {})
        self.asynchronous = job.checkpoint.async_
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        # the ranks of one replica: its tensor-parallel, context-parallel and pipeline ranks read the same rows
        replica = 1
        for name in ("tensor_parallel_size", "context_parallel_size", "pipeline_parallel_size"):
            replica *= int(self.layout.get(name, 1))
        self.layout["data_parallel_size"] = self.world_size // replica
        # The background write's collectives get a gloo group of their own (also on nccl): never interleaved
        # with the step's collectives on the default group. Created by every rank at the same point.
        self._group = dist.new_group(backend="gloo") if self.asynchronous and self.distributed else None
        self._pending: tuple[Any, Any, Saved, Commit] | None = None
        #: checkpoint.async's copy to host memory, beside the next step (made at the first async save)
        self.staging: Staging | None = None
        self._copy_at_save = False  # (no stager here: copied at each save)
        super().__init__()  # failed saves (skipped, uncommitted), steps retention deleted (rank 0), skipped rounds
        #: How many saves failed in a row (``checkpoint.max_consecutive_failures`` stops the job).
        self.consecutive_failures = 0
        #: Rank 0's retention round in flight (started once a save that committed returns) and its thread
        self._retention: Future[tuple[list[int], bool]] | None = None
        self._pruner: ThreadPoolExecutor | None = None

    def carry_on(self, before: DcpCheckpoints) -> None:
        """Go on from ``before``, this rank's checkpoints of an earlier generation of its group (a live group
        re-formed): its counts of failed saves and deleted steps, and its retention round, which this one's next save
        waits for as its own."""
        self.failed, self.consecutive_failures = before.failed, before.consecutive_failures
        self.deleted, self.retention_skipped = before.deleted, before.retention_skipped
        self._retention, self._pruner, before._retention = before._retention, before._pruner, None

    def copied(self) -> None:
        """Wait for an async save's copy of the state to host memory, if one is in flight (before the state changes
        other than by the optimizer's step, which waits for it itself)."""
        if self.staging is not None:
            self.staging.wait()

    def settle(self) -> None:
        """Wait for rank 0's retention round in flight, if any, and count what it deleted (or skipped)."""
        round_, self._retention = self._retention, None
        if round_ is None:
            return
        deleted, skipped = round_.result()
        self.deleted.update(deleted)
        self.retention_skipped += skipped

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        self.settle()  # nothing is cleared or written beside a retention round
        ready = self._finish_pending(final=final)
        if final and self.staging is not None:  # (the previous save's copy long done: its write is)
            self.staging.close()  # its thread and host buffers go; a save after this one makes another
            self.staging = None
        location = self.run.dcp_step(progress.step)
        if self.rank == 0:  # before the save's first collective: no rank writes there until rank 0 joins it
            try:
                manifest.clear_staging(self.run, progress.step)
            except OSError as e:  # the save goes on (and fails everywhere if the storage is down): the manifest
                log.warning("checkpoint %s: could not clear it before saving: %s", location, e)  # lists its files
        counters, pinned = replace(progress), schedule.to_dict()
        val_loss = report.get("val_loss")  # evaluated at this step (checkpoint.keep_best keeps the lowest)
        commit = Commit(
            step=progress.step, world_size=self.world_size, layout=self.layout, files={}, progress=counters,
            schedule=pinned, val_loss=None if val_loss is None else float(val_loss),
        )  # fmt: skip
        saved = Saved(
            step=progress.step,
            report=report,
            write=lambda d: write_meta(d, counters, schedule=pinned, dcp=location),
        )
        state = dcp.training_state(t.model, t.optimizer, t.scheduler)
        if self.asynchronous and not final:  # the copy to host memory beside the next step, until its optimizer step
            if self.staging is None and not self._copy_at_save:
                self.staging = staging_or_none()
                self._copy_at_save = self.staging is None
            future, writer, copy = dcp.async_save(state, location, process_group=self._group, staging=self.staging)
            if copy is not None and self.staging is not None:
                self.staging.started(copy, t.optimizer)
            self._pending = (future, writer, saved, commit)
            self._start_retention(due=bool(ready), writing=progress.step, wait=False)  # (the previous save's)
            return ready
        try:
            digests: dict[str, tuple[int, str]] | None = dcp.save(state, location)
        except SAVE_ERRORS as e:  # every rank gets DCP's error (its collectives carry it)
            self._failed(location, e, final=final)
            digests = None
        done = self._commit(location, commit, digests, saved, final=final)
        self._start_retention(due=bool(ready or done), writing=None, wait=final)
        return [*ready, *done]

    def _finish_pending(self, *, final: bool) -> list[Saved]:
        if self._pending is None:
            return []
        future, writer, saved, commit = self._pending
        self._pending = None
        location = self.run.dcp_step(saved.step)
        try:
            future.result()  # the previous checkpoint's write: usually long done
            digests: dict[str, tuple[int, str]] | None = dict(writer.digests)
        except SAVE_ERRORS as e:
            self._failed(location, e, final=final)
            digests = None
        return self._commit(location, commit, digests, saved, final=final)

    def _failed(self, location: str, error: BaseException, *, final: bool) -> None:
        """A save failed on every rank: skipped if the storage failed (and it is not the last save), else raised
        (a lost peer fails the group anyway; anything else is a bug to see)."""
        if not _storage_failure(error):
            raise error
        if final:
            raise CheckpointError(f"checkpoint {location} could not be written: {_first_cause(error)}") from error
        self._count_failure(location, _first_cause(error))
        if self.rank == 0:
            log.warning(
                "checkpoint %s could not be written (%s); training goes on, it is left uncommitted (never resumed) "
                "and the next save tries again",
                location,
                _first_cause(error),
            )

    def _commit(
        self, location: str, commit: Commit, digests: dict[str, tuple[int, str]] | None, saved: Saved, *, final: bool
    ) -> list[Saved]:
        """Gather every rank's files (a collective on every rank; None: this save failed everywhere), and let rank 0
        write the manifest; the checkpoint is reported only when committed."""
        files = gather(digests, group=self._group)
        if any(f is None for f in files):
            return []
        ok = True
        if self.rank == 0:
            commit.files = {name: {"size": size, "sha256": sha} for f in files for name, (size, sha) in f.items()}
            commit.written_at = time.time()
            try:
                manifest.write_commit(location, commit)
            except Exception as e:
                ok = False
                if final:
                    raise CheckpointError(f"checkpoint {location} could not be committed: {e}") from e
                log.warning("checkpoint %s could not be committed (%s); training goes on", location, e)
        if not all_true(ok, group=self._group):
            self._count_failure(location, "its manifest could not be written")
            return []
        self.consecutive_failures = 0
        return [saved]

    def _count_failure(self, location: str, cause: str) -> None:
        """One more failed save (every rank counts it: a failed save is agreed); CheckpointError once
        ``checkpoint.max_consecutive_failures`` saves in a row failed."""
        self.failed += 1
        self.consecutive_failures += 1
        limit = self.job.checkpoint.max_consecutive_failures
        if self.consecutive_failures >= limit:
            raise CheckpointsFailing(
                f"checkpoint.max_consecutive_failures={limit}: the last {limit} saves failed (the last, {location}: "
                f"{cause}); stopping rather than train on without checkpoints. Fix the storage (space, permissions, "
                "reachability) and run again: the run resumes from its newest committed checkpoint"
            )

    def _start_retention(self, *, due: bool, writing: int | None, wait: bool) -> None:
        """Rank 0, once a save that committed a checkpoint (``due``) returns: ``checkpoint.keep_last`` (and
        ``keep_best``) of raytrn's committed checkpoints (:func:`raytrn.checkpoint.manifest.prune`) in the retention
        thread, never deleting ``writing`` (a save in flight: a step saved again after a rollback may be older than the
        newest committed); ``wait``: done before this returns (the last save)."""
        if self.rank != 0 or not due:
            return
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="raytrn-retention")
        self._retention = self._pruner.submit(self._prune, () if writing is None else (writing,))
        if wait:
            self.settle()

    def _prune(self, writing: tuple[int, ...]) -> tuple[list[int], bool]:
        """One retention round: the steps deleted, and whether it was skipped (a read it needed failed)."""
        spec = self.job.checkpoint
        try:
            deleted = manifest.prune(self.run, keep_last=spec.keep_last, keep_best=spec.keep_best, keep=writing)
        except manifest.RetentionSkipped as e:  # retention never fails training
            log.warning("%s. The next save tries again; check that the checkpoint storage is reachable and readable", e)
            return [], True
        except (OSError, CheckpointError) as e:
            log.warning("could not delete old checkpoints under %s: %s", self.run.dcp, e)
            return [], False
        if deleted:
            keep = self.job.checkpoint.keep_last  # (every save's line: to the run's Ray log, not the terminal)
            log.info("deleted checkpoints of steps %s (checkpoint.keep_last=%s)", deleted, keep, extra=ROUTINE)
        return deleted, False

    def load_committed(self, candidate: Candidate, t: TrainState) -> Progress:
        """Restore the committed checkpoint :func:`raytrn.checkpoint.finder.resume_point` chose."""
        self.settle()  # (a rollback in place: no retention round beside the read)
        self.copied()  # (nor a save's copy of the tensors the read writes into)
        dcp.load(candidate.location, t.model, t.optimizer, t.scheduler, source=self.job.source)
        return replace(candidate.commit.progress)

    def load(self, directory: str, t: TrainState) -> Progress:
        self.copied()
        meta = read_local_meta(directory)
        location = meta.extra.get("dcp")
        if isinstance(location, str):
            dcp.load(self.run.own_dcp(location), t.model, t.optimizer, t.scheduler, source=self.job.source)
            return meta.progress
        if has_state(directory):
            if not self.plain_layout:
                raise CheckpointError(
                    f"{self.job.source}: the checkpoint to resume ({directory}) is a single-file state.pt of an "
                    "older raytrn, which loads only into an unsharded model. Resume it once with "
                    "parallel.data_parallel: ddp and parallel.tensor_parallel_size: 1 (run.max_steps just past its "
                    "step): the checkpoint that run writes is sharded and loads into any layout"
                )
            return load_state(directory, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
        if "sharded" in meta.extra:
            raise CheckpointError(
                f"{self.job.source}: the checkpoint to resume ({directory}) was written by neuronx-distributed "
                "(scaling.accelerator: neuron-xla); it loads only there"
            )
        raise CheckpointError(f"{self.job.source}: checkpoint {directory} holds no training state")


def _storage_failure(error: BaseException) -> bool:
    """Whether a failed save failed on the storage (every rank's error an OSError or an S3 client error), not on a
    lost peer or a bug."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    errors = [e for e, _ in failures.values()] if isinstance(failures, dict) else [error]
    return bool(errors) and all(isinstance(e, OSError) or is_transient(e) for e in errors)


def _first_cause(error: BaseException) -> str:
    """The first rank's error of a DCP CheckpointException (one line), else the error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (first, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(first).__name__}: {first}"
    return str(error)
