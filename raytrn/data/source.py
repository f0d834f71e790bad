"""A data-parallel rank's rows, streamed by Ray Data in the job's global order (:mod:`raytrn.data.order`).

Every worker reads its own rows: one Ray Dataset per epoch whose read tasks are the windows of the epoch
order (one task per window, the rank's rows of it, in training order), planned from the manifest (no
listing, no footer reads before the first task). Ray Data streams them with bounded memory and prefetch;
order is preserved, so which rows a worker trains on is determined, never first-come.

The read tasks reserve no CPU (``num_cpus=0``), with at most :data:`READ_CONCURRENCY` at a time per worker;
needing no resources, they run on the worker's own node (Ray's default policy prefers it). Training workers
commonly take every CPU slot of their nodes (one worker per core on a small node, or
``resources_per_worker: {CPU: N}``); read tasks that each wanted a whole CPU could then never be scheduled
and the job would hang forever waiting for its first batch. Token data is light (a 1B model on a trn1 node
consumes ~0.3 MB/s), so a few unreserved readers cost the training nothing measurable.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from raytrn.data.manifest import Manifest
from raytrn.data.order import (
    Position,
    RankSlice,
    SampleOrder,
    ShardFiles,
    Window,
    epoch_windows,
    epochs_from,
    plan_window,
    read_plan,
)


def _datasource_base() -> type:
    from ray.data import Datasource

    return Datasource


class RankDatasource(_datasource_base()):  # type: ignore[misc]
    """One epoch of one data-parallel rank's rows from position ``start``: a read task per window."""

    def __init__(self, manifest: Manifest, order: SampleOrder, part: RankSlice, epoch: int, start: int = 0) -> None:
        super().__init__()
        self._files = ShardFiles.of(manifest.shard_paths())
        self._column = manifest.column
        self._order, self._part, self._epoch, self._start = order, part, epoch, start
        self._windows = epoch_windows(order, part, epoch, start)
        # int32 on disk; Arrow holds the same bytes in memory (a list column: values + offsets), plus the row id.
        self._row_bytes = 4 * (manifest.row_len + 1) + 8

    @property
    def num_tasks(self) -> int:
        return len(self._windows)

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self._windows)

    def estimate_inmemory_data_size(self) -> int:
        return self.num_rows * self._row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[Any]:
        from ray.data import ReadTask
        from ray.data.block import BlockMetadata

        return [
            ReadTask(
                functools.partial(_read_window, self._files, self._column, self._order, self._part, self._epoch, w, self._start),
                BlockMetadata(num_rows=n, size_bytes=n * self._row_bytes, input_files=None, exec_stats=None),
                per_task_row_limit=per_task_row_limit,
            )
            for w, n in self._windows
        ]  # fmt: skip

    def get_name(self) -> str:
        return "RaytrnRank"


def _read_window(
    files: ShardFiles, column: str, order: SampleOrder, part: RankSlice, epoch: int, window: Window, start: int
) -> Iterator[Any]:
    yield read_plan(files, column, plan_window(order, part, epoch, window, start))


#: Read tasks in flight at once per worker (each reads one window: a few row groups).
READ_CONCURRENCY = 2


def read_rank_epoch(manifest: Manifest, order: SampleOrder, part: RankSlice, epoch: int, start: int = 0) -> Any:
    """One epoch of ``part``'s rows from ``start`` as an ordered Ray Dataset (``input_ids``, ``row_id``),
    read by tasks that reserve no CPU (see the module docstring)."""
    import ray.data

    source = RankDatasource(manifest, order, part, epoch, start)
    ds = ray.data.read_datasource(
        source,
        num_cpus=0,
        concurrency=max(1, min(READ_CONCURRENCY, source.num_tasks)),
    )
    ds.context.execution_options.preserve_order = True
    return ds


def rank_tables(
    manifest: Manifest, order: SampleOrder, part: RankSlice, position: Position, *, batch_rows: int
) -> Iterator[Any]:
    """Endless Arrow tables of ``batch_rows`` rows of ``part`` from ``position``, epoch after epoch, through
    Ray Data (a dataset per epoch).

    Ray Data hands over whole blocks (one per read task: a window's rows, prefetched two ahead); the micro-batches
    are zero-copy slices of them cut here. Asking Ray Data for ``batch_rows`` at a time instead costs about a
    millisecond per batch in its iterator (measured: the read path was 0.03x of pyarrow's that way)."""
    for epoch, start in epochs_from(position):
        ds = read_rank_epoch(manifest, order, part, epoch, start)
        blocks = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)
        yield from slices(blocks, batch_rows)


def slices(tables: Iterator[Any], rows: int) -> Iterator[Any]:
    """The rows of ``tables``, in order, as tables of ``rows`` rows (the last may be shorter): slices of each
    table, a piece left at the end of one joined to the start of the next."""
    import pyarrow as pa

    carry = None
    for table in tables:
        if carry is not None:
            table, carry = pa.concat_tables([carry, table]), None
        whole = len(table) // rows * rows
        for i in range(0, whole, rows):
            yield table.slice(i, rows)
        if whole < len(table):
            carry = table.slice(whole)
    if carry is not None:
        yield carry
