"""S3 unavailable during a checkpoint (the moto server behind a proxy that is cut): the save is retried with
backoff and committed once S3 answers again; past the retry budget it is left uncommitted, training goes on,
and the next save commits. No half checkpoint is ever the one a resume picks. One process, no Ray."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

from raytrn import storage
from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import manifest
from raytrn.checkpoint.finder import resume_point
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.config import load_job
from raytrn.train.build import build_training
from raytrn.train.schedule import Schedule
from raytrn.train.step import train_step
from tests.outage_proxy import OutageProxy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def proxy(s3_endpoint, s3_bucket, monkeypatch):
    target = urlparse(s3_endpoint)
    p = OutageProxy((target.hostname, target.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    yield p
    p.close()


def _training(bucket: str, *overrides: str) -> tuple[Any, Any]:
    job = load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=unused", "data.seq_len=16", "model.vocab_size=512", "scaling.min_workers=1",
         "scaling.max_workers=1", f"checkpoint.storage=s3://{bucket}/ckpt", "tracking.run_name=outage",
         "checkpoint.keep_last=null", *overrides],
        resolve=False,
    )  # fmt: skip
    t = build_training(job, CpuBackend(), world_size=1)
    rows = torch.randint(0, 512, (16, 17), generator=torch.Generator().manual_seed(0))
    train_step(t, iter([rows]), CpuBackend())
    return job, t


def _save(job: Any, t: Any, step: int) -> list[Any]:
    """A save, then its retention round (beside the next steps in training) waited for."""
    saved = list(t.checkpoints.save(t, Progress(step=step), Schedule.from_job(job), {}, final=False))
    t.checkpoints.settle()
    return saved


def test_an_upload_during_an_outage_is_retried_with_backoff(proxy, s3_bucket, caplog) -> None:
    """raytrn's own S3 writes (every checkpoint file goes up through S3Upload)."""
    import boto3

    outage = proxy.cut_in_background(2.5)
    time.sleep(0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="raytrn.storage"):
        upload = storage.S3Upload(f"{s3_bucket}/during-outage")
        upload.write(b"x" * 1000)
        upload.finish()
    took = time.monotonic() - started
    outage.join()
    assert took >= 2.0, took
    assert f"S3 put_object s3://{s3_bucket}/during-outage" in caplog.text and "retrying for up to 120 s" in caplog.text
    body = boto3.client("s3", endpoint_url=proxy.url).get_object(Bucket=s3_bucket, Key="during-outage")["Body"]
    assert body.read() == b"x" * 1000


def test_a_save_during_an_outage_waits_it_out_and_commits(proxy, s3_bucket) -> None:
    job, t = _training(s3_bucket)
    assert [s.step for s in _save(job, t, 1)] == [1]
    outage = proxy.cut_in_background(3.0)
    time.sleep(0.2)
    started = time.monotonic()
    saved = _save(job, t, 2)
    took = time.monotonic() - started
    outage.join()
    assert [s.step for s in saved] == [2] and took >= 2.0, took  # it waited for S3, and committed
    chosen = resume_point(job, rank=0, world_size=1)  # sha256 of every file, read back from S3
    assert chosen.commit.step == 2 and set(chosen.commit.files) == {".metadata", "__0_0.distcp"}


def test_past_the_retry_budget_the_save_is_skipped_and_the_next_commits(proxy, s3_bucket, monkeypatch) -> None:
    job, t = _training(s3_bucket)
    assert [s.step for s in _save(job, t, 1)] == [1]
    monkeypatch.setattr(storage, "RETRY_BUDGET_S", 1.0)  # raytrn's own retries of its uploads ...
    monkeypatch.setattr(storage, "S3_ATTEMPTS", 1)  # ... and pyarrow's of the listing and directory calls
    outage = proxy.cut_in_background(60.0)  # until the save gave up (ended below)
    time.sleep(0.2)
    assert _save(job, t, 2) == []  # failed after its retries: nothing reported
    assert t.checkpoints.failed == 1
    proxy.end()
    outage.join()
    run = RunDir.of(job)
    assert not manifest.is_committed(run.dcp_step(2))
    assert resume_point(job, rank=0, world_size=1).commit.step == 1  # never the half-written one
    assert [s.step for s in _save(job, t, 3)] == [3]
    assert resume_point(job, rank=0, world_size=1).commit.step == 3
    assert 2 not in run.dcp_steps()  # the leftover went with the next commit's retention


def test_the_filesystem_sent_to_ray_keeps_its_retries(proxy, s3_bucket) -> None:
    """Ray Train's controller writes its checkpoint list to S3 with the filesystem raytrn passes it (pickled): a
    plain pyarrow S3FileSystem loses its retry strategy on the way (pyarrow 25) and fails on an outage; the
    portable one rebuilds it. The plain one's outage lasts until it has failed: the strategy it falls back to (the
    AWS SDK's standard one, 3 attempts) waits a random 0-1 s, then 0-2 s, between them, so it outlasted 2.8 s of a
    3 s outage now and then (CI, stop 55), and gives up within 4.8 s (here)."""
    import pickle

    import pyarrow.fs as pafs

    plain = pickle.loads(pickle.dumps(storage.s3_filesystem()))
    portable = pickle.loads(pickle.dumps(storage.portable_filesystem(f"s3://{s3_bucket}/x")[0]))
    assert isinstance(portable, pafs.PyFileSystem)
    for fs, survives, seconds in ((plain, False, 60.0), (portable, True, 3.0)):
        outage = proxy.cut_in_background(seconds)
        time.sleep(0.2)
        started = time.monotonic()
        try:
            with fs.open_output_stream(f"{s3_bucket}/snapshot.json") as f:
                f.write(b"{}")
            ok = True
        except OSError:
            ok = False
        took = time.monotonic() - started
        if not survives:
            proxy.end()  # it gave up: the outage need not go on
            # far short of the outage (60 s): it has no retries worth the name (4.8 s at most measured here; the
            # bound leaves a machine twice as slow its margin)
            assert took < 10.0, took
        outage.join()
        assert ok == survives, fs
    assert portable.get_file_info(f"{s3_bucket}/snapshot.json").size == 2
