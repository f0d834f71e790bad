"""``raytrn data prepare``: text files -> tokenizer + packed Parquet shards + manifest.json.

Inputs are found and checked on the driver first (cheap, before Ray starts), the tokenizer is loaded
or trained, then files are tokenized in parallel with Ray Data while the driver streams the results,
in file order, through the packer into shards. Everything is written to a staging directory inside the
output directory and moved into place at the end, so an output directory is either complete or absent.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

from raytrn import __version__
from raytrn.data.instruct import FORMATS, INSTRUCTION_FORMATS, MASK_COLUMN, SEGMENT_COLUMN, Encoder
from raytrn.data.manifest import (
    MANIFEST_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    VALIDATION_NAME,
    Manifest,
    SourceInfo,
    TokenizerInfo,
)
from raytrn.data.packing import rows_per_shard
from raytrn.data.prepare.inputs import DocCounter, check_inputs, discover_inputs, fingerprint_inputs
from raytrn.data.prepare.pipeline import Progress, pack_examples, pack_text
from raytrn.data.prepare.tokenizer import (
    check_vocab_size,
    find_eos,
    load_tokenizer,
    load_tokenizer_config,
    train_tokenizer,
)
from raytrn.data.prepare.writer import (
    STAGING_PREFIX,
    ShardWriter,
    check_output,
    commit,
    inspect_output,
    make_dirs,
    refuse_foreign,
    shown,
)
from raytrn.errors import DataError
from raytrn.storage import remove_inside

MAX_SEQ_LEN = 1 << 22  # = the job schema's bound on data.seq_len (raytrn.config.schema)
MAX_SHARD_SIZE_MB = 8192.0  # a shard's list offsets are int32: at most 2**31 token ids


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
    if not 0 < seq_len <= MAX_SEQ_LEN:
        raise DataError(
            f"--seq-len must be a number of tokens in 1..{MAX_SEQ_LEN:,} (a job's data.seq_len allows no more), got "
            f"{seq_len:,}"
            if seq_len.bit_length() < 64
            else f"--seq-len must be in 1..{MAX_SEQ_LEN:,}: got an integer "
            f"of {int(seq_len.bit_length() * 0.30103) + 1:,} digits"
        )
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
    _check_args(seq_len, tokenizer, vocab_size, shard_size_mb, format, validation_fraction)
    if "://" in output:
        raise DataError(f"--output {output}: only local output directories are supported for now")
    given = output
    output = os.path.abspath(os.path.expanduser(output))
    out = inspect_output(output)
    refuse_foreign(out, given)  # first: the answer to `--output . --overwrite` in a project is this, not the input
    row_len = seq_len + 1
    max_rows = rows_per_shard(shard_size_mb, row_len)
    files = discover_inputs(inputs, exclude=output)
    instruction = format in INSTRUCTION_FORMATS
    if instruction:
        not_jsonl = [f.rel for f in files if f.kind != "jsonl"]
        if not_jsonl:
            raise DataError(f"--format {format} reads JSONL files, one example a line; not JSONL: {shown(not_jsonl)}")
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
    existing = check_output(out, output, fingerprint, max_rows, overwrite)
    if existing is not None:
        print(f"{output}: up to date (same input, seq_len, tokenizer and settings)", file=sys.stderr)
        return existing

    show = Progress(progress)
    created = make_dirs(out.path)
    tmp = os.path.join(out.path, f"{STAGING_PREFIX}{os.getpid()}")
    remove_inside(tmp, out.path)  # a leftover of a process with this pid: raytrn's own
    os.mkdir(tmp)
    committing = False
    try:
        if given_tok is None:
            assert vocab_size is not None
            show.note(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(files)} file(s)")
            counter = DocCounter(files)
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
            ShardWriter(tmp, row_len, max_rows, extra=instruction),
            ShardWriter(tmp, row_len, max_rows, prefix="val", extra=instruction),
        )
        if instruction:
            kwargs = {
                "fmt": format, "tokenizer_json": tokenizer_bytes.decode("utf-8"), "tokenizer_config": tok_config,
                "eos_id": eos_id, "skip_bad_lines": skip_bad_lines, "validation_fraction": validation_fraction,
            }  # fmt: skip
            counts = pack_examples(files, kwargs, row_len, eos_id, packing, writers, show)
            num_documents, rows, tail = counts["documents"], counts["rows"], (0, 0)
        else:
            num_documents, rows, tail = pack_text(files, tokenizer_bytes, eos_id, validation_fraction, writers, show)
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
        commit(out, tmp, [*new_names, MANIFEST_NAME])
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
