"""The order a job trains on its rows: one global sequence per epoch, the same at every world size.

Per epoch ``e`` the dataset's rows are put in one order, a pure function of the manifest (rows per shard),
``run.seed``, ``e`` and the shuffle settings; never of the number of workers:

1. The shards are cut into *blocks* of :func:`raytrn.data.manifest.rows_per_group` rows (a Parquet row
   group of a raytrn dataset, ~8 MiB of tokens; a shard's last block is shorter).
2. ``data.shuffle``: the blocks are permuted (seeded by ``seed, e``); then consecutive *windows* of
   ``data.shuffle_window`` blocks have their rows permuted together (seeded by ``seed, e, window``).
   ``shuffle: false``: manifest order, row by row.
3. The sequence is cut into *global batches* of ``B`` rows (``data.global_batch_size``, or micro x accum x DP);
   the rows after the last whole global batch of an epoch are not trained on in that epoch (a different
   ``N mod B`` rows each epoch when shuffled).
4. Data-parallel rank ``r`` of ``D`` trains on rows ``[r * B/D, (r + 1) * B/D)`` of each global batch, as
   consecutive micro-batches. The ranks of a tensor-parallel group share a data-parallel rank: they read
   the same rows.

Where a run is, is ``(epoch, samples consumed in the epoch)`` (:class:`Position`), saved with every
checkpoint: a run resumed at any data-parallel size continues at the exact next row. A window is the unit
of reading: a rank reads the row groups of a window and keeps its own rows, so storage serves each row
group to every data-parallel rank (token data is light; see README "Data order").

Pure (numpy and pyarrow, no Ray, no torch): the driver, ``raytrn precheck`` and the tests use it as it is;
:mod:`raytrn.data.source` streams the same reads through Ray Data on the workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raytrn import storage
from raytrn.data.manifest import rows_per_group
from raytrn.errors import ConfigError, DataError

#: Set to a directory, every training worker writes there which rows each of its micro-batches held (JSON lines,
#: ``raytrn.train.loop``; the driver forwards it to the workers): an audit of what a run trained on.
SAMPLE_TRACE_ENV = "RAYTRN_SAMPLE_TRACE"
#: Seconds: every training worker's feed hands out a micro-batch at most once per this many (``raytrn.data.feed``; the
#: driver forwards it too). A test's pace: the chaos tests' tiny model would otherwise train flat out on 2 shared
#: cores, starving what a recovery starts (a worker's process and imports) and training hundreds of steps the
#: uninterrupted reference run must train again.
PACE_ENV = "RAYTRN_PACE_S"
#: Row-order streams are keyed by these tags, so the block and the row permutations never share one.
_BLOCKS, _ROWS = 0, 1


def pace_s(environ: Mapping[str, str]) -> float:
    """``RAYTRN_PACE_S`` in ``environ``: the seconds a worker's feed spaces its micro-batches by (0: not set)."""
    value = environ.get(PACE_ENV) or "0"
    try:
        pace = float(value)
    except ValueError:
        pace = -1.0
    if not pace >= 0:  # (NaN too)
        raise ConfigError(f"{PACE_ENV}={value!r}: must be seconds, a number >= 0 (unset it to train at full speed)")
    return pace


@dataclass(kw_only=True)
class Position:
    """Where a run is in its data: ``epoch`` (0-based) and the rows of it consumed so far."""

    epoch: int = 0
    samples: int = 0

    def advance(self, global_batch: int, num_rows: int) -> None:
        """One optimizer step consumed ``global_batch`` rows: move on, into the next epoch when fewer than
        a whole global batch is left in this one."""
        self.samples += global_batch
        if self.samples + global_batch > num_rows:
            self.epoch, self.samples = self.epoch + 1, 0


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of shard ``shard``."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class Window:
    """Blocks whose rows are shuffled together; its rows sit at epoch positions ``[start, start + rows)``."""

    index: int
    start: int
    rows: int
    blocks: tuple[int, ...]


@dataclass
class SampleOrder:
    """The epoch orders of a dataset (see the module docstring). ``shard_rows``: rows per shard, in manifest
    order; global row ids count through the shards in that order."""

    shard_rows: Sequence[int]
    block_rows: int
    seed: int = 0
    shuffle: bool = True
    window_blocks: int = 4
    blocks: list[Block] = field(init=False)
    offsets: np.ndarray = field(init=False)  # global row id of each shard's first row

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.window_blocks < 1:
            raise ValueError(f"block_rows ({self.block_rows}) and window_blocks ({self.window_blocks}) must be >= 1")
        self.blocks = [
            Block(shard, start, min(start + self.block_rows, rows))
            for shard, rows in enumerate(self.shard_rows)
            for start in range(0, rows, self.block_rows)
        ]
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(self.shard_rows, dtype=np.int64))])

    @classmethod
    def for_job(cls, manifest: Any, job: Any) -> SampleOrder:
        """The order of ``job`` (its seed and ``data`` settings) over ``manifest``'s rows."""
        return cls(
            shard_rows=[s.rows for s in manifest.shards],
            block_rows=rows_per_group(manifest.row_len),
            seed=job.run.seed,
            shuffle=job.data.shuffle,
            window_blocks=job.data.shuffle_window,
        )

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, *key])))

    def windows(self, epoch: int) -> list[Window]:
        """The epoch's windows, in order."""
        order = np.arange(len(self.blocks))
        if self.shuffle:
            order = self._rng(epoch, _BLOCKS).permutation(len(self.blocks))
        per = self.window_blocks if self.shuffle else 1
        out, start = [], 0
        for index, first in enumerate(range(0, len(order), per)):
            ids = tuple(int(b) for b in order[first : first + per])
            rows = sum(self.blocks[b].stop - self.blocks[b].start for b in ids)
            out.append(Window(index=index, start=start, rows=rows, blocks=ids))
            start += rows
        return out

    def window_rows(self, epoch: int, window: Window) -> np.ndarray:
        """Global row ids of ``window``'s positions, in epoch order."""
        ids = np.concatenate(
            [
                np.arange(self.offsets[b.shard] + b.start, self.offsets[b.shard] + b.stop)
                for b in map(self.blocks.__getitem__, window.blocks)
            ]  # fmt: skip
        )
        if self.shuffle:
            ids = ids[self._rng(epoch, _ROWS, window.index).permutation(len(ids))]
        return ids

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row within the shard) of global row ids."""
        shard = np.searchsorted(self.offsets, rows, side="right") - 1
        return shard, rows - self.offsets[shard]


@dataclass(frozen=True)
class RankSlice:
    """Which rows of the epoch order data-parallel rank ``rank`` of ``size`` trains on: its share of every
    global batch of ``global_batch`` rows from epoch position ``start`` on."""

    rank: int
    size: int
    global_batch: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or self.global_batch % self.size:
            raise ValueError(f"rank {self.rank} of {self.size} with a global batch of {self.global_batch} rows")

    @property
    def rows_per_step(self) -> int:
        return self.global_batch // self.size

    def epoch_end(self, start: int, num_rows: int) -> int:
        """The position after the last whole global batch of an epoch read from ``start``."""
        return start + (num_rows - start) // self.global_batch * self.global_batch

    def count(self, lo: int, hi: int, start: int) -> int:
        """How many of this rank's positions lie in ``[lo, hi)`` (global batches begin at ``start``)."""

        def before(x: int) -> int:
            n = max(0, x - start)
            return n // self.global_batch * self.rows_per_step + min(
                max(0, n % self.global_batch - self.rank * self.rows_per_step), self.rows_per_step
            )

        return max(0, before(hi) - before(max(lo, start)))

    def positions(self, lo: int, hi: int, start: int) -> np.ndarray:
        """This rank's epoch positions in ``[lo, hi)``, for global batches that begin at ``start``."""
        q = np.arange(max(lo, start), hi, dtype=np.int64)
        return q[(q - start) % self.global_batch // self.rows_per_step == self.rank]


@dataclass(frozen=True)
class ReadPlan:
    """One read: the rows a rank takes from one window, as (shard, row in shard), in training order."""

    epoch: int
    window: int
    shards: np.ndarray
    rows: np.ndarray
    ids: np.ndarray  # global row ids (the same rows)

    def __len__(self) -> int:
        return len(self.ids)


def epoch_windows(order: SampleOrder, part: RankSlice, epoch: int, start: int = 0) -> list[tuple[Window, int]]:
    """The windows of epoch ``epoch`` holding rows of ``part`` from position ``start`` on (whole global batches
    only), each with how many; DataError when less than one global batch is left."""
    if order.num_rows - start < part.global_batch:
        raise DataError(
            f"epoch {epoch} from row {start:,}: {order.num_rows - start:,} rows left, fewer than one global batch "
            f"({part.global_batch:,} rows); the dataset must hold at least one global batch: prepare more data "
            "or lower data.global_batch_size"
        )
    end = part.epoch_end(start, order.num_rows)
    out = []
    for w in order.windows(epoch):
        n = part.count(w.start, min(w.start + w.rows, end), start)
        if n:
            out.append((w, n))
    return out


def plan_window(order: SampleOrder, part: RankSlice, epoch: int, window: Window, start: int = 0) -> ReadPlan:
    """What ``part`` reads of ``window`` (epoch ``epoch``, global batches from ``start``)."""
    end = part.epoch_end(start, order.num_rows)
    mine = part.positions(window.start, min(window.start + window.rows, end), start)
    ids = order.window_rows(epoch, window)[mine - window.start]
    shards, rows = order.locate(ids)
    return ReadPlan(epoch=epoch, window=window.index, shards=shards, rows=rows, ids=ids)


def plan_epoch(order: SampleOrder, part: RankSlice, epoch: int, start: int = 0) -> Iterator[ReadPlan]:
    """The reads of ``part`` through epoch ``epoch`` from position ``start``."""
    for w, _ in epoch_windows(order, part, epoch, start):
        yield plan_window(order, part, epoch, w, start)


def epochs_from(position: Position) -> Iterator[tuple[int, int]]:
    """``(epoch, first position)`` from ``position`` on: the rest of its epoch, then whole epochs, endlessly."""
    epoch, start = position.epoch, position.samples
    while True:
        yield epoch, start
        epoch, start = epoch + 1, 0


def plan_reads(order: SampleOrder, part: RankSlice, position: Position) -> Iterator[ReadPlan]:
    """Endless reads of ``part`` from ``position``: the rest of its epoch, then whole epochs."""
    for epoch, start in epochs_from(position):
        yield from plan_epoch(order, part, epoch, start)


@dataclass(frozen=True)
class ShardFiles:
    """The shards' filesystem (resolved once, where the job starts: it carries the S3 endpoint to the readers)
    and the paths inside it, in manifest order."""

    fs: Any
    paths: tuple[str, ...]

    @classmethod
    def of(cls, shard_paths: Sequence[str]) -> ShardFiles:
        if not shard_paths:
            return cls(fs=None, paths=())
        fs, _ = storage.portable_filesystem(shard_paths[0])  # it travels to Ray Data's read tasks
        return cls(fs=fs, paths=tuple(storage.filesystem(p)[1] for p in shard_paths))


def read_plan(files: ShardFiles, columns: str | Sequence[str], plan: ReadPlan) -> Any:
    """The rows of ``plan`` as an Arrow table (each of ``columns`` as fixed-size lists: token ids, and for
    instruction data the loss mask and segment ids; and ``row_id``, in plan order): every shard it touches is
    opened once and only the row groups holding its rows are read; the rows are gathered with numpy (one copy)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [columns] if isinstance(columns, str) else list(columns)
    out: dict[str, np.ndarray] = {}
    for shard in np.unique(plan.shards):
        sel = np.flatnonzero(plan.shards == shard)
        local = plan.rows[sel]
        path = files.paths[int(shard)]
        with files.fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
            group_of = np.searchsorted(bounds, local, side="right") - 1
            groups = np.unique(group_of)
            if len(groups) == 0 or bounds[-1] <= local.max():
                raise DataError(
                    f"{path}: the manifest's order needs row {int(local.max())} of it, it has "
                    f"{int(bounds[-1])} rows: the shard changed after `raytrn data prepare`; re-create the dataset"
                )
            table = pf.read_row_groups([int(g) for g in groups], columns=names)
        # Row k of what was read: the groups' rows, one group after another.
        sizes = np.diff(bounds)[groups]
        first_of = np.zeros(int(groups.max()) + 1, dtype=np.int64)
        first_of[groups] = np.cumsum(sizes) - sizes
        taken = first_of[group_of] + local - bounds[group_of]
        for name in names:
            values = table.column(name).combine_chunks()
            flat = values.flatten().to_numpy()
            if len(values) == 0 or len(flat) % len(values):
                raise DataError(f"{path}: rows of different lengths in '{name}'; re-create the dataset")
            rows = flat.reshape(len(values), -1)
            if name not in out:
                out[name] = np.empty((len(plan), rows.shape[1]), dtype=rows.dtype)
            elif rows.shape[1] != out[name].shape[1]:
                raise DataError(f"{path}: its rows are {rows.shape[1]} long, other shards' {out[name].shape[1]}")
            out[name][sel] = rows[taken]
    arrays = {}
    for name in names:
        data = out.get(name, np.empty((0, 1), dtype=np.int32))
        arrays[name] = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), data.shape[1])
    return pa.table({**arrays, "row_id": pa.array(plan.ids, type=pa.int64())})


def iter_rows(shard_paths: Sequence[str], columns: str | Sequence[str], plans: Iterator[ReadPlan]) -> Iterator[Any]:
    """Arrow tables of ``plans``, read in this process (``raytrn precheck``, evaluation, tests; training workers
    stream through Ray Data)."""
    files = ShardFiles.of(shard_paths)
    for plan in plans:
        yield read_plan(files, columns, plan)
