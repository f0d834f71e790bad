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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from raytrn.checkpoint import (
    META_FILE,
    STATE_FILE,
    Progress,
    load_state,
    parse_meta,
    recorded_steps,
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


class DcpCheckpoints(Checkpoints):
    """Sharded DCP checkpoints under ``<checkpoint.storage>/<run>/dcp/step_<N>`` (see :mod:`raytrn.train.dcp`)."""

    def __init__(self, job: JobSpec, *, rank: int, plain_layout: bool) -> None:
        import torch.distributed as dist

        self.job, self.rank = job, rank
        #: DDP or one process, TP 1: ``state.pt`` checkpoints of older raytrn versions load as they are.
        self.plain_layout = plain_layout
        self.asynchronous = job.checkpoint.async_
        self.distributed = dist.is_available() and dist.is_initialized()
        # The background write's collectives get a gloo group of their own (also on nccl): never interleaved
        # with the step's collectives on the default group. Created by every rank at the same point.
        self._group = dist.new_group(backend="gloo") if self.asynchronous and self.distributed else None
        self._pending: tuple[Any, Saved] | None = None

    def save(
        self, t: Training, progress: Progress, schedule: Schedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        from raytrn.train import dcp

        ready = self._finish_pending()
        location = dcp.step_location(self.job, progress.step)
        counters, pinned = replace(progress), schedule.to_dict()
        saved = Saved(
            step=progress.step,
            report=report,
            write=lambda d: write_meta(d, counters, schedule=pinned, dcp=location),
        )
        state = dcp.training_state(t.model, t.optimizer, t.scheduler)
        if self.asynchronous and not final:  # the step waits for staging to host memory only
            self._pending = (dcp.async_save(state, location, process_group=self._group), saved)
            return ready
        dcp.save(state, location)
        done = [*ready, saved]
        self._prune(min(r.step for r in done))  # those not yet reported to Ray are kept
        return done

    def _finish_pending(self) -> list[Saved]:
        if self._pending is None:
            return []
        future, saved = self._pending
        self._pending = None
        future.result()  # the previous checkpoint's write: usually long done
        self._prune(saved.step)
        return [saved]

    def _prune(self, step: int) -> None:
        """Rank 0 deletes the DCP checkpoints older than ``step`` whose pointers Ray Train has dropped
        (``checkpoint.keep_last`` is Ray's retention; see :func:`raytrn.train.dcp.prune`)."""
        if self.rank != 0 or self.job.checkpoint.keep_last is None:
            return
        from raytrn import storage
        from raytrn.train import dcp

        root = dcp.dcp_root(self.job)
        try:
            recorded = set(recorded_steps(storage.join(self.job.checkpoint.storage, self.job.run_name)))
            deleted = dcp.prune(root, upto=step, recorded=recorded)
        except OSError as e:  # retention never fails training
            log.warning("could not delete old checkpoints under %s: %s", root, e)
            return
        if deleted:
            log.info("deleted DCP checkpoints of steps %s (no longer recorded by Ray Train)", deleted)

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
