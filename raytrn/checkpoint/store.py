"""The interface the training loop writes and reads its state through: one :class:`Checkpoints` per layout.

The loop calls ``save`` on every rank at a checkpoint step and reports to Ray Train what it returns (a
:class:`Saved` per checkpoint that is complete), and ``load`` once when it resumes. Ray Train's own
checkpoint is always a small directory: ``meta.json`` (counters, schedule, where the state is).

- :class:`raytrn.checkpoint.sharded.DcpCheckpoints` (cpu, cuda, neuron; any DDP/FSDP/TP layout):
  ``torch.distributed.checkpoint``, every rank writing its shards, committed by a manifest, reshardable.
- The frozen XLA path's own formats (``state.pt``, neuronx-distributed's shards, none in a compile trial):
  :mod:`raytrn.xla.checkpoints`.

What a checkpoint saves is typed here by what it uses (:class:`TrainState`, :class:`PinnedSchedule`), so this
package needs nothing of :mod:`raytrn.train`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from raytrn.checkpoint.progress import Progress

if TYPE_CHECKING:
    import torch

    from raytrn.checkpoint.manifest import Candidate


class TrainState(Protocol):
    """What a checkpoint holds of a worker's training (:class:`raytrn.train.step.Training` is one)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


class PinnedSchedule(Protocol):
    """The learning-rate schedule a checkpoint pins (:class:`raytrn.train.schedule.Schedule` is one)."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(kw_only=True)
class Saved:
    """A complete checkpoint to record with Ray Train."""

    step: int
    #: What ``ray.train.report`` gets with it (the metrics of the step it was taken at).
    report: dict[str, Any]
    #: Rank 0 fills Ray's checkpoint directory with it; None: nothing to record (a trial run).
    write: Callable[[str], None] | None


class Checkpoints:
    """Writes and reads a worker's training state: the one object of its format that the loop saves, resumes and
    counts through (:class:`raytrn.train.checkpointer.Checkpointer`).

    A format with commit manifests (``manifests``: the sharded one) resumes the committed checkpoint
    :func:`raytrn.checkpoint.finder.resume_point` chose (:meth:`load_committed`); every format resumes a checkpoint
    directory Ray Train recorded (:meth:`load`): the XLA formats' own, and for the sharded format the run
    directories of an older raytrn (a ``meta.json`` naming its shards, or a single-file ``state.pt``), found by the
    same rule the driver uses (:func:`raytrn.checkpoint.finder.newest_pointer`)."""

    #: Whether checkpoints are committed by a manifest (``dcp/step_<N>/commit.json``) and found by it.
    manifests: bool = False

    def __init__(self) -> None:
        #: Steps retention deleted (``checkpoint.keep_best``: the run's checkpoint tags mark them).
        self.deleted: set[int] = set()
        #: Saves that failed, and retention rounds that deleted nothing because a read failed (the loop's metrics).
        self.failed = 0
        self.retention_skipped = 0

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        """Called by every rank at a checkpoint step; returns the checkpoints now complete, oldest first."""
        raise NotImplementedError

    def settle(self) -> None:
        """Wait for what a save left running beside the steps (the sharded format's retention round), if anything."""

    def load(self, directory: str, t: TrainState) -> Progress:
        """Restore the checkpoint Ray recorded (its directory, downloaded) into ``t``; its counters."""
        raise NotImplementedError

    def load_committed(self, candidate: Candidate, t: TrainState) -> Progress:
        """Restore the committed checkpoint ``candidate`` into ``t`` (formats with :attr:`manifests`); its counters."""
        raise NotImplementedError(f"{type(self).__name__} has no committed checkpoints")
