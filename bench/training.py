"""Training overhead and scaling: (a) a bare PyTorch loop, (b) stock Ray Train, (c) ``raytrn train``.

Same model (jobs/tiny.yaml), batch, seq_len, seed, data and torch threads in all three. (a) and (b)
run here as child processes (``python -m bench.training bare|stock``); (c) is the real command line,
with tracking and checkpointing at the job's default intervals, timed from its MLflow metric
timestamps (wall clock at each logged step, so logging and checkpoint time count). Variants are
alternated (a, b, c, a, b, c, ...) so the drift of a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import (
    REPO,
    TINY_JOB,
    BenchJob,
    add_job_args,
    child_env,
    emit,
    job_from_args,
    load_bench_job,
    mean,
    metric_points,
    metric_values,
    parse_run_id,
    run_child,
    spread,
    steady_rate,
)

# ---------------------------------------------------------------------------------------------------
# (a) the bare loop and the shared model/optimizer construction


def _model_and_optimizer(job: Any) -> tuple[Any, Any, Any]:
    """The model, AdamW (same parameter groups) and schedule raytrn builds, without any raytrn runtime."""
    import torch

    from raytrn.models import build_model
    from raytrn.train.optim import adamw_param_groups, lr_scheduler
    from raytrn.train.schedule import Schedule

    torch.manual_seed(job.run.seed)
    model = build_model(job.model, seed=job.run.seed)
    o = job.optim
    opt = torch.optim.AdamW(adamw_param_groups(model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)
    return model, opt, lr_scheduler(opt, Schedule.from_job(job))


def _step(model: Any, opt: Any, sched: Any, batch: Any, clip: float | None) -> Any:
    """forward, next-token loss, backward, clip, AdamW, schedule: what every variant does per step."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _rows(manifest_dir: str) -> Any:
    """All packed rows of the dataset as one int64 tensor (plain pyarrow)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from raytrn.data.manifest import load_manifest

    paths = load_manifest(manifest_dir).shard_paths()
    col = pq.read_table(paths, columns=["input_ids"]).column("input_ids").combine_chunks()
    arr = np.asarray(col.values.to_numpy()).reshape(len(col), -1)
    return torch.from_numpy(arr.astype(np.int64))


def bare_main(args: argparse.Namespace) -> None:
    """(a): one process, data in memory, nothing but the training step."""
    import torch

    torch.set_num_threads(args.threads)
    bench = job_from_args(args)
    job = load_bench_job(bench)
    rows = _rows(bench.manifest)
    model, opt, sched = _model_and_optimizer(job)
    model.train()
    mb, log_every = bench.micro_batch_size, job.run.log_every
    gen = torch.Generator().manual_seed(job.run.seed)
    order = torch.randperm(len(rows), generator=gen)
    points, pos = [], 0
    for step in range(1, bench.steps + 1):
        if pos + mb > len(order):
            order, pos = torch.randperm(len(rows), generator=gen), 0
        batch = rows[order[pos : pos + mb]]
        pos += mb
        loss = _step(model, opt, sched, batch, job.optim.grad_clip_norm)
        if step % log_every == 0:
            loss.item()  # the same host read a logging loop does
        points.append((step, time.perf_counter()))
    tps = steady_rate(points, bench.warmup, bench.tokens_per_step(job.data.seq_len))
    from raytrn.backends.host_malloc import describe

    emit({"tokens_per_s": tps, "threads": torch.get_num_threads(), "malloc": describe(os.environ)})


# ---------------------------------------------------------------------------------------------------
# (b) stock Ray Train


def _stock_loop(config: dict[str, Any]) -> None:
    """A minimal Ray Train loop: prepare_model, the dataset shard, the step, report metrics every log_every."""
    import ray.train
    import ray.train.torch
    import torch

    job, bench = config["job"], config["bench"]
    model, opt, sched = _model_and_optimizer(job)
    model = ray.train.torch.prepare_model(model)
    model.train()
    it = stock_batches(job, bench)
    points, first_step_at = [], None
    for step in range(1, bench.steps + 1):
        loss = _step(model, opt, sched, next(it), job.optim.grad_clip_norm)
        points.append((step, time.perf_counter()))
        if first_step_at is None:
            first_step_at = time.time()
        if step % job.run.log_every == 0 or step == bench.steps:
            metrics: dict[str, Any] = {"step": step, "loss": loss.item()}
            ray.train.report(metrics)
    # Ray Train V2 may hand back no metrics for reports without a checkpoint: answer through a file.
    tps = steady_rate(points, bench.warmup, bench.tokens_per_step(job.data.seq_len))
    with open(config["out"], "w") as f:
        json.dump({"tokens_per_s": tps, "first_step_at": first_step_at, "threads": torch.get_num_threads()}, f)


def stock_batches(job: Any, bench: BenchJob) -> Any:
    """Endless micro-batches of the Ray Data shard ``train``, as a stock Ray Train loop reads them (a local shuffle)."""
    import numpy as np
    import ray.train
    import torch

    mb = bench.micro_batch_size

    def collate(batch: dict[str, Any]) -> torch.Tensor:
        col = batch["input_ids"]
        arr = np.stack(col) if col.dtype == object else np.asarray(col)
        return torch.from_numpy(arr.astype(np.int64, copy=False))

    shard = ray.train.get_dataset_shard("train")
    epoch = 0
    while True:
        yield from shard.iter_torch_batches(
            batch_size=mb,
            drop_last=True,
            local_shuffle_buffer_size=8 * mb,
            local_shuffle_seed=job.run.seed + epoch,
            collate_fn=collate,
        )
        epoch += 1


def stock_main(args: argparse.Namespace) -> None:
    """(b): stock ``TorchTrainer`` with one CPU worker, reading the same Parquet through Ray Data."""
    import logging

    import ray
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.data.manifest import load_manifest

    bench = job_from_args(args)
    job = load_bench_job(bench)
    # The same logical CPUs raytrn's embedded Ray gets: the workers' CPUs plus one for Ray Data.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_parquet(load_manifest(bench.manifest).shard_paths(), columns=["input_ids"])
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-stock-") as tmp:
        trainer = TorchTrainer(
            _stock_loop,
            train_loop_config={"job": job, "bench": bench, "out": os.path.join(tmp, "result.json")},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="bench-stock", storage_path=tmp),
            datasets={"train": ds},
        )
        trainer.fit()
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
    ray.shutdown()
    emit(result)


# ---------------------------------------------------------------------------------------------------
# The floor: stock Ray Train with an empty train function (no model, no data, no tracking)


def _floor_loop(config: dict[str, Any]) -> None:
    import time as _time

    with open(config["out"], "w") as f:
        json.dump({"train_fn_at": _time.time()}, f)


def floor_main(args: argparse.Namespace) -> None:
    """From process start to the start of an empty train function: what any Ray Train job pays here."""
    import psutil

    started = psutil.Process().create_time()
    import logging

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-floor-") as tmp:
        out = os.path.join(tmp, "result.json")
        TorchTrainer(
            _floor_loop,
            train_loop_config={"out": out},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="bench-floor", storage_path=tmp),
        ).fit()
        with open(out) as f:
            at = json.load(f)["train_fn_at"]
    ray.shutdown()
    emit({"train_fn_start_s": at - started, "train_fn_at": at})


def run_floor(timeout_s: float = 180) -> dict[str, Any]:
    """The cold floor, with the processes started before the train function and their CPU-seconds."""
    from bench.startup import ProcessSampler

    with ProcessSampler() as sampler:
        result = run_child("training", ["floor"], threads=1, timeout_s=timeout_s)
    result["processes"] = sampler.until(result["train_fn_at"])
    return result


# ---------------------------------------------------------------------------------------------------
# Peak: what one core does on a plain fp32 matmul (the "hardware" a CPU MFU is measured against)


def peak_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        a @ b
        reps += 1
    emit({"flops_per_s": 2 * n**3 * reps / (time.perf_counter() - t0), "threads": torch.get_num_threads(), "n": n})


# ---------------------------------------------------------------------------------------------------
# (c) raytrn train, as a user runs it


@dataclass
class RaytrnRun:
    """A ``raytrn train`` child process; stdout lines are kept with the time they arrived."""

    proc: subprocess.Popen
    started_at: float
    workdir: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.workdir}/mlruns/mlflow.db"

    def stdout(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait(self, timeout_s: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            raise RuntimeError(f"raytrn train ran past {timeout_s:.0f} s (stopped)") from None
        if self.reader:
            self.reader.join(timeout=10)
        return rc


def launch_raytrn(bench: BenchJob, workdir: str, *, workers: int = 1, extra: list[str] | None = None) -> RaytrnRun:
    """Start ``raytrn train jobs/tiny.yaml --set ...`` in ``workdir`` (checkpoints and mlruns land there)."""
    sets = [*bench.overrides(workers=workers), "tracking.experiment=raytrn-bench", *(extra or [])]
    cmd = [sys.executable, "-m", "raytrn.cli", "train", str(TINY_JOB), "--no-progress"]
    cmd += [a for kv in sets for a in ("--set", kv)]
    started = time.time()
    proc = subprocess.Popen(
        cmd, cwd=workdir, env=child_env(bench.threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    run = RaytrnRun(proc=proc, started_at=started, workdir=workdir)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append((time.time(), line.rstrip("\n")))

    run.reader = threading.Thread(target=read, daemon=True)
    run.reader.start()
    return run


def run_raytrn(bench: BenchJob, *, workers: int = 1, timeout_s: float = 300) -> dict[str, Any]:
    """(c): steady tokens/s from the wall-clock timestamps of the logged steps (MLflow), and the loop's own; the
    processes started before its first step, with their CPU-seconds; its goodput ledger."""
    from bench.startup import ProcessSampler

    with tempfile.TemporaryDirectory(prefix="raytrn-bench-train-") as tmp, ProcessSampler() as sampler:
        run = launch_raytrn(bench, tmp, workers=workers)
        rc = run.wait(timeout_s)
        out = run.stdout()
        run_id = parse_run_id(out)
        if rc != 0 or run_id is None:
            raise RuntimeError(f"raytrn train exited {rc}:\n{out[-2000:]}")
        job = load_bench_job(bench, workers=workers)
        tokens = bench.tokens_per_step(job.data.seq_len, workers)
        points = metric_points(run.tracking_uri, run_id, "loss")
        reported = [v for s, v in metric_values(run.tracking_uri, run_id, "tokens_per_s") if s > bench.warmup]
        # The loop's per-step wait for its next micro-batches, against its step time (both averaged per log window).
        wait = [v for s, v in metric_values(run.tracking_uri, run_id, "data_wait_s") if s > bench.warmup]
        step = [v for s, v in metric_values(run.tracking_uri, run_id, "step_time_s") if s > bench.warmup]
        # The loop's own start-up metric: process start (raytrn train) to the end of step 1.
        first_step = [v for _, v in metric_values(run.tracking_uri, run_id, "time_to_first_step_s")]
        ledger = {k: v[-1][1] for k in ("goodput", "wall_s", "goodput_s", "badput_startup_s", "badput_shutdown_s",
                                        "badput_checkpoint_s", "badput_data_wait_s", "badput_other_s")
                  if (v := metric_values(run.tracking_uri, run_id, k))}  # fmt: skip
    return {
        "processes": sampler.until(run.started_at + first_step[0]) if first_step else [],
        "ledger": ledger,
        "tokens_per_s": steady_rate(points, bench.warmup, tokens),
        "tokens_per_s_loop_reported": mean(reported),
        "data_wait_fraction": (mean(wait) or 0.0) / step_s if wait and (step_s := mean(step)) else None,
        "first_step_s": first_step[0] if first_step else None,
        "wall_s": time.time() - run.started_at,
        "workers": workers,
    }


def run_bare(bench: BenchJob, *, tuned_malloc: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """(a) as a user runs it (glibc's default allocator settings) or, ``tuned_malloc``, with the settings raytrn
    gives its CPU workers (``run.tune_malloc``): (a'), the like-for-like baseline."""
    from raytrn.backends.host_malloc import TUNED

    return run_child("training", ["bare", *bench.as_args()], threads=bench.threads, timeout_s=timeout_s,
                     env=dict(TUNED) if tuned_malloc else None)  # fmt: skip


def run_stock(bench: BenchJob, timeout_s: float = 300) -> dict[str, Any]:
    r = run_child("training", ["stock", *bench.as_args()], threads=bench.threads, timeout_s=timeout_s)
    if r.get("first_step_at"):
        r["first_step_s"] = r["first_step_at"] - r["_started_at"]
    return r


def run_peak(threads: int, seconds: float = 3.0) -> dict[str, Any]:
    return run_child("training", ["peak", "--threads", str(threads), "--seconds", str(seconds)], threads=threads,
                     timeout_s=120)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The benchmark: alternated rounds, ratios per round


def overhead_and_scaling(bench: BenchJob, *, rounds: int, scaling: bool, deadline: float) -> dict[str, Any]:
    """Rounds of (a, b, c 1 worker[, c 2 workers]); ratios taken inside each round, then averaged."""
    per_round: list[dict[str, Any]] = []
    last_round_s = 0.0
    for _ in range(rounds):
        if per_round and time.monotonic() + last_round_s > deadline:
            break  # another round would eat the time the other benchmarks need
        round_start = time.monotonic()
        r: dict[str, Any] = {
            "bare": run_bare(bench),
            "floor": run_floor(),  # every round: the start-up goals are read against it
            "stock": run_stock(bench),
            "raytrn": run_raytrn(bench),
            "bare_tuned": run_bare(bench, tuned_malloc=True),
        }
        if scaling:
            r["raytrn_2w"] = run_raytrn(bench, workers=2)
        per_round.append(r)
        last_round_s = time.monotonic() - round_start

    def col(name: str, key: str) -> list[Any]:
        return [r[name].get(key) for r in per_round if name in r]

    def ratios(num: str, den: str) -> list[float]:
        return [
            r[num]["tokens_per_s"] / r[den]["tokens_per_s"]
            for r in per_round
            if r.get(num, {}).get("tokens_per_s") and r.get(den, {}).get("tokens_per_s")
        ]

    from raytrn.backends.host_malloc import TUNED
    from raytrn.models import model_stats

    job = load_bench_job(bench)
    out: dict[str, Any] = {
        "rounds": len(per_round),
        "rounds_asked": rounds,
        "flops_per_token": model_stats(job.model, job.data.seq_len).flops_per_token,
        "setup": {
            "job": str(TINY_JOB.relative_to(REPO)),
            "micro_batch_size": bench.micro_batch_size,
            "seq_len": job.data.seq_len,
            "steps": bench.steps,
            "warmup_steps": bench.warmup,
            "threads_per_worker": bench.threads,
            "log_every": job.run.log_every,
            "checkpoint_every_n_steps": job.checkpoint.every_n_steps,
            "tuned_malloc": TUNED,
        },
        "bare_tokens_per_s": mean(col("bare", "tokens_per_s")),
        "bare_tuned_tokens_per_s": mean(col("bare_tuned", "tokens_per_s")),
        "stock_tokens_per_s": mean(col("stock", "tokens_per_s")),
        "raytrn_tokens_per_s": mean(col("raytrn", "tokens_per_s")),
        "raytrn_tokens_per_s_loop_reported": mean(col("raytrn", "tokens_per_s_loop_reported")),
        "raytrn_data_wait_fraction": mean(col("raytrn", "data_wait_fraction")),
        "c_over_a": mean(ratios("raytrn", "bare")),
        "c_over_b": mean(ratios("raytrn", "stock")),
        "b_over_a": mean(ratios("stock", "bare")),
        "c_over_a_per_round": ratios("raytrn", "bare"),
        "c_over_a_tuned": mean(ratios("raytrn", "bare_tuned")),
        "c_over_a_tuned_per_round": ratios("raytrn", "bare_tuned"),
        "c_over_b_per_round": ratios("raytrn", "stock"),
        "spread_bare": spread(col("bare", "tokens_per_s")),
        "spread_raytrn": spread(col("raytrn", "tokens_per_s")),
        "stock_first_step_s": mean(col("stock", "first_step_s")),
        "raytrn_first_step_s": mean(col("raytrn", "first_step_s")),
        "ray_train_floor_s": mean(col("floor", "train_fn_start_s")),
        "cold_over_floor": mean(
            [
                r["raytrn"]["first_step_s"] / r["floor"]["train_fn_start_s"]
                for r in per_round
                if r["raytrn"].get("first_step_s") and r["floor"].get("train_fn_start_s")
            ]
        ),  # fmt: skip
        "floor_processes": per_round[-1]["floor"].get("processes", []) if per_round else [],
        "raytrn_processes": per_round[-1]["raytrn"].get("processes", []) if per_round else [],
        "raytrn_ledger": per_round[-1]["raytrn"].get("ledger", {}) if per_round else {},
        "threads_seen": {"bare": col("bare", "threads"), "stock": col("stock", "threads")},
        "per_round": per_round,
    }
    if scaling:
        two = ratios("raytrn_2w", "raytrn")
        out["scaling"] = {
            "tokens_per_s_1w": out["raytrn_tokens_per_s"],
            "tokens_per_s_2w": mean(col("raytrn_2w", "tokens_per_s")),
            "speedup": mean(two),
            "efficiency": mean([x / 2 for x in two]),
            "note": f"{os.cpu_count()} logical cores for 2 workers x {bench.threads} thread(s) plus Ray Data, the "
            "driver and anything else on the machine: the ceiling here is below 2x",
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.training")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn in (("bare", bare_main), ("stock", stock_main)):
        p = sub.add_parser(name)
        add_job_args(p)
        p.set_defaults(func=fn)
    p = sub.add_parser("floor")
    p.set_defaults(func=floor_main)
    p = sub.add_parser("peak")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0)
    p.set_defaults(func=peak_main)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
