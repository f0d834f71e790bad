"""Which epochs a worker reads itself and which through Ray Data (``raytrn.data.source.read_here``): an epoch of at
most ``READ_HERE_BYTES`` of the rank's rows is read here, window by window, epoch after epoch; a larger one goes to
Ray Data after the start's first window. The same rows in the same order either way. No Ray: a larger epoch's Ray
Data dataset is a stand-in yielding what the real one yields (one Arrow table per window, the read task's own
``read_plan``); tests/integration/test_data_source.py streams both paths under a real Ray."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrn.data import source
from raytrn.data.manifest import Manifest, ShardInfo, SourceInfo, TokenizerInfo
from raytrn.data.order import Position, RankSlice, SampleOrder, ShardFiles, epoch_windows, plan_epoch, read_plan
from tests.conftest import data_readers_ended

pytestmark = pytest.mark.unit

SHARD_ROWS = [23, 9, 30]
ROW_LEN = 3
START = Position(epoch=0, samples=8)
EPOCHS = 3


def _dataset(root: Path) -> Manifest:
    """Shards whose global row ``i`` holds tokens ``[i, i + 1, i + 2]`` (row groups of 5 rows), and their manifest."""
    shards, first = [], 0
    for k, rows in enumerate(SHARD_ROWS):
        values = np.concatenate([np.arange(i, i + ROW_LEN) for i in range(first, first + rows)]).astype(np.int32)
        offsets = np.arange(0, values.size + 1, ROW_LEN, dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        pq.write_table(pa.table({"input_ids": column}), root / f"shard-{k}.parquet", row_group_size=5)
        shards.append(ShardInfo(path=f"shard-{k}.parquet", rows=rows, tokens=rows * ROW_LEN, bytes=1))
        first += rows
    return Manifest(
        seq_len=ROW_LEN - 1, row_len=ROW_LEN, num_rows=first, num_tokens=first * ROW_LEN, dropped_tail_tokens=0,
        rows_per_shard=max(SHARD_ROWS), shards=shards,
        tokenizer=TokenizerInfo(file="tokenizer.json", sha256="ab" * 32, vocab_size=512, eos_token="<eos>", eos_id=0,
                                trained=True),
        source=SourceInfo(inputs=["corpus/"], num_files=1, num_documents=1, fingerprint="cd" * 32),
        created_by="raytrn test", root=str(root),
    )  # fmt: skip


def _order() -> SampleOrder:
    return SampleOrder(shard_rows=SHARD_ROWS, block_rows=4, seed=5, window_blocks=2)  # 4 windows an epoch


def _epoch_bytes(part: RankSlice, epoch: int, start: int) -> int:
    return sum(n for _, n in epoch_windows(_order(), part, epoch, start)) * ROW_LEN * 4


def _planned(part: RankSlice) -> list[int]:
    """The rank's row ids through EPOCHS epochs from START, as planned."""
    starts = [(START.epoch, START.samples)] + [(e, 0) for e in range(1, EPOCHS)]
    return [i for e, s in starts for plan in plan_epoch(_order(), part, e, s) for i in plan.ids.tolist()]


def _read(manifest: Manifest, part: RankSlice, want: int) -> list[Any]:
    """``want`` rows' micro-batches of 2 from START, the loop's first step done (past the start's first window)."""
    stepped = threading.Event()
    stepped.set()
    batches = source.rank_batches(manifest, _order(), part, START, batch_rows=2, handover=stepped)
    out: list[Any] = []
    for batch in batches:
        out.append(batch)
        if sum(len(b) for b in out) >= want:
            break
    batches.close()
    data_readers_ended(30.0)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_small_epoch_is_read_here_every_epoch_in_the_planned_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    manifest, part = _dataset(tmp_path), RankSlice(rank=rank, size=2, global_batch=8)
    assert all(source.read_here(_epoch_bytes(part, e, 0)) for e in range(EPOCHS))  # 144 bytes an epoch

    def no_ray_data(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a small epoch was given to Ray Data")

    monkeypatch.setattr(source, "read_rank_epoch", no_ray_data)
    want = _planned(part)
    batches = _read(manifest, part, len(want))
    ids = [i for b in batches for i in b.row_ids.tolist()]
    assert ids == want
    assert [row[0] for b in batches for row in b.tokens.tolist()] == ids  # each row's own tokens


def test_a_larger_epoch_goes_to_ray_data_after_the_starts_first_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, part = _dataset(tmp_path), RankSlice(rank=1, size=2, global_batch=8)
    bound = _epoch_bytes(part, START.epoch, START.samples) - 1  # every epoch (from 8 or from 0) is over it
    monkeypatch.setattr(source, "READ_HERE_BYTES", bound)
    assert source.read_here(bound) and not source.read_here(bound + 1)
    asked: list[tuple[int, int, int]] = []
    files = ShardFiles.of(manifest.shard_paths())

    class Dataset:  # what read_rank_epoch returns, as the loop uses it: one table per read task (window), in order
        def __init__(self, epoch: int, start: int, skip: int) -> None:
            self.plans = list(plan_epoch(_order(), part, epoch, start))[skip:]

        def iter_batches(self, **options: Any) -> Any:
            assert options == {"batch_size": None, "batch_format": "pyarrow", "prefetch_batches": 2}
            return (read_plan(files, (manifest.column,), plan) for plan in self.plans)

    def ray_data(manifest_: Manifest, order: SampleOrder, part_: RankSlice, epoch: int, start: int = 0,
                 skip: int = 0) -> Dataset:  # fmt: skip
        asked.append((epoch, start, skip))
        return Dataset(epoch, start, skip)

    monkeypatch.setattr(source, "read_rank_epoch", ray_data)
    want = _planned(part)
    ids = [i for b in _read(manifest, part, len(want)) for i in b.row_ids.tolist()]
    assert ids == want
    # the start's first window read here, the rest of its epoch and every later epoch through Ray Data
    assert asked[:3] == [(0, 8, 1), (1, 0, 0), (2, 0, 0)]


def test_the_driver_knows_when_no_epoch_can_go_through_ray_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run over a dataset whose whole epoch is within the bound never starts a Ray Dataset (so the driver does not
    pin Ray Data's stats actor: a process of its own, detached, kept for the cluster's life); a rank's rows of an
    epoch are at most the dataset's, every column counted (an instruction set's masks too)."""
    manifest = _dataset(tmp_path)
    whole = manifest.num_rows * ROW_LEN * 4  # 62 rows of 3 int32 token ids
    assert not source.streams_through_ray_data(manifest)
    monkeypatch.setattr(source, "READ_HERE_BYTES", whole)
    assert not source.streams_through_ray_data(manifest)
    monkeypatch.setattr(source, "READ_HERE_BYTES", whole - 1)
    assert source.streams_through_ray_data(manifest)
    monkeypatch.setattr(source, "READ_HERE_BYTES", 2 * whole - 1)  # token ids and a mask column: twice the bytes
    assert not source.streams_through_ray_data(manifest)
    assert source.streams_through_ray_data(dataclasses.replace(manifest, extra_columns=["loss_mask"]))
