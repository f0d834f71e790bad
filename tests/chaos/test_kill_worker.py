"""Kills on a real local Ray: a training worker SIGKILLed mid-run, and the driver stopped with SIGTERM.

- Worker killed, ``FailureConfig`` retries: the worker group restarts from the last checkpoint, and the MLflow
  run's history has every step exactly once, strictly increasing; the run ends FINISHED.
- Worker killed with no retries left: the job fails and its run ends FAILED.
- Driver stopped with SIGTERM (what ``ray job stop`` sends): the run ends KILLED.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrn.config import load_job
from tests.chaos._common import REPO, summary_of, tiny_chaos_overrides, train_in_thread, wait_until
from tests.conftest import mlflow_store

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def _overrides(tiny_dataset: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    return tiny_chaos_overrides(
        tiny_dataset, tmp / "ckpt", mlflow_uri=mlflow_store(tmp / "mlflow.db"), experiment="raytrn-chaos", name=name,
        extra=("checkpoint.every_n_steps=20", "tracking.log_model=false", *extra),
    )  # fmt: skip


def _run_id(client: MlflowClient, name: str) -> str | None:
    exp = client.get_experiment_by_name("raytrn-chaos")
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return runs[0].info.run_id if runs else None


def _wait_for_step(client: MlflowClient, name: str, step: int, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run_id = _run_id(client, name)
        if run_id and any(m.step >= step for m in client.get_metric_history(run_id, "loss")):
            return run_id
        time.sleep(0.2)
    raise TimeoutError(f"step {step} of {name} not logged after {timeout_s} s")


def _kill_train_worker(sig: int = signal.SIGKILL) -> int:
    pid = _train_worker_pid()
    os.kill(pid, sig)
    return pid


def _train_worker_pid() -> int:
    (pid,) = _train_worker_pids(1)
    return pid


def _train_worker_pids(count: int) -> list[int]:
    """The pids of the ``count`` live training workers (Ray's state API)."""
    import ray
    from ray.util.state import list_actors

    workers = list_actors(
        address=ray.get_runtime_context().gcs_address,  # this session's Ray, whatever else runs here
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
        timeout=30,
    )
    assert len(workers) == count, workers
    return [int(w.pid) for w in workers]


#: run.max_steps of the killed-worker run: its schedule's horizon. It ends earlier, where the test asks it to stop
#: once the restarted group trains (raytrn stop): how many steps a machine trains meanwhile does not matter.
HORIZON = 2000


def _stop_at_next_checkpoint(client: MlflowClient, name: str, every: int) -> int:
    """Ask the run to stop at the first checkpoint step after the step it logged last (at least the third, so that
    keep_last has deleted one): that step (it stops there, or at the step after the one it trained when its rank 0
    read the request)."""
    from raytrn.train.stopping import request_stop

    run_id = _run_id(client, name)
    assert run_id is not None
    logged = max(m.step for m in client.get_metric_history(run_id, "loss"))
    at = max(3 * every, (logged // every + 1) * every)
    request_stop(name, at)
    return at


def _stop_once_restarted(client: MlflowClient, name: str) -> None:
    """Once the restarted group trains (its start-up metric is logged at its first step), ask the run to end at its
    next step, or at the step after the last one logged if that is later: a group restored from an older state
    (under load the newest snapshot can be a few steps behind what was logged) stops past what is in MLflow."""
    from raytrn.train.stopping import request_stop

    run_id = _run_id(client, name)
    wait_until(lambda: client.get_metric_history(run_id, "restart_to_first_step_s"), 240, "the restarted group")
    logged = max(m.step for m in client.get_metric_history(run_id, "loss"))
    request_stop(name, logged + 1)


def test_killed_worker_resumes_and_history_has_each_step_once(ray_session, tiny_dataset, tmp_path):
    name = f"kill-{uuid.uuid4().hex[:8]}"
    job = load_job(REPO / "jobs" / "tiny.yaml", _overrides(tiny_dataset, tmp_path, name, f"run.max_steps={HORIZON}",
                                                           "scaling.max_failures=2", "tracking.usd_per_hour=36"))  # fmt: skip
    client = MlflowClient(job.tracking.mlflow_uri)
    thread, result = train_in_thread(job)
    try:
        # Past a checkpoint (20, or a later one on a fast machine: keep_last 2 may have deleted 20 already; on
        # disk, then a few steps more for Ray to register it): the steps after the restored checkpoint were logged
        # once already and are trained again.
        _wait_for_step(client, name, 28)
        wait_until(lambda: list((tmp_path / "ckpt" / name).glob("checkpoint_0*")), 60, "a checkpoint on disk")
        time.sleep(2)
        _kill_train_worker()
        # The restarted group trains (its start-up metric is logged at its first step): then the run ends at the
        # next checkpoint step.
        run_id = _run_id(client, name)
        wait_until(lambda: client.get_metric_history(run_id, "restart_to_first_step_s"), 240, "the restarted group")
        asked = _stop_at_next_checkpoint(client, name, 20)
    finally:
        thread.join(timeout=480)
    summary = summary_of(thread, result)
    steps = summary.final_step
    assert steps >= asked
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "tokens_per_s", "world_size"):
        logged = [m.step for m in client.get_metric_history(summary.mlflow_run_id, key)]
        assert logged == list(range(1, steps + 1)), (key, logged)
    # Two worker group starts: at step 0, and again from a checkpoint (20, or a later one if reached).
    first, second = run.data.tags["world_size_history"].split(",")
    assert first == "0:1" and second in {f"{s}:1" for s in range(20, steps, 20)}, run.data.tags["world_size_history"]
    restart_step = int(second.split(":")[0]) + 1
    # Start-up: once from the driver's start, then the restarted group's own start-up, not from the driver's.
    starts = client.get_metric_history(summary.mlflow_run_id, "time_to_first_step_s")
    assert [m.step for m in starts] == [1]
    [restart] = client.get_metric_history(summary.mlflow_run_id, "restart_to_first_step_s")
    assert restart.step == restart_step and 0 < restart.value < (restart.timestamp / 1000 - run.info.start_time / 1000)
    # Where the restart restored from (issue 29 item 4), in MLflow and the summary: the checkpoint's step, the load's
    # seconds, and the steps trained again: those the killed group had trained past it (every step is logged, once,
    # by the group that trained it first: the killed group's last is the one before the restart's gap in time).
    restored = restart_step - 1
    assert run.data.tags["raytrn.restore_source"] == f"storage:step_{restored}"
    # The killed group's last logged step: every step the restarted group trains again was logged by the killed one
    # (never twice), so the killed group's last is the one before the restart's gap in time (the largest between two
    # steps' losses). (Not "logged before restart_to_first_step_s": killed right at its checkpoint, the restarted
    # group's first loss can come before that metric, and the step looked trained twice.)
    loss = sorted(client.get_metric_history(summary.mlflow_run_id, "loss"), key=lambda m: m.step)
    gap = max(range(1, len(loss)), key=lambda i: loss[i].timestamp - loss[i - 1].timestamp)
    killed_last = loss[gap - 1].step
    assert killed_last >= 28
    [retrained] = client.get_metric_history(summary.mlflow_run_id, "steps_retrained")
    assert (retrained.step, retrained.value) == (restored, killed_last - restored)
    [restore_s] = client.get_metric_history(summary.mlflow_run_id, "restore_s")
    assert restore_s.step == restored and 0 < restore_s.value < 60
    assert [(r.source, r.step, r.steps_retrained) for r in summary.restores] == [
        ("storage", restored, killed_last - restored)
    ]
    # The cost keeps running through the restart (it never falls back toward 0).
    cost = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "cost_usd"), key=lambda m: m.step)]
    assert len(cost) == steps and all(b >= a for a, b in zip(cost, cost[1:], strict=False)), cost
    # Checkpoint tags match the disk: keep_last 2 left two; the tags of the others say they were deleted.
    on_disk = {p.name for p in (tmp_path / "ckpt" / name).glob("checkpoint_0*")}
    previous = steps - (steps % 20 or 20)  # the periodic checkpoint before the last step's
    assert on_disk == {f"checkpoint_{previous:08d}", f"checkpoint_{steps:08d}"}
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("checkpoint.step_")}
    live = {k.replace("checkpoint.step_", "checkpoint_") for k, v in tags.items() if not v.startswith("deleted")}
    assert live == on_disk, tags
    older = {k: v for k, v in tags.items() if int(k[-8:]) < previous}
    assert older and all(v.startswith("deleted by checkpoint.keep_last=2") for v in older.values()), tags


#: ``scaling.recovery: live`` with one replica (issue 48 item 5: losing the last replica restarts from the tier).
LIVE_ALONE = ("scaling.recovery=live", "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=1",
              "scaling.min_workers=1", "scaling.max_workers=1")  # fmt: skip


@pytest.mark.parametrize("recovery", ["restart", "live"])
def test_killed_worker_resumes_from_its_in_memory_snapshot_losing_at_most_one_step(
    ray_session, tiny_dataset, tmp_path, recovery
):
    """The memory tier (issue 29) on one node: a snapshot every step, no durable checkpoint before the end. The
    killed worker's group restarts from the newest snapshot in its node's store (which outlives the worker): at
    most one step trained again, nothing read from the checkpoint storage (it holds nothing yet), every step
    logged once. Under ``scaling.recovery: live`` (one replica, whose rank 0 snapshots alone) the same: the last
    replica lost, the group restarts from the tier as the restart path's does."""
    name = f"mem-{uuid.uuid4().hex[:8]}"
    live = LIVE_ALONE if recovery == "live" else ()
    job = load_job(REPO / "jobs" / "tiny.yaml", _overrides(tiny_dataset, tmp_path, name, f"run.max_steps={HORIZON}",
                                                           "scaling.max_failures=2", f"checkpoint.every_n_steps={HORIZON}",
                                                           "checkpoint.memory_every_n_steps=1", *live))  # fmt: skip
    client = MlflowClient(job.tracking.mlflow_uri)
    thread, result = train_in_thread(job)
    try:
        _wait_for_step(client, name, 2)
        pid = _train_worker_pid()
        _wait_for_step(client, name, 12)
        assert not list((tmp_path / "ckpt" / name / "dcp").glob("step_*")), "no durable checkpoint before the end"
        os.kill(pid, signal.SIGKILL)
        _stop_once_restarted(client, name)
    finally:
        thread.join(timeout=480)
    summary = summary_of(thread, result)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(summary.mlflow_run_id, "loss")]
    assert steps == list(range(1, summary.final_step + 1)), steps
    [(source, restored, retrained)] = [(r.source, r.step, r.steps_retrained) for r in summary.restores]
    # Step 12 is logged before its snapshot is out: the kill may come between (restored 11, one step again).
    assert source == "memory" and restored >= 11 and retrained <= 1, summary.restores
    assert run.data.tags["raytrn.restore_source"] == f"memory:step_{restored}"
    first, second = run.data.tags["world_size_history"].split(",")
    assert first == "0:1" and second == f"{restored}:1", run.data.tags["world_size_history"]
    # The node's store holds one complete snapshot after each seal: its bytes, at each log step.
    held = [m.value for m in client.get_metric_history(summary.mlflow_run_id, "memory_checkpoint_bytes")]
    per_node = [k for k in run.data.metrics if k.startswith("memory_checkpoint_bytes/node-")]
    assert len(per_node) == 1 and run.data.metrics[per_node[0]] == held[-1], run.data.metrics
    # (log_every 1: a value at nearly every step; the first seal of each group comes a step or two after its start)
    assert len(held) >= summary.final_step - 6 and 0 < min(held) and max(held) <= 2 * min(held), held


def test_a_hung_worker_is_detected_its_stacks_kept_and_the_group_restarted(ray_session, tiny_dataset, tmp_path):
    """Issue 28 item 3: one of 2 workers frozen (SIGSTOP: a process that never returns, as a stuck kernel or a lost
    device would leave it) holds the other in the gradient all-reduce. Within run.hang_timeout_s the other dumps its
    threads' stacks into <run>/hangs/ and the MLflow run and exits; Ray Train restarts the group and the run finishes
    with every step logged once. No save is due before the run's end: a rank held inside a save (or an evaluation)
    waits 10x run.hang_timeout_s before it gives up, which made this test take 29 s or 103 s by where the freeze
    landed (restores after a failure: the killed-worker tests)."""
    name = f"hang-{uuid.uuid4().hex[:8]}"
    job = load_job(REPO / "jobs" / "tiny.yaml", _overrides(
        tiny_dataset, tmp_path, name, f"run.max_steps={HORIZON}",
        "scaling.min_workers=2", "scaling.max_workers=2", "scaling.max_failures=2", "run.hang_timeout_s=8",
        f"checkpoint.every_n_steps={HORIZON}",
    ))  # fmt: skip
    client = MlflowClient(job.tracking.mlflow_uri)
    thread, result = train_in_thread(job)
    frozen = None
    try:
        _wait_for_step(client, name, 14)
        frozen = max(_train_worker_pids(2))
        os.kill(frozen, signal.SIGSTOP)
        _stop_once_restarted(client, name)  # the hang detected, the group restarted: then the run ends
        thread.join(timeout=300)
    finally:
        if frozen is not None:  # Ray kills it with the group; if not, it must not stay stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        thread.join(timeout=120)
    summary = summary_of(thread, result)
    assert 14 < summary.final_step < HORIZON
    steps = [m.step for m in client.get_metric_history(summary.mlflow_run_id, "loss")]
    assert steps == list(range(1, summary.final_step + 1))
    assert len(client.get_run(summary.mlflow_run_id).data.tags["world_size_history"].split(",")) == 2  # restarted
    dumps = sorted((tmp_path / "ckpt" / name / "hangs").glob("step_*/rank_*.txt"))
    assert dumps, "no stack dump"
    text = dumps[0].read_text()
    assert "most recent call first" in text and "raytrn/train/" in text, text[:2000]  # faulthandler's, the loop's
    step_dir = dumps[0].parent.name
    artifacts = [a.path for a in client.list_artifacts(summary.mlflow_run_id, f"hangs/{step_dir}")]
    assert f"hangs/{step_dir}/{dumps[0].name}" in artifacts, artifacts


def test_sigterm_to_a_worker_checkpoints_at_once_and_loses_no_step(ray_session, tiny_dataset, tmp_path):
    """SIGTERM to the training worker (what a node's shutdown or a pod's eviction sends): it checkpoints at the next
    step (no save is scheduled before the last) and exits; Ray Train restarts the group, which resumes from that
    checkpoint: no step is trained again."""
    name = f"term-{uuid.uuid4().hex[:8]}"
    job = load_job(REPO / "jobs" / "tiny.yaml", _overrides(tiny_dataset, tmp_path, name, f"run.max_steps={HORIZON}",
                                                           "scaling.max_failures=2",
                                                           f"checkpoint.every_n_steps={HORIZON}"))  # fmt: skip
    client = MlflowClient(job.tracking.mlflow_uri)
    thread, result = train_in_thread(job)
    try:
        _wait_for_step(client, name, 2)
        pid = _train_worker_pid()
        run_id = _wait_for_step(client, name, 6)
        logged = max(m.step for m in client.get_metric_history(run_id, "loss"))
        os.kill(pid, signal.SIGTERM)
        _stop_once_restarted(client, name)
    finally:
        thread.join(timeout=480)
    steps = summary_of(thread, result).final_step
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, steps + 1))
    first, second = run.data.tags["world_size_history"].split(",")
    resumed = int(second.split(":")[0])
    # No save is due before the last step: the one resumed from is the SIGTERM's, at or after the step seen.
    assert first == "0:1" and logged <= resumed < steps, run.data.tags["world_size_history"]
    committed = tmp_path / "ckpt" / name / "dcp" / f"step_{resumed:08d}" / "commit.json"
    assert committed.is_file()


def test_killed_worker_without_retries_ends_failed(ray_session, tiny_dataset, tmp_path):
    name = f"fail-{uuid.uuid4().hex[:8]}"
    job = load_job(REPO / "jobs" / "tiny.yaml", _overrides(tiny_dataset, tmp_path, name, f"run.max_steps={HORIZON}",
                                                           "scaling.max_failures=0"))  # fmt: skip
    client = MlflowClient(job.tracking.mlflow_uri)
    thread, result = train_in_thread(job)
    try:
        run_id = _wait_for_step(client, name, 3)
        _kill_train_worker()
    finally:
        thread.join(timeout=240)
    assert not thread.is_alive()
    assert "error" in result, "the job should have failed"
    assert client.get_run(run_id).info.status == "FAILED"


def test_sigterm_to_the_driver_ends_killed(ray_session, tiny_dataset, tmp_path):
    import ray

    name = f"stop-{uuid.uuid4().hex[:8]}"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    args = ["train", str(REPO / "jobs" / "tiny.yaml"), "--no-progress"]
    for kv in _overrides(tiny_dataset, tmp_path, name, "run.max_steps=5000"):
        args += ["--set", kv]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}  # the session's Ray
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrn.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_id = _wait_for_step(client, name, 2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, out[-2000:]
    assert client.get_run(run_id).info.status == "KILLED"
