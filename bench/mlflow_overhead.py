"""MLflow overhead: raytrn's real per-worker loop with tracking on and off, alternated in one Ray Train run.

One ``TorchTrainer`` worker calls :func:`raytrn.train.loop.train_loop_per_worker` repeatedly, each call
a segment of N more steps resuming from the previous segment's checkpoint, with the job's MLflow run
(on) or without one (off), in the order on, off, off, on, on, off, ... (drift cancels). A stand-in for
the driver's progress board records, inside the worker, when each logged step ended (after its MLflow
call), so the time between log steps includes the logging. Whatever tracking code is in the tree is
what gets measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from typing import Any

from bench.common import BenchJob, add_job_args, emit, job_from_args, load_bench_job, mean, run_child
from raytrn.tracking.board import ProgressBoard
from raytrn.tracking.roles import BoardClients


class _Board(ProgressBoard):
    """Stands in for the driver's ProgressBoard actor: the real board, in this process (its clients,
    :meth:`BoardClients.of`, call it directly); ``update``, which the loop does not wait for, also records when the
    step was posted."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[int, float]] = []

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        self.points.append((step, time.perf_counter()))
        super().update(step, max_steps, metrics)


def _plan(pairs: int, log_every: list[int]) -> list[tuple[bool, int]]:
    """A warm-up segment (discarded), then for each log interval on, off, off, on, on, off, ...: ABBA order,
    so a linear drift adds equally to both."""
    out: list[tuple[bool, int]] = [(False, log_every[0])]
    for i in range(pairs):
        for every in log_every:
            out += [(True, every), (False, every)] if i % 2 == 0 else [(False, every), (True, every)]
    return out


class _CallTimer:
    """Times rank 0's per-step tracking calls (``RemoteLogger.log_metrics`` with training metrics) where the loop
    makes them: what the training thread itself pays. On a cluster the tracking actor runs on the head node,
    so this is the whole cost there; on this 2-core machine its writes also share the cores."""

    def __init__(self) -> None:
        from raytrn.tracking.actor import RemoteLogger

        self.durations: list[float] = []
        original = RemoteLogger.log_metrics

        def timed(logger: Any, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
            t0 = time.perf_counter()
            original(logger, metrics, step, training=training)
            if training:
                self.durations.append(time.perf_counter() - t0)

        RemoteLogger.log_metrics = timed  # type: ignore[method-assign,assignment]  # this worker process only

    def take(self) -> list[float]:
        out, self.durations = self.durations, []
        return out


def _segments(config: dict[str, Any]) -> None:
    """The worker: alternate segments of raytrn's loop with and without the MLflow run."""
    from raytrn.train.loop import train_loop_per_worker
    from raytrn.train.plan import WorkerPlan
    from raytrn.train.schedule import Schedule

    job, n, warmup = config["job"], config["segment_steps"], config["warmup"]
    rows = []
    timer = _CallTimer()
    for i, (on, every) in enumerate(_plan(config["pairs"], config["log_every"])):
        run_cfg = job.run.model_copy(update={"max_steps": (i + 1) * n, "log_every": every})
        seg_job = job.model_copy(update={"run": run_cfg})
        board = _Board()
        t0 = time.perf_counter()
        plan = WorkerPlan(
            job=seg_job,
            manifest=config["manifest"],
            schedule=Schedule.from_job(seg_job),
            board=BoardClients.of(board),
            mlflow_uri=config["mlflow_uri"] if on else None,
            tracker=config["tracker"] if on else None,
        )
        train_loop_per_worker(plan.as_config())
        total = time.perf_counter() - t0
        kept = [p for p in board.points if p[0] - i * n >= warmup]
        step_s = (kept[-1][1] - kept[0][1]) / (kept[-1][0] - kept[0][0]) if len(kept) >= 2 else None
        rows.append({"tracking": on, "step_time_s": step_s, "segment_s": total, "steps": n, "warmup": i == 0,
                     "log_every": every, "log_call_s": timer.take()})  # fmt: skip
    with open(config["out"], "w") as f:
        json.dump(rows, f)


def child_main(args: argparse.Namespace) -> None:
    import ray
    import ray.data
    import ray.train
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.tracking.actor import start_tracking_actor
    from raytrn.tracking.mlflow_run import plan_run
    from raytrn.train.checks import check_data

    bench = job_from_args(args)
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-mlflow-") as tmp:
        n = args.segment_steps
        job = load_bench_job(
            bench,
            extra=[
                f"checkpoint.every_n_steps={n}",  # saves only at segment ends, outside the timed span
                f"checkpoint.storage={tmp}/checkpoints",
                f"tracking.mlflow_uri=sqlite:///{tmp}/mlruns/mlflow.db",
                "tracking.experiment=raytrn-bench",
                "tracking.run_name=bench-mlflow",
            ],
        )
        manifest = check_data(job)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
        ray.data.DataContext.get_current().enable_progress_bars = False
        tracked = plan_run(job)
        assert tracked is not None
        tracker = start_tracking_actor(tracked, job)  # what raytrn's driver starts: it creates the run
        out = os.path.join(tmp, "segments.json")
        trainer = TorchTrainer(
            _segments,
            train_loop_config={
                "job": job,
                "segment_steps": n,
                "warmup": args.warmup,
                "pairs": args.pairs,
                "log_every": [int(x) for x in args.log_every.split(",")],
                "mlflow_uri": tracked.uri,
                "tracker": tracker,
                "out": out,
                "manifest": manifest,  # every worker streams its own rows, as the trainer's do
            },
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                name="bench-mlflow",
                storage_path=f"{tmp}/checkpoints",
                checkpoint_config=CheckpointConfig(num_to_keep=job.checkpoint.keep_last),
            ),
        )
        try:
            trainer.fit()
        finally:
            ray.get(tracker.finish.remote("FINISHED", 60), timeout=120)  # flush, then mark the run
        with open(out) as f:
            rows = json.load(f)
    ray.shutdown()
    emit({"segments": rows})


def run(bench: BenchJob, *, log_every_values: tuple[int, ...], pairs: int, segment_steps: int, warmup: int) -> dict:
    """Overhead = step time with tracking / without - 1, per log interval, all from one Ray Train run."""
    out: dict[str, Any] = {"pairs": pairs, "segment_steps": segment_steps, "warmup_steps_per_segment": warmup}
    args = [
        *bench.as_args(),
        "--log-every",
        ",".join(str(x) for x in log_every_values),
        "--pairs",
        str(pairs),
        "--segment-steps",
        str(segment_steps),
        "--segment-warmup",
        str(warmup),
    ]
    rows = run_child("mlflow_overhead", args, threads=bench.threads, timeout_s=600)["segments"]
    for log_every in log_every_values:
        mine = [r for r in rows if not r["warmup"] and r["log_every"] == log_every]
        on_s = [r["step_time_s"] for r in mine if r["tracking"] and r["step_time_s"]]
        off_s = [r["step_time_s"] for r in mine if not r["tracking"] and r["step_time_s"]]
        on, off = mean(on_s), mean(off_s)
        out[f"log_every_{log_every}"] = {
            "step_time_on_s": on,
            "step_time_off_s": off,
            "overhead": (on / off - 1) if on and off else None,
            "noise": _relative_standard_error(on_s, off_s),
            # Inside the training thread: seconds per logged step, and that spread over log_every steps.
            **_in_thread(mine, log_every, off),
            "ms_per_log_call": (on - off) * log_every * 1000 if on and off else None,
            "segments": mine,
        }
    return out


def _in_thread(segments: list[dict[str, Any]], log_every: int, step_s: float | None) -> dict[str, Any]:
    import statistics

    calls = [c for r in segments if r["tracking"] for c in r.get("log_call_s", [])]
    if not calls or not step_s:
        return {}
    per_call = statistics.mean(calls)
    return {
        "in_thread_ms_per_log_call": per_call * 1000,
        "in_thread_ms_per_log_call_median": statistics.median(calls) * 1000,
        "in_thread_ms_per_log_call_max": max(calls) * 1000,
        "in_thread_overhead": per_call / (log_every * step_s),
    }


def _relative_standard_error(on: list[float], off: list[float]) -> float | None:
    """The standard error of mean(on) - mean(off), relative to mean(off): how far apart the two could be by
    the segment-to-segment noise alone (a shared machine: several % per 30-step segment)."""
    import statistics

    if len(on) < 2 or len(off) < 2:
        return None
    se = (statistics.variance(on) / len(on) + statistics.variance(off) / len(off)) ** 0.5
    return se / statistics.mean(off)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mlflow_overhead")
    add_job_args(parser)
    parser.add_argument("--log-every", default="10,1", help="comma-separated log intervals, alternated")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=40)
    parser.add_argument("--segment-warmup", dest="seg_warmup", type=int, default=10)
    args = parser.parse_args(argv)
    args.warmup = args.seg_warmup
    child_main(args)


if __name__ == "__main__":
    main()
