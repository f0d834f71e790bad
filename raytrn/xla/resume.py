"""How the frozen XLA path's checkpoints resume: through Ray Train's latest checkpoint, no commit manifests.

Its formats (``state.pt``, NxD's shards, none in a compile trial: :mod:`raytrn.xla.checkpoints`) are recorded by Ray
Train as ``checkpoint_<N>`` directories holding ``meta.json``. :class:`RecordedResume` is their
:class:`raytrn.checkpoint.resume.ResumeFormat`: the driver names the newest recorded one with a readable
``meta.json`` (:func:`raytrn.checkpoint.finder.newest_pointer`), the workers resume the one Ray Train hands them
(``ray.train.get_checkpoint()``); no in-memory tier, nothing to tidy after a run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray.train

from raytrn.checkpoint.finder import newest_pointer
from raytrn.checkpoint.progress import META_FILE, Meta, Progress, parse_meta
from raytrn.checkpoint.resume import Resumable, SnapshotTier, Start, load_recorded
from raytrn.checkpoint.rundir import RunDir

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)


class RecordedResume:
    """The frozen XLA path's resume: Ray Train's recorded checkpoints (module docstring)."""

    memory_tier = False

    def latest(self, job: JobSpec) -> tuple[Meta | None, str | None]:
        return newest_pointer(RunDir.of(job))

    def find(self, job: JobSpec, *, rank: int, world_size: int, memory: SnapshotTier | None) -> Start:
        """Ray Train's latest checkpoint and the counters of its ``meta.json`` (no collective: Ray hands every
        worker the same one)."""
        checkpoint = ray.train.get_checkpoint()
        return Start(progress=resume_progress(checkpoint), checkpoint=checkpoint)

    def load(self, t: Resumable, start: Start, *, memory: SnapshotTier | None, rank: int) -> Progress | None:
        return load_recorded(t, start.checkpoint) if start.checkpoint is not None else None

    def tidy(self, job: JobSpec) -> list[str]:
        return []  # Ray Train's retention owns these directories


def resume_progress(checkpoint: Any) -> Progress:
    """The counters of Ray's checkpoint from its ``meta.json`` (cheap: no model state): the step, and where
    in the data the next step starts (epoch, rows consumed)."""
    if checkpoint is None:
        return Progress()
    try:
        with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{META_FILE}") as f:
            return parse_meta(f.read().decode()).progress
    except (OSError, ValueError) as e:  # the full state still restores the counters
        log.warning("checkpoint %s: no readable %s (%s)", checkpoint.path, META_FILE, e)
        return Progress()
