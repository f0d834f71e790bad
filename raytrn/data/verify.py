"""Checks of a prepared dataset's files against its manifest, before any worker starts (``raytrn validate``, the
driver of ``raytrn train``): what would otherwise fail later inside Ray Data tasks, after the workers started.

- the shards' rows add up to the manifest's ``num_rows`` (a manifest claiming 10^12 rows);
- each shard is the size the manifest recorded (one listing per directory: truncated, emptied or replaced
  shards), and its Parquet footer holds the rows the manifest says, each of ``row_len`` token ids (the footer's
  value count: a manifest lying about ``seq_len``); every shard of a local dataset, a sample of a remote one;
- the tokenizer file's sha256 is the one recorded (a ``tokenizer.json`` replaced by ``{}``);
- a local validation split's manifest lies inside the dataset (not a symlink out of it).
"""

from __future__ import annotations

import hashlib
import os

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrn import storage
from raytrn.data.manifest import Manifest
from raytrn.errors import DataError

_RECREATE = "re-create the dataset with `raytrn data prepare ... --overwrite`, or copy the whole directory again"
#: Footers read of a remote dataset (first, last and evenly between): each is a request or two to S3.
REMOTE_FOOTERS = 8


def verify_dataset(manifest: Manifest) -> None:
    """DataError naming the first file of ``manifest``'s dataset that is not what the manifest recorded."""
    where = manifest.manifest_path
    rows = sum(s.rows for s in manifest.shards)
    if rows != manifest.num_rows:
        raise DataError(f"{where}: num_rows is {manifest.num_rows:,} but its shards hold {rows:,} rows; {_RECREATE}")
    sizes = _sizes(manifest)
    for s in manifest.shards:
        size = sizes.get(s.path)
        if size != s.bytes:
            got = "missing" if size is None else f"{size:,} bytes"
            raise DataError(
                f"{where}: shard {s.path} is {got}, the manifest recorded {s.bytes:,} bytes (truncated, emptied or "
                f"replaced since it was prepared); {_RECREATE}"
            )
    shards = manifest.shards
    if storage.is_remote(manifest.root) and len(shards) > REMOTE_FOOTERS:
        step = (len(shards) - 1) / (REMOTE_FOOTERS - 1)
        shards = [shards[round(i * step)] for i in range(REMOTE_FOOTERS)]
    for s in shards:
        _check_footer(manifest, s.path, s.rows, where)
    digest = file_sha256(manifest.tokenizer_path)
    if digest != manifest.tokenizer.sha256:
        raise DataError(
            f"{where}: tokenizer file {manifest.tokenizer.file} has sha256 {digest[:12]}..., the manifest recorded "
            f"{manifest.tokenizer.sha256[:12]}... (replaced since the data was tokenized with it); {_RECREATE}"
        )
    val = manifest.validation_path()
    if val is not None and not storage.is_remote(val) and not storage.is_inside(val, manifest.root):
        raise DataError(
            f"{where}: validation.manifest resolves to {os.path.realpath(val)}, outside the dataset directory "
            f"{manifest.root} (a symlink?); a dataset's files must live inside it: {_RECREATE}"
        )


def _sizes(manifest: Manifest) -> dict[str, int]:
    """Each shard's size by its manifest path, from one listing of each directory the shards are in."""
    out: dict[str, int] = {}
    for directory in sorted({os.path.dirname(s.path) for s in manifest.shards}):
        fs, path = storage.filesystem(storage.join(manifest.root, directory) if directory else manifest.root)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as e:
            raise DataError(f"{manifest.manifest_path}: cannot list the dataset's shards ({e})") from None
        for info in infos:
            if info.type == pafs.FileType.File:
                out[f"{directory}/{info.base_name}" if directory else info.base_name] = int(info.size or 0)
    return out


def _check_footer(manifest: Manifest, rel: str, rows: int, where: str) -> None:
    fs, path = storage.filesystem(storage.join(manifest.root, rel))
    try:
        with fs.open_input_file(path) as f:
            meta = pq.ParquetFile(f).metadata
            names = [meta.schema.column(i).path for i in range(meta.num_columns)]
            column = next(i for i, n in enumerate(names) if n.split(".")[0] == manifest.column)
            values = sum(meta.row_group(g).column(column).num_values for g in range(meta.num_row_groups))
            found = meta.num_rows
    except StopIteration:
        raise DataError(f"{where}: shard {rel} has no {manifest.column!r} column; {_RECREATE}") from None
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError: not Parquet, a bad footer
        raise DataError(f"{where}: shard {rel} is not a readable Parquet file ({e}); {_RECREATE}") from None
    if found != rows or values != rows * manifest.row_len:
        per_row = f"{values / found:g}" if found else "no"
        raise DataError(
            f"{where}: shard {rel} holds {found:,} rows of {per_row} token ids; the manifest says {rows:,} rows of "
            f"{manifest.row_len} (seq_len {manifest.seq_len} + 1); {_RECREATE}"
        )


def file_sha256(path: str) -> str:
    """The sha256 of a file (local or ``s3://``), read in 1 MiB pieces; DataError when it cannot be read."""
    fs, inner = storage.filesystem(path)
    h = hashlib.sha256()
    try:
        with fs.open_input_stream(inner) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise DataError(f"{path}: cannot read the dataset's tokenizer ({e})") from None
    return h.hexdigest()
