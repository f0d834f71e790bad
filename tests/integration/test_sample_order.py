"""Exact data order across resizes, proven by sample ids (issue: exact elasticity).

A dataset whose rows carry their id in their first two tokens. One uninterrupted 1-worker run, and one run
that goes 2 workers -> a worker SIGKILLed mid-epoch (the job fails) -> resumed on 1 worker -> resumed on
3 workers. Every worker records each micro-batch's rows (``RAYTRN_SAMPLE_TRACE``); the test reads the ids
from the tokens the workers got, not from raytrn's bookkeeping:

(a) both runs train on the same global batch at every step (same ids, same order);
(b) every epoch has every id exactly once (the dataset is a whole number of global batches);
(c) the loss curves agree within 1e-4 (float reduction order differs between 1, 2 and 3 workers; measured
    5e-7 over 12 steps).
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrn.config import load_job
from tests.chaos._common import REPO, read_trace, train_in_thread, wait_until
from tests.conftest import mlflow_store

pytestmark = pytest.mark.integration

ROWS, GLOBAL_BATCH, STEPS = 192, 24, 16  # 8 steps per epoch: the runs go 2 epochs
LOSS_TOLERANCE = 1e-4


def _encode(i: int) -> list[int]:
    return [1 + i // 256, i % 256]  # vocab 512: ids up to 65k


def _decode(head: list[int]) -> int:
    return (head[0] - 1) * 256 + head[1]


@pytest.fixture(scope="module")
def id_dataset(tiny_dataset: Path, tmp_path_factory) -> Path:
    """The tiny dataset's manifest and tokenizer over two new shards (100 + 92 rows) whose row ``i`` starts
    with ``_encode(i)`` (the rest random tokens)."""
    from raytrn.data.manifest import MANIFEST_NAME, ShardInfo, load_manifest

    base = load_manifest(str(tiny_dataset))
    out = tmp_path_factory.mktemp("data") / "ids"
    out.mkdir()
    (out / base.tokenizer.file).write_bytes((tiny_dataset / base.tokenizer.file).read_bytes())
    rng = np.random.default_rng(0)
    shards, first = [], 0
    for k, rows in enumerate((100, 92)):
        tokens = rng.integers(0, 512, size=(rows, base.row_len), dtype=np.int32)
        tokens[:, :2] = [_encode(i) for i in range(first, first + rows)]
        offsets = np.arange(0, tokens.size + 1, base.row_len, dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens.reshape(-1)))
        name = f"shard-{k:05d}.parquet"
        pq.write_table(pa.table({"input_ids": column}), out / name)
        shards.append(ShardInfo(path=name, rows=rows, tokens=int(tokens.size), bytes=(out / name).stat().st_size))
        first += rows
    manifest = replace(
        base, shards=shards, num_rows=ROWS, num_tokens=ROWS * base.row_len, dropped_tail_tokens=0, rows_per_shard=100
    )
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    return out


def _job(dataset: Path, tmp: Path, name: str, workers: int, max_steps: int, *extra: str):
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        [
            f"data.manifest={dataset}",
            "data.seq_len=32",
            "data.micro_batch_size=4",
            "data.grad_accum=null",
            f"data.global_batch_size={GLOBAL_BATCH}",
            "model.vocab_size=512",
            f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}",
            f"checkpoint.storage={tmp / 'ckpt'}",
            "checkpoint.every_n_steps=3",
            "checkpoint.keep_last=null",
            f"tracking.mlflow_uri={mlflow_store(tmp / 'mlflow.db')}",
            "tracking.experiment=raytrn-order",
            f"tracking.run_name={name}",
            "tracking.log_model=false",
            "tracking.system_metrics=false",
            f"run.max_steps={max_steps}",
            "run.log_every=1",
            *extra,
        ],
    )


def _train(job, trace: Path, monkeypatch) -> None:
    from raytrn.train.trainer import run_training

    monkeypatch.setenv("RAYTRN_SAMPLE_TRACE", str(trace))
    run_training(job, live_progress=False)


def _trace(directory: Path) -> dict[int, list[int]]:
    """``{step: ids of its global batch}`` from the workers' records (see :func:`read_trace`), read from the tokens
    the workers got, and checked against the rows raytrn says it read."""
    out = {}
    for step, rows in read_trace(directory).items():
        ids = [_decode(head) for _, head in rows]
        assert ids == [row for row, _ in rows], "the rows a worker got are not the rows raytrn says it read"
        out[step] = ids
    return out


def _losses(job) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(job.tracking.mlflow_uri)
    exp = client.get_experiment_by_name("raytrn-order")
    [run] = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{job.run_name}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))


def _training_worker_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    workers = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
        timeout=30,
    )
    return [int(w.pid) for w in workers]


def _latest_step(trace: Path) -> int:
    lines = [line for p in trace.glob("*.jsonl") for line in p.read_text().splitlines() if line.endswith("}")]
    return max((json.loads(line)["step"] for line in lines), default=0)


def test_resized_run_trains_on_the_same_global_batches(ray_session, id_dataset, tmp_path, monkeypatch):
    ref_job = _job(id_dataset, tmp_path, "reference", 1, STEPS)
    _train(ref_job, tmp_path / "trace-ref", monkeypatch)
    reference = _trace(tmp_path / "trace-ref")
    assert sorted(reference) == list(range(1, STEPS + 1))

    name, trace = f"resized-{uuid.uuid4().hex[:6]}", tmp_path / "trace-resized"
    ckpt = tmp_path / "ckpt" / name
    # 2 workers, a worker SIGKILLed mid-epoch once step 5 trained (checkpoints every 3 steps): no retries, so
    # the job fails. The workers' pids are looked up first (seconds), so the kill follows step 5 at once.
    monkeypatch.setenv("RAYTRN_SAMPLE_TRACE", str(trace))
    thread, result = train_in_thread(_job(id_dataset, tmp_path, name, 2, STEPS, "scaling.max_failures=0"))
    try:
        wait_until(lambda: _latest_step(trace) >= 1, 240, "step 1")
        pids = _training_worker_pids()
        assert len(pids) == 2, pids
        # Looked at every 10 ms (a fast machine trains a step in ~30 ms): the kill lands a step or two after step 5,
        # long before the last checkpoint of the run.
        wait_until(lambda: (ckpt / "checkpoint_00000003").is_dir() and _latest_step(trace) >= 5, 120, "step 5",
                   poll_s=0.01)  # fmt: skip
        os.kill(pids[-1], signal.SIGKILL)
    finally:
        thread.join(timeout=240)
    assert not thread.is_alive() and "error" in result, result
    # The machine decides how far the 2 workers got before the kill: resume on 1 worker for two steps past
    # their last checkpoint (mid-epoch: 8 steps an epoch), then on 3 workers to the end.
    from raytrn.checkpoint.finder import newest_committed
    from raytrn.checkpoint.rundir import RunDir

    reached = newest_committed(RunDir(str(ckpt.parent), ckpt.name)).commit.step  # what the next run resumes from
    assert reached < STEPS - 3, f"the 2-worker run got to step {reached} before the kill"
    _train(_job(id_dataset, tmp_path, name, 1, reached + 2), trace, monkeypatch)
    resized_job = _job(id_dataset, tmp_path, name, 3, STEPS)
    _train(resized_job, trace, monkeypatch)  # on 3 workers to the end

    resized = _trace(trace)
    groups = sorted({p.stem.split("-")[2] for p in trace.glob("group-*.jsonl")})
    assert groups == ["dp1", "dp2", "dp3"], groups
    # (a) the same global batches, step by step
    assert resized == reference
    # (b) every epoch (8 steps): every id once
    for epoch in range(STEPS // 8):
        ids = sum((reference[s] for s in range(8 * epoch + 1, 8 * epoch + 9)), [])
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"
    # (c) the loss curves agree
    ref_loss, resized_loss = _losses(ref_job), _losses(resized_job)
    assert [s for s, _ in resized_loss] == list(range(1, STEPS + 1))
    assert [v for _, v in resized_loss] == pytest.approx([v for _, v in ref_loss], abs=LOSS_TOLERANCE)
