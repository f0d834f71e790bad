"""Data pipeline: raytrn's read path (Ray Data over the packed Parquet shards, the loop's batch iterator)
vs a raw ``pyarrow.parquet`` read of the same files into the same int64 batches, alternated, over the demo data's
shards repeated 20 times (~100 MB of tokens: a pass long enough for the per-epoch start of a Ray Dataset to weigh
what it weighs in a run), two epochs per pass; Ray Data's path always (a run's worker reads an epoch under
``raytrn.data.source.READ_HERE_BYTES`` itself: the 20 copies are over it, ``--quick``'s 2 are not).

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


def _raytrn_pass(job: Any, manifest: Any, epochs: int) -> tuple[float, int]:
    """Seconds to draw ``epochs`` epochs of rows through the loop's own path, and the rows: Ray Data streaming one
    rank's rows of the job's global order (:mod:`raytrn.data.source`), cut into int64 micro-batches as the loop
    makes them (one iterator across the epochs, as a run has)."""
    import numpy as np
    import torch

    from raytrn.data.order import Position, RankSlice, SampleOrder
    from raytrn.data.source import rank_batches

    mb = job.data.micro_batch_size
    part = RankSlice(rank=0, size=1, global_batch=mb)
    order = SampleOrder.for_job(manifest, job)
    # Ray Data's path whatever the size (``--quick``'s 2 copies would be a small epoch, read by the worker itself)
    batches = rank_batches(manifest, order, part, Position(epoch=0), batch_rows=mb, read_here_bytes=0)
    wanted = epochs * (manifest.num_rows // mb * mb)
    t0, rows = time.perf_counter(), 0
    while rows < wanted:
        rows += len(torch.from_numpy(next(batches).tokens.astype(np.int64)))
    seconds = time.perf_counter() - t0
    batches.close()  # type: ignore[attr-defined]  # a generator (raytrn.data.source.slices)
    return seconds, rows


def _raw_pass(paths: list[str], mb: int, epochs: int) -> tuple[float, int]:
    """Seconds for pyarrow to read the shards and cut the same int64 micro-batches, ``epochs`` times over (a new
    row order each time), and the rows."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    t0, rows = time.perf_counter(), 0
    for epoch in range(epochs):
        col = pq.read_table(paths, columns=["input_ids"]).column("input_ids").combine_chunks()
        arr = np.asarray(col.values.to_numpy()).reshape(len(col), -1)
        order = np.random.default_rng(epoch).permutation(len(arr))
        for i in range(0, len(order) - mb + 1, mb):
            rows += len(torch.from_numpy(arr[order[i : i + mb]].astype(np.int64)))
    return time.perf_counter() - t0, rows


def _replicated(manifest: Any, copies: int, out: str) -> Any:
    """A dataset of ``copies`` copies of ``manifest``'s shards (hard links, or copies across filesystems: a manifest
    refuses symlinks out of its directory), so the pipeline streams enough data for its per-epoch start to count
    as it does in a run, not dominate."""
    import shutil
    from dataclasses import replace

    from raytrn.data.manifest import MANIFEST_NAME, load_manifest

    os.makedirs(out, exist_ok=True)
    shards = []
    for k in range(copies):
        for i, shard in enumerate(manifest.shards):
            name = f"copy{k:03d}-{i:05d}.parquet"
            _link(os.path.join(manifest.root, shard.path), os.path.join(out, name), shutil.copyfile)
            shards.append(replace(shard, path=name))
    _link(manifest.tokenizer_path, os.path.join(out, manifest.tokenizer.file), shutil.copyfile)
    copy = replace(
        manifest, shards=shards, num_rows=manifest.num_rows * copies, num_tokens=manifest.num_tokens * copies
    )
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        f.write(copy.to_json())
    return load_manifest(out)


def _link(src: str, dst: str, copy: Any) -> None:
    try:
        os.link(src, dst)
    except OSError:
        copy(src, dst)


def child_main(args: argparse.Namespace) -> None:
    import tempfile

    import ray
    import ray.data

    from raytrn.train.checks import check_data

    bench = job_from_args(args)
    job = load_bench_job(bench)
    base = check_data(job)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-data-") as tmp:
        manifest = _replicated(base, args.copies, tmp)
        first, _ = _raytrn_pass(job, manifest, 1)  # cold: Ray Data's first execution, the worker processes
        ray_rate, raw_rate = [], []
        for _ in range(args.repeats):
            seconds, rows = _raytrn_pass(job, manifest, args.epochs)
            ray_rate.append(rows / seconds)
            seconds, rows = _raw_pass(manifest.shard_paths(), bench.micro_batch_size, args.epochs)
            raw_rate.append(rows / seconds)
    # The result first: a stream the last pass left prefetching (the next epoch's, on Ray Data's own thread) may
    # end this process hard when Ray shuts down under it ("the core worker has already been shutdown"), which
    # CI saw once as "exited 1 without a result".
    emit(
        {
            "rows_per_epoch": manifest.num_rows,
            "epochs_per_pass": args.epochs,
            "copies": args.copies,
            "raytrn_rows_per_s": ray_rate,
            "raw_rows_per_s": raw_rate,
            "raytrn_first_pass_s": first,
            "bytes": sum(s.bytes for s in manifest.shards),
        }
    )
    ray.shutdown()


def run(
    bench: BenchJob, *, repeats: int, training_tokens_per_s: float | None, copies: int = 20, epochs: int = 2
) -> dict[str, Any]:
    try:
        load_bench_job(bench)
    except Exception as e:
        raise Skip(f"no dataset for the data benchmark ({e}); run `make data` first") from None
    r = run_child(
        "data",
        [*bench.as_args(), "--repeats", str(repeats), "--copies", str(copies), "--epochs", str(epochs)],
        threads=bench.threads,
        timeout_s=600,
    )
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
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
