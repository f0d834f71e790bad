"""Issue 47, item 1: the driver and the workers resume a run from the same checkpoint, by one rule, whatever the run
directory holds (:mod:`raytrn.checkpoint.finder`). An older raytrn's run directory without commit manifests — a
``checkpoint_<N>`` Ray Train recorded, holding ``meta.json`` and a single-file ``state.pt`` — was announced by the
driver as "resume step N" while the workers started from step 0 (reproduced on 2026-11-28); now both resume step N,
and the state loaded is the saved one. One process, no Ray: the driver's answer as the driver asks it (the backend's
resume format, :mod:`raytrn.checkpoint.resume`), the loop's own Checkpointer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint.progress import Meta, Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.statefile import save_state
from raytrn.train.build import build_training
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.schedule import Schedule
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit


def latest(j: Any) -> tuple[Meta | None, str | None]:
    """The driver's answer, as ``run_training`` asks for it."""
    return CpuBackend().resume_format().latest(j)


def _checkpointer(j: object) -> Checkpointer:
    return Checkpointer(j, CpuBackend(), Schedule.from_job(j), rank=0, world_size=1)  # type: ignore[arg-type]


def test_driver_and_workers_resume_an_older_state_pt_run_from_the_same_step(tmp_path: Path) -> None:
    j = job(tmp_path)
    t = trained(j)
    pointer = RunDir.of(j).pointer(20)
    save_state(pointer, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
               progress=Progress(step=20, tokens_seen=640, epoch=1, epoch_samples=32))  # fmt: skip
    meta, where = latest(j)  # the driver: "resuming run ... from step 20"
    assert meta is not None and meta.progress.step == 20 and where == pointer

    checkpointer = _checkpointer(j)
    start = checkpointer.find()  # the workers (rank 0 of 1)
    assert start.progress.step == 20 and (start.progress.epoch, start.progress.epoch_samples) == (1, 32)
    fresh = build_training(j, CpuBackend(), world_size=1)
    assert checkpointer.restore(fresh, start) is False  # the state's data position is meta.json's
    assert checkpointer.restored_from == "storage" and start.progress.tokens_seen == 640
    for (name, a), b in zip(t.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert CpuBackend().resume_format().tidy(j) == [] and latest(j)[1] == pointer  # not raytrn's DCP pointer: kept


def test_a_committed_checkpoint_wins_over_recorded_ones_for_both(tmp_path: Path) -> None:
    """The current format: the newest committed checkpoint, for the driver and the workers alike, even beside an
    older recorded ``state.pt`` of a newer step."""
    j = job(tmp_path)
    t = trained(j)
    [done] = t.checkpoints.save(t, Progress(step=2, tokens_seen=64), Schedule.from_job(j), {}, final=True)
    assert done.step == 2
    save_state(RunDir.of(j).pointer(30), model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
               progress=Progress(step=30))  # fmt: skip
    meta, where = latest(j)
    assert meta is not None and meta.progress.step == 2 and where == RunDir.of(j).dcp_step(2)
    start = _checkpointer(j).find()
    assert start.progress.step == 2 and start.resume is not None and start.checkpoint is None


def test_a_new_run_starts_at_step_0_for_both(tmp_path: Path) -> None:
    j = job(tmp_path)
    assert latest(j) == (None, None)
    start = _checkpointer(j).find()
    assert start.progress == Progress() and start.resume is None and start.checkpoint is None
