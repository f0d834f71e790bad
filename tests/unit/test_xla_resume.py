"""The frozen XLA path's resume format (:mod:`raytrn.xla.resume`): its backends choose it, it is the same protocol
as the living one's, and on a run directory of recorded ``state.pt`` checkpoints the driver's answer and the
workers' agree (the step, the data position) and the state restored is the saved one. On the CPU, without torch-xla:
the loop's own Checkpointer, Ray Train's ``get_checkpoint`` standing in for the one it registered last."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import ray.train
import torch
from ray.train import Checkpoint

from raytrn.backends import get_backend
from raytrn.checkpoint.progress import Progress, write_meta
from raytrn.checkpoint.resume import ResumeFormat
from raytrn.checkpoint.rundir import RunDir
from raytrn.train.build import build_training
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.schedule import Schedule
from raytrn.xla.backend import XlaCpuBackend
from raytrn.xla.checkpoints import StateFileCheckpoints
from raytrn.xla.resume import RecordedResume, resume_progress
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["xla-cpu", "neuron-xla"])
def test_the_xla_backends_resume_through_ray_trains_recorded_checkpoints(name: str) -> None:
    backend = get_backend(name)
    resume = backend.resume_format()
    assert isinstance(resume, ResumeFormat) and isinstance(resume, RecordedResume)
    assert not resume.memory_tier and not backend.probes_memory


def test_driver_and_workers_agree_on_a_recorded_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = job(tmp_path)
    t = trained(j)
    t = replace(t, checkpoints=StateFileCheckpoints(lambda state: state))  # the XLA path's format, on the CPU
    run = RunDir.of(j)
    for step in (10, 20):  # as the loop saves them: Ray Train records each directory rank 0 fills
        progress = Progress(step=step, tokens_seen=32 * step, epoch=1, epoch_samples=2 * step)
        [saved] = t.checkpoints.save(t, progress, Schedule.from_job(j), {}, final=False)
        assert saved.write is not None
        saved.write(run.pointer(step))
    backend = XlaCpuBackend()

    meta, where = backend.resume_format().latest(j)  # the driver: "resuming run ... from step 20"
    assert meta is not None and where == run.pointer(20)

    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: Checkpoint.from_directory(run.pointer(20)))
    checkpointer = Checkpointer(j, backend, Schedule.from_job(j), rank=0, world_size=1)
    start = checkpointer.find()  # the workers: Ray Train's latest
    assert start.progress == meta.progress and start.resume is None and start.snapshot is None
    fresh = build_training(j, get_backend("cpu"), world_size=1)
    fresh = replace(fresh, checkpoints=StateFileCheckpoints(lambda state: state))
    assert checkpointer.restore(fresh, start) is False  # the state's data position is meta.json's
    assert checkpointer.restored_from == "storage" and start.progress.tokens_seen == 640
    for (name, a), b in zip(t.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert backend.resume_format().tidy(j) == [] and backend.resume_format().latest(j)[1] == where


def test_a_new_run_starts_at_step_0_for_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = job(tmp_path)
    backend = XlaCpuBackend()
    assert backend.resume_format().latest(j) == (None, None)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    checkpointer = Checkpointer(j, backend, Schedule.from_job(j), rank=0, world_size=1)
    start = checkpointer.find()
    assert start.progress == Progress() and start.checkpoint is None
    assert checkpointer.restore(build_training(j, get_backend("cpu"), world_size=1), start) is False
    assert checkpointer.restored_from is None


def test_resume_progress_from_meta_json(tmp_path: Path) -> None:
    assert resume_progress(None) == Progress()
    saved = Progress(step=30, tokens_seen=960, epoch=2, epoch_samples=96, last_logged_step=30)
    write_meta(str(tmp_path), saved, sharded="s3://b/nxd")
    # A resumed run continues the pass over the data where it stopped: same epoch, same sample.
    assert resume_progress(Checkpoint.from_directory(str(tmp_path))) == saved


def test_resume_progress_without_meta_json_starts_at_the_beginning(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text("{not json")
    assert resume_progress(Checkpoint.from_directory(str(tmp_path))) == Progress()
    (tmp_path / "meta.json").unlink()
    assert resume_progress(Checkpoint.from_directory(str(tmp_path))) == Progress()
