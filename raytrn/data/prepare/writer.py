"""Writing a dataset: what ``--output`` holds and whether raytrn may replace it, the staged dataset moved into place
(manifest last, with a journal for an interrupted replacement), and the Parquet shard writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrn import jsonfile
from raytrn.data.instruct import MASK_COLUMN, SEGMENT_COLUMN
from raytrn.data.manifest import (
    MANIFEST_NAME,
    TOKENIZER_CONFIG_NAME,
    Manifest,
    ShardInfo,
    load_manifest,
    rows_per_group,
)
from raytrn.data.verify import file_sha256
from raytrn.errors import DataError
from raytrn.storage import remove_inside

# --- output directory state ------------------------------------------------------------------------------
#
# raytrn deletes only what it wrote: the files a readable manifest lists (shards, tokenizer), each only while it is
# the regular file the manifest records (:func:`dataset_files_written`), the manifest itself, its staging
# directories and its replacement journal. A dataset is built in a staging directory
# *inside* the output directory (same filesystem: works for mount points, keeps the directory itself, its
# permissions, symlinks to it and a shell's current directory), then moved into place file by file, the
# manifest last. While files move, a journal names the old and new files so an interrupted replacement can be
# finished by the next `--overwrite`.

STAGING_PREFIX = ".raytrn-staging-"
JOURNAL_NAME = ".raytrn-replacing.json"


@dataclass(kw_only=True)
class Output:
    """What ``--output`` holds: ``state`` is absent, empty, dataset, interrupted or foreign."""

    path: str  # the real directory (symlinks resolved)
    state: str
    manifest: Manifest | None = None
    ours: frozenset[str] = frozenset()  # top-level names raytrn wrote and may replace or delete
    foreign: tuple[str, ...] = ()  # top-level names raytrn did not write
    problem: str = ""  # why a manifest.json there is not a dataset raytrn can read
    # ``'name: why'`` for each name a manifest lists that is not what raytrn wrote there (it is in ``foreign``)
    unlike: tuple[str, ...] = ()


def inspect_output(output: str) -> Output:
    """Classify the output directory by its top-level entries (raytrn writes nothing deeper)."""
    real = os.path.realpath(output)
    if not os.path.lexists(output):
        return Output(path=real, state="absent")
    if not os.path.isdir(output):
        what = "a symlink to nothing" if os.path.islink(output) and not os.path.exists(output) else "not a directory"
        raise DataError(f"--output {output}: exists and is {what}; choose an empty or new directory for --output")
    names = sorted(os.listdir(real))
    staging = {n for n in names if n.startswith(STAGING_PREFIX) and os.path.isdir(os.path.join(real, n))}
    rest = [n for n in names if n not in staging]
    if not rest:
        return Output(path=real, state="empty", ours=frozenset(staging))
    if MANIFEST_NAME in rest:
        try:
            manifest = load_manifest(output, check_files=False)
        except DataError as e:
            return Output(path=real, state="foreign", foreign=tuple(rest), problem=str(e))
        listed, unlike = dataset_files_written(real, manifest)
        ours = {MANIFEST_NAME, *listed} | staging
        if JOURNAL_NAME in rest:
            ours |= _journal_names(real)
        return Output(
            path=real,
            state="dataset",
            manifest=manifest,
            ours=frozenset(ours),
            foreign=tuple(n for n in rest if n not in ours),
            unlike=tuple(why for name, why in unlike.items() if name not in ours),
        )
    if JOURNAL_NAME in rest:
        ours = _journal_names(real) | staging
        return Output(
            path=real, state="interrupted", ours=frozenset(ours), foreign=tuple(n for n in rest if n not in ours)
        )
    return Output(path=real, state="foreign", foreign=tuple(rest))


def dataset_files(manifest: Manifest) -> list[str]:
    """Every file of a dataset but its manifest.json: shards, tokenizer files, its validation split's manifest and
    shards (when its manifest cannot be read, only its name: the rest is then not raytrn's to delete)."""
    names = manifest.files()
    val = manifest.validation_path()
    if val is not None:
        names.append(os.path.basename(val))
        try:
            names += load_manifest(val, check_files=False).files()
        except DataError:
            pass
    return sorted(set(names))


def dataset_files_written(directory: str, manifest: Manifest) -> tuple[set[str], dict[str, str]]:
    """The files of ``manifest`` and its validation split (:func:`dataset_files`) that are what raytrn wrote in
    ``directory``, so raytrn may replace or delete them: each a regular file (not a symlink) at the top of the
    directory, of the size the manifest records (shards), of its sha256 (the tokenizer), of the name raytrn gives it
    (the tokenizer's config) or a manifest raytrn can read (the validation split's); or nothing there yet. Also
    ``{name: 'name: why'}`` for each name there that is something else: whatever the manifest says, it is never
    deleted."""
    claimed: set[str] = set()
    unlike: dict[str, str] = {}

    def claim(where: Manifest, name: str, what: str, wrote: Callable[[str], str]) -> None:
        """``wrote(path)``: '' when the regular file at ``path`` is what raytrn wrote, else why it is not."""
        if not _is_plain_name(name):
            return  # raytrn writes nothing deeper than the top: the name's first component stays foreign
        path = os.path.join(directory, name)
        why = ""
        if os.path.lexists(path):
            why = "a symlink" if os.path.islink(path) else "a directory" if os.path.isdir(path) else ""
            why = why or ("not a regular file" if not os.path.isfile(path) else wrote(path))
        if why:
            unlike.setdefault(name, f"{name}: {where.name} names it as {what}, but it is {why}")
        claimed.add(name)

    def sized(size: int) -> Callable[[str], str]:
        return lambda path: "" if _size(path) == size else f"{_size(path):,} bytes, not the {size:,} it records"

    def files(m: Manifest) -> None:
        tok = m.tokenizer
        claim(m, tok.file, "its tokenizer", lambda p: "" if file_sha256(p) == tok.sha256 else "of another sha256")
        if tok.config_file:
            other = "" if tok.config_file == TOKENIZER_CONFIG_NAME else f"not the {TOKENIZER_CONFIG_NAME} raytrn writes"
            claim(m, tok.config_file, "its tokenizer's config", lambda _: other)
        for shard in m.shards:
            claim(m, shard.path, "a shard", sized(shard.bytes))

    files(manifest)
    name = manifest.validation.get("manifest")
    if isinstance(name, str) and _is_plain_name(name):
        try:
            split = load_manifest(os.path.join(directory, name), check_files=False)
        except DataError:
            claim(manifest, name, "its validation split", lambda _: "not a manifest raytrn can read")
        else:
            claim(manifest, name, "its validation split", lambda _: "")
            files(split)
    return claimed - set(unlike), unlike


def _journal_names(directory: str) -> set[str]:
    """The names an interrupted replacement's journal says raytrn wrote (nothing if it cannot be read), each only
    while what is there is what raytrn wrote: a file of the size the journal recorded, or nothing. A journal
    without sizes (not raytrn's, or one edited by hand) names nothing: its names stay foreign, never deleted."""
    try:
        with open(os.path.join(directory, JOURNAL_NAME), encoding="utf-8") as f:
            data = jsonfile.load(f)
        entries = [*data.get("old", {}).items(), *data.get("new", {}).items()]
    except (OSError, ValueError, AttributeError, TypeError):
        return set()
    names = {JOURNAL_NAME}
    for name, size in entries:
        if isinstance(name, str) and _is_plain_name(name) and type(size) is int:
            path = os.path.join(directory, name)
            if not os.path.lexists(path) or (os.path.isfile(path) and not os.path.islink(path) and _size(path) == size):
                names.add(name)
    return names


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _file_sizes(directory: str, names: list[str]) -> dict[str, int]:
    """Each name's file size in ``directory`` (what the journal records; -1 for anything but a file)."""
    return {n: _size(os.path.join(directory, n)) if os.path.isfile(os.path.join(directory, n)) else -1 for n in names}


def _is_plain_name(name: str) -> bool:
    """A single path component: what raytrn writes at the top of a dataset directory."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def shown(names: tuple[str, ...] | list[str], limit: int = 5) -> str:
    listed = ", ".join(names[:limit])
    return listed + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output(out: Output, output: str, fingerprint: str, max_rows: int, overwrite: bool) -> Manifest | None:
    """The existing manifest when ``output`` already holds this exact dataset; None when it may be written;
    DataError (nothing touched) for anything raytrn must not replace."""
    if out.state in ("absent", "empty"):
        return None
    refuse_foreign(out, output)
    if out.state == "dataset":
        assert out.manifest is not None
        old = out.manifest
        tokenizer = os.path.join(out.path, old.tokenizer.file)
        same_tokenizer = os.path.isfile(tokenizer) and file_sha256(tokenizer) == old.tokenizer.sha256
        if old.source.fingerprint == fingerprint and same_tokenizer:
            if not _complete(out):
                what = "an incomplete copy of this dataset (files its manifest lists are missing)"
            elif old.rows_per_shard == max_rows:
                return old
            else:
                what = f"the same data with {old.rows_per_shard} rows per shard (now {max_rows})"
        else:
            what = "a different dataset (other input, seq_len or tokenizer)"
    else:
        what = f"an interrupted replacement of a dataset ({JOURNAL_NAME})"
    if out.foreign:
        unlike = "".join(f"; {u}" for u in out.unlike[:3])
        raise DataError(
            f"--output {output}: holds {what} and also files raytrn did not write ({shown(out.foreign)}){unlike}; "
            "raytrn never deletes those: move them out, or choose an empty or new directory for --output"
        )
    if overwrite:
        return None
    raise DataError(f"--output {output}: refusing to overwrite {what}; pass --overwrite to replace it")


def refuse_foreign(out: Output, output: str) -> None:
    """DataError when ``--output`` holds something that is not a raytrn dataset (checked before anything else)."""
    if out.state != "foreign":
        return
    why = (
        f"its {MANIFEST_NAME} is not a dataset raytrn can read ({out.problem})"
        if out.problem
        else f"it holds files raytrn did not write ({shown(out.foreign)}) and no {MANIFEST_NAME}"
    )
    raise DataError(
        f"--output {output}: not a raytrn dataset: {why}. raytrn never deletes files it did not write, with or "
        "without --overwrite: choose an empty or new directory for --output"
    )


def _complete(out: Output) -> bool:
    """Every file the manifest lists is there."""
    assert out.manifest is not None
    return all(os.path.isfile(os.path.join(out.path, n)) for n in dataset_files(out.manifest))


def make_dirs(path: str) -> list[str]:
    """``os.makedirs`` that returns the directories it created, outermost first (to undo on failure)."""
    created = []
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    for d in reversed(created):
        os.mkdir(d)
    return list(reversed(created))


def commit(out: Output, staging: str, new_names: list[str]) -> None:
    """Move the staged dataset into ``out.path``, manifest last, removing the old dataset's other files.

    Only names in ``out.ours`` (what a readable manifest or journal says raytrn wrote) are ever removed.
    """
    directory = out.path
    old = sorted(n for n in out.ours if not n.startswith(STAGING_PREFIX) and n != JOURNAL_NAME)
    journal = os.path.join(directory, JOURNAL_NAME)
    with open(os.path.join(staging, JOURNAL_NAME), "w", encoding="utf-8") as f:  # names and sizes: _journal_names
        json.dump({"old": _file_sizes(directory, old), "new": _file_sizes(staging, new_names)}, f)
    os.replace(os.path.join(staging, JOURNAL_NAME), journal)
    if MANIFEST_NAME in old:  # first: no reader ever sees a manifest naming half-replaced shards
        remove_inside(os.path.join(directory, MANIFEST_NAME), directory)
    for name in new_names:
        if name != MANIFEST_NAME:
            os.replace(os.path.join(staging, name), os.path.join(directory, name))
    for name in old:
        if name not in new_names:
            remove_inside(os.path.join(directory, name), directory)
    os.replace(os.path.join(staging, MANIFEST_NAME), os.path.join(directory, MANIFEST_NAME))
    remove_inside(journal, directory)
    for name in out.ours:
        if name.startswith(STAGING_PREFIX) and name != os.path.basename(staging):  # an interrupted run's leftovers
            remove_inside(os.path.join(directory, name), directory)
    os.rmdir(staging)


# --- shards ----------------------------------------------------------------------------------------------


class ShardWriter:
    """Collect rows and write ``<prefix>-00000.parquet``, ... of at most ``max_rows`` rows each: ``input_ids`` and,
    for instruction data, ``loss_mask`` (int8) and ``segment_ids`` (int32), each a list of ``row_len``."""

    def __init__(self, directory: str, row_len: int, max_rows: int, *, prefix: str = "shard", extra: bool = False):
        self.directory = directory
        self.row_len = row_len
        self.max_rows = max_rows
        self.prefix = prefix
        self.columns = ["input_ids", MASK_COLUMN, SEGMENT_COLUMN] if extra else ["input_ids"]
        self.shards: list[ShardInfo] = []
        self._blocks: list[list[np.ndarray]] = [[] for _ in self.columns]
        self._num_rows = 0

    def add(self, rows: np.ndarray, *extra: np.ndarray) -> None:
        arrays = [rows, *extra]
        assert len(arrays) == len(self.columns)
        while len(arrays[0]):
            take = min(len(arrays[0]), self.max_rows - self._num_rows)
            for blocks, a in zip(self._blocks, arrays, strict=True):
                blocks.append(a[:take])
            self._num_rows += take
            arrays = [a[take:] for a in arrays]
            if self._num_rows == self.max_rows:
                self._flush()

    def close(self) -> list[ShardInfo]:
        if self._num_rows:
            self._flush()
        return self.shards

    def _flush(self) -> None:
        offsets = pa.array(np.arange(0, self._num_rows * self.row_len + 1, self.row_len, dtype=np.int32))
        table = {}
        for name, blocks in zip(self.columns, self._blocks, strict=True):
            values = np.concatenate(blocks).reshape(-1)
            table[name] = pa.ListArray.from_arrays(offsets, pa.array(values))
        name = f"{self.prefix}-{len(self.shards):05d}.parquet"
        path = os.path.join(self.directory, name)
        pq.write_table(pa.table(table), path, row_group_size=rows_per_group(self.row_len), compression="snappy")
        tokens = self._num_rows * self.row_len
        self.shards.append(ShardInfo(path=name, rows=self._num_rows, tokens=tokens, bytes=os.path.getsize(path)))
        self._blocks, self._num_rows = [[] for _ in self.columns], 0
