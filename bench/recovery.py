"""Recovery: time from a worker's death to the next completed training step, in ``raytrn train`` and, as the
baseline, in stock Ray Train (a ``TorchTrainer`` running bench (b)'s loop with a checkpoint every few steps, restarted
by its ``FailureConfig`` after the same kill: ``python -m bench.recovery stock``).

A 1-worker ``raytrn train`` run (log every step, checkpoint every few steps, ``max_failures`` > 0) is
started; once it has passed a checkpoint, its Ray Train worker process is SIGKILLed (found among the
run's own descendants, by PID). Ray Train notices, restarts the worker group from the last checkpoint,
and training goes on. From the MLflow timestamps of the logged steps: time to the first step logged
after the kill (steps already logged are redone silently, so this includes redoing at most one
checkpoint interval: keep it short), and time until the step reached before the kill is passed. The same run gives the
time from ``raytrn train`` start to its first completed step (logged at every step here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, BenchJob, Skip, add_job_args, child_env, emit, job_from_args, metric_points, parse_run_id
from bench.training import launch_raytrn

_STEP = re.compile(r"^step (\d+)/(\d+) ")


def _train_workers(root_pid: int) -> list[Any]:
    """Ray Train worker processes started under ``root_pid`` (the ``raytrn train`` process)."""
    import psutil

    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in children:
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def run(bench: BenchJob, *, steps: int, checkpoint_every: int, kill_after: int, timeout_s: float) -> dict[str, Any]:
    """Kill the worker once step ``kill_after`` (> a checkpoint) is printed; measure from MLflow timestamps."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise Skip("psutil is needed to find the Ray Train worker process") from None
    job = BenchJob(**{**bench.__dict__, "steps": steps})
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-recovery-") as tmp:
        run_ = launch_raytrn(
            job,
            tmp,
            extra=[
                "run.log_every=1",
                f"checkpoint.every_n_steps={checkpoint_every}",
                "scaling.max_failures=2",
            ],
        )
        deadline = time.monotonic() + timeout_s
        killed_at = killed_step = killed_pid = None
        while run_.proc.poll() is None and time.monotonic() < deadline:
            seen = [int(m.group(1)) for _, line in run_.lines if (m := _STEP.match(line))]
            if killed_at is None and seen and max(seen) >= kill_after:
                workers = _train_workers(run_.proc.pid)
                if workers:
                    killed_step, killed_pid = max(seen), workers[0].pid
                    killed_at = time.time()
                    os.kill(killed_pid, signal.SIGKILL)
            time.sleep(0.05)
        rc = run_.wait(max(1.0, deadline - time.monotonic()))
        out = run_.stdout()
        run_id = parse_run_id(out)
        if rc != 0 or run_id is None:
            raise RuntimeError(f"raytrn train (recovery) exited {rc}:\n{out[-2000:]}")
        if killed_at is None or killed_step is None:
            raise RuntimeError("the run ended before a worker could be killed (raise steps)")
        points = metric_points(run_.tracking_uri, run_id, "loss")
    # The restarted group resumes at the checkpoint and does not log steps the run already logged, so the
    # first point after the kill is the first new step: recovery plus redoing at most a checkpoint interval.
    after = [(s, t) for s, t in points if t > killed_at]
    regained = [t for s, t in after if s > killed_step]
    first = [t for s, t in points if s == 1]
    return {
        "workers": 1,
        "checkpoint_every_n_steps": checkpoint_every,
        "killed_at_step": killed_step,
        "first_step_logged_after_kill": min((s for s, _ in after), default=None),
        "kill_to_next_step_s": (min(t for _, t in after) - killed_at) if after else None,
        "kill_to_regained_step_s": (min(regained) - killed_at) if regained else None,
        "start_to_first_step_s": (first[0] - run_.started_at) if first else None,
        "wall_s": time.time() - run_.started_at,
    }


# ---------------------------------------------------------------------------------------------------
# The baseline: stock Ray Train restarting after the same kill


def _stock_loop(config: dict[str, Any]) -> None:
    """Bench (b)'s loop (the same model, optimizer and Ray Data shard) with Ray Train's own checkpoints (``torch.save``
    of the model, optimizer and step every ``checkpoint_every`` steps, restored from ``ray.train.get_checkpoint()``);
    every step's end time appended to ``config["steps"]``."""
    import ray.train
    import ray.train.torch
    import torch

    from bench.training import _model_and_optimizer, _step, stock_batches

    job, bench = config["job"], config["bench"]
    model, opt, sched = _model_and_optimizer(job)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
    model = ray.train.torch.prepare_model(model)
    model.train()
    batches = stock_batches(job, bench)
    for step in range(start + 1, config["steps_total"] + 1):
        loss = _step(model, opt, sched, next(batches), job.optim.grad_clip_norm)
        loss.item()
        with open(config["steps"], "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
        if step % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                inner: Any = model.module if hasattr(model, "module") else model
                state = {"model": inner.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "step": step}  # fmt: skip
                torch.save(state, os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))


def stock_main(args: argparse.Namespace) -> None:
    """One worker of stock ``TorchTrainer`` (``FailureConfig(max_failures=2)``), bench (b)'s data and loop."""
    import logging

    import ray
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.data.manifest import load_manifest

    bench = job_from_args(args)
    from bench.common import load_bench_job

    job = load_bench_job(bench)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_parquet(load_manifest(bench.manifest).shard_paths(), columns=["input_ids"])
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-stock-restart-") as tmp:
        TorchTrainer(
            _stock_loop,
            train_loop_config={
                "job": job,
                "bench": bench,
                "steps": args.steps_file,
                "steps_total": args.steps_total,
                "checkpoint_every": args.checkpoint_every,
            },  # fmt: skip
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                name="bench-stock-restart",
                storage_path=tmp,
                failure_config=FailureConfig(max_failures=2),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),  # fmt: skip
            datasets={"train": ds},
        ).fit()
    ray.shutdown()
    emit({"finished": True})


def run_stock(
    bench: BenchJob, *, steps: int, checkpoint_every: int, kill_after: int, timeout_s: float
) -> dict[str, Any]:
    """Kill stock Ray Train's worker once step ``kill_after`` is done; the seconds to its next step after the kill."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise Skip("psutil is needed to find the Ray Train worker process") from None
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-stock-recovery-") as tmp:
        steps_file = Path(tmp) / "steps.jsonl"
        cmd = [sys.executable, "-m", "bench.recovery", "stock", *bench.as_args(), "--steps-file", str(steps_file),
               "--steps-total", str(steps), "--checkpoint-every", str(checkpoint_every)]  # fmt: skip
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(bench.threads), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        killed_at = killed_step = None
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                done = _steps(steps_file)
                if killed_at is None and done and max(done) >= kill_after:
                    workers = _train_workers(proc.pid)
                    if workers:
                        killed_step, killed_at = max(done), time.time()
                        os.kill(workers[0].pid, signal.SIGKILL)
                time.sleep(0.05)
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)
            raise RuntimeError(f"stock Ray Train (recovery) ran past {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"stock Ray Train (recovery) exited {proc.returncode}:\n{out[-2000:]}")
        if killed_at is None or killed_step is None:
            raise RuntimeError("the stock run ended before its worker could be killed (raise steps)")
        done = _steps(steps_file)
    after = [t for t in done.values() if t > killed_at]
    first = done.get(1)
    return {
        "killed_at_step": killed_step,
        "kill_to_next_step_s": (min(after) - killed_at) if after else None,
        "start_to_first_step_s": (first - started) if first else None,
    }


def _steps(path: Path) -> dict[int, float]:
    """Each step's latest end time from the stock loop's file (a restarted group repeats steps)."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        out[int(entry["step"])] = float(entry["time"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stock")
    add_job_args(p)
    p.add_argument("--steps-file", required=True)
    p.add_argument("--steps-total", type=int, required=True)
    p.add_argument("--checkpoint-every", type=int, required=True)
    p.set_defaults(func=stock_main)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
