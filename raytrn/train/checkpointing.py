"""How a backend writes and reads training state: one :class:`Checkpoints` per layout.

The loop calls ``save`` on every rank at a checkpoint step and reports to Ray Train what it returns (a
:class:`Saved` per checkpoint that is complete), and ``load`` once when it resumes. Ray Train's own
checkpoint is always a small directory: ``meta.json`` (counters, schedule, where the state is) plus, for the
single-file format, ``state.pt``.

- :class:`DcpCheckpoints` (cpu, cuda; any DDP/FSDP/TP layout): ``torch.distributed.checkpoint``, every rank
  writing its shards, reshardable; ``checkpoint.async`` overlaps the write with training.
- :class:`StateFileCheckpoints` (the frozen XLA path): rank 0 writes ``state.pt``.
- ``NxdCheckpoints`` (:mod:`raytrn.backends.nxd`, the XLA path's model parallelism): NxD's sharded format.
- :class:`NoCheckpoints`: ``neuron_parallel_compile``'s trial run, whose outputs are invalid.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from raytrn.checkpoint import (
    META_FILE,
    STATE_FILE,
    Progress,
    load_state,
    parse_meta,
    save_state,
    write_meta,
)
from raytrn.errors import CheckpointError

if TYPE_CHECKING:
    from raytrn.config import JobSpec
    from raytrn.train.schedule import Schedule
    from raytrn.train.step import Training

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Saved:
    """A complete checkpoint to record with Ray Train."""

    step: int
    #: What ``ray.train.report`` gets with it (the metrics of the step it was taken at).
    report: dict[str, Any]
    #: Rank 0 fills Ray's checkpoint directory with it; None: nothing to record (a trial run).
    write: Callable[[str], None] | None


class Checkpoints:
    """Writes and reads a worker's training state."""

    def save(
        self, t: Training, progress: Progress, schedule: Schedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        """Called by every rank at a checkpoint step; returns the checkpoints now complete, oldest first."""
        raise NotImplementedError

    def load(self, directory: str, t: Training) -> Progress:
        """Restore the checkpoint Ray handed back (its directory, downloaded) into ``t``; its counters."""
        raise NotImplementedError


def _save_errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP save raises (on every rank): DCP's CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class DcpCheckpoints(Checkpoints):
    """Sharded DCP checkpoints under ``<checkpoint.storage>/<run>/dcp/step_<N>``, each committed by a manifest once
    every rank's files are written (:mod:`raytrn.train.commit`; the write itself: :mod:`raytrn.train.dcp`).

    A save that fails (storage unavailable past the retries of :mod:`raytrn.storage`) is left uncommitted and
    training goes on, unless it is the last one or a preemption's: those raise."""

    def __init__(self, job: JobSpec, *, rank: int, plain_layout: bool, layout: dict[str, Any] | None = None) -> None:
        import torch.distributed as dist

        self.job, self.rank = job, rank
        #: DDP or one process, TP 1: ``state.pt`` checkpoints of older raytrn versions load as they are.
        self.plain_layout = plain_layout
        self.layout = dict(layout or {})
        self.asynchronous = job.checkpoint.async_
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.layout["data_parallel_size"] = self.world_size // int(self.layout.get("tensor_parallel_size", 1))
        # The background write's collectives get a gloo group of their own (also on nccl): never interleaved
        # with the step's collectives on the default group. Created by every rank at the same point.
        self._group = dist.new_group(backend="gloo") if self.asynchronous and self.distributed else None
        self._pending: tuple[Any, Any, Saved, Any] | None = None
        #: Saves that failed and were skipped (uncommitted), this worker group.
        self.failed = 0

    def save(
        self, t: Training, progress: Progress, schedule: Schedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        from raytrn.train import commit, dcp

        ready = self._finish_pending(final=final)
        root = commit.dcp_root(self.job.checkpoint.storage, self.job.run_name)
        location = commit.location_of(root, progress.step)
        if self.rank == 0:  # before the save's first collective: no rank writes there until rank 0 joins it
            try:
                commit.clear_staging(root, progress.step)
            except OSError as e:  # the save goes on (and fails everywhere if the storage is down): the manifest
                log.warning("checkpoint %s: could not clear it before saving: %s", location, e)  # lists its files
        counters, pinned = replace(progress), schedule.to_dict()
        manifest = commit.Commit(
            step=progress.step, world_size=self.world_size, layout=self.layout, files={}, progress=counters,
            schedule=pinned,
        )  # fmt: skip
        saved = Saved(
            step=progress.step,
            report=report,
            write=lambda d: write_meta(d, counters, schedule=pinned, dcp=location),
        )
        state = dcp.training_state(t.model, t.optimizer, t.scheduler)
        if self.asynchronous and not final:  # the step waits for staging to host memory only
            future, writer = dcp.async_save(state, location, process_group=self._group)
            self._pending = (future, writer, saved, manifest)
            return ready
        try:
            digests: dict[str, tuple[int, str]] | None = dcp.save(state, location)
        except _save_errors() as e:  # every rank gets DCP's error (its collectives carry it)
            self._failed(location, e, final=final)
            digests = None
        done = self._commit(location, manifest, digests, saved, final=final)
        return [*ready, *done]

    def _finish_pending(self, *, final: bool) -> list[Saved]:
        if self._pending is None:
            return []
        future, writer, saved, manifest = self._pending
        self._pending = None
        from raytrn.train import commit

        location = commit.location_of(commit_root(self.job), saved.step)
        try:
            future.result()  # the previous checkpoint's write: usually long done
            digests: dict[str, tuple[int, str]] | None = dict(writer.digests)
        except _save_errors() as e:
            self._failed(location, e, final=final)
            digests = None
        return self._commit(location, manifest, digests, saved, final=final)

    def _failed(self, location: str, error: BaseException, *, final: bool) -> None:
        """A save failed on every rank: skipped if the storage failed (and it is not the last save), else raised
        (a lost peer fails the group anyway; anything else is a bug to see)."""
        if not _storage_failure(error):
            raise error
        if final:
            raise CheckpointError(f"checkpoint {location} could not be written: {_first_cause(error)}") from error
        self.failed += 1
        if self.rank == 0:
            log.warning(
                "checkpoint %s could not be written (%s); training goes on, it is left uncommitted (never resumed) "
                "and the next save tries again",
                location,
                _first_cause(error),
            )

    def _commit(
        self, location: str, manifest: Any, digests: dict[str, tuple[int, str]] | None, saved: Saved, *, final: bool
    ) -> list[Saved]:
        """Gather every rank's files (a collective on every rank; None: this save failed everywhere), and let rank 0
        write the manifest; the checkpoint is reported only when committed."""
        from raytrn.train import commit

        files = _gather(digests, group=self._group)
        if any(f is None for f in files):
            return []
        ok = True
        if self.rank == 0:
            manifest.files = {name: {"size": size, "sha256": sha} for f in files for name, (size, sha) in f.items()}
            manifest.written_at = time.time()
            try:
                commit.write_commit(location, manifest)
            except Exception as e:
                ok = False
                if final:
                    raise CheckpointError(f"checkpoint {location} could not be committed: {e}") from e
                log.warning("checkpoint %s could not be committed (%s); training goes on", location, e)
            else:
                self._prune()
        if not _all_true(ok, group=self._group):
            self.failed += 1
            return []
        return [saved]

    def _prune(self) -> None:
        """Rank 0, after a commit: ``checkpoint.keep_last`` of raytrn's committed checkpoints (see
        :func:`raytrn.train.commit.prune`)."""
        from raytrn.train import commit

        root = commit_root(self.job)
        try:
            deleted = commit.prune(root, keep_last=self.job.checkpoint.keep_last)
        except OSError as e:  # retention never fails training
            log.warning("could not delete old checkpoints under %s: %s", root, e)
            return
        if deleted:
            log.info(
                "deleted checkpoints of steps %s (checkpoint.keep_last=%s)", deleted, self.job.checkpoint.keep_last
            )

    def load_committed(self, candidate: Any, t: Training) -> Progress:
        """Restore the committed checkpoint :func:`resume_point` chose."""
        from raytrn.train import dcp

        dcp.load(candidate.location, t.model, t.optimizer, t.scheduler, source=self.job.source)
        return replace(candidate.commit.progress)

    def load(self, directory: str, t: Training) -> Progress:
        from raytrn.train import dcp

        meta = _read_meta(directory)
        location = meta.extra.get("dcp")
        if isinstance(location, str):
            dcp.load(location, t.model, t.optimizer, t.scheduler, source=self.job.source)
            return meta.progress
        if os.path.exists(os.path.join(directory, STATE_FILE)):
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
    from raytrn.storage import is_transient

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


def commit_root(job: JobSpec) -> str:
    from raytrn.train import commit

    return commit.dcp_root(job.checkpoint.storage, job.run_name)


def resume_point(job: JobSpec, *, rank: int, world_size: int) -> Any:
    """The committed checkpoint this worker group resumes from (a :class:`raytrn.train.commit.Candidate`), or None
    when the run has none (a new run, one whose first save never finished, or one older than commit manifests:
    Ray Train's own checkpoint is then the one). A collective: every rank calls it, at the start.

    Rank 0 lists the committed checkpoints whose files are there at their sizes, newest first; with
    ``checkpoint.verify: sha256`` every rank then hashes a share of the newest one's files. A checkpoint that fails
    is skipped with a warning naming the file and the next is tried; CheckpointError when every committed one
    fails (nothing is silently started over)."""
    from raytrn.train import commit

    root = commit_root(job)
    listing: list[Any] = [None, False]
    if rank == 0:
        listing = [list(commit.candidates(root)), commit.has_commits(root)]
    found, any_commits = _broadcast(listing)
    rejected: list[str] = []
    for candidate in found:
        if job.checkpoint.verify == "sha256":
            names = sorted(candidate.commit.files)[rank::world_size]
            problems = [
                p for mine in _gather(commit.digest_problems(candidate.location, candidate.commit, names)) for p in mine
            ]
            if problems:
                if rank == 0:
                    log.warning(
                        "checkpoint %s: skipped: its files do not match its manifest (%s); trying the one before",
                        candidate.location,
                        "; ".join(problems),
                    )
                rejected.append(f"{candidate.location}: {problems[0]}")
                continue
        return candidate
    if any_commits:
        raise commit.corrupt_error(root, rejected or ["no committed checkpoint has all its files"])
    return None


def _gather(value: Any, *, group: Any = None) -> list[Any]:
    """``value`` of every rank, in rank order (one element without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group or _host_group())
    return out


def _all_true(value: bool, *, group: Any = None) -> bool:
    return all(_gather(bool(value), group=group))


def _broadcast(value: list[Any]) -> list[Any]:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = list(value)
    dist.broadcast_object_list(box, src=0, group=_host_group())
    return box


_HOST_GROUP: list[Any] = []


def _host_group() -> Any:
    """A gloo group over every rank for small host-side agreements (None: the default group is gloo already).
    Created once per process, at the first agreement, which every rank reaches at the same point."""
    import torch.distributed as dist

    if not _HOST_GROUP:
        _HOST_GROUP.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


class StateFileCheckpoints(Checkpoints):
    """Rank 0 writes the whole state as ``state.pt`` (the frozen XLA path: replicas are identical)."""

    def __init__(self, to_cpu: Callable[[Any], Any]) -> None:
        self.to_cpu = to_cpu

    def save(
        self, t: Training, progress: Progress, schedule: Schedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        counters, pinned = replace(progress), schedule.to_dict()

        def write(d: str) -> None:
            save_state(
                d, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, progress=counters,
                schedule=pinned, to_cpu=self.to_cpu,
            )  # fmt: skip

        return [Saved(step=progress.step, report=report, write=write)]

    def load(self, directory: str, t: Training) -> Progress:
        return load_state(directory, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)


class NoCheckpoints(Checkpoints):
    """Nothing written, nothing recorded: ``neuron_parallel_compile``'s trial run (its outputs are invalid)."""

    def save(
        self, t: Training, progress: Progress, schedule: Schedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        return [Saved(step=progress.step, report=report, write=None)]

    def load(self, directory: str, t: Training) -> Progress:
        return _read_meta(directory).progress


def _read_meta(directory: str) -> Any:
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            return parse_meta(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {META_FILE} ({e})") from None
