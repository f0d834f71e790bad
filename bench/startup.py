"""Start-up on a Ray that is already running (the production path: ``ray job submit``, a restart, a sweep's trial):
``raytrn train`` from process start to its first step done, against stock Ray Train from process start to an empty
train function, alternated on one held local Ray; and, for each, the processes that started before that point and
the CPU-seconds each took (:class:`ProcessSampler`, also used for the cold start in :mod:`bench.training`).

A local Ray is held by a child process (``python -m bench.startup hold``: ``ray.init`` with a dashboard, as a
cluster's head has), stopped by PID at the end; both variants connect to it with ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import REPO, TINY_JOB, BenchJob, child_env, emit, mean

#: Every child of this benchmark runs without token auth (a token file left on the machine would turn it on).
AUTH = {"RAY_AUTH_MODE": "disabled"}


@dataclass
class ProcessSampler:
    """Every process started after it starts (a pid it did not see at first), with its CPU-seconds over time (psutil,
    every ``interval_s``). Times are this process's wall clock: psutil's create times are off by up to a second
    (Linux counts them from a boot time in whole seconds), so a process counts from when it was first seen."""

    interval_s: float = 0.1
    #: Only the processes descended from this pid (None: every new process on the machine). A test's own (its
    #: driver subprocess, its local Ray's workers), not another job's that runs on the same machine (CI's pip).
    root: int | None = None
    started_at: float = field(default_factory=time.time)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _before: set[int] = field(default_factory=set)
    _others: set[int] = field(default_factory=set)

    def __enter__(self) -> ProcessSampler:
        import psutil

        self._before = set(psutil.pids())
        self._thread = threading.Thread(target=self._run, name="bench-process-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            now = time.time()
            for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
                info = p.info
                cpu = info.get("cpu_times")
                if info["pid"] in self._before or info["pid"] in self._others or cpu is None:
                    continue
                if self.root is not None and info["pid"] not in self.samples and not _descends(p, self.root):
                    self._others.add(info["pid"])
                    continue
                entry = self.samples.setdefault(info["pid"], {"born": now, "name": "", "cpu": []})
                name = _name(info.get("cmdline") or [])
                # a Ray worker is ray::IDLE until it runs an actor or task, then takes its name (kept once taken)
                if name and (not entry["name"].startswith("ray::") or entry["name"] == "ray::IDLE"):
                    entry["name"] = name
                entry["cpu"].append((now, cpu.user + cpu.system))
            self._stop.wait(self.interval_s)

    def until(self, at: float) -> list[dict[str, Any]]:
        """The processes first seen by ``at`` (wall clock), each with its name and CPU-seconds at ``at`` (the last
        sample before it), in the order they were seen."""
        out = []
        for pid, entry in sorted(self.samples.items(), key=lambda kv: kv[1]["born"]):
            if entry["born"] > at:
                continue
            before = [c for t, c in entry["cpu"] if t <= at]
            out.append({"pid": pid, "name": entry["name"], "born_s": round(entry["born"] - self.started_at, 2),
                        "cpu_s": round(before[-1] if before else 0.0, 2)})  # fmt: skip
        return out


def _descends(process: Any, root: int) -> bool:
    """Whether ``process`` (a psutil.Process) is ``root`` or one of its descendants (False once it is gone)."""
    import psutil

    try:
        return process.pid == root or any(a.pid == root for a in process.parents())
    except psutil.Error:
        return False


def _name(cmdline: list[str]) -> str:
    """``ray::TrainController`` for Ray's processes (their title), else the program and its first arguments."""
    text = " ".join(cmdline)
    if text.startswith("ray::"):  # ray::TrainController.__init__, ray::<actor name>:TrackingActor: the class
        return "ray::" + text.split()[0][len("ray::") :].split(".")[0].rsplit(":", 1)[-1]
    parts = [os.path.basename(a) for a in cmdline[:4]]
    return " ".join(parts)[:60]


def process_table(processes: list[dict[str, Any]]) -> str:
    """``driver 1.3, ray::RayTrainWorker 4.4, ...`` (CPU-seconds each), for the report."""
    return ", ".join(f"{p['name'].replace('ray::', '')} {p['cpu_s']:.1f}" for p in processes)


# ---------------------------------------------------------------------------------------------------
# The held Ray


def hold_main(args: argparse.Namespace) -> None:
    """Start a local Ray, print its address, keep it until SIGTERM (then stop it: the processes are this one's)."""
    import logging

    import ray

    ray.init(address="local", num_cpus=args.num_cpus, logging_level=logging.ERROR)
    print(f"ADDRESS {ray.get_runtime_context().gcs_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    ray.shutdown()


class HeldRay:
    """A local Ray held by a child process for the length of a ``with`` block (stopped by PID)."""

    def __init__(self, num_cpus: int) -> None:
        self.num_cpus = num_cpus
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def __enter__(self) -> HeldRay:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # the child's sigwait needs them
        try:  # blocked: the child inherits the mask
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.startup", "hold", "--num-cpus", str(self.num_cpus)],
                cwd=REPO, env=child_env(1, AUTH), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:
            if line.startswith("ADDRESS "):
                self.address = line.split()[1]
                break
            if time.monotonic() > deadline:
                break
        if not self.address:
            self.__exit__()
            raise RuntimeError("the held local Ray did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def env(self, threads: int) -> dict[str, str]:
        return child_env(threads, {**AUTH, "RAY_ADDRESS": self.address})


# ---------------------------------------------------------------------------------------------------
# The two variants


def floor_main(args: argparse.Namespace) -> None:
    """Stock Ray Train on the Ray in ``RAY_ADDRESS``: process start to the start of an empty train function."""
    import psutil

    started = psutil.Process().create_time()
    import logging

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-floor-") as tmp:
        out = os.path.join(tmp, "result.json")
        TorchTrainer(
            _floor_fn,
            train_loop_config={"out": out},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"bench-floor-{os.getpid()}", storage_path=tmp),
        ).fit()
        with open(out) as f:
            at = json.load(f)["train_fn_at"]
    emit({"train_fn_start_s": at - started, "train_fn_at": at, "started_at": started})


def _floor_fn(config: dict[str, Any]) -> None:
    with open(config["out"], "w") as f:
        json.dump({"train_fn_at": time.time()}, f)


def _stock(held: HeldRay, timeout_s: float) -> dict[str, Any]:
    with ProcessSampler() as sampler:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.startup", "floor"], cwd=REPO, env=held.env(1), capture_output=True,
            text=True, timeout=timeout_s,
        )  # fmt: skip
    result = _result(proc, "stock floor")
    result["processes"] = sampler.until(result["train_fn_at"])
    return result


def _raytrn(held: HeldRay, bench: BenchJob, timeout_s: float) -> dict[str, Any]:
    from bench.common import metric_values, parse_run_id

    with tempfile.TemporaryDirectory(prefix="raytrn-bench-running-") as tmp, ProcessSampler() as sampler:
        sets = [*bench.overrides(workers=1), "run.max_steps=3", "run.log_every=1", "tracking.log_model=false",
                "tracking.experiment=raytrn-bench-startup"]  # fmt: skip
        cmd = [sys.executable, "-m", "raytrn.cli", "train", str(TINY_JOB), "--no-progress"]
        cmd += [a for kv in sets for a in ("--set", kv)]
        launched = time.time()  # the process's start (its time_to_first_step_s counts from its own create time)
        proc = subprocess.run(cmd, cwd=tmp, env=held.env(bench.threads), capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
        run_id = parse_run_id(proc.stdout)
        if proc.returncode != 0 or run_id is None:
            raise RuntimeError(f"raytrn train on a running Ray exited {proc.returncode}:\n{proc.stdout[-1500:]}")
        first = [v for _, v in metric_values(f"sqlite:///{tmp}/mlruns/mlflow.db", run_id, "time_to_first_step_s")]
    if not first:
        raise RuntimeError("raytrn train logged no time_to_first_step_s")
    return {"first_step_s": first[0], "processes": sampler.until(launched + first[0])}


def _result(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    from bench.common import RESULT_PREFIX

    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    raise RuntimeError(f"{what} exited {proc.returncode} without a result:\n{(proc.stderr or proc.stdout)[-1500:]}")


def run(bench: BenchJob, *, rounds: int, timeout_s: float = 300) -> dict[str, Any]:
    """``rounds`` alternated pairs (stock, raytrn) on one held local Ray; the ratio raytrn / stock per round."""
    per_round = []
    with HeldRay(num_cpus=max(os.cpu_count() or 1, 2)) as held:
        _stock(held, timeout_s)  # warm-up: the cluster's own first actors (Ray Data's, the autoscaling coordinator)
        for _ in range(rounds):
            stock = _stock(held, timeout_s)
            ours = _raytrn(held, bench, timeout_s)
            per_round.append(
                {"stock": stock, "raytrn": ours, "ratio": ours["first_step_s"] / stock["train_fn_start_s"]}
            )
    return {
        "rounds": rounds,
        "stock_train_fn_s": mean([r["stock"]["train_fn_start_s"] for r in per_round]),
        "raytrn_first_step_s": mean([r["raytrn"]["first_step_s"] for r in per_round]),
        "ratio": mean([r["ratio"] for r in per_round]),
        "ratio_per_round": [round(r["ratio"], 3) for r in per_round],
        "stock_processes": per_round[-1]["stock"]["processes"],
        "raytrn_processes": per_round[-1]["raytrn"]["processes"],
        "per_round": per_round,
    }


def demo_goodput(bench: BenchJob, timeout_s: float = 300) -> dict[str, Any]:
    """``jobs/tiny.yaml`` as ``make demo`` trains it (2 workers, 100 steps, the job's own settings) on a cold local Ray:
    its goodput ledger (the run's ``goodput`` and ``badput_*_s`` metrics)."""
    from bench.common import metric_values, parse_run_id
    from raytrn.tracking.goodput import METRICS

    with tempfile.TemporaryDirectory(prefix="raytrn-bench-demo-") as tmp:
        cmd = [sys.executable, "-m", "raytrn.cli", "train", str(TINY_JOB), "--no-progress", "--set",
               f"data.manifest={bench.manifest}", "--set", "tracking.experiment=raytrn-bench-demo"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tmp, env=child_env(bench.threads, AUTH), capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
        run_id = parse_run_id(proc.stdout)
        if proc.returncode != 0 or run_id is None:
            raise RuntimeError(f"the demo job exited {proc.returncode}:\n{proc.stdout[-1500:]}")
        uri = f"sqlite:///{tmp}/mlruns/mlflow.db"
        return {k: v[-1][1] for k in METRICS if (v := metric_values(uri, run_id, k))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--num-cpus", type=int, default=2)
    p.set_defaults(func=hold_main)
    p = sub.add_parser("floor")
    p.set_defaults(func=floor_main)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
