"""The input of ``raytrn data prepare``: finding the files (directories, globs), checking them before Ray starts,
reading their documents (whole text files, JSONL "text" fields, Parquet "text" rows), fingerprinting them, and the
validation split.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from raytrn import jsonfile
from raytrn.data.manifest import FORMAT
from raytrn.errors import DataError

TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".text")
ACCEPTED_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")


@dataclass(frozen=True)
class InputFile:
    """One input file: absolute path, name relative to the inputs' common directory, and how to read it."""

    path: str
    rel: str
    kind: str  # "text" | "jsonl" | "parquet"


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
    if "text" not in schema.names:
        return f'{path}: Parquet file has no "text" column (columns: {", ".join(schema.names) or "none"})'
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f'{path}: Parquet column "text" has type {kind}, expected string'
    return None


def check_inputs(files: list[InputFile]) -> None:
    """Cheap checks before any real work: some file has content, Parquet files have a string "text" column."""
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
                obj = jsonfile.loads(line)
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


def in_validation(rel: str, index: int, fraction: float) -> bool:
    """Whether document (or example) ``index`` of input file ``rel`` goes to the validation split: a hash of the two
    against ``fraction``, so the split is the same on every run and machine, and independent of the tokenizer."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{rel}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


class DocCounter:
    """Iterate the documents of all files in order (for tokenizer training), counting them."""

    def __init__(self, files: list[InputFile]) -> None:
        self.files = files
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        for f in self.files:
            for text in iter_documents(f.path, f.kind):
                self.count += 1
                yield text
