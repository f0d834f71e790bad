"""The tiny job on a local 3-node Ray, elastic 1..3 workers (one per node), while things break.

Run as a program (``python -m tests.chaos.elastic_cluster --out result.json [--events ...] [--s3] [--reference]``):
the cluster (``ray.cluster_utils.Cluster``: a head without ``neuron_cores`` and three nodes with one each), and
with ``--s3`` a moto S3 server behind an :class:`~tests.outage_proxy.OutageProxy` holding the checkpoints, live
and die with the process (stopped by PID), so a test or a benchmark runs it in a subprocess with a timeout and
reads the JSON it writes. Events happen at seeded steps, in order:

- ``kill``: a training worker process is SIGKILLed (Ray Train restarts the group, ``scaling.max_failures``);
- ``remove``: a node that holds a worker is removed (its raylet and workers killed);
- ``remove2``: two such nodes are removed at once: on a ring of three every pair holds some rank's snapshot and its
  only replica (``checkpoint.memory_replicas: 1``), so that snapshot is lost and the restart uses an older state;
- ``add``: a node is added back (the group should grow within ``scaling.resize_interval_s``);
- ``drain``: a node that holds a worker gets a preemption notice (``ray drain-node --reason
  DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds``, :data:`DRAIN_DEADLINE_S`); its recovery is measured
  from the notice (the group restarts without the node once the notice's checkpoint is committed, not at the
  deadline), then the node is removed (the cloud takes it, at the deadline at the latest);
- ``s3down``: the S3 endpoint refuses every connection for ``--outage-s`` seconds (needs ``--s3``), covering
  the next checkpoint.

Events are triggered on observed steps, each once the previous one's effect was measured; ``--steps`` is the job's
``run.max_steps`` (its schedule's horizon), and the run is asked to stop ``--tail`` steps after its last event
(``raytrn stop``'s request: :mod:`raytrn.train.stopping`), so how many steps a machine trains while a node comes
back never decides whether the events fit in the run.

The result has, per event, the seconds until the next new step was logged (recovery) or until a step ran at
the larger size (scale-up); the step the run ended at; the steps logged (each exactly once?); the worker groups and
what each resumed from (committed?); the run's goodput ledger; with ``--reference``, an uninterrupted 1-worker run
of the same job and seed on the same cluster, stopped at the same step, and whether both trained on the same rows
at every step, every epoch's rows exactly once, and how far their loss curves are apart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
#: the preemption notice's deadline (``ray drain-node --deadline-remaining-seconds``). Ray Train restarts the group at
#: the deadline whatever the workers are doing (at 10 s, with the machine at load 7 (2026-12-01), the two steps after
#: the notice took 8 s and the notice's save was cut short: one step lost); raytrn's restart comes once the notice's
#: checkpoint is committed, and nothing waits for the deadline, so a long one (a spot instance's real notice gives
#: 120 s) costs nothing and shows that the restart did not wait for it.
DRAIN_DEADLINE_S = 60
GLOBAL_BATCH = 48
#: scaling.resize_interval_s of the job: how soon a returning node is used (a check is one small call: a short one
#: costs nothing while capacity stays the same).
RESIZE_INTERVAL_S = 4


def _logged(db: Path, key: str = "loss") -> list[tuple[int, float, float]]:
    """``(step, timestamp s, value)`` of every ``key`` metric MLflow has, from its sqlite store (read-only)."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute(
                "SELECT step, timestamp, value FROM metrics WHERE key = ? ORDER BY timestamp", (key,)
            ).fetchall()
    except sqlite3.Error:
        return []
    return [(int(step), ts / 1000, float(value)) for step, ts, value in rows]


def _logged_steps(db: Path) -> list[tuple[int, float]]:
    return [(s, ts) for s, ts, _ in _logged(db)]


def _trace_groups(trace: Path) -> list[tuple[float, int, int]]:
    """``(start s, first step, data-parallel size)`` of every worker group, from the sample trace file names."""
    seen = set()
    for path in trace.glob("group-*-rank0.jsonl"):
        _, first, dp, ns, _ = path.stem.split("-")
        seen.add((int(ns) / 1e9, int(first), int(dp[2:])))
    return sorted(seen)


def _traced_steps(trace: Path, pattern: str = "group-*.jsonl") -> list[int]:
    return [
        json.loads(line)["step"]
        for path in trace.glob(pattern)
        for line in path.read_text().splitlines()
        if line.endswith("}") and '"rows"' in line
    ]


def _last_traced_step(trace: Path, group: tuple[float, int, int]) -> int:
    """The last step any rank of ``group`` started (its rank files share the first step and DP size)."""
    _, first, dp = group
    return max(_traced_steps(trace, f"group-{first:08d}-dp{dp}-*.jsonl"), default=first)


def _old_group_last_step(trace: Path, before: float) -> int | None:
    """The last step the newest group started before ``before`` started (None: no group had)."""
    old = [g for g in _trace_groups(trace) if g[0] < before]
    return _last_traced_step(trace, old[-1]) if old else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _actors(class_name: str) -> list[Any]:
    """This session's live actors of ``class_name`` (Ray's state API)."""
    import ray
    from ray.util.state import list_actors

    return list(
        list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
            timeout=30,
        )
    )


def _placement_groups() -> dict[str, int]:
    """Every placement group of this session (any state, removed ones too): its id and its number of bundles. A
    worker group Ray Train tried to start is one placement group of one bundle per worker."""
    import ray
    from ray.util.state import list_placement_groups

    groups = list_placement_groups(address=ray.get_runtime_context().gcs_address, detail=True, timeout=30)
    return {g.placement_group_id: len(g.bundles or []) for g in groups}


#: A request line in the S3 server's access log (werkzeug's: ``... "GET /bucket/key?query HTTP/1.1" 200 -``, some
#: of them in terminal colours).
_ACCESS = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01](?:\x1b\[[0-9;]*m)*"')


def _reads(requests: list[tuple[str, str]], bucket: str) -> list[str]:
    """The objects of ``bucket`` that ``requests`` read (GETs of a key, not listings), by key."""
    from urllib.parse import unquote, urlsplit

    keys = []
    for method, target in requests:
        path = urlsplit(target).path
        if method == "GET" and path.startswith(f"/{bucket}/") and len(path) > len(bucket) + 2:
            keys.append(unquote(path[len(bucket) + 2 :]))
    return keys


class _S3:
    """A moto server (by PID) behind an outage proxy, and a bucket on it; AWS_ENDPOINT_URL points at the proxy."""

    def __init__(self, work: Path) -> None:
        import boto3

        from tests.outage_proxy import OutageProxy

        port = _free_port()
        self.log_path = work / "moto.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        proxy = None
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").list_buckets()
                    break
                except Exception:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise
                    time.sleep(0.2)
            self.proxy = proxy = OutageProxy(("127.0.0.1", port))
            os.environ["AWS_ENDPOINT_URL"] = self.proxy.url
            self.bucket = f"chaos-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=self.proxy.url).create_bucket(Bucket=self.bucket)
        except BaseException:  # (no AWS credentials, say: the server must not outlive a harness that never got it)
            if proxy is not None:
                proxy.close()
            self._stop_server()
            raise

    def requests(self) -> list[tuple[str, str]]:
        """``(method, path)`` of every request the S3 server has answered so far, oldest first (its access log)."""
        text = self.log_path.read_text(errors="replace")
        return [(m.group(1), m.group(2)) for m in _ACCESS.finditer(text)]

    def stop(self) -> None:
        self.proxy.close()
        self._stop_server()

    def _stop_server(self) -> None:
        """The moto server stopped by its PID (SIGTERM, then SIGKILL after 10 s), its log closed."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


#: An uninterrupted reference saves no checkpoint on its way (its losses and rows do not depend on them; ~20 saves).
NO_CHECKPOINTS = "checkpoint.every_n_steps=1000000"
#: An uninterrupted 1-worker reference takes its global batch as one micro-batch: the same rows in the same order
#: (a micro-batch is a contiguous slice of the step's rows) and the same sums but for their order, without 6
#: accumulated micro-batches' per-call overhead (a small saving: the tiny model's step is mostly compute, 0.17 s here
#: either way; the live test's reference 47 s instead of 56).
ONE_MICRO_BATCH = f"data.micro_batch_size={GLOBAL_BATCH}"


def _job(
    args: Any,
    work: Path,
    storage_root: str,
    *,
    name: str,
    workers: tuple[int, int],
    db: Path,
    extra: tuple[str, ...] = (),
) -> Any:
    from raytrn.config import load_job

    return load_job(
        REPO / "jobs" / "tiny.yaml",
        [
            f"data.manifest={args.dataset}",
            "data.seq_len=32",
            "data.micro_batch_size=8",
            "data.grad_accum=null",
            f"data.global_batch_size={GLOBAL_BATCH}",
            "model.vocab_size=512",
            f"scaling.min_workers={workers[0]}",
            f"scaling.max_workers={workers[1]}",
            "scaling.workers_per_node=1",
            "scaling.resources_per_worker={neuron_cores: 1}",
            "scaling.max_failures=10",
            f"scaling.resize_interval_s={RESIZE_INTERVAL_S}",
            f"checkpoint.storage={storage_root}",
            "checkpoint.every_n_steps=5",
            "checkpoint.keep_last=null",  # every checkpoint stays: what each group resumed from is checked after
            f"tracking.mlflow_uri=sqlite:///{db}",
            "tracking.experiment=raytrn-elastic",
            f"tracking.run_name={name}",
            "tracking.log_model=false",
            "tracking.system_metrics=false",
            f"run.max_steps={args.steps}",
            "run.log_every=1",
            *args.overrides,
            *extra,
        ],
    )


def _train_in_thread(job: Any) -> tuple[threading.Thread, dict[str, Any]]:
    from raytrn.train.trainer import run_training

    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["summary"] = run_training(job, live_progress=False)
        except BaseException as e:
            outcome["error"] = repr(e)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread, outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--events", default="remove@12,add@+3", help="EVENT@STEP (or @+N: N steps after the last)")
    parser.add_argument("--steps", type=int, default=1000, help="run.max_steps: the schedule's horizon")
    parser.add_argument("--tail", type=int, default=5, help="steps trained after the last event, then the run stops")
    parser.add_argument("--s3", action="store_true", help="checkpoints on a moto S3 server behind an outage proxy")
    parser.add_argument("--outage-s", type=float, default=6.0)
    parser.add_argument("--reference", action="store_true", help="then an uninterrupted 1-worker run to compare")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    work = Path(args.out).resolve().parent / f"elastic-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    trace, db = work / "trace", work / "mlflow.db"
    os.environ["RAYTRN_SAMPLE_TRACE"] = str(trace)
    s3 = _S3(work) if args.s3 else None  # before the cluster: its processes inherit the endpoint
    cluster = Cluster(  # the head's dashboard agent on a port the OS picks, as its worker nodes' (Cluster's default)
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_port": _free_port(),
            "dashboard_agent_listen_port": 0,
        },
    )
    nodes = [cluster.add_node(**NODE) for _ in range(3)]
    result: dict[str, Any] = {"events": []}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes(timeout=60)
        storage_root = f"s3://{s3.bucket}/ckpt" if s3 else str(work / "ckpt")
        job = _job(args, work, storage_root, name="elastic", workers=(1, 3), db=db)
        thread, outcome = _train_in_thread(job)
        removed: list[Any] = []
        last_step = 0
        for spec in filter(None, args.events.split(",")):
            kind, at = spec.split("@")
            step = last_step + int(at[1:]) if at.startswith("+") else int(at)
            while thread.is_alive() and max((s for s, _ in _logged_steps(db)), default=0) < step:
                time.sleep(0.1)
            if not thread.is_alive():
                break
            last_step = max(s for s, _ in _logged_steps(db))
            event: dict[str, Any] = {"kind": kind, "at_step": last_step}
            driver_node = ray.get_runtime_context().get_node_id()
            result.setdefault("driver_node", driver_node)
            result.setdefault("tracking_nodes", sorted({a.node_id for a in _actors("TrackingActor")}))
            if kind in ("remove", "remove2", "drain", "kill"):
                tried_before = _placement_groups()
                # Never the driver's node (its tracking actor lives there): on a real cluster that is the head,
                # not a spot node; here every node shares the host and the driver attaches to any of them.
                workers = [a for a in _actors("RayTrainWorker") if a.node_id != driver_node]
                holding = {a.node_id for a in workers}
                victims = [n for n in reversed(nodes) if n.node_id in holding and n not in removed]
                victim = victims[0]
                if kind == "drain":
                    notice_at = time.time()
                    subprocess.run(
                        [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                         "--node-id", victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                         "--reason-message", "spot interruption (test)",
                         "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
                        check=True, capture_output=True, timeout=30,
                    )  # fmt: skip
                seen = len(s3.requests()) if s3 else 0
                t0 = notice_at if kind == "drain" else time.time()
                if kind != "drain":
                    event["old_group_last_step"] = _old_group_last_step(trace, t0)
                if kind == "kill":
                    pid = next(int(a.pid) for a in workers if a.node_id == victim.node_id)
                    os.kill(pid, signal.SIGKILL)
                elif kind != "drain":  # (the drained node goes once the group restarted without it: below)
                    for node in victims[: 2 if kind == "remove2" else 1]:
                        cluster.remove_node(node, allow_graceful=False)
                        removed.append(node)
                # Recovery: until a step is logged by a group started after the event (a step the old group
                # finished may still be on its way to MLflow).
                while thread.is_alive() and not [g for g in _trace_groups(trace) if g[0] > t0]:
                    time.sleep(0.1)
                restarted = [g for g in _trace_groups(trace) if g[0] > t0]
                start = restarted[0][0] if restarted else float("inf")
                while thread.is_alive() and not [s for s, ts in _logged_steps(db) if ts > start]:
                    time.sleep(0.1)
                new = [(s, ts) for s, ts in _logged_steps(db) if ts > start]
                event["recovery_s"] = round(new[0][1] - t0, 2) if new else None
                if kind == "drain":  # the old group trained up to its notice's checkpoint; then the node goes
                    event["old_group_last_step"] = _old_group_last_step(trace, t0)
                    event["node_gone_s"] = round(time.time() - t0, 2)
                    cluster.remove_node(victim, allow_graceful=False)
                    removed.append(victim)
                # from the event to the restarted group's start (its data feed's first trace): at most its gap
                event["group_start_s"] = round(start - t0, 2) if restarted else None
                event["resumed_from_step"] = restarted[0][1] if restarted else None
                event["restarted_dp"] = restarted[0][2] if restarted else None
                # The sizes of the worker groups Ray Train tried to start after the event: one try, sized from the
                # live cluster, not first a stale size that waits out Ray's 60 s start timeout.
                event["tried_sizes"] = [n for g, n in _placement_groups().items() if g not in tried_before]
                if s3 is not None:  # the checkpoint store's objects read from the event to the restart's first step
                    event["storage_reads"] = _reads(s3.requests()[seen:], s3.bucket)
                if restarted and event["old_group_last_step"] is not None:
                    # Trained again: the last step the old group started, minus the step the new one resumed at.
                    event["steps_lost"] = max(0, event["old_group_last_step"] - restarted[0][1])
            elif kind == "add":
                tried_before = _placement_groups()
                seen = len(s3.requests()) if s3 else 0
                t0 = time.time()
                nodes.append(cluster.add_node(**NODE))
                while thread.is_alive() and not [g for g in _trace_groups(trace) if g[0] > t0 and g[2] == 3]:
                    time.sleep(0.1)
                grown = [g for g in _trace_groups(trace) if g[0] > t0 and g[2] == 3]
                event["scale_up_s"] = round(grown[0][0] - t0, 2) if grown else None
                if s3 is not None and grown:  # ... from the node's return to the grown group's first step
                    while thread.is_alive() and not [s for s, ts in _logged_steps(db) if ts > grown[0][0]]:
                        time.sleep(0.1)
                    event["storage_reads"] = _reads(s3.requests()[seen:], s3.bucket)
                event["tried_sizes"] = [n for g, n in _placement_groups().items() if g not in tried_before]
            elif kind == "s3down":
                assert s3 is not None, "s3down needs --s3"
                # Cut S3 right after a checkpoint commits, so that the outage covers the next one (a cut at a
                # logged step raced the commits: one landed as the cut began, written before it took effect).
                known = _newest_commit(storage_root)
                deadline = time.monotonic() + 120
                while thread.is_alive() and time.monotonic() < deadline and _newest_commit(storage_root) <= known:
                    time.sleep(0.05)
                before = _newest_commit(storage_root)
                groups_before = len(_trace_groups(trace))
                s3.proxy.cut(args.outage_s)
                start, end = s3.proxy.outages[-1]
                # The first checkpoint committed after the cut, once it is there (it waited for S3 to come back).
                while thread.is_alive() and not [c for c in _commits(storage_root) if c["step"] > before]:
                    time.sleep(0.2)
                after = [c for c in _commits(storage_root) if c["step"] > before]
                event.update(
                    committed_before=before,
                    outage=[round(start, 2), round(end, 2)],
                    first_commit_after=after[0] if after else None,
                    restarts_during=len(_trace_groups(trace)) - groups_before,
                )
            result["events"].append(event)
            last_step = max(s for s, _ in _logged_steps(db))
        if thread.is_alive():  # every event measured: the run ends a few steps on, at a step every rank agrees on
            result["stop_requested_at"] = _stop(job.run_name, last_step + args.tail)
        thread.join(timeout=600)
        steps = [s for s, _ in _logged_steps(db)]
        ledger = outcome["summary"].goodput if "summary" in outcome else None
        result.update(
            stopped_at=max(steps, default=0),
            resize_interval_s=RESIZE_INTERVAL_S,
            drain_deadline_s=DRAIN_DEADLINE_S,
            ledger=(
                {
                    "seconds": ledger.seconds(),
                    "wall_s": ledger.wall_s,
                    "unaccounted": ledger.unaccounted,
                    "events": ledger.events,
                }  # fmt: skip
                if ledger is not None
                else None
            ),
            finished="summary" in outcome,
            error=outcome.get("error"),
            steps_logged=len(steps),
            distinct_steps=len(set(steps)),
            max_step=max(steps, default=0),
            groups=[{"start": round(t, 2), "first_step": s, "dp": d} for t, s, d in _trace_groups(trace)],
            resumes=_resumes(trace),
            # Each restart's {source, step, steps_retrained} as the job's board counted it (the run's summary).
            restores=[r.as_dict() for r in outcome["summary"].restores] if "summary" in outcome else [],
            summary_text=outcome["summary"].render() if "summary" in outcome else "",
            work=str(work),
        )
        if args.reference:
            result["reference"] = _compare_with_reference(args, work, trace, db)
    finally:
        Path(args.out).write_text(json.dumps(result, indent=2))
        ray.shutdown()
        cluster.shutdown()
        if s3 is not None:
            s3.stop()
    return 0


def _stop(run_name: str, at_step: int, timeout_s: float = 120) -> int:
    """Ask the run (training in this process's Ray) to end at ``at_step``, once its board answers."""
    from raytrn.errors import RaytrnError
    from raytrn.train.stopping import request_stop

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request_stop(run_name, at_step)
            return at_step
        except RaytrnError:  # not started yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _commits(storage_root: str, run_name: str = "elastic") -> list[dict[str, Any]]:
    """``{"step", "written_at"}`` of every committed checkpoint of the run, oldest first."""
    from raytrn.checkpoint import manifest
    from raytrn.checkpoint.rundir import RunDir

    run = RunDir(storage_root, run_name)
    out = []
    for step in run.dcp_steps():
        try:
            c = manifest.read_commit(run.dcp_step(step))
        except (OSError, ValueError):
            continue
        if c is not None:
            out.append({"step": c.step, "written_at": round(c.written_at, 2)})
    return out


def _newest_commit(storage_root: str, run_name: str = "elastic") -> int:
    """The newest committed checkpoint's step (-1: none), reading only the newest checkpoints' manifests (cheap
    enough to poll between two checkpoints)."""
    from raytrn.checkpoint import manifest
    from raytrn.checkpoint.rundir import RunDir

    run = RunDir(storage_root, run_name)
    for step in sorted(run.dcp_steps(), reverse=True):
        try:
            c = manifest.read_commit(run.dcp_step(step))
        except (OSError, ValueError):
            continue
        if c is not None:
            return int(c.step)
    return -1


def _resumes(trace: Path) -> list[dict[str, Any]]:
    """What every restarted group resumed from, and whether that checkpoint is committed with that step."""
    from raytrn.checkpoint import manifest
    from tests.chaos._common import read_resumes

    out = []
    for record in read_resumes(trace):
        try:
            c = manifest.read_commit(record["resumed_from"])
        except (OSError, ValueError):
            c = None
        out.append({**record, "committed": c is not None and c.step == record["step"]})
    return out


def _compare_with_reference(args: Any, work: Path, trace: Path, db: Path) -> dict[str, Any]:
    """The same job and seed on 1 worker, uninterrupted: the rows of every step, the losses."""
    from tests.chaos._common import read_trace

    ref_trace, ref_db = work / "trace-ref", work / "mlflow-ref.db"
    os.environ["RAYTRN_SAMPLE_TRACE"] = str(ref_trace)
    job = _job(args, work, str(work / "ckpt-ref"), name="reference", workers=(1, 1), db=ref_db,
               extra=(NO_CHECKPOINTS, ONE_MICRO_BATCH))  # fmt: skip
    steps = max((s for s, _ in _logged_steps(db)), default=0)  # where the chaos run stopped
    started = time.monotonic()
    thread, outcome = _train_in_thread(job)
    _stop(job.run_name, steps)  # the same schedule (run.max_steps), stopped at the same step
    thread.join(timeout=600)
    print(f"chaos harness: the reference run: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    chaos, ref = read_trace(trace), read_trace(ref_trace)
    per_epoch = args_steps_per_epoch(args)
    epochs_once = []
    for e in range(steps // per_epoch):
        rows = [row for s in range(e * per_epoch + 1, (e + 1) * per_epoch + 1) for row, _ in chaos.get(s, [])]
        epochs_once.append(len(rows) == per_epoch * GLOBAL_BATCH and len(set(rows)) == len(rows))
    losses = {s: v for s, _, v in _logged(db)}
    ref_losses = {s: v for s, _, v in _logged(ref_db)}
    common = sorted(set(losses) & set(ref_losses))
    return {
        "finished": "summary" in outcome,
        "error": outcome.get("error"),
        "steps": len(ref),
        "same_rows_every_step": chaos == ref,
        "steps_with_other_rows": [s for s in ref if chaos.get(s) != ref[s]][:10],
        "epochs_exactly_once": epochs_once,
        "final_loss": losses.get(steps),
        "reference_final_loss": ref_losses.get(steps),
        "max_loss_diff": max((abs(losses[s] - ref_losses[s]) for s in common), default=None),
    }


def args_steps_per_epoch(args: Any) -> int:
    """Steps per epoch of the job's dataset at the fixed global batch (the last partial batch is dropped)."""
    from raytrn.data.manifest import load_manifest

    return load_manifest(args.dataset).num_rows // GLOBAL_BATCH


if __name__ == "__main__":
    sys.exit(main())
