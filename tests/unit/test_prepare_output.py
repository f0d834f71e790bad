"""What ``raytrn data prepare --overwrite`` may delete in an output directory (raytrn.data.prepare.writer): only
regular files a manifest or a replacement journal recorded, at the size (or sha256) it recorded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from raytrn.data.manifest import Manifest, ShardInfo, SourceInfo, TokenizerInfo
from raytrn.data.prepare.writer import JOURNAL_NAME, STAGING_PREFIX, check_output, commit, inspect_output
from raytrn.errors import DataError

pytestmark = pytest.mark.unit


def _journal(directory: Path, data: object) -> None:
    (directory / JOURNAL_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize(
    "journal",
    [
        {"old": ["precious.txt"], "new": []},  # names without sizes: not a journal raytrn writes
        {"old": {"precious.txt": 3}, "new": {}},  # a size that is not the file's
        {"old": {"precious.txt": True}, "new": {}},
    ],
    ids=["no-sizes", "other-size", "bool-size"],
)
def test_a_journal_never_makes_a_file_raytrn_did_not_write_deletable(tmp_path: Path, journal: object) -> None:
    (tmp_path / "precious.txt").write_text("not raytrn's")
    _journal(tmp_path, journal)
    out = inspect_output(str(tmp_path))
    assert out.state == "interrupted" and "precious.txt" in out.foreign and "precious.txt" not in out.ours
    with pytest.raises(DataError, match=r"files raytrn did not write \(.*precious\.txt\); raytrn never deletes those"):
        check_output(out, str(tmp_path), "fp", 10, overwrite=True)
    assert (tmp_path / "precious.txt").read_text() == "not raytrn's"


def test_a_journal_names_the_files_it_recorded_at_their_size(tmp_path: Path) -> None:
    (tmp_path / "shard-00000.parquet").write_bytes(b"x" * 7)
    (tmp_path / "shard-00001.parquet").write_bytes(b"y" * 5)  # replaced since: another size
    _journal(tmp_path, {"old": {"shard-00000.parquet": 7, "shard-00001.parquet": 9}, "new": {"gone.parquet": 4}})
    out = inspect_output(str(tmp_path))
    assert out.ours == {JOURNAL_NAME, "shard-00000.parquet", "gone.parquet"}
    assert out.foreign == ("shard-00001.parquet",)


def _dataset(directory: Path, shards: dict[str, int]) -> None:
    """A dataset's manifest.json (and its tokenizer) naming ``shards`` (name: the size it records)."""
    tokenizer = b'{"model": "not really"}'
    manifest = Manifest(
        seq_len=8, row_len=9, num_rows=10 * len(shards), num_tokens=90 * len(shards), dropped_tail_tokens=0,
        rows_per_shard=10,
        shards=[ShardInfo(path=name, rows=10, tokens=90, bytes=size) for name, size in shards.items()],
        tokenizer=TokenizerInfo(file="tokenizer.json", sha256=hashlib.sha256(tokenizer).hexdigest(), vocab_size=512,
                                eos_token="<|endoftext|>", eos_id=0, trained=True),
        source=SourceInfo(inputs=["corpus/"], num_files=1, num_documents=1, fingerprint="cd" * 32),
        created_by="raytrn test",
    )  # fmt: skip
    directory.mkdir(exist_ok=True)
    (directory / "manifest.json").write_text(manifest.to_json())
    (directory / "tokenizer.json").write_bytes(tokenizer)


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else p.read_text()
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("entry", ["directory", "symlink", "other-size"])
def test_overwrite_deletes_only_the_regular_files_a_manifest_records(tmp_path: Path, entry: str) -> None:
    """A manifest naming a directory, a symlink or a file of another size than it records as a shard: --overwrite
    refuses, naming it and why, and nothing is deleted."""
    ds = tmp_path / "ds"
    _dataset(ds, {"shard-00000.parquet": 5, "precious": 5})
    (ds / "shard-00000.parquet").write_bytes(b"x" * 5)
    if entry == "directory":
        (ds / "precious").mkdir()
        (ds / "precious" / "thesis.tex").write_text("years of work")
    elif entry == "symlink":
        (ds / "shard-00000.parquet").rename(ds / "target.parquet")
        (ds / "precious").symlink_to("target.parquet")
        _dataset(ds, {"target.parquet": 5, "precious": 5})
    else:
        (ds / "precious").write_text("not 5 bytes long")
    before = _tree(tmp_path)
    out = inspect_output(str(ds))
    assert "precious" not in out.ours and "precious" in out.foreign
    why = {"directory": "a directory", "symlink": "a symlink", "other-size": "16 bytes, not the 5 it records"}[entry]
    with pytest.raises(DataError, match=rf"precious: manifest\.json names it as a shard, but it is {why}.*move"):
        check_output(out, str(ds), "another fingerprint", 10, overwrite=True)
    assert _tree(tmp_path) == before


def test_overwrite_replaces_the_files_a_manifest_records_at_their_size(tmp_path: Path) -> None:
    """The dataset raytrn wrote (shards at their recorded sizes, the tokenizer of its recorded sha256) is replaced by
    --overwrite: the old shards go, the new ones take their place."""
    ds = tmp_path / "ds"
    _dataset(ds, {"shard-00000.parquet": 5, "shard-00001.parquet": 3})
    (ds / "shard-00000.parquet").write_bytes(b"x" * 5)
    (ds / "shard-00001.parquet").write_bytes(b"y" * 3)
    out = inspect_output(str(ds))
    assert out.state == "dataset" and not out.foreign
    assert out.ours == {"manifest.json", "tokenizer.json", "shard-00000.parquet", "shard-00001.parquet"}
    assert check_output(out, str(ds), "another fingerprint", 10, overwrite=True) is None
    staging = ds / f"{STAGING_PREFIX}1"
    staging.mkdir()
    for name, text in (("tokenizer.json", "{}"), ("shard-00000.parquet", "new"), ("manifest.json", "{}")):
        (staging / name).write_text(text)
    commit(out, str(staging), ["tokenizer.json", "shard-00000.parquet", "manifest.json"])
    assert _tree(ds) == {"manifest.json": "{}", "shard-00000.parquet": "new", "tokenizer.json": "{}"}
