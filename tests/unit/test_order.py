"""The job's one global sample order (raytrn.data.order): the same global batches at every data-parallel size,
every row once per epoch, resumable at any size from (epoch, rows consumed); reads return the planned rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrn.data.order import (
    Position,
    RankSlice,
    SampleOrder,
    ShardFiles,
    epoch_windows,
    iter_rows,
    plan_epoch,
    plan_reads,
    read_plan,
)
from raytrn.errors import DataError


def _epoch_rows(order: SampleOrder, epoch: int) -> np.ndarray:
    """Every global row id in the epoch's order: its windows' rows, one window after another."""
    return np.concatenate([order.window_rows(epoch, w) for w in order.windows(epoch)])


def _global_batches(
    order: SampleOrder, size: int, global_batch: int, position: Position, steps: int
) -> list[list[int]]:
    """The global batches ``size`` ranks train on for ``steps`` steps from ``position``: each rank's rows of a
    step, concatenated in rank order (what the gradient all-reduce averages over)."""
    per_rank = []
    for rank in range(size):
        part = RankSlice(rank=rank, size=size, global_batch=global_batch)
        ids: list[int] = []
        for plan in plan_reads(order, part, position):
            ids.extend(plan.ids.tolist())
            if len(ids) >= steps * part.rows_per_step:
                break
        per_rank.append(ids)
    b = global_batch // size
    return [sum((per_rank[r][g * b : (g + 1) * b] for r in range(size)), []) for g in range(steps)]


def test_an_epoch_is_a_permutation_of_every_row() -> None:
    order = SampleOrder(shard_rows=[10, 7, 13], block_rows=4, seed=3, window_blocks=2)
    rows = _epoch_rows(order, 0)
    assert sorted(rows.tolist()) == list(range(30))
    assert rows.tolist() != list(range(30))
    assert _epoch_rows(order, 1).tolist() != rows.tolist()  # a new order every epoch
    assert (
        _epoch_rows(SampleOrder(shard_rows=[10, 7, 13], block_rows=4, seed=3, window_blocks=2), 0).tolist()
        == rows.tolist()
    )
    assert (
        _epoch_rows(SampleOrder(shard_rows=[10, 7, 13], block_rows=4, seed=4, window_blocks=2), 0).tolist()
        != rows.tolist()
    )


def test_no_shuffle_is_manifest_order() -> None:
    order = SampleOrder(shard_rows=[5, 6], block_rows=4, shuffle=False)
    assert _epoch_rows(order, 0).tolist() == _epoch_rows(order, 7).tolist() == list(range(11))


def test_window_rows_stay_within_their_blocks() -> None:
    order = SampleOrder(shard_rows=[16, 16], block_rows=4, seed=1, window_blocks=2)
    for w in order.windows(0):
        want = set()
        for b in w.blocks:
            block = order.blocks[b]
            want |= set(
                range(int(order.offsets[block.shard]) + block.start, int(order.offsets[block.shard]) + block.stop)
            )
        assert set(order.window_rows(0, w).tolist()) == want


@settings(max_examples=60, deadline=None)
@given(
    shard_rows=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    block_rows=st.integers(1, 9),
    window=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    micro=st.integers(1, 3),
    sizes=st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=2, max_size=3),
)
def test_global_batches_do_not_depend_on_the_data_parallel_size(shard_rows, block_rows, window, seed, micro, sizes):
    order = SampleOrder(shard_rows=shard_rows, block_rows=block_rows, seed=seed, window_blocks=window)
    global_batch = 12 * micro  # divisible by every size drawn
    if order.num_rows < global_batch:
        with pytest.raises(DataError, match="fewer than one global batch"):
            list(plan_epoch(order, RankSlice(rank=0, size=1, global_batch=global_batch), 0))
        return
    steps = order.num_rows // global_batch
    epoch = _epoch_rows(order, 0).tolist()
    want = [epoch[g * global_batch : (g + 1) * global_batch] for g in range(steps)]
    for size in sizes:
        assert _global_batches(order, size, global_batch, Position(), steps) == want


def test_every_row_once_per_epoch_and_the_tail_is_left_for_next_epoch() -> None:
    order = SampleOrder(shard_rows=[50, 50, 23], block_rows=8, seed=0)
    part = RankSlice(rank=0, size=1, global_batch=10)
    seen = np.concatenate([p.ids for p in plan_epoch(order, part, 0)])
    assert len(seen) == 120 and len(set(seen.tolist())) == 120  # 12 whole global batches, no repeats
    assert set(_epoch_rows(order, 0)[120:].tolist()).isdisjoint(seen.tolist())  # the last 3 rows wait


def test_resume_at_another_size_continues_at_the_next_row() -> None:
    """2 ranks for 5 steps, then 3 ranks from the saved position (mid-epoch), then 1 rank into the next epoch:
    the same global batches as 1 rank all along."""
    order = SampleOrder(shard_rows=[40, 33], block_rows=6, seed=11, window_blocks=3)
    B, steps_per_epoch = 6, 73 // 6
    reference = _global_batches(order, 1, B, Position(), 2 * steps_per_epoch)

    got, position = [], Position()
    for size, steps in ((2, 5), (3, 4), (1, 2 * steps_per_epoch - 9)):
        got += _global_batches(order, size, B, Position(epoch=position.epoch, samples=position.samples), steps)
        for _ in range(steps):
            position.advance(B, order.num_rows)
    assert got == reference
    assert position == Position(epoch=2, samples=0)


def test_position_moves_to_the_next_epoch_when_no_whole_batch_is_left() -> None:
    p = Position()
    for _ in range(3):
        p.advance(4, 14)
    assert p == Position(epoch=1, samples=0)  # 12 rows used, 2 left: fewer than a batch


def test_rank_counts_match_the_positions() -> None:
    for rank in range(3):
        part = RankSlice(rank=rank, size=3, global_batch=9)
        for lo, hi, start in [(0, 30, 0), (5, 31, 4), (10, 11, 2), (0, 3, 7)]:
            assert part.count(lo, hi, start) == len(part.positions(lo, hi, start))


def test_a_rank_slice_needs_a_divisible_global_batch() -> None:
    with pytest.raises(ValueError):
        RankSlice(rank=0, size=4, global_batch=10)
    with pytest.raises(ValueError):
        RankSlice(rank=4, size=4, global_batch=8)


def _write_shards(tmp_path: Path, shard_rows: list[int], row_len: int, group_rows: int) -> list[str]:
    """Shards whose row ``i`` (global) holds tokens ``[i, i + 1, ...]``: a row says which it is."""
    paths, first = [], 0
    for k, rows in enumerate(shard_rows):
        values = np.concatenate([np.arange(i, i + row_len) for i in range(first, first + rows)]).astype(np.int32)
        offsets = np.arange(0, values.size + 1, row_len, dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        path = tmp_path / f"shard-{k}.parquet"
        pq.write_table(pa.table({"input_ids": column}), path, row_group_size=group_rows)
        paths.append(str(path))
        first += rows
    return paths


def test_reads_return_the_planned_rows_in_order(tmp_path: Path) -> None:
    # Row groups (5 rows) that do not line up with the order's blocks (4 rows): reads still find each row.
    shard_rows = [23, 9, 30]
    paths = _write_shards(tmp_path, shard_rows, row_len=3, group_rows=5)
    order = SampleOrder(shard_rows=shard_rows, block_rows=4, seed=5, window_blocks=3)
    for rank in range(2):
        part = RankSlice(rank=rank, size=2, global_batch=8)
        plans = list(plan_epoch(order, part, 0, start=16))
        for plan, table in zip(plans, iter_rows(paths, "input_ids", iter(plans)), strict=True):
            firsts = [row[0] for row in table.column("input_ids").to_pylist()]
            assert firsts == plan.ids.tolist() == table.column("row_id").to_pylist()
        assert sum(len(p) for p in plans) == (62 - 16) // 8 * 4
    assert sum(n for _, n in epoch_windows(order, RankSlice(rank=0, size=2, global_batch=8), 0, 16)) == 20


def test_a_read_past_the_shard_is_an_error(tmp_path: Path) -> None:
    paths = _write_shards(tmp_path, [4], row_len=2, group_rows=2)
    order = SampleOrder(shard_rows=[6], block_rows=2, shuffle=False)  # the manifest says 6 rows, the file has 4
    plans = list(plan_epoch(order, RankSlice(rank=0, size=1, global_batch=6), 0))
    files = ShardFiles.of(paths)
    read_plan(files, "input_ids", plans[1])  # rows 2, 3: there
    with pytest.raises(DataError, match="row 5 of it, it has 4 rows"):
        read_plan(files, "input_ids", plans[2])


@pytest.mark.parametrize("sizes", [[5, 3, 8, 1, 7], [8, 8], [1, 1, 1, 1, 1, 1, 1, 1, 1], [], [3]])
def test_micro_batches_are_slices_of_the_blocks_in_order(sizes: list[int]) -> None:
    """Ray Data's blocks (one per read task) cut into micro-batches: every row once, in order, its tokens with it;
    whole batches but for the last; a piece left at a block's end joins the next block's start."""
    from raytrn.data.source import MicroBatch, slices

    ids = iter(range(sum(sizes)))
    blocks = []
    for n in sizes:
        rows = np.array([next(ids) for _ in range(n)], dtype=np.int64)
        blocks.append(MicroBatch(tokens=np.stack([rows, rows * 2]).T.astype(np.int32).reshape(n, 2), row_ids=rows))
    out = list(slices(iter(blocks), 4))
    assert [r for b in out for r in b.row_ids.tolist()] == list(range(sum(sizes)))
    assert all((b.tokens[:, 1] == 2 * b.row_ids).all() and b.tokens.shape == (len(b), 2) for b in out)
    assert all(len(b) == 4 for b in out[:-1]) and (not out or 0 < len(out[-1]) <= 4)


def test_blocks_become_arrays_and_odd_rows_are_refused() -> None:
    import pyarrow as pa

    from raytrn.data.source import block_arrays
    from raytrn.errors import DataError

    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int32())), "row_id": [7, 9]})
    block = block_arrays(table, "input_ids", 3)
    assert block.tokens.tolist() == [[1, 2, 3], [4, 5, 6]] and block.row_ids.tolist() == [7, 9]
    with pytest.raises(DataError, match="not 4 tokens .data.seq_len \\+ 1. long"):
        block_arrays(table, "input_ids", 4)


def test_ahead_runs_in_the_background_and_passes_errors_on() -> None:
    from raytrn.data.source import ahead

    assert list(ahead(iter(range(100)), depth=2)) == list(range(100))

    def broken():
        yield 1
        raise ValueError("bad shard")

    items = ahead(broken(), depth=2)
    assert next(items) == 1
    with pytest.raises(ValueError, match="bad shard"):
        next(items)


def test_a_closed_ahead_leaves_no_thread_behind() -> None:
    """The consumer stops early (a restart, a rollback, `raytrn stop`) while the producer has run to the end of its
    items with the queue full: its thread ends all the same (it waited forever to say "end" before), and so does one
    stopped mid-way or after its items raised."""
    import threading
    import time

    from raytrn.data.source import ahead

    def producers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "raytrn-data-ahead"]

    def broken():
        yield 1
        yield 2
        raise ValueError("bad shard")

    assert producers() == []
    for source in (iter([1, 2]), iter(range(1, 1000)), broken()):
        items = ahead(source, depth=1)
        assert next(items) == 1
        time.sleep(0.3)  # the producer fills the queue, then waits to hand over what comes next
        items.close()
        deadline = time.monotonic() + 5
        while producers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert producers() == [], source
