"""``raytrn data prepare``: text files -> tokenizer + packed Parquet shards + manifest.json.

Inputs are found and checked on the driver first (cheap, before Ray starts), the tokenizer is loaded
or trained, then files are tokenized in parallel with Ray Data while the driver streams the results,
in file order, through the packer into shards. Everything is written to a temporary sibling directory
that is renamed into place at the end, so an output directory is either complete or absent.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrn.compat import RAY_DATA_CHATTY_LOGGERS
from raytrn.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    Manifest,
    ShardInfo,
    SourceInfo,
    TokenizerInfo,
    load_manifest,
    rows_per_group,
)
from raytrn.data.packing import Packer, rows_per_shard
from raytrn.errors import DataError
from raytrn.storage import remove_inside

if TYPE_CHECKING:
    import pyarrow as pa
    from tokenizers import Tokenizer

TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".text")
ACCEPTED_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
SPECIAL_TOKENS = ["<|endoftext|>"]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_SHARD_SIZE_MB = 8192.0  # a shard's list offsets are int32: at most 2**31 token ids
_DOCS_PER_BLOCK = 256


@dataclass(frozen=True)
class InputFile:
    """One input file: absolute path, name relative to the inputs' common directory, and how to read it."""

    path: str
    rel: str
    kind: str  # "text" | "jsonl" | "parquet"


# --- finding and reading input ---------------------------------------------------------------------------


def _kind_of(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(ext, "text")


def _walk(top: str, excluded: Callable[[str], bool]) -> list[str]:
    """Accepted files under ``top``, skipping hidden entries (.git, .venv) and raytrn's own output."""
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not excluded(os.path.join(dirpath, d)))
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not name.startswith(".") and name.lower().endswith(ACCEPTED_EXTENSIONS) and not excluded(path):
                found.append(path)
    return found


def discover_inputs(inputs: list[str], *, exclude: str | None = None) -> list[InputFile]:
    """Expand directories (recursively) and globs into a sorted, de-duplicated list of input files.

    ``exclude`` is the output directory: nothing under it (the old dataset, raytrn's staging) is read as input.
    """
    if not inputs:
        raise DataError("no --input given; pass a directory or a glob of text/JSONL/Parquet files")
    accepted = ", ".join(ACCEPTED_EXTENSIONS)

    skip = os.path.realpath(exclude) if exclude is not None else None

    def excluded(path: str) -> bool:
        if skip is None:
            return False
        path = os.path.realpath(path)
        return path == skip or path.startswith(skip.rstrip(os.sep) + os.sep)

    paths: set[str] = set()
    for spec in inputs:
        pattern = os.path.expanduser(spec)
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"--input {spec}: the glob matched no files; check the pattern (and quote it)")
            files = [os.path.abspath(m) for m in matches if os.path.isfile(m) and not excluded(m)]
            for m in matches:
                if os.path.isdir(m):
                    files += [os.path.abspath(p) for p in _walk(m, excluded)]
            if not files:
                raise DataError(f"--input {spec}: the glob matched no readable files (accepted in folders: {accepted})")
        elif os.path.isdir(pattern):
            files = [os.path.abspath(p) for p in _walk(pattern, excluded)]
            if not files:
                raise DataError(f"--input {spec}: directory has no input files (accepted extensions: {accepted})")
        elif os.path.isfile(pattern):
            files = [os.path.abspath(pattern)]
        elif os.path.exists(pattern):
            raise DataError(f"--input {spec}: not a regular file or directory")
        else:
            raise DataError(f"--input {spec}: no such file or directory")
        paths.update(files)
    ordered = sorted(paths)
    base = os.path.commonpath([os.path.dirname(p) for p in ordered])
    return [InputFile(path=p, rel=os.path.relpath(p, base), kind=_kind_of(p)) for p in ordered]


def _parquet_text_column_error(path: str, schema: pa.Schema) -> str | None:
    import pyarrow as pa

    if "text" not in schema.names:
        return f'{path}: Parquet file has no "text" column (columns: {", ".join(schema.names) or "none"})'
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f'{path}: Parquet column "text" has type {kind}, expected string'
    return None


def check_inputs(files: list[InputFile]) -> None:
    """Cheap checks before any real work: some file has content, Parquet files have a string "text" column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if all(os.path.getsize(f.path) == 0 for f in files):
        names = ", ".join(f.rel for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(f"the {len(files)} input file(s) are all empty ({names}); there is no text to tokenize")
    for f in files:
        if f.kind == "parquet":
            try:
                schema = pq.read_schema(f.path)
            except (pa.ArrowException, OSError) as e:  # ArrowInvalid for a file that is not Parquet
                raise DataError(f"{f.path}: not a readable Parquet file ({e})") from None
            problem = _parquet_text_column_error(f.path, schema)
            if problem:
                raise DataError(problem)


def iter_documents(path: str, kind: str) -> Iterator[str]:
    """Yield the non-empty documents of one file: the whole text file, each JSONL "text", each Parquet row."""
    try:
        if kind == "text":
            with open(path, "rb") as fb:
                text = fb.read().decode("utf-8", errors="replace")
            if text:
                yield text
        elif kind == "jsonl":
            yield from _iter_jsonl(path)
        elif kind == "parquet":
            yield from _iter_parquet(path)
        else:
            raise AssertionError(f"unknown input kind {kind!r}")
    except OSError as e:
        raise DataError(
            f"{path}: cannot read ({e.strerror or e}); input files must be readable where Ray runs"
        ) from None


def _iter_jsonl(path: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                    'each line must be one JSON object with a "text" field'
                ) from None
            if not isinstance(obj, dict) or "text" not in obj:
                keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f'{path}:{lineno}: no "text" field (found: {keys}); each line needs {{"text": "..."}}')
            text = obj["text"]
            if text is not None and not isinstance(text, str):
                raise DataError(f'{path}:{lineno}: "text" is a {type(text).__name__}, expected a string')
            if text:
                yield text


def _iter_parquet(path: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    problem = _parquet_text_column_error(path, pf.schema_arrow)
    if problem:
        raise DataError(problem)
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


def fingerprint_inputs(files: list[InputFile], *, seq_len: int, tokenizer_choice: str) -> str:
    """sha256 over relative file names, file contents, seq_len and the tokenizer choice; streams the files."""
    h = hashlib.sha256(f"{FORMAT}\0seq_len={seq_len}\0tokenizer={tokenizer_choice}\0".encode())
    for f in files:
        h.update(f"{f.rel}\0{os.path.getsize(f.path)}\0".encode())
        with open(f.path, "rb") as fb:
            for chunk in iter(lambda: fb.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# --- tokenizer -------------------------------------------------------------------------------------------


def train_tokenizer(documents: Iterable[str], vocab_size: int, *, show_progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` on ``documents``; deterministic for the same documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Deterministic: the alphabet is fixed (all 256 byte symbols) and merges are chosen by (count, pair ids),
    # independent of thread count and hash-map order; tests/unit/test_tokenizer.py checks it across processes.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer)
    return tok


def check_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE needs room for 256 byte tokens plus the special tokens."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 byte tokens + {', '.join(SPECIAL_TOKENS)}); try --vocab-size 4096"
        )


def load_tokenizer(path: str) -> tuple[Tokenizer, bytes]:
    """Load a HF ``tokenizers`` JSON file; returns the tokenizer and the file's bytes (copied into the dataset)."""
    from tokenizers import Tokenizer

    try:
        with open(os.path.expanduser(path), "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(
            f"--tokenizer {path}: cannot read ({e.strerror or e}); pass a HF tokenizers tokenizer.json, "
            "or --vocab-size V to train one"
        ) from None
    try:
        return Tokenizer.from_str(raw.decode("utf-8")), raw
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"--tokenizer {path}: not a valid HF tokenizers JSON file ({e})") from None


def find_eos(tokenizer: Tokenizer) -> tuple[str, int]:
    """The EOS token appended after every document: the first of EOS_CANDIDATES in the vocabulary."""
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, token_id
    raise DataError(
        f"the tokenizer has no EOS token (tried {', '.join(EOS_CANDIDATES)}); "
        "use a tokenizer with one of them, or --vocab-size V to train one"
    )


# --- output directory state ------------------------------------------------------------------------------
#
# raytrn deletes only what it wrote: the files a readable manifest lists (shards, tokenizer), the manifest
# itself, its staging directories and its replacement journal. A dataset is built in a staging directory
# *inside* the output directory (same filesystem: works for mount points, keeps the directory itself, its
# permissions, symlinks to it and a shell's current directory), then moved into place file by file, the
# manifest last. While files move, a journal names the old and new files so an interrupted replacement can be
# finished by the next `--overwrite`.

STAGING_PREFIX = ".raytrn-staging-"
JOURNAL_NAME = ".raytrn-replacing.json"


@dataclass(kw_only=True)
class _Output:
    """What ``--output`` holds: ``state`` is absent, empty, dataset, interrupted or foreign."""

    path: str  # the real directory (symlinks resolved)
    state: str
    manifest: Manifest | None = None
    ours: frozenset[str] = frozenset()  # top-level names raytrn wrote and may replace or delete
    foreign: tuple[str, ...] = ()  # top-level names raytrn did not write
    problem: str = ""  # why a manifest.json there is not a dataset raytrn can read


def _inspect_output(output: str) -> _Output:
    """Classify the output directory by its top-level entries (raytrn writes nothing deeper)."""
    real = os.path.realpath(output)
    if not os.path.lexists(output):
        return _Output(path=real, state="absent")
    if not os.path.isdir(output):
        what = "a symlink to nothing" if os.path.islink(output) and not os.path.exists(output) else "not a directory"
        raise DataError(f"--output {output}: exists and is {what}; choose an empty or new directory for --output")
    names = sorted(os.listdir(real))
    staging = {n for n in names if n.startswith(STAGING_PREFIX) and os.path.isdir(os.path.join(real, n))}
    rest = [n for n in names if n not in staging]
    if not rest:
        return _Output(path=real, state="empty", ours=frozenset(staging))
    if MANIFEST_NAME in rest:
        try:
            manifest = load_manifest(output, check_files=False)
        except DataError as e:
            return _Output(path=real, state="foreign", foreign=tuple(rest), problem=str(e))
        ours = {MANIFEST_NAME, manifest.tokenizer.file, *(s.path for s in manifest.shards)} | staging
        if JOURNAL_NAME in rest:
            ours |= _journal_names(real)
        return _Output(
            path=real,
            state="dataset",
            manifest=manifest,
            ours=frozenset(ours),
            foreign=tuple(n for n in rest if n not in ours),
        )
    if JOURNAL_NAME in rest:
        ours = _journal_names(real) | staging
        return _Output(
            path=real, state="interrupted", ours=frozenset(ours), foreign=tuple(n for n in rest if n not in ours)
        )
    return _Output(path=real, state="foreign", foreign=tuple(rest))


def _journal_names(directory: str) -> set[str]:
    """The names an interrupted replacement's journal says raytrn wrote (nothing if it cannot be read)."""
    try:
        with open(os.path.join(directory, JOURNAL_NAME), encoding="utf-8") as f:
            data = json.load(f)
        names = [*data.get("old", []), *data.get("new", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return set()
    return {JOURNAL_NAME} | {n for n in names if isinstance(n, str) and _is_plain_name(n)}


def _is_plain_name(name: str) -> bool:
    """A single path component: what raytrn writes at the top of a dataset directory."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _shown(names: tuple[str, ...] | list[str], limit: int = 5) -> str:
    listed = ", ".join(names[:limit])
    return listed + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_output(out: _Output, output: str, fingerprint: str, max_rows: int, overwrite: bool) -> Manifest | None:
    """The existing manifest when ``output`` already holds this exact dataset; None when it may be written;
    DataError (nothing touched) for anything raytrn must not replace."""
    if out.state in ("absent", "empty"):
        return None
    _refuse_foreign(out, output)
    if out.state == "dataset":
        assert out.manifest is not None
        old = out.manifest
        tokenizer = os.path.join(out.path, old.tokenizer.file)
        same_tokenizer = os.path.isfile(tokenizer) and _sha256_file(tokenizer) == old.tokenizer.sha256
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
        raise DataError(
            f"--output {output}: holds {what} and also files raytrn did not write ({_shown(out.foreign)}); raytrn "
            "never deletes those: move them out, or choose an empty or new directory for --output"
        )
    if overwrite:
        return None
    raise DataError(f"--output {output}: refusing to overwrite {what}; pass --overwrite to replace it")


def _refuse_foreign(out: _Output, output: str) -> None:
    """DataError when ``--output`` holds something that is not a raytrn dataset (checked before anything else)."""
    if out.state != "foreign":
        return
    why = (
        f"its {MANIFEST_NAME} is not a dataset raytrn can read ({out.problem})"
        if out.problem
        else f"it holds files raytrn did not write ({_shown(out.foreign)}) and no {MANIFEST_NAME}"
    )
    raise DataError(
        f"--output {output}: not a raytrn dataset: {why}. raytrn never deletes files it did not write, with or "
        "without --overwrite: choose an empty or new directory for --output"
    )


def _complete(out: _Output) -> bool:
    """Every file the manifest lists is there."""
    assert out.manifest is not None
    names = [out.manifest.tokenizer.file, *(s.path for s in out.manifest.shards)]
    return all(os.path.isfile(os.path.join(out.path, n)) for n in names)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _make_dirs(path: str) -> list[str]:
    """``os.makedirs`` that returns the directories it created, outermost first (to undo on failure)."""
    created = []
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    for d in reversed(created):
        os.mkdir(d)
    return list(reversed(created))


def _commit(out: _Output, staging: str, new_names: list[str]) -> None:
    """Move the staged dataset into ``out.path``, manifest last, removing the old dataset's other files.

    Only names in ``out.ours`` (what a readable manifest or journal says raytrn wrote) are ever removed.
    """
    directory = out.path
    old = sorted(n for n in out.ours if not n.startswith(STAGING_PREFIX) and n != JOURNAL_NAME)
    journal = os.path.join(directory, JOURNAL_NAME)
    with open(os.path.join(staging, JOURNAL_NAME), "w", encoding="utf-8") as f:
        json.dump({"old": old, "new": new_names}, f)
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


# --- progress --------------------------------------------------------------------------------------------


class _Progress:
    """Progress on stderr: one updating line on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._last = 0.0
        self._open_line = False

    def note(self, message: str) -> None:
        if self.enabled:
            self._end_line()
            print(message, file=sys.stderr, flush=True)

    def update(self, message: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < (0.2 if self.tty else 10.0):
            return
        self._last = now
        if self.tty:
            print(f"\r{message}\x1b[K", end="", file=sys.stderr, flush=True)
            self._open_line = True
        else:
            print(message, file=sys.stderr, flush=True)

    def _end_line(self) -> None:
        if self._open_line:
            print(file=sys.stderr, flush=True)
            self._open_line = False

    def close(self) -> None:
        self._end_line()


# --- shards ----------------------------------------------------------------------------------------------


class _ShardWriter:
    """Collect packed rows and write ``shard-00000.parquet``, ... of at most ``max_rows`` rows each."""

    def __init__(self, directory: str, row_len: int, max_rows: int) -> None:
        self.directory = directory
        self.row_len = row_len
        self.max_rows = max_rows
        self.shards: list[ShardInfo] = []
        self._blocks: list[np.ndarray] = []
        self._num_rows = 0

    def add(self, rows: np.ndarray) -> None:
        while len(rows):
            take = min(len(rows), self.max_rows - self._num_rows)
            self._blocks.append(rows[:take])
            self._num_rows += take
            rows = rows[take:]
            if self._num_rows == self.max_rows:
                self._flush()

    def close(self) -> list[ShardInfo]:
        if self._num_rows:
            self._flush()
        return self.shards

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        values = np.concatenate(self._blocks).reshape(-1)
        offsets = np.arange(0, values.size + 1, self.row_len, dtype=np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))
        name = f"shard-{len(self.shards):05d}.parquet"
        path = os.path.join(self.directory, name)
        pq.write_table(
            pa.table({"input_ids": column}), path, row_group_size=rows_per_group(self.row_len), compression="snappy"
        )
        self.shards.append(
            ShardInfo(path=name, rows=self._num_rows, tokens=int(values.size), bytes=os.path.getsize(path))
        )
        self._blocks, self._num_rows = [], 0


# --- tokenizing with Ray Data ----------------------------------------------------------------------------

_TOKENIZER_CACHE: dict[str, Any] = {}


def _tokenize_files(batch: pa.Table, *, tokenizer_json: str, tokenizer_sha: str, eos_id: int) -> Iterator[pa.Table]:
    """Ray Data UDF: for each input file row, yield tables of documents (``ids`` = tokens + EOS) in file order.

    A user error (bad JSONL line, unreadable file) comes back as a row with ``error`` set, so the driver can
    raise it as one clean DataError instead of a wrapped Ray task failure.
    """
    import pyarrow as pa
    from tokenizers import Tokenizer

    tok = _TOKENIZER_CACHE.get(tokenizer_sha)
    if tok is None:
        tok = _TOKENIZER_CACHE[tokenizer_sha] = Tokenizer.from_str(tokenizer_json)
    schema = pa.schema([("file", pa.int32()), ("ids", pa.list_(pa.int32())), ("error", pa.string())])
    for index, path, kind in zip(*(batch.column(c).to_pylist() for c in ("index", "path", "kind")), strict=True):
        texts: list[str] = []
        try:
            for text in iter_documents(path, kind):
                texts.append(text)
                if len(texts) == _DOCS_PER_BLOCK:
                    yield _docs_table(schema, index, tok.encode_batch(texts, add_special_tokens=False), eos_id)
                    texts = []
            if texts:
                yield _docs_table(schema, index, tok.encode_batch(texts, add_special_tokens=False), eos_id)
        except DataError as e:
            yield pa.table({"file": [index], "ids": [[]], "error": [str(e)]}, schema=schema)
            return


def _docs_table(schema: pa.Schema, index: int, encodings: list, eos_id: int) -> pa.Table:
    import pyarrow as pa

    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int32)
    for enc, start, end in zip(encodings, offsets[:-1], offsets[1:], strict=True):
        values[start : end - 1] = enc.ids
        values[end - 1] = eos_id
    ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=pa.int32()))
    n = len(encodings)
    return pa.Table.from_arrays([pa.array([index] * n, pa.int32()), ids, pa.nulls(n, pa.string())], schema=schema)


def _stream_token_batches(
    files: list[InputFile], tokenizer_json: str, eos_id: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Tokenize ``files`` on Ray; yield ``(last file index, documents, flat token ids)`` per block, in order."""
    import ray
    from ray.data import DataContext

    from raytrn.runtime import ensure_ray

    ensure_ray()
    ctx = DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start)
    ctx.execution_options.preserve_order = True  # stream order = sorted file order, documents in file order
    ctx.enable_progress_bars = False  # our own progress line instead
    ctx.print_on_execution_start = False
    # Quiet Ray Data's own chatter ("progress bars disabled", "execution finished") for this run only.
    quiet = {name: logging.getLogger(name) for name in RAY_DATA_CHATTY_LOGGERS}
    saved_levels = {name: log.level for name, log in quiet.items()}
    for log in quiet.values():
        log.setLevel(logging.ERROR)
    try:
        items = [{"index": i, "path": f.path, "kind": f.kind} for i, f in enumerate(files)]
        ds: Any = ray.data.from_items(items, override_num_blocks=min(len(items), 200))  # Any: loose Ray Data stubs
        ds = ds.map_batches(
            _tokenize_files,
            batch_size=1,
            batch_format="pyarrow",
            fn_kwargs={
                "tokenizer_json": tokenizer_json,
                "tokenizer_sha": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
                "eos_id": eos_id,
            },
            num_cpus=1,
        )
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            if block.num_rows == 0:
                continue
            errors = block.column("error").drop_null()
            if len(errors):
                raise DataError(errors[0].as_py())
            ids = block.column("ids").combine_chunks()
            flat = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
            yield block.column("file")[-1].as_py(), block.num_rows, flat
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start = saved
        for name, log in quiet.items():
            log.setLevel(saved_levels[name])


# --- the command -----------------------------------------------------------------------------------------


def _check_args(seq_len: int, tokenizer: str | None, vocab_size: int | None, shard_size_mb: float) -> None:
    if seq_len <= 0:
        raise DataError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    if tokenizer is not None and vocab_size is not None:
        raise DataError("give either --tokenizer FILE (use it) or --vocab-size V (train one), not both")
    if tokenizer is None and vocab_size is None:
        raise DataError("give --tokenizer tokenizer.json to use a tokenizer, or --vocab-size V to train one")
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    if not 0 < shard_size_mb <= MAX_SHARD_SIZE_MB:
        raise DataError(f"--shard-size-mb must be in (0, {MAX_SHARD_SIZE_MB:g}], got {shard_size_mb:g}")


def prepare_dataset(
    *,
    inputs: list[str],
    output: str,
    seq_len: int,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    shard_size_mb: float = 64.0,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    """Tokenize and pack ``inputs`` into ``output`` (shards, tokenizer.json, manifest.json); return the manifest.

    Re-running with the same input, seq_len and tokenizer is a no-op that returns the existing manifest.
    """
    from raytrn import __version__

    _check_args(seq_len, tokenizer, vocab_size, shard_size_mb)
    if "://" in output:
        raise DataError(f"--output {output}: only local output directories are supported for now")
    given = output
    output = os.path.abspath(os.path.expanduser(output))
    out = _inspect_output(output)
    _refuse_foreign(out, given)  # first: the answer to `--output . --overwrite` in a project is this, not the input
    row_len = seq_len + 1
    max_rows = rows_per_shard(shard_size_mb, row_len)
    files = discover_inputs(inputs, exclude=output)
    check_inputs(files)
    given_tok, given_raw = load_tokenizer(tokenizer) if tokenizer is not None else (None, b"")
    if given_tok is not None:
        find_eos(given_tok)
    choice = f"file:{hashlib.sha256(given_raw).hexdigest()}" if given_tok is not None else f"bpe:{vocab_size}"
    fingerprint = fingerprint_inputs(files, seq_len=seq_len, tokenizer_choice=choice)
    existing = _check_output(out, output, fingerprint, max_rows, overwrite)
    if existing is not None:
        print(f"{output}: up to date (same input, seq_len and tokenizer)", file=sys.stderr)
        return existing

    show = _Progress(progress)
    created = _make_dirs(out.path)
    tmp = os.path.join(out.path, f"{STAGING_PREFIX}{os.getpid()}")
    remove_inside(tmp, out.path)  # a leftover of a process with this pid: raytrn's own
    os.mkdir(tmp)
    committing = False
    try:
        if given_tok is None:
            assert vocab_size is not None
            show.note(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(files)} file(s)")
            counter = _DocCounter(files)
            tok = train_tokenizer(counter, vocab_size, show_progress=show.tty)
            if counter.count == 0:
                raise DataError(f"the {len(files)} input file(s) contain no text (every document is empty)")
            tok.save(os.path.join(tmp, TOKENIZER_NAME))
        else:
            tok = given_tok
            with open(os.path.join(tmp, TOKENIZER_NAME), "wb") as f:
                f.write(given_raw)
        eos_token, eos_id = find_eos(tok)
        with open(os.path.join(tmp, TOKENIZER_NAME), "rb") as f:
            tokenizer_bytes = f.read()

        show.note(f"tokenizing {len(files)} file(s) with Ray Data into rows of {row_len} tokens")
        packer = Packer(row_len)
        writer = _ShardWriter(tmp, row_len, max_rows)
        num_documents = 0
        # closing(): on any error the stream stops Ray Data and restores the DataContext at once.
        with contextlib.closing(_stream_token_batches(files, tokenizer_bytes.decode("utf-8"), eos_id)) as stream:  # type: ignore[type-var]
            for last_file, docs, flat in stream:
                num_documents += docs
                writer.add(packer.push(flat))
                show.update(f"tokenized {last_file}/{len(files)} files, {packer.num_rows:,} rows packed")
        shards = writer.close()
        show.update(f"tokenized {len(files)}/{len(files)} files, {packer.num_rows:,} rows packed", force=True)
        show.close()
        if num_documents == 0:
            raise DataError(f"the {len(files)} input file(s) contain no text (every document is empty)")
        if packer.num_rows == 0:
            raise DataError(
                f"the input has only {packer.num_tokens_in:,} tokens (with one EOS per document) but one row needs "
                f"seq_len + 1 = {row_len}; use a smaller --seq-len or more input"
            )
        manifest = Manifest(
            seq_len=seq_len,
            row_len=row_len,
            num_rows=packer.num_rows,
            num_tokens=packer.num_rows * row_len,
            dropped_tail_tokens=packer.pending_tokens,
            rows_per_shard=max_rows,
            shards=shards,
            tokenizer=TokenizerInfo(
                file=TOKENIZER_NAME,
                sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
                vocab_size=tok.get_vocab_size(),
                eos_token=eos_token,
                eos_id=eos_id,
                trained=given_tok is None,
            ),
            source=SourceInfo(
                inputs=list(inputs), num_files=len(files), num_documents=num_documents, fingerprint=fingerprint
            ),
            created_by=f"raytrn {__version__}",
            root=output,
        )
        with open(os.path.join(tmp, MANIFEST_NAME), "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
        committing = True  # from here an interruption leaves the journal for the next --overwrite to finish
        _commit(out, tmp, [TOKENIZER_NAME, *(s.path for s in shards), MANIFEST_NAME])
    except BaseException:
        show.close()
        if not committing:
            remove_inside(tmp, out.path)
            for d in reversed(created):
                try:
                    os.rmdir(d)
                except OSError:
                    break
        raise
    return manifest


class _DocCounter:
    """Iterate the documents of all files in order (for tokenizer training), counting them."""

    def __init__(self, files: list[InputFile]) -> None:
        self.files = files
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        for f in self.files:
            for text in iter_documents(f.path, f.kind):
                self.count += 1
                yield text
