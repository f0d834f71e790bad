"""How a run resumes, one object per checkpoint format, chosen by the backend (:meth:`Backend.resume_format`).

A :class:`ResumeFormat` is everything the driver and the workers ask of a format about resuming, so that neither
branches on which format it is:

- the driver's answer before any worker starts (:meth:`~ResumeFormat.latest`: where the run resumes, its counters
  and pinned schedule), and its tidying once ``fit()`` returned (:meth:`~ResumeFormat.tidy`);
- the workers' answer (:meth:`~ResumeFormat.find`, a collective: a :class:`Start`) and its restore
  (:meth:`~ResumeFormat.load`);
- whether the in-memory tier (snapshots in the nodes' memory, :mod:`raytrn.train.snapshots`) applies.

Saving, and what a save deleted or failed, are the per-rank :class:`raytrn.checkpoint.store.Checkpoints`'.

- :class:`CommittedResume` (cpu, cuda, neuron): commit manifests (:mod:`raytrn.checkpoint.finder`), the in-memory
  tier, and an older raytrn's run directory without manifests (its ``checkpoint_<N>`` pointers).
- The frozen XLA path's formats resume through Ray Train's latest checkpoint: :mod:`raytrn.xla.resume`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from raytrn import storage
from raytrn.checkpoint.finder import latest_checkpoint, newest_pointer, resume_point
from raytrn.checkpoint.manifest import describe, tidy_pointers
from raytrn.checkpoint.progress import Meta, Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.store import Checkpoints, TrainState

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Start:
    """Where a worker group starts: the counters (a copy the loop moves on), and the checkpoint they come from (the
    committed ``resume``; or a checkpoint Ray Train recorded, ``checkpoint``: its Ray ``Checkpoint`` for the XLA
    formats, its location for an older raytrn's run directory; neither for a new run)."""

    progress: Progress
    resume: Any = None
    checkpoint: Any = None
    #: An in-memory snapshot newer than ``resume`` (:class:`raytrn.train.snapshots.Snapshot`): it wins.
    snapshot: Any = None

    @property
    def location(self) -> str | None:
        if self.snapshot is not None:
            return f"memory:step_{self.snapshot.step}"  # as the run's raytrn.restore_source tag says it
        return self.resume.location if self.resume is not None else None


class SnapshotTier(Protocol):
    """One rank's side of the in-memory tier, as a resume reads it (:class:`raytrn.train.snapshots.MemorySnapshots`
    is one): the newest complete snapshot (its ``step`` and ``progress``), the step the group starts at, a restore."""

    def newest(self) -> Any: ...

    def starting_at(self, step: int) -> None: ...

    def load(self, t: Any, snapshot: Any) -> Progress: ...


class Resumable(TrainState, Protocol):
    """A worker's training as a restore fills it: its state and the format's per-rank :class:`Checkpoints`
    (:class:`raytrn.train.step.Training` is one)."""

    checkpoints: Checkpoints


@runtime_checkable
class ResumeFormat(Protocol):
    """What the driver and the workers ask of a checkpoint format about resuming (module docstring)."""

    #: Whether the in-memory tier applies: the loop keeps snapshots, and :meth:`find` prefers one at least as new.
    memory_tier: bool

    def latest(self, job: JobSpec) -> tuple[Meta | None, str | None]:
        """The driver's answer: what the checkpoint ``job``'s run resumes from says (counters, schedule) and where
        it is, or (None, None) for a new run. No torch, no Ray: it runs before the workers start."""
        ...

    def find(self, job: JobSpec, *, rank: int, world_size: int, memory: SnapshotTier | None) -> Start:
        """The workers' answer (a collective: every rank, at the start, before the model builds)."""
        ...

    def load(self, t: Resumable, start: Start, *, memory: SnapshotTier | None, rank: int) -> Progress | None:
        """Restore ``start``'s state into ``t`` (every rank); its counters, or None for a new run."""
        ...

    def tidy(self, job: JobSpec) -> list[str]:
        """The driver, once ``fit()`` returned: remove what Ray Train left that this format no longer needs;
        the locations removed."""
        ...


class CommittedResume:
    """Checkpoints committed by a manifest (``dcp/step_<N>/commit.json``), found by :mod:`raytrn.checkpoint.finder`
    (the driver checks sizes, the workers sha256), with the in-memory tier in front of them; a run directory of an
    older raytrn (no manifests) resumes from the newest ``checkpoint_<N>`` Ray Train recorded, by driver and
    workers alike."""

    memory_tier = True

    def latest(self, job: JobSpec) -> tuple[Meta | None, str | None]:
        return latest_checkpoint(job)

    def find(self, job: JobSpec, *, rank: int, world_size: int, memory: SnapshotTier | None) -> Start:
        """The newest complete in-memory snapshot when it is at least as new as every committed checkpoint (none of
        whose files is then read), else the newest committed checkpoint whose files check out, else the newest
        recorded one (:meth:`_recorded_start`), else a new run. The tier then forgets newer snapshots."""
        snapshot = memory.newest() if memory is not None else None  # a collective
        # A collective too; behind a snapshot at least as new only the newest checkpoint's manifest is read.
        step = snapshot.step if snapshot is not None else None
        resume = resume_point(job, rank=rank, world_size=world_size, snapshot=step)
        if snapshot is not None and (resume is None or snapshot.step >= resume.commit.step):  # (memory is faster)
            start = Start(progress=replace(snapshot.progress), resume=resume, snapshot=snapshot)
        elif resume is not None:
            start = Start(progress=replace(resume.commit.progress), resume=resume)
        else:  # no committed checkpoint: an older raytrn's run directory, as the driver finds it, or a new run
            start = self._recorded_start(job, rank=rank)
        if memory is not None:
            memory.starting_at(start.progress.step)
        return start

    def _recorded_start(self, job: JobSpec, *, rank: int) -> Start:
        """Where a run without committed checkpoints starts: the newest checkpoint directory Ray Train recorded with
        a readable ``meta.json`` (an older raytrn's: its shards named there, or a single-file ``state.pt``), by the
        rule the driver announced it with (:func:`raytrn.checkpoint.finder.newest_pointer`); a new run otherwise.
        Rank 0 reads it, every rank gets its answer (a collective)."""
        from raytrn.checkpoint import agree  # torch.distributed: the driver imports this module and never needs torch

        found: list[Any] = [None, None]
        if rank == 0:
            found = list(newest_pointer(RunDir.of(job)))
        meta, location = agree.broadcast(found)
        if meta is None or location is None:
            return Start(progress=Progress())
        if rank == 0:
            log.info("no committed checkpoint: resuming Ray Train's recorded checkpoint %s", location)
        return Start(progress=replace(meta.progress), checkpoint=str(location))

    def load(self, t: Resumable, start: Start, *, memory: SnapshotTier | None, rank: int) -> Progress | None:
        """The snapshot from memory, else the committed checkpoint, else the recorded directory (local, or on S3:
        downloaded) through the format's :meth:`Checkpoints.load` (``state.pt`` or shards named in ``meta.json``)."""
        if start.snapshot is not None and memory is not None:
            from_memory = memory.load(t, start.snapshot)
            if rank == 0:
                log.info("resumed from the in-memory snapshot of step %d (no read from storage)", start.snapshot.step)
            return replace(from_memory)
        if start.resume is not None:
            loaded = t.checkpoints.load_committed(start.resume, t)
            if rank == 0:
                log.info("resumed from %s", describe(start.resume))
            return loaded
        if start.checkpoint is None:
            return None
        import ray.train  # only a worker gets here; the driver imports this module too (ray.train: ~1 s)

        fs, path = storage.filesystem(start.checkpoint)
        return load_recorded(t, ray.train.Checkpoint(path, filesystem=fs))

    def tidy(self, job: JobSpec) -> list[str]:
        """Ray Train's pointers to sharded checkpoints raytrn's retention deleted
        (:func:`raytrn.checkpoint.manifest.tidy_pointers`)."""
        return tidy_pointers(RunDir.of(job))


def load_recorded(t: Resumable, checkpoint: Any) -> Progress:
    """Restore a checkpoint directory Ray Train recorded (a ``ray.train.Checkpoint``, downloaded when remote) into
    ``t`` through its format's :meth:`Checkpoints.load`; its counters."""
    with checkpoint.as_directory() as d:
        return t.checkpoints.load(d, t)
