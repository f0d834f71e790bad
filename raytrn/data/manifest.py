"""The manifest of a prepared dataset: what the shards hold, which tokenizer made them, from which input.

``manifest.json`` sits next to its shards and ``tokenizer.json``; paths inside it are relative to its
directory so a dataset can be moved or copied as a whole. This module stays light (no Ray, no torch):
the trainer and ``raytrn validate`` import it on the driver.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrn import jsonfile, storage
from raytrn.errors import DataError

FORMAT = "raytrn.packed/v1"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
#: The validation split's manifest, next to the training set's (its shards: ``val-<n>.parquet``).
VALIDATION_NAME = "validation.json"
COLUMN = "input_ids"
DTYPE = "int32"

#: A manifest larger than this is not one (a million shards take ~150 MB of JSON; raytrn writes ~100 bytes each).
MAX_MANIFEST_BYTES = 256 << 20
#: Tokens per Parquet row group of a prepared shard (~8 MiB of int32 ids): the unit of reading and of shuffling.
GROUP_TOKENS = 2 << 20


def rows_per_group(row_len: int) -> int:
    """Rows per Parquet row group for rows of ``row_len`` token ids (the last group of a shard may be shorter)."""
    return max(1, GROUP_TOKENS // row_len)


_PREPARE_HINT = "run `raytrn data prepare --input DIR --output DIR --seq-len N --vocab-size V` to create it"
_RECREATE_HINT = "re-create the dataset with `raytrn data prepare ... --overwrite`"


# --- the one place that touches storage: local paths and s3:// URIs (raytrn.storage) -------------------


def _join(root: str, rel: str) -> str:
    return storage.join(root, rel)


def _kind(path: str) -> str:
    import pyarrow.fs as pafs

    try:
        fs, inner = storage.filesystem(path)
        kind = fs.get_file_info(inner).type
    except OSError as e:  # unreachable endpoint, no credentials, no such bucket
        raise DataError(f"{path}: cannot read the dataset location: {storage.short_error(e)}") from None
    return {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}.get(kind, "none")


def _size(path: str) -> int:
    fs, inner = storage.filesystem(path)
    return int(fs.get_file_info(inner).size or 0)


def _is_file(path: str) -> bool:
    return _kind(path) == "file"


def _is_dir(path: str) -> bool:
    return _kind(path) == "dir"


def _read_text(path: str) -> str:
    return storage.read_text(path) or ""


# --- the manifest ------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class ShardInfo:
    """One Parquet shard: its path relative to the manifest, its rows, tokens and size on disk."""

    path: str
    rows: int
    tokens: int
    bytes: int


@dataclass(kw_only=True, frozen=True)
class TokenizerInfo:
    """The tokenizer saved with the dataset (``file`` relative to the manifest) and its EOS token;
    ``config_file``: its Hugging Face ``tokenizer_config.json`` (special tokens, chat template), when given one."""

    file: str
    sha256: str
    vocab_size: int
    eos_token: str
    eos_id: int
    trained: bool
    config_file: str = ""


@dataclass(kw_only=True, frozen=True)
class SourceInfo:
    """Where the text came from; ``fingerprint`` hashes file names, contents, seq_len and tokenizer choice."""

    inputs: list[str]
    num_files: int
    num_documents: int
    fingerprint: str


@dataclass(kw_only=True)
class Manifest:
    """A prepared dataset: rows of ``row_len`` (= seq_len + 1) int32 token ids in Parquet shards."""

    format: str = FORMAT
    seq_len: int
    row_len: int
    column: str = COLUMN
    dtype: str = DTYPE
    num_rows: int
    num_tokens: int
    dropped_tail_tokens: int
    rows_per_shard: int
    shards: list[ShardInfo]
    tokenizer: TokenizerInfo
    source: SourceInfo
    created_by: str
    #: ``text`` (packed documents), ``prompt-completion`` or ``chat`` (rows with a loss mask and segment ids).
    kind: str = "text"
    #: Per-row columns besides ``column``: ``loss_mask`` (int8, 1 = a target to train on) and ``segment_ids``
    #: (int32, 1, 2, ... per example of the row, 0 = padding), each ``row_len`` long, for instruction data.
    extra_columns: list[str] = field(default_factory=list)
    #: Instruction data: several whole examples per row (True) or one, padded (False).
    packing: bool = True
    #: Instruction data: examples kept, skipped (no token to train on), cut to a row, bad lines skipped, trained
    #: tokens.
    examples: dict[str, int] = field(default_factory=dict)
    #: The validation split written with the dataset: ``{"manifest": "validation.json", "fraction": F,
    #: "num_rows": N}`` (documents or examples chosen by a hash of their file and position), or empty.
    validation: dict[str, Any] = field(default_factory=dict)
    root: str = field(default="", compare=False)
    """Absolute directory holding manifest.json; not serialized."""
    name: str = field(default=MANIFEST_NAME, compare=False)
    """The manifest's file name (``validation.json`` for a validation split); not serialized."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready content of manifest.json (everything but ``root``)."""
        data = asdict(self)
        del data["root"], data["name"]
        return data

    def to_json(self) -> str:
        """Deterministic JSON text (fixed key order, no timestamps) for manifest.json."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @property
    def manifest_path(self) -> str:
        return _join(self.root, self.name)

    @property
    def instruction(self) -> bool:
        """Rows carry a loss mask and segment ids (prompt-completion or chat data)."""
        return bool(self.extra_columns)

    def validation_path(self) -> str | None:
        """The validation split's manifest, when the dataset was prepared with one."""
        name = self.validation.get("manifest")
        return _join(self.root, name) if isinstance(name, str) and name else None

    def files(self) -> list[str]:
        """Every file this manifest names, relative to its directory (shards, tokenizer files)."""
        names = [self.tokenizer.file, *(s.path for s in self.shards)]
        return names + ([self.tokenizer.config_file] if self.tokenizer.config_file else [])

    @property
    def tokenizer_path(self) -> str:
        """Absolute path of the dataset's tokenizer.json."""
        return _join(self.root, self.tokenizer.file)

    def shard_paths(self) -> list[str]:
        """Absolute paths of the shards, in training order."""
        return [_join(self.root, s.path) for s in self.shards]

    def describe(self) -> str:
        """A one-screen human summary of the dataset."""
        total_bytes = sum(s.bytes for s in self.shards)
        tok = self.tokenizer
        origin = "BPE trained on the input" if tok.trained else "given with --tokenizer"
        extra = []
        if self.instruction:
            e = self.examples
            extra.append(
                f"examples     {self.kind}: {e.get('examples', 0):,} in rows ({'packed' if self.packing else 'one a row'}), "
                f"{e.get('skipped', 0):,} skipped (nothing to train on), {e.get('truncated', 0):,} cut to a row, "
                f"{e.get('bad_lines', 0):,} bad lines skipped; {e.get('trained_tokens', 0):,} tokens trained on"
            )
        if self.validation:
            extra.append(
                f"validation   {self.validation.get('num_rows', 0):,} rows in {self.validation.get('manifest')} "
                f"({float(self.validation.get('fraction', 0)):.1%} of the documents)"
            )
        inputs = ", ".join(self.source.inputs[:3]) + (
            f" (+{len(self.source.inputs) - 3} more)" if len(self.source.inputs) > 3 else ""
        )
        lines = [
            f"dataset      {self.root or '.'}  ({self.format})",
            (
                f"rows         {self.num_rows:,} x {self.row_len} token ids (seq_len {self.seq_len}), "
                f"{self.dtype} column '{self.column}'"
            ),
            f"tokens       {self.num_tokens:,} in rows, {self.dropped_tail_tokens:,} tail tokens dropped",
            (
                f"shards       {len(self.shards)} Parquet file(s), {_human_bytes(total_bytes)}, "
                f"at most {self.rows_per_shard:,} rows each"
            ),
            f"tokenizer    {tok.file}: vocab {tok.vocab_size:,}, EOS {tok.eos_token!r} = {tok.eos_id}, {origin}",
            f"source       {self.source.num_files:,} file(s), {self.source.num_documents:,} document(s) from {inputs}",
            *extra,
            f"fingerprint  {self.source.fingerprint[:16]}",
        ]
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: Any, *, root: str = "", where: str = MANIFEST_NAME, name: str = MANIFEST_NAME) -> Manifest:
        """Build a Manifest from parsed JSON, raising DataError naming ``where`` on a missing or mistyped field."""
        if not isinstance(data, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(data).__name__}; {_RECREATE_HINT}")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise DataError(f"{where}: unknown dataset format {fmt!r} (this raytrn reads {FORMAT!r}); {_RECREATE_HINT}")
        try:
            shards = [
                ShardInfo(**_fields(s, ShardInfo, f"{where}: shards[{i}]"))
                for i, s in enumerate(_get(data, "shards", list, where))
            ]
            tok_data = _get(data, "tokenizer", dict, where)
            tokenizer = TokenizerInfo(
                **_fields(tok_data, TokenizerInfo, f"{where}: tokenizer"),
                config_file=_optional(tok_data, "config_file", str, "", f"{where}: tokenizer"),
            )
            source = SourceInfo(**_fields(_get(data, "source", dict, where), SourceInfo, f"{where}: source"))
            top = {
                name: _get(data, name, kind, where)
                for name, kind in [
                    ("seq_len", int),
                    ("row_len", int),
                    ("column", str),
                    ("dtype", str),
                    ("num_rows", int),
                    ("num_tokens", int),
                    ("dropped_tail_tokens", int),
                    ("rows_per_shard", int),
                    ("created_by", str),
                ]
            }
        except TypeError as e:  # an unexpected key inside a nested object
            raise DataError(f"{where}: {e}; {_RECREATE_HINT}") from None
        if top["seq_len"] < 1 or top["row_len"] != top["seq_len"] + 1:
            raise DataError(
                f"{where}: seq_len {top['seq_len']} and row_len {top['row_len']}: need seq_len >= 1 and "
                f"row_len = seq_len + 1; {_RECREATE_HINT}"
            )
        counts = [
            (f"shards[{i}].{k}", getattr(s, k)) for i, s in enumerate(shards) for k in ("rows", "tokens", "bytes")
        ]
        counts += [(k, top[k]) for k in ("num_rows", "num_tokens", "dropped_tail_tokens", "rows_per_shard")]
        counts += [("tokenizer.vocab_size", tokenizer.vocab_size), ("tokenizer.eos_id", tokenizer.eos_id)]
        negative = next(((k, v) for k, v in counts if v < 0), None)
        if negative:
            raise DataError(f"{where}: {negative[0]}: {negative[1]} is negative; {_RECREATE_HINT}")
        if sum(s.rows for s in shards) != top["num_rows"]:
            raise DataError(
                f"{where}: num_rows {top['num_rows']} != the shards' rows ({sum(s.rows for s in shards)}); {_RECREATE_HINT}"
            )
        if not 0 <= tokenizer.eos_id < max(tokenizer.vocab_size, 1):
            raise DataError(
                f"{where}: tokenizer.eos_id {tokenizer.eos_id} is outside the vocabulary "
                f"(vocab_size {tokenizer.vocab_size}); {_RECREATE_HINT}"
            )
        for i, s in enumerate(shards):
            _check_relative(s.path, f"{where}: shards[{i}].path")
        _check_relative(tokenizer.file, f"{where}: tokenizer.file")
        if tokenizer.config_file:
            _check_relative(tokenizer.config_file, f"{where}: tokenizer.config_file")
        optional = {
            "kind": _optional(data, "kind", str, "text", where),
            "extra_columns": _optional(data, "extra_columns", list, [], where),
            "packing": _optional(data, "packing", bool, True, where),
            "examples": _optional(data, "examples", dict, {}, where),
            "validation": _optional(data, "validation", dict, {}, where),
        }
        if optional["kind"] not in ("text", "prompt-completion", "chat"):
            raise DataError(
                f"{where}: kind {optional['kind']!r} is not text, prompt-completion or chat; {_RECREATE_HINT}"
            )
        if not set(optional["extra_columns"]) <= {"loss_mask", "segment_ids"}:
            raise DataError(f"{where}: extra_columns {optional['extra_columns']!r}: unknown column; {_RECREATE_HINT}")
        val = optional["validation"].get("manifest")
        if val is not None:
            if not isinstance(val, str):
                raise DataError(f"{where}: validation.manifest should be a file name; {_RECREATE_HINT}")
            _check_relative(val, f"{where}: validation.manifest")
        return cls(
            format=fmt, shards=shards, tokenizer=tokenizer, source=source, root=root, name=name, **top, **optional
        )


_FIELD_TYPES: dict[type, dict[str, type | tuple[type, ...]]] = {
    ShardInfo: {"path": str, "rows": int, "tokens": int, "bytes": int},
    TokenizerInfo: {"file": str, "sha256": str, "vocab_size": int, "eos_token": str, "eos_id": int, "trained": bool},
    SourceInfo: {"inputs": list, "num_files": int, "num_documents": int, "fingerprint": str},
}


def _get(data: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise DataError(f"{where}: missing field '{key}'; {_RECREATE_HINT}")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field '{key}' should be {name}, got {value!r}; {_RECREATE_HINT}")
    return value


def _optional(data: dict, key: str, kind: type, default: Any, where: str) -> Any:
    """``data[key]`` checked like :func:`_get`, or ``default`` when absent (fields newer manifests add)."""
    return _get(data, key, kind, where) if key in data else default


def _fields(data: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object, got {data!r}; {_RECREATE_HINT}")
    return {key: _get(data, key, kind, where) for key, kind in _FIELD_TYPES[cls].items()}


def _check_relative(path: str, where: str) -> None:
    """A path in a manifest names a file inside the dataset: relative, no ``..``, nothing a shell would expand."""
    parts = path.replace("\\", "/").split("/")
    if (
        not path
        or path.startswith(("/", "~"))
        or (len(path) > 1 and path[1] == ":")  # C:\...
        or "://" in path
        or "\0" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise DataError(
            f"{where}: {path!r} is not a path inside the dataset directory (it must be relative, without '..'); "
            f"a manifest only names its own files: {_RECREATE_HINT}"
        )


def _check_inside(manifest: Manifest, where: str) -> None:
    """Local datasets: every named file resolves (symlinks followed) inside the manifest's directory."""
    named = [(f"shards[{i}].path", s.path) for i, s in enumerate(manifest.shards)]
    named.append(("tokenizer.file", manifest.tokenizer.file))
    if manifest.tokenizer.config_file:
        named.append(("tokenizer.config_file", manifest.tokenizer.config_file))
    for field_name, rel in named:
        if not storage.is_inside(os.path.join(manifest.root, rel), manifest.root):
            target = os.path.realpath(os.path.join(manifest.root, rel))
            raise DataError(
                f"{where}: {field_name}: {rel!r} resolves to {target}, outside the dataset directory {manifest.root} "
                f"(a symlink?); a dataset's files must live inside it: copy them in, or {_RECREATE_HINT}"
            )


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def manifest_file(path: str) -> str:
    """The manifest.json path for ``path``, which names the manifest file or the dataset directory."""
    if storage.is_remote(path):
        path = path.rstrip("/")
        return path if path.endswith(".json") else _join(path, MANIFEST_NAME)
    path = os.path.abspath(os.path.expanduser(path))
    return _join(path, MANIFEST_NAME) if _is_dir(path) or not path.endswith(".json") else path


def load_manifest(path: str, *, check_files: bool = True) -> Manifest:
    """Read and check a dataset manifest (file or its directory); DataError says what is wrong and how to fix it.

    With ``check_files`` (the default) every shard and the tokenizer file must exist too.
    """
    mpath = manifest_file(path)
    root = mpath.rsplit("/", 1)[0] if storage.is_remote(mpath) else os.path.dirname(mpath)
    if not _is_file(mpath):
        if not _is_dir(root):
            raise DataError(f"dataset {path}: no such directory ({root}); {_PREPARE_HINT}")
        raise DataError(f"dataset {path}: no {MANIFEST_NAME} in {root}; {_PREPARE_HINT}")
    size = _size(mpath)
    if size > MAX_MANIFEST_BYTES:
        raise DataError(
            f"{mpath}: {size:,} bytes is not a manifest (raytrn's are kilobytes; at most {MAX_MANIFEST_BYTES >> 20} MiB)"
        )
    try:
        data = jsonfile.loads(_read_text(mpath))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise DataError(f"{mpath}: not valid JSON ({e}); {_RECREATE_HINT}") from None
    except RecursionError:
        raise DataError(f"{mpath}: JSON nested too deeply to be a manifest; {_RECREATE_HINT}") from None
    name = mpath.rsplit("/", 1)[-1] if storage.is_remote(mpath) else os.path.basename(mpath)
    manifest = Manifest.from_dict(data, root=root, where=mpath, name=name)
    if not storage.is_remote(root):
        _check_inside(manifest, mpath)
    if check_files:
        check_dataset_files(manifest)
    return manifest


def check_dataset_files(manifest: Manifest) -> None:
    """Raise DataError when a shard or the tokenizer file of ``manifest`` is missing."""
    missing = [s.path for s in manifest.shards if not _is_file(_join(manifest.root, s.path))]
    if missing:
        raise DataError(
            f"{manifest.manifest_path}: shard {missing[0]} is missing ({len(missing)} of {len(manifest.shards)} "
            f"shards missing); copy the whole dataset directory or {_RECREATE_HINT}"
        )
    if not _is_file(manifest.tokenizer_path):
        raise DataError(
            f"{manifest.manifest_path}: tokenizer file {manifest.tokenizer.file} is missing; "
            f"copy the whole dataset directory or {_RECREATE_HINT}"
        )
