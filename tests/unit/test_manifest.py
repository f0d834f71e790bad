"""Manifest round trip, describe(), and the errors load_manifest gives for broken datasets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raytrn.data.manifest import FORMAT, Manifest, ShardInfo, SourceInfo, TokenizerInfo, load_manifest
from raytrn.errors import DataError

pytestmark = pytest.mark.unit


def _manifest(root: Path, num_shards: int = 3) -> Manifest:
    shards = [
        ShardInfo(path=f"shard-{i:05d}.parquet", rows=10, tokens=10 * 9, bytes=1000 + i) for i in range(num_shards)
    ]
    return Manifest(
        seq_len=8,
        row_len=9,
        num_rows=10 * num_shards,
        num_tokens=90 * num_shards,
        dropped_tail_tokens=4,
        rows_per_shard=10,
        shards=shards,
        tokenizer=TokenizerInfo(
            file="tokenizer.json", sha256="ab" * 32, vocab_size=512, eos_token="<|endoftext|>", eos_id=0, trained=True
        ),
        source=SourceInfo(inputs=["corpus/"], num_files=4, num_documents=7, fingerprint="cd" * 32),
        created_by="raytrn 0.1.0",
        root=str(root),
    )


def _write_dataset(root: Path, num_shards: int = 3) -> Manifest:
    m = _manifest(root, num_shards)
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(m.to_json())
    (root / "tokenizer.json").write_text("{}")
    for s in m.shards:
        (root / s.path).write_bytes(b"x")
    return m


def test_round_trip_from_directory_or_file(tmp_path: Path) -> None:
    written = _write_dataset(tmp_path / "ds")
    for path in (tmp_path / "ds", tmp_path / "ds" / "manifest.json"):
        loaded = load_manifest(str(path))
        assert loaded == written
        assert loaded.root == str(tmp_path / "ds")
    assert loaded.format == FORMAT
    assert loaded.shard_paths() == [str(tmp_path / "ds" / f"shard-{i:05d}.parquet") for i in range(3)]
    assert loaded.tokenizer_path == str(tmp_path / "ds" / "tokenizer.json")


def test_manifest_json_layout(tmp_path: Path) -> None:
    data = json.loads(_manifest(tmp_path).to_json())
    assert list(data) == [
        "format",
        "seq_len",
        "row_len",
        "column",
        "dtype",
        "num_rows",
        "num_tokens",
        "dropped_tail_tokens",
        "rows_per_shard",
        "shards",
        "tokenizer",
        "source",
        "created_by",
        "kind",
        "extra_columns",
        "packing",
        "examples",
        "validation",
    ]
    assert data["column"] == "input_ids" and data["dtype"] == "int32"
    assert data["shards"][0] == {"path": "shard-00000.parquet", "rows": 10, "tokens": 90, "bytes": 1000}
    assert "root" not in data


def test_describe_is_a_short_summary(tmp_path: Path) -> None:
    text = _manifest(tmp_path).describe()
    lines = text.splitlines()
    assert 3 <= len(lines) <= 20 and all(len(line) <= 120 for line in lines)
    for needle in ("30 x 9 token ids", "seq_len 8", "3 Parquet file(s)", "vocab 512", "<|endoftext|>", "4 file(s)"):
        assert needle in text


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no manifest\.json in .*raytrn data prepare"):
        load_manifest(str(tmp_path))
    with pytest.raises(DataError, match=r"no such directory.*raytrn data prepare"):
        load_manifest(str(tmp_path / "nope"))


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"format": "raytrn.packed/v1",')
    with pytest.raises(DataError, match=r"manifest\.json: not valid JSON .*--overwrite"):
        load_manifest(str(tmp_path))


def test_unknown_format(tmp_path: Path) -> None:
    m = _write_dataset(tmp_path)
    data = m.to_dict() | {"format": "raytrn.packed/v0"}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"unknown dataset format 'raytrn.packed/v0'.*'raytrn.packed/v1'"):
        load_manifest(str(tmp_path))


def test_missing_or_mistyped_field(tmp_path: Path) -> None:
    m = _write_dataset(tmp_path)
    data = m.to_dict()
    del data["num_rows"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"missing field 'num_rows'"):
        load_manifest(str(tmp_path))
    data = m.to_dict()
    data["tokenizer"]["eos_id"] = "zero"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"tokenizer: field 'eos_id' should be int"):
        load_manifest(str(tmp_path))


def test_missing_shards_names_the_first_and_counts(tmp_path: Path) -> None:
    _write_dataset(tmp_path, num_shards=4)
    (tmp_path / "shard-00001.parquet").unlink()
    (tmp_path / "shard-00003.parquet").unlink()
    with pytest.raises(DataError, match=r"shard shard-00001\.parquet is missing \(2 of 4 shards missing\)"):
        load_manifest(str(tmp_path))
    assert load_manifest(str(tmp_path), check_files=False).num_rows == 40


def test_missing_tokenizer(tmp_path: Path) -> None:
    _write_dataset(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer file tokenizer\.json is missing"):
        load_manifest(str(tmp_path))


def test_manifest_module_imports_no_ray_or_torch() -> None:
    code = "import sys, raytrn.data.manifest; print(any(m in sys.modules for m in ('ray', 'torch', 'tokenizers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _rewrite(root: Path, edit) -> None:
    data = json.loads((root / "manifest.json").read_text())
    edit(data)
    (root / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shards[1].path", "/etc/passwd"),
        ("shards[1].path", "../outside.parquet"),
        ("shards[1].path", "sub/../../outside.parquet"),
        ("shards[1].path", "~/x.parquet"),
        ("shards[1].path", "s3://bucket/x.parquet"),
        ("shards[1].path", ""),
        ("tokenizer.file", "../tokenizer.json"),
        ("tokenizer.file", "/tmp/tokenizer.json"),
    ],
)
def test_paths_outside_the_dataset_are_refused_with_the_field_named(tmp_path: Path, field: str, value: str) -> None:
    root = tmp_path / "ds"
    _write_dataset(root)

    def edit(data: dict) -> None:
        if field.startswith("shards"):
            data["shards"][1]["path"] = value
        else:
            data["tokenizer"]["file"] = value

    _rewrite(root, edit)
    for check_files in (True, False):  # refused when loaded, before any file is opened
        with pytest.raises(DataError) as e:
            load_manifest(str(root), check_files=check_files)
        assert f"{root / 'manifest.json'}: {field}: {value!r} is not a path inside the dataset directory" in str(
            e.value
        )


def test_a_symlink_out_of_the_dataset_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _write_dataset(root)
    outside = tmp_path / "elsewhere.parquet"
    outside.write_bytes(b"x")
    (root / "shard-00002.parquet").unlink()
    (root / "shard-00002.parquet").symlink_to(outside)
    with pytest.raises(DataError) as e:
        load_manifest(str(root))
    msg = str(e.value)
    assert "shards[2].path: 'shard-00002.parquet' resolves to" in msg and "outside the dataset directory" in msg
    # A symlink that stays inside the dataset is fine (e.g. deduplicated shards).
    (root / "shard-00002.parquet").unlink()
    (root / "shard-00002.parquet").symlink_to(root / "shard-00001.parquet")
    load_manifest(str(root))
    # The dataset directory itself may be a symlink (to where the data lives).
    (tmp_path / "link").symlink_to(root)
    assert load_manifest(str(tmp_path / "link")).num_rows == 30


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(seq_len=0, row_len=1), "need seq_len >= 1"),
        (lambda d: d["shards"][0].update(rows=-5), "shards[0].rows: -5 is negative"),
        (lambda d: d.update(num_rows=31), "num_rows 31 != the shards' rows (30)"),
        (lambda d: d["tokenizer"].update(eos_id=512), "tokenizer.eos_id 512 is outside the vocabulary"),
    ],
)
def test_inconsistent_counts_are_refused(tmp_path: Path, edit, message: str) -> None:
    root = tmp_path / "ds"
    _write_dataset(root)
    _rewrite(root, edit)
    with pytest.raises(
        DataError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        load_manifest(str(root))


def test_deeply_nested_json_is_a_data_error(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    (root / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="nested too deeply|expected a JSON object"):
        load_manifest(str(root))


#: An integer of 5,000 digits: Python's json refuses one over 4,300 with a plain ValueError (not a JSONDecodeError).
HUGE_INT = "9" * 5000


def test_an_integer_too_long_for_python_is_one_clear_error_in_every_json_raytrn_reads(tmp_path: Path) -> None:
    from raytrn.config.hf_config import read_config
    from raytrn.data.prepare.tokenizer import load_tokenizer_config
    from raytrn.errors import ConfigError

    (tmp_path / "manifest.json").write_text('{"format": "raytrn.packed/v1", "num_rows": ' + HUGE_INT + "}")
    with pytest.raises(DataError, match=r"manifest\.json: not valid JSON \(Exceeds the limit .*--overwrite"):
        load_manifest(str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": ' + HUGE_INT + "}")
    with pytest.raises(ConfigError, match=r"model\.init_from: .*config\.json is not JSON \(Exceeds the limit"):
        read_config(str(model))
    (model / "tokenizer_config.json").write_text('{"model_max_length": ' + HUGE_INT + "}")
    with pytest.raises(DataError, match=r"--tokenizer .*tokenizer_config\.json is not JSON \(Exceeds the limit"):
        load_tokenizer_config(str(model))
