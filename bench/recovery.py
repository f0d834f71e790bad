"""Recovery: time from a worker's death to the next completed training step, in ``raytrn train``.

A 1-worker ``raytrn train`` run (log every step, checkpoint every few steps, ``max_failures`` > 0) is
started; once it has passed a checkpoint, its Ray Train worker process is SIGKILLed (found among the
run's own descendants, by PID). Ray Train notices, restarts the worker group from the last checkpoint,
and training goes on. From the MLflow timestamps of the logged steps: time to the first step logged
after the kill (steps already logged are redone silently, so this includes redoing at most one
checkpoint interval: keep it short), and time until the step reached before the kill is passed. The same run gives the
time from ``raytrn train`` start to its first completed step (logged at every step here).
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from typing import Any

from bench.common import BenchJob, Skip, metric_points, parse_run_id
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
