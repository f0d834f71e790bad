"""The Ray Data pipeline of ``raytrn data prepare``: input files tokenized (text) or encoded (instruction examples)
in parallel, one task per file, streamed back to the driver in file order and packed there into shards, with a
progress line on stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from raytrn.compat import RAY_DATA_CHATTY_LOGGERS
from raytrn.data.instruct import BadLine, Encoder, Example, RowPacker, iter_jsonl_examples
from raytrn.data.packing import Packer
from raytrn.data.prepare.inputs import InputFile, in_validation, iter_documents
from raytrn.data.prepare.writer import ShardWriter
from raytrn.errors import DataError
from raytrn.runtime import ensure_ray

log = logging.getLogger(__name__)

_DOCS_PER_BLOCK = 256


class Progress:
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
    # Lazy: importing Ray Data takes about 2 s, which an up-to-date re-run and errors found before Ray would pay.
    import ray
    from ray.data import DataContext

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


# --- packing the stream into shards ----------------------------------------------------------------------


def pack_text(
    files: list[InputFile],
    tokenizer_bytes: bytes,
    eos_id: int,
    validation_fraction: float,
    writers: tuple[ShardWriter, ShardWriter],
    show: Progress,
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


def pack_examples(
    files: list[InputFile],
    kwargs: dict[str, Any],
    row_len: int,
    pad_id: int,
    packing: bool,
    writers: tuple[ShardWriter, ShardWriter],
    show: Progress,
) -> dict[str, Any]:
    """Instruction examples packed into rows with loss masks and segment ids (training and validation apart)."""
    packers = (RowPacker(row_len, pad_id, packing), RowPacker(row_len, pad_id, packing))
    documents, bad = 0, [0, 0]
    first_bad = ""

    def write(writer: ShardWriter, done: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
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
