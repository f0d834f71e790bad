"""Whole-node elasticity on a local 3-node Ray (tests/chaos/elastic_cluster.py, in a subprocess: the cluster
lives and dies with it): the tiny job elastic 1..3 (one worker per node) loses a node, then gets it back.

- the restart after the loss runs at 2 workers at once (sized from the live cluster: no attempt at the old
  size 3 that waits out Ray's 60 s worker-group start timeout), from a checkpoint;
- the returning node is used: a group of 3 starts within ``scaling.resize_interval_s`` plus a restart;
- the run ends FINISHED with every step logged exactly once.

The seconds themselves are measured by ``make bench`` (bench/elastic.py), not asserted here; the bounds below
only tell "sized from the live view" from "waited out a start timeout".
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.chaos._common import REPO

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

EVERY = 5  # checkpoint.every_n_steps of the driver's job
RESIZE_INTERVAL_S = 15


def _run(dataset, tmp_path, events: str, steps: int) -> dict:
    """The driver in a subprocess (its cluster dies with it): its result, after checking the run finished with
    every step logged exactly once."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.elastic_cluster", "--out", str(out), "--dataset", str(dataset),
         "--events", events, "--steps", str(steps)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (tmp_path / "driver.log").write_text(proc.stdout + proc.stderr)  # what Ray said, for a failure
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["finished"], result
    assert result["steps_logged"] == result["distinct_steps"] == result["max_step"] == steps, result
    # The job's tracking actor lives on the driver's node, never on a worker node the job may lose.
    assert result["tracking_nodes"] == [result["driver_node"]], result
    return result


def test_node_lost_and_returned(tiny_dataset, tmp_path):
    result = _run(tiny_dataset, tmp_path, "remove@12,add@+3", 100)
    removed, added = result["events"]
    assert removed["kind"] == "remove" and added["kind"] == "add"
    assert removed["restarted_dp"] == 2, result  # not 3 on a stale view
    # From a checkpoint (Ray's latest registered one: it can lag the newest written by a few seconds of steps).
    assert removed["resumed_from_step"] % EVERY == 0 and removed["resumed_from_step"] <= removed["at_step"], result
    assert removed["recovery_s"] is not None and removed["recovery_s"] < 45, result
    assert added["scale_up_s"] is not None and added["scale_up_s"] < RESIZE_INTERVAL_S + 30, result
    assert [g["dp"] for g in result["groups"]][:3] == [3, 2, 3], result


def test_preemption_notice_checkpoints_and_loses_no_step(tiny_dataset, tmp_path):
    """``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 15`` on a node that
    holds a worker, the node removed at the deadline: the group checkpoints at once, trains no further step,
    and the restart (at 2 workers, not on the draining node) resumes at exactly that step."""
    result = _run(tiny_dataset, tmp_path, "drain@12", 40)
    [drained] = result["events"]
    assert drained["restarted_dp"] == 2, result
    assert drained["steps_lost"] == 0, result
    assert drained["resumed_from_step"] >= drained["at_step"], result  # checkpointed on the notice, not at 10
