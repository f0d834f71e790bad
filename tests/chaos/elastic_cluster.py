"""The tiny job on a local 3-node Ray, elastic 1..3 workers (one per node), while nodes go and come back.

Run as a program (``python -m tests.chaos.elastic_cluster --out result.json [--events ...]``): the cluster
(``ray.cluster_utils.Cluster``: a head without ``neuron_cores`` and three nodes with one each) lives and dies
with the process, so a test or a benchmark runs it in a subprocess with a timeout and reads the JSON it
writes. Events happen at seeded steps, in order:

- ``remove``: a node that holds a worker is removed (its raylet and workers killed);
- ``add``: a node is added back (the group should grow within ``scaling.resize_interval_s``);
- ``drain``: a node that holds a worker gets a preemption notice (``ray drain-node --reason
  DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 15``) and is removed at the deadline.

The result has, per event, the seconds until the next new step was logged (recovery) or until a step ran
at the larger size (scale-up), the steps logged (each exactly once?), the world sizes and the final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NODE = {"num_cpus": 1, "resources": {"neuron_cores": 1}}
DRAIN_DEADLINE_S = 15


def _logged_steps(db: Path) -> list[tuple[int, float]]:
    """``(step, timestamp s)`` of every ``loss`` MLflow has, from its sqlite store (read-only, no server)."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute("SELECT step, timestamp FROM metrics WHERE key = 'loss' ORDER BY timestamp").fetchall()
    except sqlite3.Error:
        return []
    return [(int(step), ts / 1000) for step, ts in rows]


def _trace_groups(trace: Path) -> list[tuple[float, int, int]]:
    """``(start s, first step, data-parallel size)`` of every worker group, from the sample trace file names."""
    seen = set()
    for path in trace.glob("group-*-rank0.jsonl"):
        _, first, dp, ns, _ = path.stem.split("-")
        seen.add((int(ns) / 1e9, int(first), int(dp[2:])))
    return sorted(seen)


def _last_traced_step(trace: Path, group: tuple[float, int, int]) -> int:
    """The last step any rank of ``group`` started (its rank files share the first step and DP size)."""
    _, first, dp = group
    steps = [
        json.loads(line)["step"]
        for path in trace.glob(f"group-{first:08d}-dp{dp}-*.jsonl")
        for line in path.read_text().splitlines()
        if line.endswith("}")
    ]
    return max(steps, default=first)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _actor_nodes(class_name: str) -> set[str]:
    """The nodes of this session's live actors of ``class_name`` (Ray's state API)."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
        timeout=30,
    )
    return {a.node_id for a in actors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--events", default="remove@12,add@+3", help="EVENT@STEP (or @+N: N steps after the last)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from raytrn.config import load_job
    from raytrn.train.trainer import run_training

    work = Path(args.out).resolve().parent / f"elastic-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    trace, db = work / "trace", work / "mlflow.db"
    os.environ["RAYTRN_SAMPLE_TRACE"] = str(trace)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": True, "dashboard_port": _free_port()}
    )
    nodes = [cluster.add_node(**NODE) for _ in range(3)]
    result: dict[str, Any] = {"events": []}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes(timeout=60)
        job = load_job(
            REPO / "jobs" / "tiny.yaml",
            [
                f"data.manifest={args.dataset}",
                "data.seq_len=32",
                "data.micro_batch_size=8",
                "data.grad_accum=null",
                "data.global_batch_size=48",
                "model.vocab_size=512",
                "scaling.min_workers=1",
                "scaling.max_workers=3",
                "scaling.workers_per_node=1",
                "scaling.resources_per_worker={neuron_cores: 1}",
                "scaling.max_failures=10",
                "scaling.resize_interval_s=15",
                f"checkpoint.storage={work / 'ckpt'}",
                "checkpoint.every_n_steps=5",
                "checkpoint.keep_last=3",
                f"tracking.mlflow_uri=sqlite:///{db}",
                "tracking.experiment=raytrn-elastic",
                "tracking.run_name=elastic",
                "tracking.log_model=false",
                "tracking.system_metrics=false",
                f"run.max_steps={args.steps}",
                "run.log_every=1",
                *args.overrides,
            ],
        )
        outcome: dict[str, Any] = {}

        def train() -> None:
            try:
                outcome["summary"] = run_training(job, live_progress=False)
            except BaseException as e:
                outcome["error"] = repr(e)

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        removed: list[Any] = []
        last_step = 0
        for spec in args.events.split(","):
            kind, at = spec.split("@")
            step = last_step + int(at[1:]) if at.startswith("+") else int(at)
            while thread.is_alive() and max((s for s, _ in _logged_steps(db)), default=0) < step:
                time.sleep(0.1)
            if not thread.is_alive():
                break
            last_step = max(s for s, _ in _logged_steps(db))
            event: dict[str, Any] = {"kind": kind, "at_step": last_step}
            result.setdefault("driver_node", ray.get_runtime_context().get_node_id())
            result.setdefault("tracking_nodes", sorted(_actor_nodes("TrackingActor")))
            if kind in ("remove", "drain"):
                # Never the driver's node (its tracking actor lives there): on a real cluster that is the head,
                # not a spot node; here every node shares the host and the driver attaches to any of them.
                holding = _actor_nodes("RayTrainWorker") - {ray.get_runtime_context().get_node_id()}
                victim = next(n for n in reversed(nodes) if n.node_id in holding and n not in removed)
                if kind == "drain":
                    notice_at = time.time()
                    subprocess.run(
                        [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                         "--node-id", victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                         "--reason-message", "spot interruption (test)",
                         "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
                        check=True, capture_output=True, timeout=30,
                    )  # fmt: skip
                    time.sleep(max(0.0, notice_at + DRAIN_DEADLINE_S - time.time()))
                    old = [g for g in _trace_groups(trace) if g[0] < notice_at]
                    event["old_group_last_step"] = _last_traced_step(trace, old[-1]) if old else None
                t0 = time.time()
                cluster.remove_node(victim, allow_graceful=False)
                removed.append(victim)
                # Recovery: until a step is logged by a group started after the loss (a step the old group
                # finished may still be on its way to MLflow).
                while thread.is_alive() and not [g for g in _trace_groups(trace) if g[0] > t0]:
                    time.sleep(0.1)
                restarted = [g for g in _trace_groups(trace) if g[0] > t0]
                start = restarted[0][0] if restarted else float("inf")
                while thread.is_alive() and not [s for s, ts in _logged_steps(db) if ts > start]:
                    time.sleep(0.1)
                new = [(s, ts) for s, ts in _logged_steps(db) if ts > start]
                event["recovery_s"] = round(new[0][1] - t0, 2) if new else None
                event["resumed_from_step"] = restarted[0][1] if restarted else None
                event["restarted_dp"] = restarted[0][2] if restarted else None
                if kind == "drain" and restarted and event["old_group_last_step"] is not None:
                    event["steps_lost"] = event["old_group_last_step"] - restarted[0][1]
            elif kind == "add":
                t0 = time.time()
                nodes.append(cluster.add_node(**NODE))
                while thread.is_alive() and not [g for g in _trace_groups(trace) if g[0] > t0 and g[2] == 3]:
                    time.sleep(0.1)
                grown = [g for g in _trace_groups(trace) if g[0] > t0 and g[2] == 3]
                event["scale_up_s"] = round(grown[0][0] - t0, 2) if grown else None
            result["events"].append(event)
            last_step = max(s for s, _ in _logged_steps(db))
        thread.join(timeout=600)
        steps = [s for s, _ in _logged_steps(db)]
        result.update(
            finished="summary" in outcome,
            error=outcome.get("error"),
            steps_logged=len(steps),
            distinct_steps=len(set(steps)),
            max_step=max(steps, default=0),
            groups=[{"start": round(t, 2), "first_step": s, "dp": d} for t, s, d in _trace_groups(trace)],
            work=str(work),
        )
    finally:
        Path(args.out).write_text(json.dumps(result, indent=2))
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
