"""Retention (checkpoint.keep_last, keep_best, pins) when a read fails: that round deletes nothing, warns, and counts
it (the ``checkpoint_retention_skipped`` metric); the next round, once the read works, deletes as usual."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from raytrn.checkpoint.manifest import COMMIT_FILE
from raytrn.checkpoint.pins import pin
from raytrn.checkpoint.rundir import RunDir
from tests.unit.test_commit import save
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit

#: A file whose every read fails (EIO) while it is listed and stat'ed as a file: a read that failed.
UNREADABLE = "/proc/self/mem"


def test_keep_best_deletes_nothing_when_a_manifest_cannot_be_read(tmp_path: Path, caplog) -> None:
    j = job(tmp_path, "checkpoint.keep_last=1", "checkpoint.keep_best=true")
    run, t = RunDir.of(j), trained(j)
    save(t, j, 2, val_loss=1.0)  # the best
    save(t, j, 4, val_loss=2.0)
    assert run.dcp_steps() == [2, 4]
    commit = Path(run.dcp_step(2)) / COMMIT_FILE
    commit.rename(tmp_path / "commit.json")
    commit.symlink_to(UNREADABLE)
    with caplog.at_level(logging.WARNING):
        save(t, j, 6, val_loss=3.0)
    assert run.dcp_steps() == [2, 4, 6]  # nothing deleted this round
    assert t.checkpoints.retention_skipped == 1
    assert f"{run.dcp_step(2)}/{COMMIT_FILE}" in caplog.text and "deleted nothing" in caplog.text
    commit.unlink()
    shutil.move(tmp_path / "commit.json", commit)
    save(t, j, 8, val_loss=4.0)  # readable again: the best and the newest stay
    assert run.dcp_steps() == [2, 8] and t.checkpoints.retention_skipped == 1


@pytest.mark.parametrize("failure", ["listing", "pin"])
def test_a_pinned_checkpoint_stays_when_the_pins_cannot_be_read(tmp_path: Path, caplog, failure: str) -> None:
    j = job(tmp_path, "checkpoint.keep_last=1")
    run, t = RunDir.of(j), trained(j)
    save(t, j, 1)
    pin(run, 1, ttl_s=600)
    pins = Path(run.pins)
    pins.rename(tmp_path / "pins")
    if failure == "listing":
        pins.write_text("not a directory: listing it fails")
    else:
        pins.mkdir()
        (pins / f"{RunDir.step_name(1)}.json").symlink_to(UNREADABLE)
    with caplog.at_level(logging.WARNING):
        save(t, j, 2)
    assert run.dcp_steps() == [1, 2]  # the pinned one stays
    assert t.checkpoints.retention_skipped == 1 and "deleted nothing" in caplog.text
    shutil.rmtree(pins) if pins.is_dir() else pins.unlink()
    shutil.move(tmp_path / "pins", pins)
    save(t, j, 3)  # readable again: step 1 still pinned, step 2 goes
    assert run.dcp_steps() == [1, 3] and t.checkpoints.retention_skipped == 1
