"""The real ``raytrn`` command line in a subprocess: help, usage errors, and one clear line per user mistake.

User mistakes exit 2 with exactly one ``raytrn: error:`` line and no traceback. The data cases use a
small fake dataset (manifest, empty tokenizer.json, one Parquet shard): no Ray, no tokenizer training.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrn.data.manifest import Manifest, ShardInfo, SourceInfo, TokenizerInfo
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.unit

TINY = str(REPO / "jobs" / "tiny.yaml")  # seq_len 128, vocab 4096
TIMEOUT = 120


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # cwd is a temporary directory, so nothing (checkpoints, mlruns) can land in the checkout.
    return run_cli(*args, cwd=cwd, timeout=TIMEOUT)


def make_dataset(root: Path, *, seq_len: int = 128, vocab_size: int = 4096, rows: int = 4) -> Path:
    """A minimal dataset `raytrn data prepare` could have written: manifest.json, tokenizer.json, one shard."""
    root.mkdir(parents=True)
    shard = root / "shard-00000.parquet"
    ids = [[(r * 7 + i) % vocab_size for i in range(seq_len + 1)] for r in range(rows)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}), shard)
    (root / "tokenizer.json").write_text("")
    manifest = Manifest(
        seq_len=seq_len,
        row_len=seq_len + 1,
        num_rows=rows,
        num_tokens=rows * (seq_len + 1),
        dropped_tail_tokens=0,
        rows_per_shard=rows,
        shards=[ShardInfo(path=shard.name, rows=rows, tokens=rows * (seq_len + 1), bytes=shard.stat().st_size)],
        tokenizer=TokenizerInfo(
            file="tokenizer.json",
            sha256=hashlib.sha256(b"").hexdigest(),  # the empty tokenizer.json above
            vocab_size=vocab_size,
            eos_token="<|endoftext|>",
            eos_id=0,
            trained=True,
        ),
        source=SourceInfo(inputs=["fake"], num_files=1, num_documents=rows, fingerprint="0" * 64),
        created_by="tests",
    )
    (root / "manifest.json").write_text(manifest.to_json())
    return root


def assert_user_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, one `raytrn: error:` line holding every needle, no traceback; return that line."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("raytrn: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# --- help and usage ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        pytest.param((), ("train", "validate", "data", "--version", "raytrn validate jobs/tiny.yaml"), id="raytrn"),
        pytest.param(("train",), ("JOB.yaml", "--set", "KEY=VALUE", "--no-progress", "RAY_ADDRESS"), id="train"),
        pytest.param(("validate",), ("JOB.yaml", "--set", "--no-data"), id="validate"),
        pytest.param(
            ("data", "prepare"),
            ("--input", "--output", "--seq-len", "--tokenizer", "--vocab-size", "--shard-size-mb", "--overwrite"),
            id="data-prepare",
        ),
    ],
)
def test_help(tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    result = cli(*args, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for needle in needles:
        assert needle in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        pytest.param((), "the following arguments are required: COMMAND", id="no-args"),
        pytest.param(("bogus",), "invalid choice: 'bogus'", id="unknown-command"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: raytrn")
    assert_user_error(result, needle)


# --- stop ------------------------------------------------------------------------------------------------------


def test_stop_needs_a_cluster_and_a_step_of_one_or_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert_user_error(cli("stop", "some-run", cwd=tmp_path), "no Ray cluster to talk to", "RAY_ADDRESS", "--address")
    assert_user_error(cli("stop", "some-run", "--at-step", "0", cwd=tmp_path), "--at-step 0: a step is 1 or more")
    help_text = cli("stop", "--help", cwd=tmp_path).stdout
    assert "ends FINISHED" in help_text and "--at-step" in help_text and "resumes" in help_text


# --- validate ---------------------------------------------------------------------------------------------------


def test_validate_missing_file(tmp_path: Path) -> None:
    assert_user_error(cli("validate", "nope.yaml", cwd=tmp_path), "nope.yaml: job file not found")


def test_validate_yaml_syntax_error(tmp_path: Path) -> None:
    text = Path(TINY).read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "extra: key: value\n")
    line = len(text.splitlines()) + 1
    assert_user_error(cli("validate", str(bad), cwd=tmp_path), f"{bad}:{line}:11: YAML syntax error")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        pytest.param(
            "scaling.max_worker=4", "--set scaling.max_worker: unknown field. Did you mean 'max_workers'?", id="unknown"
        ),
        pytest.param("data.seq_len=abc", "--set data.seq_len: Input should be a valid integer", id="wrong-type"),
        pytest.param("optim.lr=0", "--set optim.lr: input should be greater than 0 (got 0)", id="out-of-range"),
    ],
)
def test_validate_bad_spec(tmp_path: Path, override: str, needle: str) -> None:
    assert_user_error(cli("validate", TINY, "--set", override, cwd=tmp_path), f"{TINY}: {needle}")


def _no_dataset(root: Path) -> Path:
    return root / "nope"


def _missing_shard(root: Path) -> Path:
    ds = make_dataset(root / "ds")
    (ds / "shard-00000.parquet").unlink()
    return ds


def _truncated_shard(root: Path) -> Path:
    ds = make_dataset(root / "ds", rows=64)
    shard = ds / "shard-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    return ds


def _emptied_tokenizer(root: Path) -> Path:
    ds = make_dataset(root / "ds", rows=64)
    (ds / "tokenizer.json").write_text("{}")
    return ds


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        pytest.param(_no_dataset, ("no such directory", "raytrn data prepare"), id="missing-dir"),
        pytest.param(
            _missing_shard, ("shard shard-00000.parquet is missing (1 of 1 shards missing)",), id="missing-shard"
        ),
        pytest.param(
            _truncated_shard,
            ("shard shard-00000.parquet is 100 bytes, the manifest recorded", "truncated, emptied or replaced"),
            id="truncated-shard",
        ),
        pytest.param(
            _emptied_tokenizer,
            ("tokenizer file tokenizer.json has sha256 44136fa355b3...", "replaced since the data was tokenized"),
            id="tokenizer-replaced",
        ),
        pytest.param(
            lambda root: make_dataset(root / "ds", vocab_size=8192),
            ("tokenizer has 8,192 tokens but model.vocab_size=4,096", "set model.vocab_size >= 8192"),
            id="vocab-too-big",
        ),
        pytest.param(
            lambda root: make_dataset(root / "ds", seq_len=64),
            ("packed with seq_len=64 but data.seq_len=128", "set data.seq_len: 64"),
            id="seq-len-mismatch",
        ),
    ],
)
def test_validate_bad_dataset(tmp_path: Path, make, needles: tuple[str, ...]) -> None:
    ds = make(tmp_path)
    result = cli("validate", TINY, "--set", f"data.manifest={ds}", cwd=tmp_path)
    assert_user_error(result, *needles)
    assert result.stdout == ""


def test_validate_ok(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", rows=64)
    result = cli("validate", TINY, "--set", f"data.manifest={ds}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == f"{TINY}: OK"
    assert "model: llama, " in result.stdout
    assert "batch: 2 workers: 16 x 1 x 2 (DP) = 32 sequences/step of 128 tokens" in lines
    assert "data: 64 rows x 129 tokens in 1 shard(s) (text), tokenizer vocab 4,096 (model vocab 4,096)" in lines


def test_validate_dataset_smaller_than_one_global_batch(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", rows=31)
    result = cli("validate", TINY, "--set", f"data.manifest={ds}", cwd=tmp_path)
    assert_user_error(result, "the dataset has 31 rows, fewer than one global batch (32 sequences per step")


# --- train fails before Ray starts ------------------------------------------------------------------------------


def test_train_missing_manifest_fails_before_ray(tmp_path: Path) -> None:
    start = time.monotonic()
    result = cli("train", TINY, "--set", f"data.manifest={tmp_path / 'nope'}", "--no-progress", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert_user_error(result, f"dataset {tmp_path / 'nope'}: no such directory")
    assert elapsed < 30
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []  # no checkpoints/ or mlruns/ either


def test_train_neuron_is_refused_clearly(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds")
    result = cli("train", TINY, "--set", f"data.manifest={ds}", "--set", "scaling.accelerator=neuron", cwd=tmp_path)
    assert_user_error(result, "scaling.instance_type", "scaling.workers_per_node")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
