"""A Ray Data source for a prepared dataset: one read task per Parquet shard named in its manifest.

``ray.data.read_parquet`` lists the files and reads every footer first (a listing task and footer-reader
actors: new processes, seconds before the first row on a small machine). The manifest already holds each
shard's rows and bytes, so this source plans the read from it and the first task starts reading at once.

The read tasks reserve no CPU (``num_cpus=0``), with at most :data:`READ_CONCURRENCY` at a time. Training
workers commonly take every CPU slot of their nodes (one worker per core on a small node, or
``resources_per_worker: {CPU: N}``); read tasks that each wanted a whole CPU could then never be scheduled
and the job would hang forever waiting for its first batch. Token data is light (a 1B model on a trn1 node
consumes ~0.3 MB/s), so a few unreserved readers cost the training nothing measurable.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from raytrn import storage
from raytrn.data.manifest import Manifest


def _datasource_base() -> type:
    from ray.data import Datasource

    return Datasource


class ShardsDatasource(_datasource_base()):  # type: ignore[misc]
    """Reads the ``input_ids`` column of every shard, in manifest order, a row group at a time."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__()
        self._fs, _ = storage.filesystem(manifest.root)
        self._shards = [
            (storage.filesystem(p)[1], s.rows, s.bytes)
            for p, s in zip(manifest.shard_paths(), manifest.shards, strict=True)
        ]
        self._column = manifest.column
        # int32 on disk; Arrow holds the same bytes in memory (a list column: values + offsets).
        self._row_bytes = 4 * (manifest.row_len + 1)

    def estimate_inmemory_data_size(self) -> int:
        return sum(rows for _, rows, _ in self._shards) * self._row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[Any]:
        from ray.data import ReadTask
        from ray.data.block import BlockMetadata

        fs, column = self._fs, self._column
        tasks: list[Any] = []
        for path, rows, _ in self._shards:
            meta = BlockMetadata(num_rows=rows, size_bytes=rows * self._row_bytes, input_files=(path,), exec_stats=None)
            tasks.append(
                ReadTask(
                    functools.partial(_read_shard, fs, path, column),
                    meta,
                    per_task_row_limit=per_task_row_limit,
                )
            )
        return tasks

    def get_name(self) -> str:
        return "RaytrnShards"


def _read_shard(fs: Any, path: str, column: str) -> Iterator[Any]:
    """One shard's row groups as Arrow tables (a block each: memory stays bounded by the row-group size)."""
    import pyarrow.parquet as pq

    with fs.open_input_file(path) as f:
        shard = pq.ParquetFile(f)
        for group in range(shard.num_row_groups):
            yield shard.read_row_group(group, columns=[column])


#: Read tasks in flight at once (each streams one shard a row group at a time).
READ_CONCURRENCY = 4


def read_shards(manifest: Manifest) -> Any:
    """The dataset's rows as a Ray Dataset with one column, ``input_ids`` (fixed length: seq_len + 1), read
    by tasks that reserve no CPU (see the module docstring)."""
    import ray.data

    concurrency = max(1, min(READ_CONCURRENCY, len(manifest.shards)))
    return ray.data.read_datasource(ShardsDatasource(manifest), num_cpus=0, concurrency=concurrency)
