"""The tiny job with ``scaling.recovery: live`` on a local 3-node Ray (one worker per node, hsdp replicas of one
worker), a node removed mid-run and then one added back; then the same job uninterrupted on 1 worker.

Run as a program (``python -m tests.chaos.live_cluster --out result.json --dataset DIR``): the cluster
(``ray.cluster_utils.Cluster``: a head without ``neuron_cores``, three nodes with one each) lives and dies with the
process, so the test runs it in a subprocess with a timeout and reads the JSON it writes. Events come at observed
steps: the removal of ``--lose`` nodes at once once step 5 is logged, as many new nodes once a step at the fewer
replicas is logged (and Ray marked the lost nodes dead), a worker process
SIGKILLed (its node stays) once a step at 3 replicas is logged, with ``--s3`` the checkpoints' S3 endpoint down
for ``--outage-s`` from three steps before a checkpoint is due, a SIGTERM to every worker process once a step at 3 replicas is
logged again (every replica has a notice: nothing live is left, they checkpoint the step they
stop at and wait) and, once that checkpoint is committed, every worker process SIGKILLed (their nodes going: the
group restarts from that checkpoint), a preemption
notice (``ray drain-node``) to a node holding a worker once the restarted group trains (its replica leaves at a
step boundary, the other two train on), that node removed once a step at 2 replicas is logged (its deadline: no
capacity returns), once Ray marked it dead one of the two replicas left frozen (SIGSTOP) until Ray Train gives it up
and its replacement joins, and the stop request (``raytrn stop``) a few steps on.

The result: the training workers' pids before the removal, after the return and at the end; the removal's step and
the seconds from it to the first step logged at 2 replicas; from the new node to the first step at 3; the same two
for the kill; for the notice, the seconds to the first step logged at 2 replicas and the pids before and after;
every logged step (each
exactly once?), the losses and validation losses (every 10 steps) of both runs and the replicas of the live one by step; each worker's sample trace
(``RAYTRN_SAMPLE_TRACE``: the rows it read per step) and the reference's; the run's summary (restores, final step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raytrn.data.order import PACE_ENV
from tests.chaos._common import tiny_chaos_job, train_in_thread, wait_until
from tests.chaos.elastic_cluster import (
    _S3,
    NO_CHECKPOINTS,
    _actors,
    _commits,
    _free_port,
    _logged,
    _newest_commit,
    _traced_steps,
)

NODE = {"num_cpus": 1, "resources": {"neuron_cores": 1}}
#: The GCS's health checks of the nodes (``--fast-node-death``): every second, dead after 4 failed in a row (Ray's
#: defaults: every 3 s, 5 in a row). A check fails at once on a removed node (its raylet refuses) and only after its
#: own 10 s timeout (kept) on a busy one, so a loaded machine does not make a live node dead.
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}
#: Ray Train's health-check bound for this test's frozen replica (the variable wins over scaling.peer_timeout_s).
FROZEN_AFTER_S = 10
GLOBAL_BATCH = 48  # 6 micro-batches of 8 rows: 2 a replica at 3, 3 at 2
#: RAYTRN_PACE_S of a ``--paced`` live run (the live test's, and the bench's paced row): a replica's micro-batch at
#: most every 0.15 s (2 a step at 3 replicas, 6 at 1). Flat out, the tiny model's 3 replicas kept the 2 cores busy and
#: trained ~380 steps in the test, most of them at 1 replica while the events took their seconds, each trained again
#: by the reference.
PACE_S = 0.15
LIVE = (
    "scaling.min_workers=3", "scaling.max_workers=3", "scaling.workers_per_node=1",
    "scaling.resources_per_worker={neuron_cores: 1}", "scaling.recovery=live", "scaling.max_failures=10",
    "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=1",
)  # fmt: skip
COMMON = (
    "data.grad_accum=null", f"data.global_batch_size={GLOBAL_BATCH}",
    "tracking.log_model=false", "tracking.system_metrics=false", "optim.decay_steps=2000",
    "optim.lr=5e-4",  # AdamW amplifies the replicas' other summation order less than at the tiny job's 3e-3 or 1e-3
)  # fmt: skip


def _traces(directory: Path) -> dict[str, dict[int, list[int]]]:
    """``{file name: {step: rows read, in order}}`` of every worker's sample trace."""
    out: dict[str, dict[int, list[int]]] = {}
    for path in sorted(directory.glob("group-*.jsonl")):
        steps: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            if line.endswith("}") and "rows" in (record := json.loads(line)):
                steps.setdefault(record["step"], []).extend(record["rows"])
        out[path.name] = steps
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--tail", type=int, default=5, help="steps trained after the node's return, then it stops")
    parser.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run (the bench's use)")
    parser.add_argument("--lose", type=int, choices=(1, 2), default=1, help="nodes removed at once, then added back")
    parser.add_argument("--loss-only", action="store_true", help="stop after the return (the bench's use)")
    parser.add_argument("--s3", action="store_true", help="checkpoints on a moto S3 server behind an outage proxy, "
                        "cut for --outage-s seconds across a checkpoint after the kill")  # fmt: skip
    parser.add_argument("--outage-s", type=float, default=6.0)
    parser.add_argument("--every", type=int, default=20, help="checkpoint.every_n_steps of the live run")
    parser.add_argument("--paced", action="store_true", help=f"RAYTRN_PACE_S={PACE_S} for the live run (the test's: "
                        "a micro-batch at most every that many seconds, CPU left for what a recovery starts, fewer "
                        "steps for the reference to train again; the bench's headline row trains flat out)")  # fmt: skip
    parser.add_argument("--fast-node-death", action="store_true", help="Ray's GCS marks a removed node dead after "
                        "~4 s, not 13-40 s (the test's: its waits for that are not what it tests; the bench keeps "
                        "Ray's defaults)")  # fmt: skip
    args = parser.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from raytrn.train.stopping import request_stop

    if not args.loss_only:
        # the frozen replica (the last event) is given up after 10 s, not the job's scaling.peer_timeout_s (30 s: what
        # raytrn sets when the variable is not; tests/unit/test_live_config.py), so that its wait and the steps the
        # other trains meanwhile (the reference trains each again) cost the suite a third as much
        os.environ.setdefault("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", str(FROZEN_AFTER_S))
    work = Path(args.out).resolve().parent / f"live-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    db, ref_db = work / "mlflow.db", work / "reference.db"
    os.environ["RAYTRN_SAMPLE_TRACE"] = str(work / "trace")
    s3 = _S3(work) if args.s3 else None  # before the cluster: its processes inherit the endpoint
    ckpt = f"s3://{s3.bucket}/ckpt" if s3 else str(work / "ckpt")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_port": _free_port(),
            "dashboard_agent_listen_port": 0,  # the OS picks (its worker nodes' too: Cluster's default for them)
            **({"_system_config": FAST_NODE_DEATH} if args.fast_node_death else {}),
        },  # fmt: skip
    )
    nodes = [cluster.add_node(**NODE) for _ in range(3)]
    result: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes(timeout=60)
        # both runs evaluate one global batch of the dataset every 10 steps (every replica the whole of it)
        evaluated = (f"data.validation={args.dataset}", "run.eval_every=10", "run.eval_batches=1")
        job = tiny_chaos_job(Path(args.dataset), ckpt, mlflow_uri=f"sqlite:///{db}", experiment="live",
                             name="live", extra=(*LIVE, *COMMON, *evaluated, "run.max_steps=2000",
                                                 f"checkpoint.every_n_steps={args.every}"))  # fmt: skip
        result["every"], result["pace_s"] = args.every, PACE_S if args.paced else 0.0
        # (set for each run, forwarded to its workers: nodes added meanwhile inherit the harness's variables)
        os.environ[PACE_ENV] = str(result["pace_s"])
        slots = _SlotWatch()  # (from before the run's placement groups: every one seen from its start)
        thread, outcome = train_in_thread(job)

        def at(replicas: float, since: float) -> list[tuple[int, float]]:
            return [(s, ts) for s, ts, v in _logged(db, "replicas") if v == replicas and ts > since]

        wait_until(lambda: max((s for s, _, _ in _logged(db)), default=0) >= 5 or not thread.is_alive(), 240, "step 5")
        workers = _actors("RayTrainWorker")
        result["pids_before"] = sorted(int(a.pid) for a in workers)
        holding = {a.node_id for a in workers}
        victims = [n for n in nodes if n.node_id in holding][: args.lose]
        lost = {v.node_id for v in victims}
        survivors = 3.0 - len(victims)
        result["victim_pids"] = [int(a.pid) for a in workers if a.node_id in lost]
        result["removed_at_step"] = max(s for s, _, _ in _logged(db))
        removed = time.time()
        for victim in victims:  # at once
            cluster.remove_node(victim, allow_graceful=False)
        wait_until(lambda: at(survivors, removed) or not thread.is_alive(), 120, f"a step at {survivors:.0f} replicas")
        result["lost_to_next_step_s"] = round(at(survivors, removed)[0][1] - removed, 2)
        # A node that returns is a new one, after the lost one is gone for good: Ray marks it dead after its health
        # checks fail; until then Ray Train's first replacement waits on the lost node's slot (and fails).
        wait_until(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] in lost), 120,
                   "Ray marking the removed nodes dead")  # fmt: skip
        result["node_dead_after_s"] = round(time.time() - removed, 2)
        added = time.time()
        for _ in victims:
            cluster.add_node(**NODE)  # (returns once Ray has the node alive: its raylet registered)
        alive = time.time()
        wait_until(lambda: at(3.0, added) or not thread.is_alive(), 240, "a step at 3 replicas again")
        result["back_to_full_size_s"] = round(at(3.0, added)[0][1] - added, 2)
        # what of that is Ray's start of the node's own processes (a cloud node's boot is not in it either), and what
        # is the replacement's: its slot placed, its worker process started and imported, its admission with the state
        result["node_start_s"] = round(alive - added, 2)
        result["alive_to_full_size_s"] = round(at(3.0, added)[0][1] - alive, 2)
        result["pids_after"] = sorted(int(a.pid) for a in _actors("RayTrainWorker"))
        if not args.loss_only:
            _later_events(result, db, ckpt, work / "trace", s3, args.outage_s, args.every, thread, cluster, at)
        stop_at = max(s for s, _, _ in _logged(db)) + args.tail
        result["slots_at_stop"] = sorted(slots.states().values())  # (the drained node's slot still waiting)
        request_stop("live", stop_at)
        thread.join(240)
        result["slots_rescheduling_s"], result["gcs_cpu_s"] = slots.stop()
        result["stopped_at"] = stop_at
        summary = outcome.get("summary")
        result["error"] = repr(outcome["error"]) if "error" in outcome else None
        result["summary"] = None
        if summary is not None:
            ledger = summary.goodput
            result["summary"] = {"final_step": summary.final_step, "restores": [r.as_dict() for r in summary.restores],
                                 "ledger": {**asdict(ledger), "unaccounted": ledger.unaccounted}}  # fmt: skip
        result["steps"] = [s for s, _, _ in _logged(db)]
        result["loss"] = {s: v for s, _, v in _logged(db)}
        result["replicas"] = {s: v for s, _, v in _logged(db, "replicas")}  # (re-formations' values too)
        result["trained_at"] = {s: v for s, _, v in _logged(db, "world_size")}  # the replicas each step trained at
        result["val_loss"] = {s: v for s, _, v in _logged(db, "val_loss")}
        result["val_loss_steps"] = sorted(s for s, _, _ in _logged(db, "val_loss"))
        # the memory tier (on: 3 nodes): the live rank 0's snapshots at the checkpoint steps, the bytes a store holds
        result["memory_checkpoint_bytes"] = {s: v for s, _, v in _logged(db, "memory_checkpoint_bytes")}
        result["traces"] = _traces(work / "trace")
        # the tests' dataset: every epoch read by the workers themselves, so no Ray Dataset ran and no stats actor
        result["data_stats_actors"] = len(_actors("_StatsActor"))
        if args.no_reference:
            return 0
        # the same job and seed, uninterrupted, on 1 worker (the same global batch, as one micro-batch: the same rows
        # in the same order, the same sums but for their order; elastic_cluster.ONE_MICRO_BATCH)
        os.environ["RAYTRN_SAMPLE_TRACE"] = str(work / "trace-reference")
        final = max(result["steps"])
        reference = tiny_chaos_job(Path(args.dataset), work / "ckpt-ref", mlflow_uri=f"sqlite:///{ref_db}",
                                   experiment="reference", name="reference",
                                   extra=(*COMMON, *evaluated, "scaling.resources_per_worker={neuron_cores: 1}",
                                          f"run.max_steps={final}", NO_CHECKPOINTS,
                                          f"data.micro_batch_size={GLOBAL_BATCH}"))  # fmt: skip
        os.environ[PACE_ENV] = "0"  # flat out
        started = time.monotonic()
        ref_thread, ref_outcome = train_in_thread(reference)
        ref_thread.join(240)
        print(f"chaos harness: the reference run: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        result["reference_error"] = repr(ref_outcome["error"]) if "error" in ref_outcome else None
        result["reference_loss"] = {s: v for s, _, v in _logged(ref_db)}
        result["reference_val_loss"] = {s: v for s, _, v in _logged(ref_db, "val_loss")}
        result["reference_trace"] = _traces(work / "trace-reference")
    finally:
        Path(args.out).write_text(json.dumps(result))
        if "frozen_pid" in result and _running(result["frozen_pid"]):
            os.kill(result["frozen_pid"], signal.SIGKILL)  # a stopped process would outlive its raylet
        try:
            ray.shutdown()
            cluster.shutdown()
        finally:  # (a cluster that fails to shut down must not leave the S3 server running: stop 62's did)
            if s3 is not None:
                s3.stop()
    return 0


def _later_events(
    result: dict[str, Any], db: Path, ckpt: str, trace: Path, s3: _S3 | None, outage_s: float, every: int,
    thread: Any, cluster: Any, at: Any,
) -> None:  # fmt: skip
    """After the loss and the return: a worker killed, (``s3``) the storage down across a checkpoint, every worker
    noticed then killed, a node drained then removed with no capacity returning (the module docstring); their
    measures into ``result``."""
    import ray

    # a worker process killed (its node stays): Ray starts its replacement at once, on that node
    killed_pid = result["pids_after"][0]
    result["killed_pid"] = killed_pid
    killed = time.time()
    os.kill(killed_pid, signal.SIGKILL)
    degraded, full = _down_then_up(at, thread, killed, 2, 3, "kill")
    result["kill_to_next_step_s"] = round(degraded - killed, 2)
    result["kill_to_full_size_s"] = round(full - killed, 2)
    result["pids_end"] = sorted(int(a.pid) for a in _actors("RayTrainWorker"))
    if s3 is not None:
        # S3 refuses every connection, cut three steps before a checkpoint is due (seen in the workers' sample traces:
        # MLflow's metrics lag by seconds; not right after a commit: the commit's retention pruning then takes the
        # outage, not a save) so that the outage covers that save: every replica's save waits for it (retried),
        # nothing is re-formed or restarted, the checkpoint commits after it
        known = _newest_commit(ckpt, "live")  # (then a fresh commit: the workers a few steps past it)
        wait_until(lambda: _newest_commit(ckpt, "live") > known or not thread.is_alive(), 120, "a checkpoint")
        base = _newest_commit(ckpt, "live")
        wait_until(
            lambda: max(_traced_steps(trace), default=0) >= base + every - 3 or not thread.is_alive(),
            120,
            "3 steps before a save",
        )
        committed = _newest_commit(ckpt, "live")
        s3.proxy.cut(outage_s)
        start, end = s3.proxy.outages[-1]
        wait_until(lambda: any(c["step"] > committed for c in _commits(ckpt, "live")) or not thread.is_alive(), 240,
                   "the checkpoint after the outage")  # fmt: skip
        first = min((c for c in _commits(ckpt, "live") if c["step"] > committed), key=lambda c: c["step"])
        stepped = {s: ts for s, ts, _ in _logged(db)}
        result["outage"] = {"committed_before": committed, "start": start, "end": end, "first_commit_after": first,
                            "its_step_logged_at": stepped.get(first["step"]),
                            "pids_after": sorted(int(a.pid) for a in _actors("RayTrainWorker")),
                            "replicas": sorted({v for _, ts, v in _logged(db, "replicas") if ts >= start})}  # fmt: skip
    # every replica gets a notice (a SIGTERM each, as a scheduler's stop): nobody is left to train on, so they
    # checkpoint the step they stop at and wait; then their processes are killed (their nodes going): the group
    # restarts from that checkpoint, as under scaling.recovery: restart, and trains no step again
    known = _newest_commit(ckpt, "live")
    for pid in result["pids_end"]:
        os.kill(pid, signal.SIGTERM)

    def stopped_at_a_checkpoint() -> bool:  # committed past the last one, and no step trained after it
        newest = _newest_commit(ckpt, "live")
        if newest <= known or newest < max(s for s, _, _ in _logged(db)):
            return False
        time.sleep(2.0)
        return newest == max(s for s, _, _ in _logged(db))

    wait_until(lambda: stopped_at_a_checkpoint() or not thread.is_alive(), 120, "the notices' checkpoint")
    result["notice_checkpoint"] = _newest_commit(ckpt, "live")
    everyone = time.time()
    for pid in result["pids_end"]:
        os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        pids = {int(a.pid) for a in _actors("RayTrainWorker")}
        return len(pids) == 3 and not pids & set(result["pids_end"])

    wait_until(lambda: restarted() or not thread.is_alive(), 240, "a restarted group after every replica died")
    regrouped = time.time()
    wait_until(lambda: any(ts > regrouped for _, ts, _ in _logged(db)) or not thread.is_alive(), 240,
               "a step of the restarted group")  # fmt: skip
    result["all_lost_to_next_step_s"] = round(min(ts for _, ts, _ in _logged(db) if ts > regrouped) - everyone, 2)
    # a preemption notice to one replica's node (its deadline after the run's end): that replica trains one more
    # step and leaves at its boundary, the other two re-form without it and train on; nothing restarts
    workers = _actors("RayTrainWorker")
    result["pids_before_notice"] = sorted(int(a.pid) for a in workers)
    noticed = time.time()
    subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address, "--node-id",
         workers[0].node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
         "spot interruption (test)", "--deadline-remaining-seconds", "600"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    wait_until(lambda: at(2.0, noticed) or not thread.is_alive(), 120, "a step at 2 replicas after the notice")
    result["notice_to_next_step_s"] = round(at(2.0, noticed)[0][1] - noticed, 2)
    result["pids_after_notice"] = sorted(int(a.pid) for a in _actors("RayTrainWorker"))
    # its deadline: the drained node goes (the replica that left with it): a preemption, not one of
    # scaling.max_failures; no capacity comes back, so its replacement waits while the others train on, and the
    # run still ends when they do (the controller keeps polling: before stop 58 it waited in the replacement)
    drained = next(n for n in cluster.list_all_nodes() if n.node_id == workers[0].node_id)
    cluster.remove_node(drained, allow_graceful=False)
    wait_until(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == drained.node_id), 120,
               "Ray marking the drained node dead")  # fmt: skip
    time.sleep(3)  # a poll or two: the failure decided, the replacement waiting for capacity
    # one of the two replicas left frozen whole (SIGSTOP: a hung host): the other trains on alone once its heartbeat
    # stands still (inside a collective: once the kill below closes its connections, or at scaling.peer_timeout_s);
    # Ray Train gives the frozen worker up after its health checks' bound (FROZEN_AFTER_S here, not Ray's 600 s),
    # raytrn kills its actor, and a replacement on its node (capacity there) joins live: 2 replicas again, the
    # survivor's process the same
    before = sorted(int(a.pid) for a in _actors("RayTrainWorker"))
    frozen_pid = before[0]
    result["frozen_pid"], result["pids_before_freeze"] = frozen_pid, before
    frozen = time.time()
    os.kill(frozen_pid, signal.SIGSTOP)
    alone, full = _down_then_up(at, thread, frozen, 1, 2, "freeze")
    result["freeze_to_next_step_s"] = round(alone - frozen, 2)
    result["freeze_to_full_size_s"] = round(full - frozen, 2)
    result["frozen_gone"] = not _running(frozen_pid)
    result["pids_after_freeze"] = sorted(int(a.pid) for a in _actors("RayTrainWorker"))


class _SlotWatch:
    """Every placement group's state, every 0.5 s from a thread: the longest time one stayed ``RESCHEDULING`` (a
    lost slot Ray 2.60's GCS retries with no backoff, a whole core; raytrn asks for such a slot anew, and a group
    asked for anew waits ``PENDING``: raytrn.compat.replica_slots), and the GCS's CPU-seconds meanwhile."""

    def __init__(self) -> None:
        import threading

        import psutil

        self._gcs = next(p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server")
        self._cpu = sum(self._gcs.cpu_times()[:2])
        self._since: dict[str, float] = {}  # group id: when first seen rescheduling (this time)
        self.longest = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def states() -> dict[str, str]:
        from ray.util.placement_group import placement_group_table

        return {g: t["state"] for g, t in placement_group_table().items() if t["state"] != "REMOVED"}

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            now, states = time.monotonic(), self.states()
            for group, state in states.items():
                if state == "RESCHEDULING":
                    self.longest = max(self.longest, now - self._since.setdefault(group, now))
                else:
                    self._since.pop(group, None)

    def stop(self) -> tuple[float, float]:
        """``(the longest rescheduling in seconds, the GCS's CPU-seconds since the start)``."""
        self._done.set()
        self._thread.join(10)
        return round(self.longest, 2), round(sum(self._gcs.cpu_times()[:2]) - self._cpu, 1)


def _down_then_up(at: Any, thread: Any, since: float, down: int, up: int, event: str) -> tuple[float, float]:
    """When the first step at ``down`` replicas after ``since`` (the ``event``'s time) was logged, then the first at
    ``up`` replicas after that one (each wait bounded; the run's end stops it)."""
    wait_until(lambda: at(float(down), since) or not thread.is_alive(), 120, f"a step at {down} after the {event}")
    degraded = at(float(down), since)[0][1]
    wait_until(lambda: at(float(up), degraded) or not thread.is_alive(), 240, f"a step at {up} after the {event}")
    return degraded, at(float(up), degraded)[0][1]


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
