"""Each worker-group restart records where it restored from, the load's seconds and the steps trained again
(issue 29 item 4): on the job's progress board, in the end summary (and in MLflow: the tracking actor, tested on a
real Ray in tests/chaos/test_kill_worker.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raytrn.checkpoint.messages import Passed, PassedOver
from raytrn.tracking.board import ProgressBoard, RestoreRecord, Summary

pytestmark = pytest.mark.unit


def test_a_restart_records_its_source_step_and_the_steps_trained_again() -> None:
    board = ProgressBoard()
    assert board.restored("storage", 40, 1.5) is None  # the job's first group (resuming an earlier job): no restart
    board.group_started(40, 2)
    board.update(41, 100, {"loss": 1.0})
    board.reached(47)  # between log steps
    board.reached(45)  # late: the highest stays
    record = board.restored("storage", 45, 0.25)
    assert record == RestoreRecord(source="storage", step=45, restore_s=0.25, steps_retrained=2)
    board.group_started(45, 2)
    board.update(50, 100, {"loss": 0.9})
    assert board.restored(None, 0, 0.0) == RestoreRecord(source="none", step=0, restore_s=0.0, steps_retrained=50)
    assert board.snapshot().restores == (record, board.restores[1])
    # A restart that passed over newer in-memory snapshots keeps why (the run's summary names them).
    why = PassedOver(52, Passed.RANKS_MISSING, lost_nodes=("n2",), missing=(1,), world_size=2)
    board.group_started(0, 1)
    passed = board.restored("storage", 50, 0.1, [why])
    assert passed is not None and passed.passed_over == (why,)
    assert passed.as_dict()["passed_over"] == [why.record()] and "passed_over" not in record.as_dict()  # JSON


def test_the_summary_names_each_restart() -> None:
    base = dict(run_name="r", start_step=0, final_step=80, tokens=1, tokens_per_s=1.0, first_loss=1.0,
                final_loss=0.5, checkpoint=None, mlflow_run_id=None, mlflow_ui=None)  # fmt: skip
    assert "restarts" not in Summary(**base).render()
    stored = RestoreRecord(source="storage", step=20, restore_s=0.42, steps_retrained=8)
    text = Summary(**base, restores=[stored]).render()
    assert "restarts    1: from storage step 20 (loaded in 0.4 s, 8 steps trained again)" in text
    fresh = RestoreRecord(source="none", step=0, restore_s=0.0, steps_retrained=3)
    text = Summary(**base, restores=[stored, fresh]).render()
    assert "2: from storage step 20 (loaded in 0.4 s, 8 steps trained again); from step 0, no checkpoint yet (" in text
    skipped = (PassedOver(23, Passed.RANKS_MISSING, missing=(0,), world_size=3), PassedOver(22, Passed.NO_MANIFEST))
    passed = replace(stored, passed_over=skipped)
    text = Summary(**base, restores=[passed]).render()
    assert (
        "from storage step 20 (loaded in 0.4 s, 8 steps trained again, passed over snapshot 23, snapshot 22 (see the log))"
        in text
    )
