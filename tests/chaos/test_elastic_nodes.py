"""The chaos suite: the tiny job, elastic 1..3 workers on a local 3-node Ray (tests/chaos/elastic_cluster.py, in a
subprocess: the cluster, a moto S3 server and the proxy that cuts it live and die with it), with both checkpoint
tiers as a job gets them by default on several nodes: durable checkpoints on S3 (every ``EVERY`` steps) and an
in-memory snapshot every step, replicated to the next node. One run is hit, at seeded steps, by: a SIGKILLed
worker, a lost node, the node coming back, a spot interruption notice on another node (``ray drain-node``), S3
refusing every connection for 6 s across a checkpoint, another node back, and two nodes lost at once (a
snapshot's only copies among them). Then the same job and seed on 1 worker, uninterrupted, on the same cluster.

Events come at observed steps, each after the previous one's effect was measured, and the run is asked to stop
(``raytrn stop``) a few steps after the last: how many steps a machine trains meanwhile does not matter.

Asserted: the run ends FINISHED at the step asked; every step is logged exactly once; every step trained
on the same rows as the uninterrupted run, and every epoch on each of its rows exactly once; the losses within
``LOSS_TOLERANCE`` of the uninterrupted run's at every step. The killed worker, the lost node and each return
restore from the newest snapshot in memory (or the checkpoint, when no complete snapshot is newer): at most one step
trained again, and from a snapshot, of the checkpoint storage only
manifests read (the newest checkpoint's, to compare), none of its files (counted in the S3 server's log). After
the lost node the group restarts at 2 at once (sized from the live cluster, no wait on Ray's 60 s start timeout);
the returning node is used; the preemption notice loses no step, and the group restarts without the node once
its checkpoint is committed, not at the deadline; the S3 outage restarts nothing and the
checkpoint it covered is committed once S3 is back; with a snapshot's only copies lost, the group restores from the
newest committed checkpoint at 1 worker, warning which snapshot it passed over and why. The goodput ledger adds up to
the run's wall time within 2%, and books each event's time to its own cause.

The seconds themselves are measured by ``make bench`` (bench/elastic.py, bench/memory_tier.py), not asserted
tightly here: "sized from the live view, not first waited out a start timeout" is asserted from the placement
groups Ray Train created after each event (one, of the restarted size), not from a wall-clock bound.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrn.checkpoint.rundir import LEASE_FILE
from tests.chaos._common import REPO
from tests.chaos.elastic_cluster import DRAIN_DEADLINE_S, RESIZE_INTERVAL_S

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

EVERY = 5  # checkpoint.every_n_steps of the driver's job
#: run.max_steps of the run: its schedule's horizon. The run does not train that far: the harness asks it to stop a
#: few steps after its last event (raytrn stop), however many steps the machine trained while nodes came back.
STEPS = 300
#: Loss, chaos run vs the uninterrupted 1-worker run, at every step: the same rows and arithmetic, but the gradients
#: summed over 1, 2 or 3 workers in other orders, and AdamW amplifies those last-bit differences: at the tiny job's lr
#: 3e-3 to 0.020-0.078 within ~100 steps (stop 62's rehearsal failed a 0.05 bound at 0.078), at ``LR`` 5e-4 to at
#: most 9.5e-7 (the loss still falls from 6.2 to 4.1 in 95 steps). A lost optimizer state or a wrong data position
#: moves it by far more: at this lr, on the fixture's rows, one process, AdamW's state dropped at step 20 put the loss
#: 0.196 off within 60 steps, one batch skipped 0.091.
LOSS_TOLERANCE = 1e-3
LR = 5e-4
EVENTS = "kill@8,remove@+6,add@+3,drain@+6,s3down@+6,add@+3,remove2@+5"


def _run(dataset, tmp_path, events: str, steps: int, *extra: str) -> tuple[dict, str]:
    """The driver in a subprocess (its cluster dies with it): its result and its log (what Ray forwarded from the
    workers), after checking the run finished with every step logged exactly once."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.elastic_cluster", "--out", str(out), "--dataset", str(dataset),
         "--events", events, "--steps", str(steps), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    (tmp_path / "driver.log").write_text(log)  # what Ray said, for a failure
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["finished"], result
    # Stopped where the harness asked after its last event (or the next step, if the run was past it when rank 0 read
    # the request), every step logged exactly once.
    assert result["stopped_at"] >= result.get("stop_requested_at", steps), result
    assert result["steps_logged"] == result["distinct_steps"] == result["max_step"] == result["stopped_at"], result
    # The job's tracking actor lives on the driver's node, never on a worker node the job may lose.
    assert result["tracking_nodes"] == [result["driver_node"]], result
    return result, log


def _no_checkpoint_file_read(event: dict) -> bool:
    """Of the checkpoint storage, the restart read manifests at most (``commit.json``, to compare), no shard (the
    driver's reads of its lease, every few seconds, are not the restart's)."""
    return all(key.endswith(("/commit.json", f"/{LEASE_FILE}")) for key in event["storage_reads"])


@pytest.mark.timeout(1300)  # 605 s here: seven events and the uninterrupted run
def test_chaos_suite(tiny_dataset, tmp_path):
    result, log = _run(tiny_dataset, tmp_path, EVENTS, STEPS, "--s3", "--reference", "--set", f"optim.lr={LR}")
    assert [e["kind"] for e in result["events"]] == ["kill", "remove", "add", "drain", "s3down", "add", "remove2"], (
        result
    )
    kill, remove, add, drain, s3down, add2, remove2 = result["events"]
    restores = result["restores"]  # the board's record of every restart, in order: one per event but the outage
    assert len(restores) == 6, restores
    r_kill, r_remove, r_add, r_drain, r_add2, r_remove2 = restores

    for event in (kill, remove, drain, remove2):
        # One start, at the size the cluster had (a stale size would wait out Ray's 60 s start timeout first).
        assert event["tried_sizes"] == [event["restarted_dp"]], event
        # A restart, not a hang: the seconds are measured by make bench (kill → next step 38 s here, 55 s on CI).
        assert event["recovery_s"] is not None and event["recovery_s"] < 120, event
    assert kill["restarted_dp"] == 3, kill  # every node still there
    assert remove["restarted_dp"] == 2, remove  # not 3 on a stale view
    # The returning node is used at the next resize check: one restart, at 3 (41-46 s after the node joined here).
    for event in (add, add2):
        assert event["tried_sizes"] == [3] and event["scale_up_s"] is not None, event
        assert event["scale_up_s"] < RESIZE_INTERVAL_S + 90, event

    # A worker killed, a node lost, a node back: from the newest snapshot in memory, at most one step again, no
    # checkpoint file read. Or from the committed checkpoint when it is as new as any complete snapshot: a node lost
    # while the snapshot of a checkpoint's step was being made (seen here: the lost node's group was at step 20,
    # snapshot 20 never completed, checkpoint 20 was committed; snapshot 19 is older).
    for event, restore in ((kill, r_kill), (remove, r_remove), (add, r_add), (add2, r_add2)):
        assert restore["steps_retrained"] <= 1, (event, restores)
        if restore["source"] == "memory":
            assert _no_checkpoint_file_read(event), event
        else:
            assert restore["source"] == "storage" and restore["step"] % EVERY == 0, (event, restores)
            # Each passed-over snapshot as the board records it (raytrn.checkpoint.messages.PassedOver.record).
            newer = [p for p in restore.get("passed_over", []) if p["step"] is not None and p["step"] > restore["step"]]
            assert all(p["kind"] == "no_manifest" for p in newer), (event, restore)
    # The old group's last step started, less the step restored: that one step, and the step it had begun (whose
    # snapshot was still being written when the worker died: measured here, 10 started, restored at 8).
    assert kill["steps_lost"] <= 2 and remove["steps_lost"] <= 2, (kill, remove)

    # The notice: checkpointed on it (and snapshotted), no step lost, from the notice's state, not an older one; the
    # group restarted without the node once that checkpoint was committed, its next step long before the notice's
    # deadline (Ray Train waits for it: the node was still there, draining, until the step came)
    assert drain["restarted_dp"] == 2 and drain["steps_lost"] == 0, drain
    assert drain["recovery_s"] <= drain["node_gone_s"] < DRAIN_DEADLINE_S, drain
    assert drain["resumed_from_step"] >= drain["at_step"] and r_drain["steps_retrained"] == 0, (drain, r_drain)

    # S3 down for 6 s across a checkpoint: retried, nothing restarted, committed once S3 answered again.
    start, end = s3down["outage"]
    assert s3down["restarts_during"] == 0, s3down
    assert s3down["first_commit_after"] is not None and s3down["first_commit_after"]["written_at"] >= end, s3down
    assert s3down["first_commit_after"]["step"] == s3down["committed_before"] + EVERY, s3down  # the next one

    # Two nodes lost at once: some rank's snapshot and its one replica were on them, so the newest snapshot is
    # passed over, saying why, for the newest committed checkpoint (at most one checkpoint interval again).
    assert remove2["restarted_dp"] == 1, remove2
    assert r_remove2["source"] == "storage" and r_remove2["steps_retrained"] <= EVERY, (remove2, r_remove2)
    assert remove2["steps_lost"] <= EVERY and remove2["resumed_from_step"] % EVERY == 0, remove2
    # Why, from the restart's record (the log's warning can be cut by another process's lines, seen in CI): a complete
    # snapshot's rank files, or rank 0's manifest, had their only copies on the lost nodes (which: where rank 0 was).
    passed_over = [
        p["step"]
        for p in r_remove2.get("passed_over", [])
        if (p["kind"] == "ranks_missing" and p["world_size"] == 3 and (p["lost_nodes"] or p["gone_nodes"]))
        or (p["kind"] == "no_manifest" and p["complete"])
    ]
    # (at least as new as the checkpoint restored: the lost one may have been of a checkpoint's step; or none newer
    # than it was sealed: the nodes went while the snapshot of that checkpoint's own step was being made, as the
    # single loss above once saw, and the checkpoint is the newest state there is)
    unsealed = {p["step"] for p in r_remove2.get("passed_over", []) if p["kind"] == "no_manifest" and not p["complete"]}
    assert any(step >= r_remove2["step"] for step in passed_over) or r_remove2["step"] in unsealed, r_remove2
    assert "passed over snapshot" in result["summary_text"], result["summary_text"]
    # Every restart resumed from what the board says: a snapshot by its step, or a committed checkpoint.
    resumes = result["resumes"]
    assert len(resumes) == len(restores), (resumes, restores)
    for resume, restore in zip(resumes, restores, strict=True):
        if restore["source"] == "memory":
            assert resume["resumed_from"] == f"memory:step_{restore['step']}", (resume, restore)
        else:
            assert resume["committed"] and resume["step"] == restore["step"], (resume, restore)
    assert [g["dp"] for g in result["groups"]] == [3, 3, 2, 3, 2, 3, 1], result["groups"]

    # The goodput ledger: every second of the run booked to one cause (within 2% of its wall time), each group's
    # end to why it ended, and each event's time in its own cause.
    ledger = result["ledger"]
    seconds, wall = ledger["seconds"], ledger["wall_s"]
    assert abs(ledger["unaccounted"]) <= 0.02 * wall and all(v >= 0 for v in seconds.values()), ledger
    assert ledger["events"] == ["restart", "restart", "resize", "preemption", "resize", "restart"], ledger
    restored = sum(r["restore_s"] for r in restores)
    starts = sum(e["group_start_s"] for e in (kill, remove, remove2))
    assert seconds["restart"] >= starts - restored - 1.0, (ledger, starts, restored)  # event -> restarted group
    assert 0 < seconds["resize"] <= add["scale_up_s"] + add2["scale_up_s"] + 10, (ledger, add, add2)
    # the notice's restart (its group's last step to the next group's first, the notice's checkpoint in the
    # checkpoint time) in its own cause: no wait for the node's deadline in it; the save that S3's outage (6 s) held
    # up: in the checkpoint time
    assert 0 < seconds["preemption"] <= drain["recovery_s"] and seconds["checkpoint"] >= 3, (ledger, drain)
    # steps trained again are booked when a restart retrained any (none at all is possible: each event's restore can
    # come from its group's last step, seen in CI: two nodes lost right after their group committed a checkpoint)
    assert (seconds["retrained"] > 0) == any(r["steps_retrained"] > 0 for r in restores), (ledger, restores)
    assert seconds["startup"] > 0 and seconds["productive"] > 0, ledger

    ref = result["reference"]
    assert ref["finished"] and ref["steps"] == result["stopped_at"], ref
    assert ref["same_rows_every_step"], ref["steps_with_other_rows"]
    assert ref["epochs_exactly_once"] and all(ref["epochs_exactly_once"]), ref
    assert abs(ref["final_loss"] - ref["reference_final_loss"]) < LOSS_TOLERANCE, ref
    assert ref["max_loss_diff"] < LOSS_TOLERANCE, ref
