"""The local trn-cluster simulator end to end: a job submitted to an empty cluster scales it up, trains, is
tracked in MLflow, and the idle worker nodes are removed again.

The simulator (``raytrn.cluster.local``, Ray's fake_multinode autoscaler) is the session's shared one (the
``simulator`` fixture: the README's, with token auth and an MLflow server on its head), a second Ray next to the
session's in-process one (``ray_session``, used by ``tiny_dataset`` to pack the data): both are small, and
these tests talk to the simulator only through its dashboard URL (job submission and state APIs, with its token).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, mlflow_store
from tests.simulator import SCALE_DOWN_TIMEOUT_S, Simulator

pytestmark = pytest.mark.integration

#: submit -> SUCCEEDED, including the scale-up (~15 s) and a fresh node's imports: ~85 s here when idle; a CI run
#: at stop 26 (tests beside it on 2 cores) took over 150 s.
JOB_TIMEOUT_S = 300


def _job_overrides(tiny_dataset: Path, tmp_path: Path, experiment: str) -> list[str]:
    """jobs/tiny.yaml shrunk to one fake trn node; absolute paths: the job runs in the unpacked working dir."""
    return [
        f"data.manifest={tiny_dataset}",
        "data.seq_len=32",
        "model.vocab_size=512",
        "data.micro_batch_size=4",
        "scaling.min_workers=1",
        "scaling.max_workers=1",
        # One fake trn node (CPU 1, neuron_cores 2) holds the worker; CPU 0.5 leaves room for Ray Data.
        "scaling.resources_per_worker={neuron_cores: 1, CPU: 0.5}",
        "run.max_steps=4",
        "run.log_every=2",
        "checkpoint.every_n_steps=2",
        f"checkpoint.storage={tmp_path}/checkpoints",
        f"tracking.mlflow_uri={mlflow_store(tmp_path / 'mlflow.db')}",
        f"tracking.experiment={experiment}",
        "tracking.log_model=false",  # the Hugging Face export is tested elsewhere; here it only adds time
    ]


def test_job_scales_cluster_up_and_down(simulator: Simulator, tiny_dataset: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobStatus

    from raytrn.submit import WORKING_DIR_EXCLUDES

    url = simulator.address
    assert simulator.worker_nodes_at_start == [], "the simulator must start without worker nodes"
    simulator.wait_no_worker_nodes()  # an earlier test's nodes gone: this job's scale-up is its own

    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    sets = _job_overrides(tiny_dataset, tmp_path, "autoscaling-test")
    submission_id = f"raytrn-autoscale-{uuid.uuid4().hex[:8]}"
    # Plain `ray job submit`: the trainer finds the submission id in the job config Ray gives the driver.
    runtime_env = {"working_dir": str(REPO), "excludes": list(WORKING_DIR_EXCLUDES)}
    # The driver's shell on the head may not have this venv on PATH: name its python explicitly.
    entrypoint = [sys.executable, "-m", "raytrn.cli", "train", "jobs/tiny.yaml", "--no-progress"]
    entrypoint += [a for kv in sets for a in ("--set", kv)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | simulator.cluster.env
    ray_bin = str(Path(sys.executable).parent / "ray")

    t_submit = time.monotonic()
    proc = subprocess.run(
        [ray_bin, "job", "submit", "--address", url, "--submission-id", submission_id, "--no-wait"]
        + ["--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    client = simulator.job_client()
    max_nodes = 0
    scale_up_s = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        status = client.get_job_status(submission_id)
        n = len(simulator.worker_nodes())
        max_nodes = max(max_nodes, n)
        if n and scale_up_s is None:
            scale_up_s = time.monotonic() - t_submit
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        if time.monotonic() > deadline:
            client.stop_job(submission_id)
            pytest.fail(
                f"job {submission_id} still {status} after {JOB_TIMEOUT_S} s:\n{client.get_job_logs(submission_id)[-3000:]}"
            )
        time.sleep(1)
    t_done = time.monotonic()
    logs = client.get_job_logs(submission_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert "== raytrn: training finished ==" in logs
    # The job's log has raytrn's lines, not Ray's: those are in raytrn-<run>.log in Ray's log directory of the
    # driver's node (here the simulator's head), named once in the job's log. Neither MLflow's run and experiment
    # links (the summary gives the run's) nor Ray Data's progress-bar notice of each worker.
    match = re.search(r"raytrn: Ray's logs: (\S+/raytrn-\S+\.log) \(on the driver's node: `ray logs raytrn-", logs)
    assert match and Path(match.group(1)).parent.name == "logs", logs[-4000:]
    assert "Started training worker group" in Path(match.group(1)).read_text()
    for noise in ("View run", "View experiment", "Progress bars disabled", "Started training worker group"):
        assert noise not in logs, (noise, logs[-4000:])
    assert scale_up_s is not None and max_nodes >= 1, "the autoscaler launched no worker node"
    # The autoscaler (Ray's monitor.py on the head, found as `cluster down --local` finds it to stop it first)
    # looks every second (raytrn.cluster.local), not Ray's 5 s.
    import psutil

    from raytrn.cluster import local

    procs = local._cluster_procs(simulator.cluster.temp_dir)
    monitors = [psutil.Process(pid) for pid, _ in local.stop_stages(procs, local._cmdlines(procs))[0]]
    assert monitors and all(p.environ().get("AUTOSCALER_UPDATE_INTERVAL_S") == "1" for p in monitors), monitors
    # The worker node unpacked the job's working_dir into its own directory, not into the head's, which the
    # driver runs in (raytrn.cluster.simprovider: a fake node shares the head's session directory).
    session = Path(simulator.cluster.session_dir)
    assert list(session.glob("runtime_resources_*/working_dir_files/_ray_pkg_*")), sorted(os.listdir(session))

    # Tracked by rank 0 into the sqlite store named by the job, tagged with the submission id.
    client_ml = MlflowClient(mlflow_uri)
    exp = client_ml.get_experiment_by_name("autoscaling-test")
    runs = client_ml.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED", logs[-6000:]
    assert run.data.params["run.max_steps"] == "4"
    assert run.data.params["scaling.max_workers"] == "1"
    assert run.data.tags["ray.job_submission_id"] == submission_id
    assert list((tmp_path / "checkpoints").glob("*/checkpoint_00000004"))

    # Idle worker nodes go away after idle_timeout_minutes.
    simulator.wait_no_worker_nodes(SCALE_DOWN_TIMEOUT_S)
    scale_down_s = time.monotonic() - t_done

    timings = {
        "scale_up_s": round(scale_up_s, 1),
        "job_s": round(t_done - t_submit, 1),
        "scale_down_s": round(scale_down_s, 1),
        "max_worker_nodes": max_nodes,
    }
    print(f"autoscaling timings: {timings}")
    (tmp_path / "autoscaling-timings.json").write_text(json.dumps(timings, indent=2))


def test_sweep_submitted_to_the_simulator_scales_it_up_and_down(
    simulator: Simulator, tiny_dataset: Path, tmp_path: Path
) -> None:
    """``raytrn sweep --address``: the sweep's driver runs as one Ray job on the simulator, its two trials (2 at a
    time: what cluster/local-sim.yaml can grow to) scale the empty cluster up, both are tracked under one parent run,
    best.yaml is written beside the sweep's state. (That idle nodes go away is the job test's: not waited for again.)"""
    from mlflow.tracking import MlflowClient

    url = simulator.address
    simulator.wait_no_worker_nodes()  # before the sweep
    name = f"sim-sweep-{uuid.uuid4().hex[:6]}"
    sets = [a for kv in _job_overrides(tiny_dataset, tmp_path, "sweep-sim") for a in ("--set", kv)]
    args = [sys.executable, "-m", "raytrn.cli", "sweep", "jobs/tiny.yaml", *sets, "--grid", "optim.lr=1e-3,3e-3",
            "--cluster", "cluster/local-sim.yaml", "--address", url, "--name", name]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | simulator.cluster.env
    log_path = tmp_path / "sweep.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        max_nodes = 0
        try:
            deadline = time.monotonic() + 2 * JOB_TIMEOUT_S
            while driver.poll() is None and time.monotonic() < deadline:
                max_nodes = max(max_nodes, len(simulator.worker_nodes()))
                time.sleep(1)
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait(timeout=30)
    out = log_path.read_text()
    assert driver.returncode == 0, out[-6000:]
    assert f"(sweep {name})" in out and "2 trial(s) of jobs/tiny.yaml, 2 at a time" in out, out[-6000:]
    assert max_nodes >= 1, "the sweep's trials launched no worker node"

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("sweep-sim")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("raytrn.kind") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and parent.info.run_name == name
    assert sorted(float(c.data.params["optim.lr"]) for c in children) == [1e-3, 3e-3]
    assert all(c.info.status == "FINISHED" and c.data.metrics["loss"] > 0 for c in children)
    assert all(c.data.tags["ray.job_submission_id"].startswith(f"raytrn-{name}-") for c in children)
    best = tmp_path / "checkpoints" / "sweeps" / name / "best.yaml"
    assert "The best trial of sweep" in best.read_text()
