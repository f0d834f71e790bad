"""Live recovery under Ray (issue 48): ``scaling.recovery: live``, 3 one-slot nodes, hsdp replicas of one worker
(tests/chaos/live_cluster.py, in a subprocess: its cluster lives and dies with it). Two nodes holding workers are
removed at once mid-run, then two nodes are added back, then a worker process is killed (its node stays), then the
checkpoints' S3 endpoint (moto behind an outage proxy) refuses every connection for 6 s across a save, then every
worker process gets a SIGTERM (every replica has a notice: they checkpoint that step and wait) and is then killed
(the fallback: a restart from that checkpoint), then one node gets a preemption notice
(``ray drain-node``) and goes at its deadline, no capacity returning, then one of the two replicas left is frozen
(SIGSTOP) until Ray Train gives it up and raytrn kills it; the run is asked to stop a few steps later;
then the same job uninterrupted on 1 worker. (The bench loses one node: bench/elastic.run_live.)

Asserted: the survivor's process is the one that started (pids compared: none restarted), the run trains on at
1 replica right after the loss and at 3 after the return (the returning worker took its state from a live replica:
the run's only restore is the fallback's, from storage), the goodput ledger books the recoveries as restart time,
every step is logged exactly once, every worker read the same rows at every step as
the uninterrupted run (one lost while it read a step's micro-batches: the first of them), and the losses (and the validation losses every 10 steps, each logged once) match it: within 1e-5 up to the loss, within 1e-4 for the 30 steps after it,
within 1e-3 after that (summation order: gradients summed over 3, 2, 3 replicas instead of accumulated in one
process, which AdamW amplifies over the steps). The seconds are asserted loosely (a shared 2-core machine); the
bench measures them. The live run is paced (``RAYTRN_PACE_S``: the harness's ``PACE_S``) and checkpoints every 10 steps.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.chaos._common import REPO
from tests.chaos.live_cluster import FROZEN_AFTER_S

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

#: Losses long after the loss: AdamW amplifies last-bit differences of the summation order over the steps (at the tiny
#: job's lr 3e-3 to 0.02-0.04 in ~100 steps, tests/chaos/test_elastic_nodes.py; at 1e-3, 1.3e-5 over 93 steps and
#: 3.9e-3 over 405 (stop 62's first rehearsal: the test failed); at this test's 5e-4, under 1e-6 over 230 steps
#: measured). A lost optimizer state or a wrong row moves the loss by far more.
LOSS_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def live_run(tiny_dataset, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("live")
    out = tmp / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.live_cluster", "--out", str(out), "--dataset", str(tiny_dataset),
         "--lose", "2", "--s3", "--fast-node-death", "--paced",
         "--every", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (tmp / "driver.log").write_text(proc.stdout + proc.stderr)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result.get("error") is None and result.get("reference_error") is None, (result, proc.stderr[-3000:])
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.mark.timeout(1000)
def test_survivors_train_on_and_the_returning_node_joins_live(live_run: dict) -> None:
    r = live_run
    # two nodes lost at once: the one survivor trained on alone (its pid the same), both replacements joined it
    survivors = sorted(set(r["pids_before"]) - set(r["victim_pids"]))
    assert len(survivors) == 1 and set(survivors) <= set(r["pids_after"]), r
    assert len(r["pids_after"]) == 3, r
    # a killed worker process: the other two train on (their pids stay), its replacement joins on the same node
    others = sorted(set(r["pids_after"]) - {r["killed_pid"]})
    assert set(others) <= set(r["pids_end"]) and r["killed_pid"] not in r["pids_end"] and len(r["pids_end"]) == 3, r
    # (a kill inside a checkpoint's save: the survivors skip that checkpoint; the one whose collective failed closes
    # its connections as it re-forms, so none waits out scaling.peer_timeout_s, 30 s, as one did at stop 56; one
    # killed after the save's collectives, rank 0 committing it, is found by its heartbeat in the agreement: stop 59's
    # CI waited 32 s for its report)
    assert r["kill_to_next_step_s"] < 25 and r["kill_to_full_size_s"] < 120, r
    # the checkpoints' S3 down for 6 s from three steps before a save: every replica's save waited for it
    # (retried); no replica counted lost, nothing re-formed or restarted, that checkpoint committed once S3 was back
    outage = r["outage"]
    assert outage["first_commit_after"]["step"] == outage["committed_before"] + r["every"], outage  # the next one
    assert outage["its_step_logged_at"] < outage["end"] <= outage["first_commit_after"]["written_at"], outage
    # (a replica counted lost in the save would have made the others skip that checkpoint: the next one is further)
    assert outage["pids_after"] == r["pids_end"] and set(outage["replicas"]) <= {3.0}, outage
    # the next step at fewer replicas after the loss (goal 5 s; bench/elastic.py measures it), 3 after the return.
    # A removed node's workers can live on until Ray marks the node dead (38.6 s after the removal once here; they
    # trained 5 more steps, then waited for data they will not get): orphaned by their raylet, they stop beating and
    # the survivors drop them after the heartbeat's silence. Bounded by the peer timeout all the same: once at stop 57
    # (1 run of 6) the survivors still waited 34 s for them (Ray marked the node dead after 36 s; cause not found).
    assert r["lost_to_next_step_s"] < 30 + 25, r
    assert r["back_to_full_size_s"] < 120, r
    # the returning and the replacing workers took the state from a live replica: the run's one restore is the
    # fallback's, after every replica had a notice (checkpointed at the step they stopped at) and died: from that
    # checkpoint, no step trained again
    (restore,) = r["summary"]["restores"]
    assert restore["source"] == "storage" and restore["step"] == r["notice_checkpoint"], (restore, r)
    assert restore["steps_retrained"] == 0, restore
    assert "every replica has a preemption notice" in r["log"]
    # (said as such: every replica failed, Ray restarts the whole group; the others do not "train on")
    assert re.search(r"failed: its process died[^\n]*; restarting the group from the newest state", r["log"])
    assert r["all_lost_to_next_step_s"] < 120, r
    # a preemption notice: its replica trained one more step and left at its boundary (its process waits for the
    # run's end: nothing restarted), the other two re-formed without it at once (no heartbeat's silence, no step
    # aborted) and trained on; the drain is seen by the driver's poll (1 s)
    assert r["pids_after_notice"] == r["pids_before_notice"], r
    assert r["notice_to_next_step_s"] < 15, r
    assert "left the live group after step" in r["log"] and "left on a preemption notice (3 -> 2 replicas" in r["log"]
    # the drain's deadline (600 s: `ray drain-node --deadline-remaining-seconds`) read from Ray by the driver's watch
    # and said by the replica; with one, no warning that the slot holds the node until the run ends
    left = re.search(r"left the live group after step \d+ \(its node is draining, deadline in (\d+) s\)", r["log"])
    assert left and 450 <= int(left.group(1)) <= 600, r["log"][-3000:]
    assert "draining without a deadline" not in r["log"]
    # the drained node then went (its deadline) and no capacity returned: a preemption, not a failure; its replacement
    # waited for capacity while the other two trained on and ended the run at the stop request
    assert "(its node preempted after its notice); the other replicas train on" in r["log"], r["log"][-3000:]
    assert "(a preemption: not counted against scaling.max_failures)" in r["log"]
    assert r["summary"]["final_step"] >= r["stopped_at"], r["summary"]  # (a stop request past the step: at the step)
    # that replacement's slot, lost with the node, was asked for anew: it waited PENDING, not RESCHEDULING (which Ray
    # 2.60's GCS retries with no backoff: a whole core of the head until the run's end; docs/elasticity.md); no lost
    # slot stayed RESCHEDULING for more than a few of the controller's polls
    assert "PENDING" in r["slots_at_stop"] and "RESCHEDULING" not in r["slots_at_stop"], r["slots_at_stop"]
    assert r["slots_rescheduling_s"] < 10, (r["slots_rescheduling_s"], r["gcs_cpu_s"])
    # a replica frozen whole (SIGSTOP): the other trained on alone (its heartbeat stood still: 2 s; inside a
    # collective, once the kill closed its connections); Ray Train gave the frozen worker up after its health
    # checks' bound (10 s here; scaling.peer_timeout_s by default: Ray's 600 s would have kept the slot and the run's
    # end waiting), raytrn killed it, and its replacement joined live: 2 replicas again, the survivor the same
    assert r["freeze_to_next_step_s"] < FROZEN_AFTER_S + 25, r
    assert r["freeze_to_full_size_s"] < FROZEN_AFTER_S + 90 and r["frozen_gone"], r
    survivor = set(r["pids_before_freeze"]) - {r["frozen_pid"]}
    assert survivor <= set(r["pids_after_freeze"]) and r["frozen_pid"] not in r["pids_after_freeze"], r
    assert len(r["pids_after_freeze"]) == 2, r
    assert "stopped answering Ray's health checks" in r["log"], r["log"][-3000:]
    assert "joined the live group" in r["log"]
    # the memory tier ran (3 nodes): the live rank 0, whichever replica it was, snapshotted at the checkpoint steps
    # alone; rank 0's log steps carry what a store holds (the fallback above resumed from the notices' checkpoint,
    # newer than any snapshot: a group's final step takes none)
    held = r["memory_checkpoint_bytes"]
    assert held and min(held.values()) > 0 and max(int(s) for s in held) > r["notice_checkpoint"], held
    # each event costs one of scaling.max_failures (5 at stop 56: a replacement placed on a lost node Ray had not
    # marked dead yet failed once more), one more if the two lost nodes are seen by two polls; the notice none (its
    # replica left, its process ended with the run); the freeze one
    failures = [int(n) for n in re.findall(r"failure (\d+) of scaling\.max_failures", r["log"])]
    assert 4 <= max(failures) <= 5, failures
    # the goodput ledger: live recoveries inside the groups and the fallback's gap are restart time, all accounted
    ledger = r["summary"]["ledger"]
    assert ledger["events"] == ["restart"] and ledger["restart"] > 0 and ledger["retrained"] == 0, ledger
    assert abs(ledger["unaccounted"]) < 0.02 * ledger["wall_s"], ledger
    # every step logged once, to the step the stop request named
    steps = r["steps"]
    assert steps == list(range(1, max(steps) + 1)) and r["summary"]["final_step"] == max(steps), steps
    # the replicas each step trained at (a re-formation's own metric at a step can be a later one: a replacement
    # admitted at the end of the step its predecessor was lost in)
    trained_at = {int(s): v for s, v in r["trained_at"].items()}
    assert {trained_at[s] for s in steps} == {1.0, 2.0, 3.0}, trained_at
    # a small dataset's epochs are read by the workers themselves: the driver pinned no Ray Data stats actor (a process
    # of its own, detached: it would outlive the run on the head), and nothing else made one
    assert r["data_stats_actors"] == 0, r["data_stats_actors"]


def test_every_worker_read_the_uninterrupted_runs_rows_at_every_step(live_run: dict) -> None:
    reference = {}
    for steps in live_run["reference_trace"].values():
        reference.update({int(s): rows for s, rows in steps.items()})
    read: set[int] = set()
    for name, steps in live_run["traces"].items():
        last = max(steps, key=int)  # a worker lost while it read its step's micro-batches read a part of it, in order
        for step, rows in steps.items():
            if step == last and len(rows) < len(reference[int(step)]):
                assert rows == reference[int(step)][: len(rows)], (name, step)
                continue
            assert rows == reference[int(step)], (name, step)
            read.add(int(step))
    assert read >= set(live_run["steps"])  # every step read by the replicas that trained it (one after two losses)


@pytest.mark.parametrize("key", ["loss", "val_loss"])
def test_losses_match_the_uninterrupted_run(live_run: dict, key: str) -> None:
    """The training loss at every step and the validation loss every 10 steps (evaluated by every replica on its own
    copy of the model, logged by the live rank 0) on the uninterrupted run's."""
    live = {int(s): v for s, v in live_run[key].items()}
    reference = {int(s): v for s, v in live_run[f"reference_{key}"].items()}
    # every step (every 10th for val_loss): a rank 0 lost before logging its step leaves it to the next rank 0
    assert sorted(reference) == sorted(live) and live, (sorted(live), sorted(reference))
    assert key == "loss" or live_run["val_loss_steps"] == sorted(live)  # each once
    lost = live_run["removed_at_step"]
    for step in sorted(live):
        tolerance = 1e-5 if step <= lost else 1e-4 if step <= lost + 30 else LOSS_TOLERANCE
        assert live[step] == pytest.approx(reference[step], abs=tolerance), (step, live[step], reference[step])
