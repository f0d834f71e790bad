"""Data pipeline: raytrn's read path (Ray Data over the packed Parquet shards, the loop's batch iterator)
vs a raw ``pyarrow.parquet`` read of the same files into the same int64 batches, alternated.

Rows/s of micro-batches handed to the step. The training step itself consumes far fewer rows/s; the
ratio of the two (headroom) says whether data can ever be what a CPU step waits for.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from bench.common import BenchJob, Skip, add_job_args, emit, job_from_args, load_bench_job, mean, run_child


def _raytrn_pass(job: Any, manifest: Any, epoch: int, rows_wanted: int) -> float:
    """Seconds to draw ``rows_wanted`` rows through the loop's own path: Ray Data streaming one rank's rows of
    the job's global order (:mod:`raytrn.data.source`), cut into int64 micro-batches (``rows_tensor``)."""

    from raytrn.data.order import Position, RankSlice, SampleOrder
    from raytrn.data.source import rank_tables
    from raytrn.train.loop import rows_tensor

    mb = job.data.micro_batch_size
    tables = rank_tables(
        manifest, SampleOrder.for_job(manifest, job), RankSlice(rank=0, size=1, global_batch=mb),
        Position(epoch=epoch), batch_rows=mb,
    )  # fmt: skip
    t0, rows = time.perf_counter(), 0
    while rows < rows_wanted:
        rows += len(rows_tensor(next(tables), job.data.seq_len + 1))
    return time.perf_counter() - t0


def _raw_pass(paths: list[str], mb: int, rows_wanted: int) -> float:
    """Seconds for pyarrow to read the shards and cut the same int64 micro-batches."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    t0 = time.perf_counter()
    col = pq.read_table(paths, columns=["input_ids"]).column("input_ids").combine_chunks()
    arr = np.asarray(col.values.to_numpy()).reshape(len(col), -1)
    order = np.random.default_rng(0).permutation(len(arr))
    rows = 0
    while rows < rows_wanted:
        for i in range(0, len(order) - mb + 1, mb):
            torch.from_numpy(arr[order[i : i + mb]].astype(np.int64))
            rows += mb
            if rows >= rows_wanted:
                break
    return time.perf_counter() - t0


def child_main(args: argparse.Namespace) -> None:
    import ray
    import ray.data

    from raytrn.train.checks import check_data

    bench = job_from_args(args)
    job = load_bench_job(bench)
    manifest = check_data(job)
    rows_wanted = (manifest.num_rows // bench.micro_batch_size) * bench.micro_batch_size
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    first = _raytrn_pass(job, manifest, 0, rows_wanted)  # cold: Ray Data's first execution
    ray_s, raw_s = [], []
    for epoch in range(1, args.repeats + 1):
        ray_s.append(_raytrn_pass(job, manifest, epoch, rows_wanted))
        raw_s.append(_raw_pass(manifest.shard_paths(), bench.micro_batch_size, rows_wanted))
    ray.shutdown()
    emit(
        {
            "rows_per_pass": rows_wanted,
            "raytrn_rows_per_s": [rows_wanted / s for s in ray_s],
            "raw_rows_per_s": [rows_wanted / s for s in raw_s],
            "raytrn_first_pass_s": first,
            "bytes": sum(s.bytes for s in manifest.shards),
        }
    )


def run(bench: BenchJob, *, repeats: int, training_tokens_per_s: float | None) -> dict[str, Any]:
    try:
        load_bench_job(bench)
    except Exception as e:
        raise Skip(f"no dataset for the data benchmark ({e}); run `make data` first") from None
    r = run_child("data", [*bench.as_args(), "--repeats", str(repeats)], threads=bench.threads, timeout_s=300)
    ray_rate, raw_rate = mean(r["raytrn_rows_per_s"]), mean(r["raw_rows_per_s"])
    ratios = [a / b for a, b in zip(r["raytrn_rows_per_s"], r["raw_rows_per_s"], strict=True)]
    out = {
        **r,
        "raytrn_rows_per_s_mean": ray_rate,
        "raw_rows_per_s_mean": raw_rate,
        "raytrn_over_raw": mean(ratios),
    }
    out.pop("_started_at", None)
    if training_tokens_per_s and ray_rate:
        job = load_bench_job(bench)
        out["headroom_vs_training"] = ray_rate / (training_tokens_per_s / job.data.seq_len)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.data")
    add_job_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
