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
from raytrn.data.instruct import (
    FORMATS,
    INSTRUCTION_FORMATS,
    MASK_COLUMN,
    SEGMENT_COLUMN,
    BadLine,
    Encoder,
    Example,
    RowPacker,
    iter_jsonl_examples,
)
from raytrn.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    VALIDATION_NAME,
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

log = logging.getLogger(__name__)

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
    """Load a HF ``tokenizers`` JSON file, or the ``tokenizer.json`` of a Hugging Face tokenizer directory; returns the
    tokenizer and the file's bytes (copied into the dataset)."""
    from tokenizers import Tokenizer

    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, TOKENIZER_NAME)):
            raise DataError(
                f"--tokenizer {path}: a directory without {TOKENIZER_NAME}; give a Hugging Face tokenizer directory "
                "(tokenizer.json + tokenizer_config.json, as save_pretrained writes it) or a tokenizer.json file"
            )
        path = os.path.join(path, TOKENIZER_NAME)
    try:
        with open(path, "rb") as f:
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


def load_tokenizer_config(path: str | None) -> tuple[dict[str, Any] | None, bytes]:
    """A tokenizer directory's ``tokenizer_config.json`` (special tokens, chat template) and its bytes; (None, b"")
    for a plain tokenizer.json or a directory without one."""
    if path is None or not os.path.isdir(os.path.expanduser(path)):
        return None, b""
    file = os.path.join(os.path.expanduser(path), TOKENIZER_CONFIG_NAME)
    if not os.path.isfile(file):
        return None, b""
    with open(file, "rb") as f:
        raw = f.read()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"--tokenizer {path}: {TOKENIZER_CONFIG_NAME} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"--tokenizer {path}: {TOKENIZER_CONFIG_NAME} holds {type(config).__name__}, not an object")
    return config, raw


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def find_eos(tokenizer: Tokenizer, config: dict[str, Any] | None = None) -> tuple[str, int]:
    """The EOS token appended after every document (and every completion): the tokenizer config's ``eos_token``
    when it names one of its tokens, else the first of EOS_CANDIDATES in the vocabulary."""
    named = _token_text((config or {}).get("eos_token"))
    named_id = tokenizer.token_to_id(named) if named is not None else None
    if named is not None and named_id is not None:
        return named, int(named_id)
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
        ours = {MANIFEST_NAME, *_dataset_files(manifest)} | staging
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


def _dataset_files(manifest: Manifest) -> list[str]:
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
    return all(os.path.isfile(os.path.join(out.path, n)) for n in _dataset_files(out.manifest))


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
        import pyarrow as pa
        import pyarrow.parquet as pq

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


def in_validation(rel: str, index: int, fraction: float) -> bool:
    """Whether document (or example) ``index`` of input file ``rel`` goes to the validation split: a hash of the two
    against ``fraction``, so the split is the same on every run and machine, and independent of the tokenizer."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{rel}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


# --- tokenizing with Ray Data ----------------------------------------------------------------------------

_TOKENIZER_CACHE: dict[str, Any] = {}


def _tokenize_files(
    batch: pa.Table, *, tokenizer_json: str, tokenizer_sha: str, eos_id: int, validation_fraction: float = 0.0
) -> Iterator[pa.Table]:
    """Ray Data UDF: for each input file row, yield tables of documents (``ids`` = tokens + EOS, ``val``: in the
    validation split) in file order.

    A user error (bad JSONL line, unreadable file) comes back as a row with ``error`` set, so the driver can
    raise it as one clean DataError instead of a wrapped Ray task failure.
    """
    import pyarrow as pa
    from tokenizers import Tokenizer

    tok = _TOKENIZER_CACHE.get(tokenizer_sha)
    if tok is None:
        tok = _TOKENIZER_CACHE[tokenizer_sha] = Tokenizer.from_str(tokenizer_json)
    schema = pa.schema(
        [("file", pa.int32()), ("ids", pa.list_(pa.int32())), ("val", pa.bool_()), ("error", pa.string())]
    )
    columns = ("index", "path", "kind", "rel")
    for index, path, kind, rel in zip(*(batch.column(c).to_pylist() for c in columns), strict=True):
        texts: list[str] = []
        count = 0
        try:
            for text in iter_documents(path, kind):
                texts.append(text)
                if len(texts) == _DOCS_PER_BLOCK:
                    val = [in_validation(rel, count + i, validation_fraction) for i in range(len(texts))]
                    yield _docs_table(schema, index, tok.encode_batch(texts, add_special_tokens=False), eos_id, val)
                    count, texts = count + len(texts), []
            if texts:
                val = [in_validation(rel, count + i, validation_fraction) for i in range(len(texts))]
                yield _docs_table(schema, index, tok.encode_batch(texts, add_special_tokens=False), eos_id, val)
        except DataError as e:
            yield pa.table({"file": [index], "ids": [[]], "val": [False], "error": [str(e)]}, schema=schema)
            return


def _docs_table(schema: pa.Schema, index: int, encodings: list, eos_id: int, val: list[bool]) -> pa.Table:
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
    return pa.Table.from_arrays(
        [pa.array([index] * n, pa.int32()), ids, pa.array(val, pa.bool_()), pa.nulls(n, pa.string())], schema=schema
    )


_ENCODER_CACHE: dict[str, Any] = {}


def _encode_examples(
    batch: pa.Table,
    *,
    fmt: str,
    tokenizer_json: str,
    tokenizer_config: dict[str, Any] | None,
    eos_id: int,
    skip_bad_lines: bool,
    validation_fraction: float,
) -> Iterator[pa.Table]:
    """Ray Data UDF for instruction data: each JSONL line of each file as one example (``ids``, ``mask``, ``val``),
    in order; a skipped bad line as a row with ``bad`` set, a user error as a row with ``error`` set."""
    import pyarrow as pa

    key = hashlib.sha256((fmt + tokenizer_json + json.dumps(tokenizer_config, sort_keys=True)).encode()).hexdigest()
    encoder = _ENCODER_CACHE.get(key)
    if encoder is None:
        encoder = _ENCODER_CACHE[key] = Encoder(fmt, tokenizer_json, eos_id, tokenizer_config)
    schema = pa.schema(
        [("file", pa.int32()), ("ids", pa.list_(pa.int32())), ("mask", pa.list_(pa.int8())), ("val", pa.bool_()),
         ("bad", pa.string()), ("error", pa.string())]
    )  # fmt: skip
    columns = ("index", "path", "rel")
    for index, path, rel in zip(*(batch.column(c).to_pylist() for c in columns), strict=True):
        rows: list[tuple[Any, ...]] = []
        try:
            for lineno, example, bad in iter_jsonl_examples(path, rel, fmt, skip_bad_lines=skip_bad_lines):
                if example is None:
                    rows.append((index, [], [], False, bad, None))
                    continue
                try:
                    enc = encoder.encode(example, where=f"{rel}:{lineno}")
                except BadLine as e:
                    if not skip_bad_lines:
                        raise
                    rows.append((index, [], [], False, str(e), None))
                    continue
                rows.append((index, enc.ids, enc.mask, in_validation(rel, lineno, validation_fraction), None, None))
                if len(rows) >= _DOCS_PER_BLOCK:
                    yield _rows_table(schema, rows)
                    rows = []
        except (DataError, OSError) as e:
            message = str(e) if isinstance(e, DataError) else f"{path}: cannot read ({e})"
            rows.append((index, [], [], False, None, message))
        if rows:
            yield _rows_table(schema, rows)


def _rows_table(schema: Any, rows: list[tuple[Any, ...]]) -> Any:
    import pyarrow as pa

    return pa.table({name: [r[k] for r in rows] for k, name in enumerate(schema.names)}, schema=schema)


def _stream_token_batches(
    files: list[InputFile], tokenizer_json: str, eos_id: int, validation_fraction: float = 0.0
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """Tokenize ``files`` on Ray; yield ``(last file index, documents, flat token ids, flat validation token ids)``
    per block, in order."""
    kwargs = {
        "tokenizer_json": tokenizer_json,
        "tokenizer_sha": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "eos_id": eos_id,
        "validation_fraction": validation_fraction,
    }
    for block in _run_udf(files, _tokenize_files, kwargs):
        val = block.column("val").to_numpy(zero_copy_only=False)
        yield block.column("file")[-1].as_py(), block.num_rows, _flat(block, ~val), _flat(block, val)


def _flat(block: Any, rows: np.ndarray) -> np.ndarray:
    """The token ids of ``block``'s selected ``rows``, one after another."""
    ids = block.column("ids").filter(rows).combine_chunks()
    return ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)


def _stream_examples(files: list[InputFile], kwargs: dict[str, Any]) -> Iterator[Any]:
    """Encode instruction ``files`` on Ray; yield their blocks of examples (see :func:`_encode_examples`), in order."""
    yield from _run_udf(files, _encode_examples, kwargs)


def _run_udf(files: list[InputFile], udf: Any, kwargs: dict[str, Any]) -> Iterator[Any]:
    """``udf`` over ``files`` (one task per file) on Ray Data, its blocks in file order; a row with ``error`` set
    raises it as a DataError."""
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
        items = [{"index": i, "path": f.path, "kind": f.kind, "rel": f.rel} for i, f in enumerate(files)]
        ds: Any = ray.data.from_items(items, override_num_blocks=min(len(items), 200))  # Any: loose Ray Data stubs
        ds = ds.map_batches(udf, batch_size=1, batch_format="pyarrow", fn_kwargs=kwargs, num_cpus=1)
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            if block.num_rows == 0:
                continue
            errors = block.column("error").drop_null()
            if len(errors):
                raise DataError(errors[0].as_py())
            yield block
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.print_on_execution_start = saved
        for name, log in quiet.items():
            log.setLevel(saved_levels[name])


# --- the command -----------------------------------------------------------------------------------------


def _check_args(
    seq_len: int, tokenizer: str | None, vocab_size: int | None, shard_size_mb: float, fmt: str, fraction: float
) -> None:
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt in INSTRUCTION_FORMATS and tokenizer is None:
        raise DataError(
            f"--format {fmt} needs --tokenizer (the tokenizer of the model you fine-tune: a Hugging Face tokenizer "
            "directory, or its tokenizer.json); a tokenizer trained on the examples would not match any model"
        )
    if not 0 <= fraction <= 0.5:
        raise DataError(f"--validation-fraction must be in [0, 0.5], got {fraction:g}")
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
    format: str = "text",  # noqa: A002 (the CLI flag's name)
    packing: bool = True,
    validation_fraction: float = 0.0,
    skip_bad_lines: bool = False,
) -> Manifest:
    """Tokenize and pack ``inputs`` into ``output`` (shards, tokenizer files, manifest.json, and with
    ``validation_fraction`` a validation split: validation.json and its shards); return the manifest.

    ``format``: ``text`` documents (packed, every token trained on), or ``prompt-completion`` / ``chat`` JSONL
    examples (rows with a loss mask and segment ids, see :mod:`raytrn.data.instruct`; ``packing``: several whole
    examples per row, or one). Re-running with the same input and settings is a no-op that returns the existing
    manifest.
    """
    from raytrn import __version__

    _check_args(seq_len, tokenizer, vocab_size, shard_size_mb, format, validation_fraction)
    if "://" in output:
        raise DataError(f"--output {output}: only local output directories are supported for now")
    given = output
    output = os.path.abspath(os.path.expanduser(output))
    out = _inspect_output(output)
    _refuse_foreign(out, given)  # first: the answer to `--output . --overwrite` in a project is this, not the input
    row_len = seq_len + 1
    max_rows = rows_per_shard(shard_size_mb, row_len)
    files = discover_inputs(inputs, exclude=output)
    instruction = format in INSTRUCTION_FORMATS
    if instruction:
        not_jsonl = [f.rel for f in files if f.kind != "jsonl"]
        if not_jsonl:
            raise DataError(f"--format {format} reads JSONL files, one example a line; not JSONL: {_shown(not_jsonl)}")
    check_inputs(files)
    given_tok, given_raw = load_tokenizer(tokenizer) if tokenizer is not None else (None, b"")
    tok_config, config_raw = load_tokenizer_config(tokenizer)
    if given_tok is not None:
        eos_token, eos_id = find_eos(given_tok, tok_config)
        if format == "chat":
            Encoder(format, given_raw.decode("utf-8"), eos_id, tok_config)  # no chat template: refused now
    choice = (
        f"file:{hashlib.sha256(given_raw + config_raw).hexdigest()}" if given_tok is not None else f"bpe:{vocab_size}"
    )
    if instruction or validation_fraction:  # (plain text keeps the fingerprint datasets prepared before had)
        choice += f"|format={format}|packing={packing}|validation={validation_fraction!r}|skip_bad={skip_bad_lines}"
    fingerprint = fingerprint_inputs(files, seq_len=seq_len, tokenizer_choice=choice)
    existing = _check_output(out, output, fingerprint, max_rows, overwrite)
    if existing is not None:
        print(f"{output}: up to date (same input, seq_len, tokenizer and settings)", file=sys.stderr)
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
        if config_raw:
            with open(os.path.join(tmp, TOKENIZER_CONFIG_NAME), "wb") as cf:
                cf.write(config_raw)
        eos_token, eos_id = find_eos(tok, tok_config)
        with open(os.path.join(tmp, TOKENIZER_NAME), "rb") as rf:
            tokenizer_bytes = rf.read()

        show.note(f"tokenizing {len(files)} file(s) with Ray Data into rows of {row_len} tokens")
        writers = (
            _ShardWriter(tmp, row_len, max_rows, extra=instruction),
            _ShardWriter(tmp, row_len, max_rows, prefix="val", extra=instruction),
        )
        if instruction:
            kwargs = {
                "fmt": format, "tokenizer_json": tokenizer_bytes.decode("utf-8"), "tokenizer_config": tok_config,
                "eos_id": eos_id, "skip_bad_lines": skip_bad_lines, "validation_fraction": validation_fraction,
            }  # fmt: skip
            counts = _pack_examples(files, kwargs, row_len, eos_id, packing, writers, show)
            num_documents, rows, tail = counts["documents"], counts["rows"], (0, 0)
        else:
            num_documents, rows, tail = _pack_text(files, tokenizer_bytes, eos_id, validation_fraction, writers, show)
            counts = {}
        shards, val_shards = writers[0].close(), writers[1].close()
        show.close()
        if num_documents == 0:
            raise DataError(f"the {len(files)} input file(s) contain no text (every document is empty)")
        if rows[0] == 0:
            raise DataError(
                f"the input makes no training row: {'every example was skipped (nothing to train on)' if instruction else f'one row needs seq_len + 1 = {row_len} tokens'}"
                "; use a smaller --seq-len, more input, or a lower --validation-fraction"
            )
        if validation_fraction > 0 and rows[1] == 0:
            raise DataError(
                f"--validation-fraction {validation_fraction:g} left no validation row ({num_documents} "
                "document(s)); raise it or add input"
            )
        tok_info = TokenizerInfo(
            file=TOKENIZER_NAME,
            sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
            vocab_size=tok.get_vocab_size(),
            eos_token=eos_token,
            eos_id=eos_id,
            trained=given_tok is None,
            config_file=TOKENIZER_CONFIG_NAME if config_raw else "",
        )
        common: dict[str, Any] = dict(
            seq_len=seq_len, row_len=row_len, rows_per_shard=max_rows, tokenizer=tok_info,
            source=SourceInfo(inputs=list(inputs), num_files=len(files), num_documents=num_documents,
                              fingerprint=fingerprint),
            created_by=f"raytrn {__version__}", kind=format,
            extra_columns=[MASK_COLUMN, SEGMENT_COLUMN] if instruction else [], packing=packing,
        )  # fmt: skip
        validation = {}
        new_names = [TOKENIZER_NAME, *([TOKENIZER_CONFIG_NAME] if config_raw else []), *(s.path for s in shards)]
        if val_shards:
            val_manifest = Manifest(
                **common, num_rows=rows[1], num_tokens=rows[1] * row_len, dropped_tail_tokens=tail[1],
                shards=val_shards, examples=counts.get("val", {}), root=output, name=VALIDATION_NAME,
            )  # fmt: skip
            with open(os.path.join(tmp, VALIDATION_NAME), "w", encoding="utf-8") as vf:
                vf.write(val_manifest.to_json())
            validation = {"manifest": VALIDATION_NAME, "fraction": validation_fraction, "num_rows": rows[1]}
            new_names += [VALIDATION_NAME, *(s.path for s in val_shards)]
        manifest = Manifest(
            **common, num_rows=rows[0], num_tokens=rows[0] * row_len, dropped_tail_tokens=tail[0], shards=shards,
            examples=counts.get("train", {}), validation=validation, root=output,
        )  # fmt: skip
        with open(os.path.join(tmp, MANIFEST_NAME), "w", encoding="utf-8") as mf:
            mf.write(manifest.to_json())
        committing = True  # from here an interruption leaves the journal for the next --overwrite to finish
        _commit(out, tmp, [*new_names, MANIFEST_NAME])
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


def _pack_text(
    files: list[InputFile],
    tokenizer_bytes: bytes,
    eos_id: int,
    validation_fraction: float,
    writers: tuple[_ShardWriter, _ShardWriter],
    show: _Progress,
) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Text documents packed into rows (training and validation split apart); (documents, rows, dropped tails)."""
    row_len = writers[0].row_len
    packers = (Packer(row_len), Packer(row_len))
    num_documents = 0
    stream = _stream_token_batches(files, tokenizer_bytes.decode("utf-8"), eos_id, validation_fraction)
    # closing(): on any error the stream stops Ray Data and restores the DataContext at once.
    with contextlib.closing(stream):  # type: ignore[type-var]
        for last_file, docs, train, val in stream:
            num_documents += docs
            for packer, writer, flat in zip(packers, writers, (train, val), strict=True):
                writer.add(packer.push(flat))
            show.update(f"tokenized {last_file}/{len(files)} files, {packers[0].num_rows:,} rows packed")
    show.update(f"tokenized {len(files)}/{len(files)} files, {packers[0].num_rows:,} rows packed", force=True)
    if packers[0].num_rows == 0 and packers[0].num_tokens_in:
        raise DataError(
            f"the input has only {packers[0].num_tokens_in:,} tokens (with one EOS per document) but one row needs "
            f"seq_len + 1 = {row_len}; use a smaller --seq-len or more input"
        )
    rows = (packers[0].num_rows, packers[1].num_rows)
    return num_documents, rows, (packers[0].pending_tokens, packers[1].pending_tokens)


def _pack_examples(
    files: list[InputFile],
    kwargs: dict[str, Any],
    row_len: int,
    pad_id: int,
    packing: bool,
    writers: tuple[_ShardWriter, _ShardWriter],
    show: _Progress,
) -> dict[str, Any]:
    """Instruction examples packed into rows with loss masks and segment ids (training and validation apart)."""
    packers = (RowPacker(row_len, pad_id, packing), RowPacker(row_len, pad_id, packing))
    documents, bad = 0, [0, 0]
    first_bad = ""

    def write(writer: _ShardWriter, done: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        if done:
            writer.add(*(np.stack([row[k] for row in done]) for k in range(3)))

    stream = _stream_examples(files, kwargs)
    with contextlib.closing(stream):  # type: ignore[type-var]
        for block in stream:
            ids, masks = block.column("ids").to_pylist(), block.column("mask").to_pylist()
            vals, bads = block.column("val").to_pylist(), block.column("bad").to_pylist()
            for example_ids, mask, val, why in zip(ids, masks, vals, bads, strict=True):
                if why is not None:
                    bad[0] += 1
                    first_bad = first_bad or why
                    continue
                documents += 1
                k = int(bool(val))
                write(
                    writers[k], packers[k].push(Example(np.asarray(example_ids, np.int32), np.asarray(mask, np.int8)))
                )
            show.update(f"encoded {documents:,} examples, {packers[0].rows:,} rows")
    for packer, writer in zip(packers, writers, strict=True):
        write(writer, packer.flush())
    if bad[0]:
        log.warning("--skip-bad-lines: %d line(s) skipped, the first: %s", bad[0], first_bad)

    def stats(p: RowPacker, bad_lines: int) -> dict[str, int]:
        return {"examples": p.examples, "skipped": p.skipped, "truncated": p.truncated, "bad_lines": bad_lines,
                "trained_tokens": p.trained_tokens}  # fmt: skip

    return {
        "documents": documents,
        "rows": (packers[0].rows, packers[1].rows),
        "train": stats(packers[0], bad[0]),
        "val": stats(packers[1], 0),
    }


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
