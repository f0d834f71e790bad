"""What ``raytrn data prepare --overwrite`` may delete in an output directory left with a replacement journal
(raytrn.data.prepare.writer): only files the journal recorded, at the size it recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrn.data.prepare.writer import JOURNAL_NAME, check_output, inspect_output
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
