"""A rank's rows through Ray Data (raytrn.data.source): the planned rows in the planned order, from local disk or S3."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import FIXTURE_CORPUS, data_readers_ended

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


def _in_process(manifest, part, epoch: int, start: int = 0) -> list[list[int]]:
    """The baseline: the same plan read by pyarrow in this process."""
    from raytrn.data.order import SampleOrder, iter_rows, plan_epoch

    order = SampleOrder(shard_rows=[s.rows for s in manifest.shards], block_rows=4, seed=7, window_blocks=3)
    plans = plan_epoch(order, part, epoch, start)
    return [r for t in iter_rows(manifest.shard_paths(), "input_ids", plans) for r in t.column("row_id").to_pylist()]


def _order(manifest):
    from raytrn.data.order import SampleOrder

    # Blocks of 4 rows: many windows (read tasks) even on the small fixture.
    return SampleOrder(shard_rows=[s.rows for s in manifest.shards], block_rows=4, seed=7, window_blocks=3)


def test_read_tasks_are_the_windows_of_the_rank(sharded_dataset: Path) -> None:
    from raytrn.data.manifest import load_manifest
    from raytrn.data.order import RankSlice, epoch_windows
    from raytrn.data.source import RankDatasource

    manifest = load_manifest(str(sharded_dataset))
    assert len(manifest.shards) >= 3, "the fixture should span several shards"
    part = RankSlice(rank=1, size=2, global_batch=8)
    source = RankDatasource(manifest, _order(manifest), part, epoch=0, start=8)
    tasks = source.get_read_tasks(parallelism=1)
    windows = epoch_windows(_order(manifest), part, 0, 8)
    assert [t.metadata.num_rows for t in tasks] == [n for _, n in windows]
    assert source.num_rows == (manifest.num_rows - 8) // 8 * 4


@pytest.mark.parametrize("path", ["ray-data", "here"])
def test_ray_data_streams_the_ranks_rows_in_order(
    sharded_dataset: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Two ranks through Ray Data (an epoch over ``READ_HERE_BYTES``; the bound lowered to 0 here) while every CPU
    of the Ray is held, as training workers hold their nodes' (the read tasks reserve none: they still run), and
    read by the worker itself (a small epoch, the fixture's 73 kB): each gets its planned rows, in order, with their
    tokens."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from raytrn.data import source

    datasets: list[object] = []
    real = source.read_rank_epoch

    def counted(*args, **kwargs):  # the real read, counted
        datasets.append(real(*args, **kwargs))
        return datasets[-1]

    monkeypatch.setattr(source, "read_rank_epoch", counted)
    held = None
    if path == "ray-data":
        monkeypatch.setattr(source, "READ_HERE_BYTES", 0)
        held = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
        ray.get(held.ready(), timeout=60)
    try:
        _two_ranks_in_order(sharded_dataset)
        data_readers_ended()  # (not counted in the other variant)
    finally:
        if held is not None:
            remove_placement_group(held)
    # each rank: the rest of epoch 0 after its first window, then epoch 1 (and maybe 2, read ahead)
    assert (len(datasets) >= 4) if path == "ray-data" else not datasets


def _two_ranks_in_order(sharded_dataset: Path) -> None:
    from raytrn.data.manifest import load_manifest
    from raytrn.data.order import Position, RankSlice
    from raytrn.data.source import rank_batches

    manifest = load_manifest(str(sharded_dataset))
    every = pq.read_table(manifest.shard_paths()).column("input_ids").to_pylist()  # rows by global id
    for rank in range(2):
        part = RankSlice(rank=rank, size=2, global_batch=8)
        want = _in_process(manifest, part, 0, 8) + _in_process(manifest, part, 1)
        ids, rows = [], []
        batches = rank_batches(manifest, _order(manifest), part, Position(epoch=0, samples=8), batch_rows=2)
        for batch in batches:
            assert len(batch) == 2 and batch.tokens.shape == (2, manifest.row_len)
            ids += batch.row_ids.tolist()
            rows += batch.tokens.tolist()
            if len(ids) >= len(want):
                break
        batches.close()
        assert ids == want
        assert rows == [every[i] for i in ids]


def test_reads_from_s3(sharded_dataset: Path, s3_bucket: str, s3_endpoint: str) -> None:
    import boto3

    from raytrn.data.manifest import load_manifest
    from raytrn.data.order import RankSlice
    from raytrn.data.source import read_rank_epoch

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for path in sharded_dataset.iterdir():
        s3.upload_file(str(path), s3_bucket, f"sharded/{path.name}")
    manifest = load_manifest(f"s3://{s3_bucket}/sharded")
    part = RankSlice(rank=0, size=1, global_batch=7)
    ds = read_rank_epoch(manifest, _order(manifest), part, epoch=0)
    assert ds.take_all()[0]["input_ids"] is not None
    assert [r["row_id"] for r in ds.iter_rows()] == _in_process(manifest, part, 0)
    assert ds.count() == manifest.num_rows // 7 * 7
