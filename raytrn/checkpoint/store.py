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
    """Writes and reads a worker's training state."""

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        """Called by every rank at a checkpoint step; returns the checkpoints now complete, oldest first."""
        raise NotImplementedError

    def load(self, directory: str, t: TrainState) -> Progress:
        """Restore the checkpoint Ray handed back (its directory, downloaded) into ``t``; its counters."""
        raise NotImplementedError
