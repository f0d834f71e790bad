"""``RAYTRN_PACE_S``: a worker's feed hands out a micro-batch at most once per that many seconds (the chaos tests'
pace, raytrn.data.feed), the same rows in the same order; a bad value is one clear error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raytrn.config import JobSpec, load_job
from raytrn.data.feed import DataFeed
from raytrn.data.manifest import load_manifest
from raytrn.data.order import Position, pace_s
from raytrn.errors import ConfigError
from tests.conftest import REPO
from tests.unit.test_cli import make_dataset

pytestmark = pytest.mark.unit


def _job(tmp_path: Path, *extra: str) -> JobSpec:
    """The tiny job on a 16-row dataset made in ``tmp_path``/data (seq 32, vocabulary 512), with ``extra``."""
    data = make_dataset(tmp_path / "data", seq_len=32, vocab_size=512, rows=16)
    return load_job(REPO / "jobs" / "tiny.yaml", [f"data.manifest={data}", "data.seq_len=32", "model.vocab_size=512",
                                                  *extra])  # fmt: skip


def _rows(feed: DataFeed, n: int) -> tuple[list[list[int]], float]:
    """The first ``n`` micro-batches' token rows from the start, and the seconds they took."""
    batches = feed.batches(Position(epoch=0, samples=0))
    started = time.monotonic()
    rows = [next(batches).tolist() for _ in range(n)]  # [micro_batch_size, seq_len + 1] tokens
    return rows, time.monotonic() - started


def test_the_feed_spaces_its_micro_batches_and_keeps_their_rows(tmp_path: Path, monkeypatch) -> None:
    job = _job(tmp_path, "data.micro_batch_size=2", "data.grad_accum=null", "data.global_batch_size=4")
    feed = DataFeed(job, load_manifest(job.data.manifest), dp=1, dp_rank=0, global_batch=4)
    monkeypatch.delenv("RAYTRN_PACE_S", raising=False)
    flat_out, _ = _rows(feed, 4)
    monkeypatch.setenv("RAYTRN_PACE_S", "0.2")
    paced, seconds = _rows(feed, 4)
    assert seconds >= 3 * 0.2  # the first at once, each next one 0.2 s after the one before
    assert paced == flat_out and len({str(r) for r in paced}) == 4


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1s"])
def test_a_bad_pace_is_one_clear_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"RAYTRN_PACE_S=.*must be seconds, a number >= 0 \(unset it"):
        pace_s({"RAYTRN_PACE_S": value})


def test_a_run_with_a_bad_pace_stops_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    """The driver reads the pace first: no Ray, no run directory, no MLflow store."""
    from raytrn.train.trainer import run_training

    job = _job(tmp_path, f"checkpoint.storage={tmp_path / 'ckpt'}",
               f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}")  # fmt: skip
    monkeypatch.setenv("RAYTRN_PACE_S", "1s")
    with pytest.raises(ConfigError, match=r"RAYTRN_PACE_S='1s'"):
        run_training(job, live_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_no_pace_unless_set() -> None:
    assert pace_s({}) == 0.0 and pace_s({"RAYTRN_PACE_S": ""}) == 0.0 and pace_s({"RAYTRN_PACE_S": "0.15"}) == 0.15


def test_the_driver_forwards_its_pace_to_the_workers_even_zero() -> None:
    """A node that joins a cluster inherits whoever started it; a run's own pace, 0 too, reaches its workers in their
    runtime environment (the live test's reference run trains flat out on the nodes its paced run left)."""
    from raytrn.backends.worker_setup import driver_variables

    assert driver_variables({"RAYTRN_PACE_S": "0", "HOME": "/root"}) == {"RAYTRN_PACE_S": "0"}
    assert driver_variables({"RAYTRN_PACE_S": "0.15"}) == {"RAYTRN_PACE_S": "0.15"}
    assert "RAYTRN_PACE_S" not in driver_variables({})
