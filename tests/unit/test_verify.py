"""A dataset's files against its manifest, before any worker starts (raytrn.data.verify): real Parquet shards as
`raytrn data prepare` writes them, then damaged the way users damage them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from raytrn.data.manifest import load_manifest
from raytrn.data.verify import verify_dataset
from raytrn.errors import DataError
from tests.unit.test_cli import make_dataset

pytestmark = pytest.mark.unit


def _edit_manifest(ds: Path, **changes: object) -> None:
    data = json.loads((ds / "manifest.json").read_text())
    data.update(changes)
    (ds / "manifest.json").write_text(json.dumps(data))


def test_an_intact_dataset_passes(tmp_path: Path) -> None:
    verify_dataset(load_manifest(str(make_dataset(tmp_path / "ds", rows=8))))


def test_a_manifest_claiming_more_rows_than_its_shards_hold(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds")
    data = json.loads((ds / "manifest.json").read_text())
    data["shards"][0].update(rows=10**12, tokens=10**12 * 129)  # consistent with itself, not with the file
    _edit_manifest(ds, num_rows=10**12, num_tokens=10**12 * 129, shards=data["shards"])
    with pytest.raises(DataError, match=r"holds 4 rows of 129 token ids; the manifest says 1,000,000,000,000 rows"):
        verify_dataset(load_manifest(str(ds)))


def test_a_manifest_lying_about_seq_len_is_caught_by_the_footer(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", seq_len=128)
    _edit_manifest(ds, seq_len=64, row_len=65)
    with pytest.raises(DataError, match=r"holds 4 rows of 129 token ids; the manifest says 4 rows of 65 \(seq_len 64"):
        verify_dataset(load_manifest(str(ds)))


@pytest.mark.parametrize("damage", ["empty", "not-parquet"])
def test_an_empty_or_foreign_shard(tmp_path: Path, damage: str) -> None:
    ds = make_dataset(tmp_path / "ds")
    shard = ds / "shard-00000.parquet"
    size = shard.stat().st_size
    if damage == "empty":
        shard.write_bytes(b"")
        with pytest.raises(DataError, match=r"shard shard-00000.parquet is 0 bytes, the manifest recorded"):
            verify_dataset(load_manifest(str(ds)))
    else:  # the same size, other bytes: the footer says so
        shard.write_bytes(b"z" * size)
        with pytest.raises(DataError, match=r"shard shard-00000.parquet is not a readable Parquet file"):
            verify_dataset(load_manifest(str(ds)))


def test_a_validation_manifest_symlinked_out_of_the_dataset(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds")
    other = make_dataset(tmp_path / "elsewhere")
    os.symlink(other / "manifest.json", ds / "validation.json")
    _edit_manifest(ds, validation={"manifest": "validation.json"})
    with pytest.raises(DataError, match=r"validation.manifest resolves to .*elsewhere/manifest.json, outside the"):
        verify_dataset(load_manifest(str(ds)))
