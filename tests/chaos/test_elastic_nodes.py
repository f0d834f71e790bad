"""The chaos suite: the tiny job, elastic 1..3 workers on a local 3-node Ray (tests/chaos/elastic_cluster.py, in a
subprocess: the cluster, a moto S3 server and the proxy that cuts it live and die with it), checkpoints on S3,
through one run that is hit, at seeded steps, by: a SIGKILLed worker, a lost node, the node coming back, a spot
interruption notice on another node (``ray drain-node``), and S3 refusing every connection for 10 s across a
checkpoint. Then the same job and seed on 1 worker, uninterrupted, on the same cluster.

Asserted: the run reaches ``max_steps`` and ends FINISHED; every step is logged exactly once; every step trained
on the same rows as the uninterrupted run, and every epoch on each of its rows exactly once; the final loss
within ``LOSS_TOLERANCE`` of the uninterrupted run's; every restart resumed from a committed checkpoint; after the
lost node the group restarts at 2 at once (sized from the live cluster, no wait on Ray's 60 s start timeout); the
returning node is used; the preemption notice loses no step; the S3 outage restarts nothing and the checkpoint it
covered is committed once S3 is back.

The seconds themselves are measured by ``make bench`` (bench/elastic.py), not asserted tightly here: "sized from
the live view, not first waited out a start timeout" is asserted from the placement groups Ray Train created after
each event (one, of the restarted size), not from a wall-clock bound.
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
STEPS = 110
#: Loss, chaos run vs the uninterrupted 1-worker run, at every step: the same rows and arithmetic, but the gradients
#: summed over 1, 2 or 3 workers in other orders, and AdamW (lr 3e-3 here) amplifies those last-bit differences
#: within a few dozen steps. Measured over 110 steps: an uninterrupted 3-worker run vs the 1-worker run at most
#: 0.020 apart; the chaos run 0.027. A lost optimizer state or a wrong data position moves it by far more.
LOSS_TOLERANCE = 0.05
EVENTS = "kill@8,remove@+6,add@+3,drain@+6,s3down@+6"


def _run(dataset, tmp_path, events: str, steps: int, *extra: str) -> dict:
    """The driver in a subprocess (its cluster dies with it): its result, after checking the run finished with
    every step logged exactly once."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.elastic_cluster", "--out", str(out), "--dataset", str(dataset),
         "--events", events, "--steps", str(steps), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (tmp_path / "driver.log").write_text(proc.stdout + proc.stderr)  # what Ray said, for a failure
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["finished"], result
    assert result["steps_logged"] == result["distinct_steps"] == result["max_step"] == steps, result
    # The job's tracking actor lives on the driver's node, never on a worker node the job may lose.
    assert result["tracking_nodes"] == [result["driver_node"]], result
    return result


def test_chaos_suite(tiny_dataset, tmp_path):
    result = _run(tiny_dataset, tmp_path, EVENTS, STEPS, "--s3", "--reference")
    kill, remove, add, drain, s3down = result["events"]
    assert [e["kind"] for e in result["events"]] == ["kill", "remove", "add", "drain", "s3down"], result

    # Every restart resumed from a committed checkpoint (never a half-written one), at or before the event.
    assert result["resumes"] and all(r["committed"] for r in result["resumes"]), result["resumes"]
    for event in (kill, remove, drain):
        assert event["steps_lost"] <= EVERY, event  # at most one checkpoint interval trained again
        # One start, at the size the cluster had (a stale size would wait out Ray's 60 s start timeout first).
        assert event["tried_sizes"] == [event["restarted_dp"]], event
        # A restart, not a hang: the seconds are measured by make bench (kill → next step 38 s here, 55 s on CI).
        assert event["recovery_s"] is not None and event["recovery_s"] < 120, event
    assert kill["resumed_from_step"] % EVERY == 0 and remove["resumed_from_step"] % EVERY == 0, result
    assert kill["restarted_dp"] == 3, kill  # every node still there
    assert remove["restarted_dp"] == 2, remove  # not 3 on a stale view
    # The returning node is used at the next resize check: one restart, at 3 (41-46 s after the node joined here).
    assert add["tried_sizes"] == [3] and add["scale_up_s"] is not None, add
    assert add["scale_up_s"] < RESIZE_INTERVAL_S + 90, add
    assert drain["restarted_dp"] == 2 and drain["steps_lost"] == 0, drain  # checkpointed on the notice
    assert drain["resumed_from_step"] >= drain["at_step"], drain  # the notice's checkpoint, not the one before

    # S3 down for 10 s across a checkpoint: retried, nothing restarted, committed once S3 answered again.
    start, end = s3down["outage"]
    assert s3down["restarts_during"] == 0, s3down
    assert s3down["first_commit_after"] is not None and s3down["first_commit_after"]["written_at"] >= end, s3down
    assert s3down["first_commit_after"]["step"] == s3down["committed_before"] + EVERY, s3down  # the next one

    ref = result["reference"]
    assert ref["finished"] and ref["steps"] == STEPS, ref
    assert ref["same_rows_every_step"], ref["steps_with_other_rows"]
    assert ref["epochs_exactly_once"] and all(ref["epochs_exactly_once"]), ref
    assert abs(ref["final_loss"] - ref["reference_final_loss"]) < LOSS_TOLERANCE, ref
    assert ref["max_loss_diff"] < LOSS_TOLERANCE, ref


def test_a_lost_node_costs_at_most_one_step_with_the_memory_tier(tiny_dataset, tmp_path):
    """Issue 29's scenario: an in-memory snapshot every step, durable checkpoints on S3 every 50 steps, a node lost
    at step 30. The group goes on at 2 workers from the snapshot of step 29 or 30 (at most one step trained again,
    nothing read from the checkpoint storage: no checkpoint yet), and at 3 from a snapshot once the node is back
    (of the checkpoint storage only the newest checkpoint's manifest is read, to compare, none of its files: a
    snapshot at that checkpoint's step or newer wins); reads counted in the S3 server's log. The same rows at every
    step as the uninterrupted run, every epoch once, the losses within LOSS_TOLERANCE. 120 steps: the group grows
    back ``resize_interval_s`` and a restart after the node returns (56 s, 18 steps here; 60 steps were too few)."""
    steps = 120
    result = _run(tiny_dataset, tmp_path, "remove@30,add@+5", steps, "--reference", "--s3",
                  "--set", "checkpoint.every_n_steps=50", "--set", "checkpoint.memory_every_n_steps=1")  # fmt: skip
    remove, add = result["events"]
    assert [e["kind"] for e in result["events"]] == ["remove", "add"], result
    assert remove["restarted_dp"] == 2 and remove["tried_sizes"] == [2], remove
    assert add["tried_sizes"] == [3] and add["scale_up_s"] is not None, add
    lost, grown = result["restores"]  # the node lost, the node back: each from a snapshot, at most one step again
    assert lost["source"] == "memory" and lost["steps_retrained"] <= 1 and lost["step"] >= 29, result["restores"]
    assert grown["source"] == "memory" and grown["steps_retrained"] <= 1 and grown["step"] < steps, result["restores"]
    assert remove["storage_reads"] == [], remove  # no checkpoint yet: a listing, nothing read
    newest = grown["step"] // 50 * 50  # the checkpoint of step 50 when the group grew back after it (as here)
    read = [f"ckpt/elastic/dcp/step_{newest:08d}/commit.json"] if newest else []  # its manifest, nothing else
    # A restart at the checkpoint's own step may come before that checkpoint committed: then there is none to read.
    allowed = [read, []] if grown["step"] == newest else [read]
    assert add["storage_reads"] in allowed, (grown, add)
    assert [r["resumed_from"] for r in result["resumes"]] == [f"memory:step_{lost['step']}",
                                                              f"memory:step_{grown['step']}"], result  # fmt: skip
    assert [g["dp"] for g in result["groups"]] == [3, 2, 3], result["groups"]

    ref = result["reference"]
    assert ref["finished"] and ref["same_rows_every_step"], ref["steps_with_other_rows"]
    assert ref["epochs_exactly_once"] and all(ref["epochs_exactly_once"]), ref
    assert ref["max_loss_diff"] < LOSS_TOLERANCE, ref
