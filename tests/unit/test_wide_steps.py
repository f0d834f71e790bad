"""Steps of 10^8 and above (run.max_steps allows 10^12): their directories and pins are wider than 8 digits and
count like any other, in numeric order; steps below keep the 8-digit names existing runs have."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.checkpoint.finder import latest_checkpoint
from raytrn.checkpoint.manifest import tidy_pointers
from raytrn.checkpoint.pins import pin, pinned
from raytrn.checkpoint.rundir import RunDir
from tests.unit.test_commit import save
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit

BIG = 100_000_000


def test_names_keep_eight_digits_below_10_to_the_8_and_widen_above() -> None:
    assert RunDir.step_name(20) == "step_00000020" and RunDir.pointer_name(20) == "checkpoint_00000020"
    assert RunDir.step_name(BIG - 1) == "step_99999999"
    assert RunDir.step_name(BIG) == "step_100000000" and RunDir.pointer_name(10**12) == "checkpoint_1000000000000"


def test_a_run_past_step_10_to_the_8_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    j = job(tmp_path, "checkpoint.keep_last=2")
    run, t = RunDir.of(j), trained(j)
    for step in (BIG - 1, BIG):
        save(t, j, step)
    assert run.dcp_steps() == [BIG - 1, BIG]
    meta, location = latest_checkpoint(j)
    assert meta is not None and meta.progress.step == BIG and location == run.dcp_step(BIG)
    save(t, j, BIG + 1)  # keep_last=2: the oldest goes, numerically
    assert run.dcp_steps() == [BIG, BIG + 1]
    # Names raytrn never writes are not its checkpoints: a zero-padded 9-digit name would be a second name for step 20.
    for name in ("step_000000020", "step_20", "step_1e9"):
        (Path(run.dcp) / name).mkdir()
    assert run.dcp_steps() == [BIG, BIG + 1]


def test_pins_and_pointers_of_wide_steps(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path), "r")
    pin(run, BIG, ttl_s=600)
    pin(run, 7, ttl_s=600)
    assert pinned(run) == {7, BIG}
    for step in (BIG, BIG - 1, 10**12):
        Path(run.pointer(step)).mkdir(parents=True)
    assert run.pointer_steps() == [BIG - 1, BIG, 10**12]
    assert tidy_pointers(run) == []  # no meta.json: not raytrn's pointer to a deleted checkpoint, kept
