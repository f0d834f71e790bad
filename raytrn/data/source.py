"""A data-parallel rank's rows, streamed by Ray Data in the job's global order (:mod:`raytrn.data.order`).

Every worker reads its own rows: one Ray Dataset per epoch whose read tasks are the windows of the epoch
order (one task per window, the rank's rows of it, in training order), planned from the manifest (no
listing, no footer reads before the first task). Ray Data streams them with bounded memory and prefetch;
order is preserved, so which rows a worker trains on is determined, never first-come. A small epoch
(:func:`read_here`) and the first window of a group's start are read by the worker itself, the same reads.

The read tasks reserve no CPU (``num_cpus=0``), with at most :data:`READ_CONCURRENCY` at a time per worker;
needing no resources, they run on the worker's own node (Ray's default policy prefers it). Training workers
commonly take every CPU slot of their nodes (one worker per core on a small node, or
``resources_per_worker: {CPU: N}``); read tasks that each wanted a whole CPU could then never be scheduled
and the job would hang forever waiting for its first batch. Token data is light (a 1B model on a trn1 node
consumes ~0.3 MB/s), so a few unreserved readers cost the training nothing measurable.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
from raytrn.errors import DataError


def _datasource_base() -> type:
    from ray.data import Datasource

    return Datasource


class RankDatasource(_datasource_base()):  # type: ignore[misc]
    """One epoch of one data-parallel rank's rows from position ``start``: a read task per window (the first
    ``skip`` windows left out: read already)."""

    def __init__(
        self, manifest: Manifest, order: SampleOrder, part: RankSlice, epoch: int, start: int = 0, skip: int = 0
    ) -> None:
        super().__init__()
        self._files = ShardFiles.of(manifest.shard_paths())
        self._columns = (manifest.column, *manifest.extra_columns)
        self._order, self._part, self._epoch, self._start = order, part, epoch, start
        self._windows = epoch_windows(order, part, epoch, start)[skip:]
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
                functools.partial(_read_window, self._files, self._columns, self._order, self._part, self._epoch, w, self._start),
                BlockMetadata(num_rows=n, size_bytes=n * self._row_bytes, input_files=None, exec_stats=None),
                per_task_row_limit=per_task_row_limit,
            )
            for w, n in self._windows
        ]  # fmt: skip

    def get_name(self) -> str:
        return "RaytrnRank"


def _read_window(
    files: ShardFiles,
    columns: tuple[str, ...],
    order: SampleOrder,
    part: RankSlice,
    epoch: int,
    window: Window,
    start: int,
) -> Iterator[Any]:
    yield read_plan(files, columns, plan_window(order, part, epoch, window, start))


#: Read tasks in flight at once per worker (each reads one window: a few row groups, milliseconds of work for
#: seconds of training; each task in flight is a Ray worker process).
READ_CONCURRENCY = 1


def read_rank_epoch(
    manifest: Manifest, order: SampleOrder, part: RankSlice, epoch: int, start: int = 0, skip: int = 0
) -> Any:
    """One epoch of ``part``'s rows from ``start`` as an ordered Ray Dataset (``input_ids``, ``row_id``),
    read by tasks that reserve no CPU (see the module docstring); the epoch's first ``skip`` windows left out."""
    import ray.data

    source = RankDatasource(manifest, order, part, epoch, start, skip)
    ds = ray.data.read_datasource(
        source,
        num_cpus=0,
        concurrency=max(1, min(READ_CONCURRENCY, source.num_tasks)),
        # One block per read task (a window's rows): Ray Data would otherwise split the output into ~1 MB blocks
        # to reach its minimum block count (read_op_min_num_blocks), each costing its own handoff.
        override_num_blocks=max(1, source.num_tasks),
    )
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = False  # a training worker's: the driver shows its own progress
    return ds


@dataclass(frozen=True)
class MicroBatch:
    """``rows`` consecutive rows of a rank's order: their token ids (int32, ``[rows, seq_len + 1]``, as stored),
    global row ids, and for instruction data the rows' ``loss_mask`` and ``segment_ids`` (same shape)."""

    tokens: np.ndarray
    row_ids: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.row_ids)

    def rows(self, lo: int, hi: int) -> MicroBatch:
        return MicroBatch(
            tokens=self.tokens[lo:hi], row_ids=self.row_ids[lo:hi], extra={k: v[lo:hi] for k, v in self.extra.items()}
        )

    @staticmethod
    def join(a: MicroBatch, b: MicroBatch) -> MicroBatch:
        return MicroBatch(
            tokens=np.concatenate([a.tokens, b.tokens]),
            row_ids=np.concatenate([a.row_ids, b.row_ids]),
            extra={k: np.concatenate([v, b.extra[k]]) for k, v in a.extra.items()},
        )


def rank_batches(
    manifest: Manifest,
    order: SampleOrder,
    part: RankSlice,
    position: Position,
    *,
    batch_rows: int,
    handover: threading.Event | None = None,
    read_here_bytes: int | None = None,
) -> Iterator[MicroBatch]:
    """Endless micro-batches of ``batch_rows`` rows of ``part`` from ``position``, epoch after epoch, through
    Ray Data (a dataset per epoch).

    Ray Data hands over whole blocks (one per read task: a window's rows, prefetched two ahead), turned into
    numpy arrays once; the micro-batches are slices of those. A background thread runs ahead of the consumer by a
    few blocks and across epoch boundaries, so the next epoch's dataset starts while the step still trains on the
    last one's rows. (Asking Ray Data for ``batch_rows`` at a time costs about a millisecond per batch in its
    iterator: measured, the read path was 0.03x of pyarrow's that way.)

    Until ``handover`` is set (the loop's first step is done; None: after the first window) windows are read here,
    the way a read task reads them: a group's start does not wait for Ray Data to start its task processes (~1 s
    each, more on a busy node) nor share the CPU with them; Ray Data takes over from the next window on. An epoch
    whose rows of ``part`` hold at most ``read_here_bytes`` (None: :data:`READ_HERE_BYTES`) is read here whole
    (:func:`read_here`)."""
    columns = (manifest.column, *manifest.extra_columns)
    files = ShardFiles.of(manifest.shard_paths())
    row_bytes = _row_bytes(manifest)

    def here() -> bool:
        return not (handover.is_set() if handover is not None else True)

    def blocks() -> Iterator[MicroBatch]:
        first = True
        for epoch, start in epochs_from(position):
            windows = epoch_windows(order, part, epoch, start)
            small = read_here(sum(n for _, n in windows) * row_bytes, read_here_bytes)
            skip = 0
            while skip < len(windows) and (first or here() or small):
                table = read_plan(files, columns, plan_window(order, part, epoch, windows[skip][0], start))
                yield block_arrays(table, manifest.column, manifest.row_len, manifest.extra_columns)
                first, skip = False, skip + 1
            if skip == len(windows):
                continue
            ds = read_rank_epoch(manifest, order, part, epoch, start, skip)
            for table in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
                yield block_arrays(table, manifest.column, manifest.row_len, manifest.extra_columns)

    return slices(ahead(blocks(), depth=BLOCKS_AHEAD), batch_rows)


#: Blocks (converted, waiting for the step) the background reader keeps ready, on top of Ray Data's prefetch.
BLOCKS_AHEAD = 2

#: An epoch of at most this many bytes of a rank's rows is read by the worker itself, not by Ray Data.
READ_HERE_BYTES = 64 << 20


def read_here(epoch_bytes: int, bound: int | None = None) -> bool:
    """Whether a rank reads an epoch of ``epoch_bytes`` (its rows of it, every column; at most ``bound``, None:
    :data:`READ_HERE_BYTES`) itself, window by window in the background reader's thread, instead of through a Ray
    Data dataset. Each epoch's dataset starts its read tasks' processes anew (Ray ends a task's idle process within
    a second or so when the node's workers outnumber its CPUs, as training workers that hold every CPU make them):
    measured on 2 cores, 3-4 processes per rank and epoch at ~1 CPU-second each, steps 5-10x slower for 2-5 s at
    every epoch boundary of a small dataset. A small epoch's read costs milliseconds (pyarrow, outside the GIL for
    the most part); a large one's stays with Ray Data (its reads in their own processes, overlapped with training),
    where a process start is nothing beside it."""
    return epoch_bytes <= (READ_HERE_BYTES if bound is None else bound)


def streams_through_ray_data(manifest: Manifest) -> bool:
    """Whether some rank of a run over ``manifest`` may read through Ray Data: only when an epoch of a rank's rows may
    be larger than :func:`read_here`'s bound (an epoch holds at most the dataset's rows, every rank's together). A
    run whose every epoch is read here never starts a Ray Data dataset, nor its stats actor."""
    return not read_here(manifest.num_rows * _row_bytes(manifest))


def _row_bytes(manifest: Manifest) -> int:
    """A row's bytes as a rank reads it: its token ids and its extra columns' (instruction data's masks)."""
    return manifest.row_len * np.dtype(manifest.dtype).itemsize * (1 + len(manifest.extra_columns))


def block_arrays(table: Any, column: str, row_len: int, extra: list[str] | tuple[str, ...] = ()) -> MicroBatch:
    """An Arrow block of a rank's rows (``column``, the ``extra`` columns and ``row_id``) as numpy arrays; DataError
    when its rows are not ``row_len`` tokens long."""
    rows = table.num_rows

    def matrix(name: str) -> np.ndarray:
        flat = np.concatenate([chunk.flatten().to_numpy() for chunk in table.column(name).chunks] or [[]])
        if len(flat) != rows * row_len:
            raise DataError(
                f"dataset rows are not {row_len} tokens (data.seq_len + 1) long; prepare the data with the job's "
                "seq_len"
            )
        return flat.reshape(rows, row_len)

    return MicroBatch(
        tokens=matrix(column), row_ids=table.column("row_id").to_numpy(), extra={name: matrix(name) for name in extra}
    )


def slices(blocks: Iterator[MicroBatch], rows: int) -> Iterator[MicroBatch]:
    """The rows of ``blocks``, in order, as micro-batches of ``rows`` rows (the last may be shorter): slices of each
    block, a piece left at the end of one joined to the start of the next."""
    carry: MicroBatch | None = None
    for block in blocks:
        if carry is not None:
            block, carry = MicroBatch.join(carry, block), None
        whole = len(block) // rows * rows
        for i in range(0, whole, rows):
            yield block.rows(i, i + rows)
        if whole < len(block):
            carry = block.rows(whole, len(block))
    if carry is not None:
        yield carry


def ahead(items: Iterator[Any], *, depth: int) -> Iterator[Any]:
    """``items``, produced by a background thread that stays up to ``depth`` items ahead of the consumer (its errors
    re-raised here). Closing the generator stops the thread (at its next item at the latest: never blocked on a full
    queue nobody reads)."""
    import queue
    import threading

    box: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(entry: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                box.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer(("item", item)):
                    return
            offer(("end", None))
        except BaseException as e:  # re-raised in the consumer
            offer(("error", e))

    thread = threading.Thread(target=produce, name="raytrn-data-ahead", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = box.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
