"""Whole-node elasticity on a local 3-node Ray (tests/chaos/elastic_cluster.py, in a subprocess: the cluster
lives and dies with it): the tiny job elastic 1..3 (one worker per node) loses a node, then gets it back.

- the restart after the loss runs at 2 workers at once (sized from the live cluster: no attempt at the old
  size 3 that waits out Ray's 60 s worker-group start timeout), from the newest complete checkpoint (at most
  one checkpoint interval of steps trained again);
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


def test_node_lost_and_returned(tiny_dataset, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.elastic_cluster", "--out", str(out), "--dataset", str(tiny_dataset),
         "--events", "remove@12,add@+3", "--steps", "100"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["finished"], result
    assert result["steps_logged"] == result["distinct_steps"] == result["max_step"] == 100, result
    removed, added = result["events"]
    assert removed["kind"] == "remove" and added["kind"] == "add"
    assert removed["restarted_dp"] == 2, result  # not 3 on a stale view
    assert removed["at_step"] - removed["resumed_from_step"] <= EVERY, result
    assert removed["recovery_s"] is not None and removed["recovery_s"] < 45, result
    assert added["scale_up_s"] is not None and added["scale_up_s"] < RESIZE_INTERVAL_S + 30, result
    assert [g["dp"] for g in result["groups"]][:3] == [3, 2, 3], result
