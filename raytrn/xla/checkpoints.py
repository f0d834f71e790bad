"""The frozen XLA path's own checkpoint formats, resumed through Ray Train's latest checkpoint (no manifests).

- :class:`StateFileCheckpoints` (plain XLA workers): rank 0 writes the whole state as one ``state.pt``
  (:mod:`raytrn.checkpoint.statefile`).
- :class:`NxdCheckpoints` (neuronx-distributed's model parallelism): NxD's sharded format in the run's ``nxd``
  directory (:meth:`raytrn.checkpoint.rundir.RunDir.nxd`).
- :class:`NoCheckpoints`: ``neuron_parallel_compile``'s trial run, whose outputs are invalid.

Ray Train records each as a ``meta.json`` pointer; how a run resumes from them (the driver's answer, the workers'):
:class:`raytrn.xla.resume.RecordedResume`, these backends' resume format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from raytrn.checkpoint.progress import Progress, read_local_meta, write_meta
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.statefile import load_state, save_state
from raytrn.checkpoint.store import Checkpoints, PinnedSchedule, Saved, TrainState
from raytrn.xla.nxd import load_sharded_checkpoint, save_sharded_checkpoint

if TYPE_CHECKING:
    from raytrn.config import JobSpec


class StateFileCheckpoints(Checkpoints):
    """Rank 0 writes the whole state as ``state.pt`` (the frozen XLA path: replicas are identical)."""

    def __init__(self, to_cpu: Callable[[Any], Any]) -> None:
        super().__init__()
        self.to_cpu = to_cpu

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        counters, pinned = replace(progress), schedule.to_dict()

        def write(d: str) -> None:
            save_state(
                d, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, progress=counters,
                schedule=pinned, to_cpu=self.to_cpu,
            )  # fmt: skip

        return [Saved(step=progress.step, report=report, write=write)]

    def load(self, directory: str, t: TrainState) -> Progress:
        return load_state(directory, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)


class NoCheckpoints(Checkpoints):
    """Nothing written, nothing recorded: ``neuron_parallel_compile``'s trial run (its outputs are invalid)."""

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        return [Saved(step=progress.step, report=report, write=None)]

    def load(self, directory: str, t: TrainState) -> Progress:
        return read_local_meta(directory).progress


class NxdCheckpoints(Checkpoints):
    """neuronx-distributed's sharded checkpoints in the run's ``nxd`` directory (every rank writes
    its shards; rank 0 the scheduler and raytrn's counters as NxD's user content)."""

    def __init__(self, job: JobSpec) -> None:
        super().__init__()
        self.job = job
        self.directory = RunDir.of(job).nxd

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        counters, pinned = replace(progress), schedule.to_dict()
        save_sharded_checkpoint(
            self.directory, f"step_{progress.step:08d}", t.model, t.optimizer, t.scheduler,
            {**asdict(counters), "schedule": pinned}, self.job.checkpoint.keep_last,
        )  # fmt: skip
        where = self.directory
        return [
            Saved(
                step=progress.step,
                report=report,
                write=lambda d: write_meta(d, counters, schedule=pinned, sharded=where),
            )
        ]

    def load(self, directory: str, t: TrainState) -> Progress:
        saved = load_sharded_checkpoint(self.directory, t.model, t.optimizer, t.scheduler)
        return Progress.from_dict(saved) if isinstance(saved, dict) else Progress()
