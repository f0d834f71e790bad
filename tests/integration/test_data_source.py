"""The manifest's Ray Data source: every row once, in manifest order, planned without listing or footers."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import FIXTURE_CORPUS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sharded_dataset(ray_session, tmp_path_factory) -> Path:
    """The fixture corpus in several small shards (so there are several read tasks and row groups)."""
    from raytrn.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "sharded"
    prepare_dataset(
        inputs=[str(FIXTURE_CORPUS)], output=str(out), seq_len=32, vocab_size=512, shard_size_mb=0.01, progress=False
    )
    return out


def _pyarrow_rows(manifest) -> list[list[int]]:
    """The baseline: every (local) shard read with pyarrow, in manifest order."""
    tables = [pq.read_table(p, columns=["input_ids"]) for p in manifest.shard_paths()]
    return pa.concat_tables(tables).column("input_ids").to_pylist()


def test_read_tasks_come_from_the_manifest(sharded_dataset: Path) -> None:
    from raytrn.data.manifest import load_manifest
    from raytrn.data.source import ShardsDatasource

    manifest = load_manifest(str(sharded_dataset))
    assert len(manifest.shards) >= 3, "the fixture should span several shards"
    source = ShardsDatasource(manifest)
    tasks = source.get_read_tasks(parallelism=1)
    assert [t.metadata.num_rows for t in tasks] == [s.rows for s in manifest.shards]  # one task per shard
    assert [t.metadata.input_files[0] for t in tasks] == [p for p in manifest.shard_paths()]
    assert source.estimate_inmemory_data_size() == manifest.num_rows * 4 * (manifest.row_len + 1)


def test_every_row_once_in_manifest_order(sharded_dataset: Path) -> None:
    import ray.data

    from raytrn.data.manifest import load_manifest
    from raytrn.data.source import read_shards

    manifest = load_manifest(str(sharded_dataset))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    try:
        rows = [list(r["input_ids"]) for r in read_shards(manifest).iter_rows()]
    finally:
        ctx.execution_options.preserve_order = False
    assert len(rows) == manifest.num_rows
    assert all(len(r) == manifest.row_len for r in rows)
    assert rows == _pyarrow_rows(manifest)


def test_reads_from_s3(sharded_dataset: Path, s3_bucket: str, s3_endpoint: str) -> None:
    import boto3

    from raytrn.data.manifest import load_manifest
    from raytrn.data.source import read_shards

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for path in sharded_dataset.iterdir():
        s3.upload_file(str(path), s3_bucket, f"sharded/{path.name}")
    manifest = load_manifest(f"s3://{s3_bucket}/sharded")
    assert read_shards(manifest).count() == manifest.num_rows
    total = sum(len(batch["input_ids"]) for batch in read_shards(manifest).iter_batches(batch_size=7))
    assert total == manifest.num_rows
