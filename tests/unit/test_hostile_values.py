"""Values YAML can spell but no config means (issue 46, item 9): integers of thousands of digits anywhere a number
is read (job files, ``--set``, a sweep's ``--grid`` and ``--uniform``, cluster files), a key given twice in one
mapping (the last one silently won), and ``data prepare``'s ``--vocab-size`` and ``--seq-len`` out of the job
schema's range: each one line naming where, exit 2, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raytrn.config import load_job, safe_load_yaml, yaml_value
from raytrn.errors import ConfigError, DataError
from raytrn.sweep.space import parse_flag

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
HUGE = "9" * 5000


def test_a_huge_integer_in_a_job_file_is_refused_at_its_line(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    text = (REPO / "jobs" / "tiny.yaml").read_text().replace("  every_n_steps: 50", f"  every_n_steps: {HUGE}")
    job.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("  every_n_steps:"))
    with pytest.raises(ConfigError) as e:
        load_job(job, resolve=False)
    assert str(e.value) == f"{job}:{line}:18: an integer of 5,000 digits; no setting takes more than 100"


@pytest.mark.parametrize("value", [HUGE, f"-{HUGE}", f"0x{'f' * 5000}", f"[1, {HUGE}]", f"{{a: {HUGE}}}"])
def test_a_huge_integer_in_a_set_value_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^--set run.max_steps: an integer of [\d,]+ digits; no setting takes"):
        load_job(REPO / "jobs" / "tiny.yaml", [f"run.max_steps={value}"], resolve=False)


def test_sweep_grids_and_ranges_refuse_huge_integers_in_one_short_line() -> None:
    for kind, text in (("grid", f"optim.lr=1,{HUGE}"), ("choice", f"optim.lr=[1, {HUGE}]"),
                       ("uniform", f"optim.lr=1:{HUGE}"), ("loguniform", f"optim.lr={HUGE}:1")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            parse_flag(kind, text)  # type: ignore[arg-type]
        message = str(e.value)
        assert f"--{kind} " in message and "an integer of 5,000 digits" in message and len(message) < 200, message


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "jobs" / "tiny.yaml").read_text().replace("  lr: 3.0e-3\n", "  lr: 3.0e-3\n  lr: 1.0\n"))
    with pytest.raises(ConfigError, match=r"job\.yaml:15:3: key 'lr' given twice in one mapping \(first at line 14\); "
                       "the last one would silently win: keep one"):  # fmt: skip
        load_job(job, resolve=False)
    # a whole section twice (the first `run:` is in tiny.yaml already)
    job.write_text((REPO / "jobs" / "tiny.yaml").read_text() + "run:\n  seed: 1\n")
    with pytest.raises(ConfigError, match="key 'run' given twice"):
        load_job(job, resolve=False)
    with pytest.raises(ConfigError, match=r"^--set x: key 'a' given twice"):
        yaml_value("{a: 1, a: 2}", "--set x")


def test_merge_keys_may_be_overridden_as_yaml_intends() -> None:
    text = "base: &b {lr: 1, warmup: 2}\nrun:\n  <<: *b\n  lr: 3\n"
    assert safe_load_yaml(text, "x.yaml")["run"] == {"lr": 3, "warmup": 2}
    assert yaml_value("[1, 2, 12345678901234567890]", "--set x") == [1, 2, 12345678901234567890]


def test_cluster_files_refuse_duplicates_and_huge_integers(tmp_path: Path) -> None:
    from raytrn.cluster.common import load_yaml_documents

    for text, expect in (
        ("cluster_name: a\ncluster_name: b\n", "key 'cluster_name' given twice"),
        (f"cluster_name: a\nmax_workers: {HUGE}\n", "an integer of 5,000 digits"),
    ):
        path = tmp_path / "cluster.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=expect):
            load_yaml_documents(str(path), what="cluster file")


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--vocab-size", "99999999999", "--seq-len", "16"], "--vocab-size 99,999,999,999 is too large"),
        (["--vocab-size", "300", "--seq-len", "100000000"], r"--seq-len must be a number of tokens in 1\.\.4,194,304"),
        (["--vocab-size", "300", "--seq-len", "0"], r"--seq-len must be a number of tokens in 1\.\."),
    ],
)
def test_data_prepare_checks_its_ranges_before_anything_starts(tmp_path: Path, flags: list[str], expect: str) -> None:
    """Before: the tokenizer library panicked (a Rust backtrace) for a vocabulary of 10^11, and a seq_len of 10^20
    reached numpy ("Maximum allowed dimension exceeded") after Ray had started."""
    (tmp_path / "in.txt").write_text("hello world\n")
    proc = subprocess.run(
        [sys.executable, "-m", "raytrn.cli", "data", "prepare", "--input", str(tmp_path / "in.txt"), "--output",
         str(tmp_path / "out"), *flags],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raytrn: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr and "panicked" not in proc.stderr, proc.stderr
    import re

    assert re.search(expect, errors[0]), errors[0]
    assert "Ray" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()


def test_the_range_checks_agree_with_the_job_schema() -> None:
    from raytrn.config.model import ModelConfig
    from raytrn.config.schema import DataConfig
    from raytrn.data.prepare.command import MAX_SEQ_LEN, _check_args
    from raytrn.data.prepare.tokenizer import MAX_VOCAB_SIZE, check_vocab_size

    def bound(model: type, name: str) -> int:
        return next(m.le for m in model.model_fields[name].metadata if getattr(m, "le", None) is not None)

    assert MAX_SEQ_LEN == bound(DataConfig, "seq_len") and MAX_VOCAB_SIZE == bound(ModelConfig, "vocab_size")
    check_vocab_size(MAX_VOCAB_SIZE)
    with pytest.raises(DataError, match="too large"):
        check_vocab_size(MAX_VOCAB_SIZE + 1)
    with pytest.raises(DataError, match="an integer of 5,000 digits"):
        _check_args(10**4999, None, 300, 64.0, "text", 0.0)


# -- item 13: storage URIs -------------------------------------------------------------------------------------------

BAD_URIS = {
    "s3:/bucket/x": "is not an S3 URI: write s3://BUCKET/PREFIX",
    "S3://bucket/x": "is not an S3 URI",
    "s3://": "names no bucket",
    "s3:///x": "names no bucket",
    "s3://Bad_Bucket/x": "'Bad_Bucket' is not a valid S3 bucket name",
    "s3://ab/x": "'ab' is not a valid S3 bucket name",
    "s3://a..b/x": "is not a valid S3 bucket name",
    "s3://192.168.1.1/x": "is not a valid S3 bucket name",
    "s3://bucket-/x": "is not a valid S3 bucket name",
}
STORAGE_FIELDS = ("checkpoint.storage", "data.manifest", "data.validation", "model.init_from",
                  "neuron.compile_cache", "eval.include_path")  # fmt: skip


@pytest.mark.parametrize("field", STORAGE_FIELDS)
def test_every_storage_field_refuses_a_malformed_s3_uri(field: str) -> None:
    from raytrn.config.paths import PATH_FIELDS

    assert {f.key for f in PATH_FIELDS if f.kind == "path"} == set(STORAGE_FIELDS)  # every one is tried here
    for value, expect in BAD_URIS.items():
        with pytest.raises(ConfigError) as e:
            load_job(REPO / "jobs" / "tiny.yaml", [f"{field}={value}"], resolve=False)
        assert str(e.value).startswith(f"{REPO / 'jobs' / 'tiny.yaml'}: --set {field}: ") and expect in str(e.value)
    for fine in ("s3://my-bucket.v2/x", "s3://abc", "/tmp/a:b", "relative/dir", "file:///tmp/x"):
        load_job(REPO / "jobs" / "tiny.yaml", [f"checkpoint.storage={fine}"], resolve=False)


def test_a_job_file_with_a_malformed_s3_uri_is_refused_by_validate(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "jobs" / "tiny.yaml").read_text().replace("storage: checkpoints", "storage: s3:/b/c"))
    proc = subprocess.run([sys.executable, "-m", "raytrn", "validate", str(job), "--no-data"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"raytrn: error: {job}: checkpoint.storage: 's3:/b/c' is not an S3 URI: write s3://BUCKET/PREFIX (lowercase "
        "s3, two slashes)"
    ), proc.stderr


def test_validate_answers_in_seconds_when_the_s3_endpoint_is_unreachable() -> None:
    """The SFT jobs' placeholder bucket on an endpoint nothing listens on: one line, not ~55 s of retries and AWS's
    raw text (the checks' reads use few attempts and short timeouts: raytrn.storage.quick_checks)."""
    import os
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1"}  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrn", "validate", "jobs/qwen3-0.6b-sft-trn2.yaml"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)  # fmt: skip
    # (botocore's own retries: ~55 s; this one process's start and imports took 11 s at nice 19 beside the Ray tests)
    assert time.monotonic() - started < 30, proc.stderr
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("raytrn: error: model.init_from: cannot read s3://my-raytrn-bucket/")
    assert f"cannot reach the S3 endpoint http://127.0.0.1:{port}" in proc.stderr and "curlCode" not in proc.stderr


# -- JSON nested too deep (or holding a huge integer) in every file raytrn reads ----------------------------------------

DEEP = "[" * 100_000
HUGE_JSON = '{"a": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("text", [DEEP, HUGE_JSON], ids=["deep", "huge-int"])
def test_every_json_reader_answers_a_hostile_file_in_its_own_words(tmp_path: Path, text: str) -> None:
    """Before: a RecursionError (or, for the JSONL readers, a ValueError that is not a JSONDecodeError) escaped
    every reader but the dataset manifest's: a traceback, or a crash of what read it."""
    from raytrn.checkpoint.lease import Holder
    from raytrn.checkpoint.manifest import Commit
    from raytrn.checkpoint.pins import pinned
    from raytrn.checkpoint.progress import parse_meta
    from raytrn.checkpoint.rundir import RunDir
    from raytrn.cluster.kuberay import ray_resources
    from raytrn.cluster.local import _load_state
    from raytrn.config.hf_config import read_config
    from raytrn.data.instruct import parse_line
    from raytrn.data.manifest import load_manifest
    from raytrn.data.prepare.inputs import iter_documents
    from raytrn.data.prepare.tokenizer import load_tokenizer_config
    from raytrn.data.prepare.writer import _journal_names
    from raytrn.errors import RaytrnError
    from raytrn.sweep.plan import SweepState
    from raytrn.tracking.mlflow_run import _read_marker

    def file(name: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    # refused, one line, each reader's own error
    for call in (
        lambda: load_manifest(str(file("data/manifest.json").parent)),
        lambda: read_config(str(file("model/config.json").parent)),
        lambda: SweepState.load(str(file("sweep/sweep.json").parent)),
        lambda: _load_state(file("local/state.json")),
        lambda: list(iter_documents(str(file("in/a.jsonl")), "jsonl")),
        lambda: parse_line(text.encode(), "chat", where="x.jsonl:1"),
    ):
        with pytest.raises(RaytrnError) as e:
            call()
        assert "\n" not in str(e.value), str(e.value)
    # a tokenizer directory whose tokenizer_config.json is hostile
    from tokenizers import Tokenizer, models

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(Tokenizer(models.BPE()).to_str())
    (tok / "tokenizer_config.json").write_text(text)
    with pytest.raises(RaytrnError) as e:
        load_tokenizer_config(str(tok))
    assert "tokenizer_config.json is not JSON" in str(e.value) and "\n" not in str(e.value)
    # not ours: a ValueError the caller already turns into its message, or passed over
    for call in (lambda: Commit.from_json(text), lambda: parse_meta(text)):
        with pytest.raises(ValueError):
            call()
    assert Holder.parse(text) is None
    assert _read_marker(str(file("run/raytrn-run.json"))) == {}
    assert ray_resources(text) == {}
    journal = file("out/.raytrn-replacing.json")
    assert _journal_names(str(journal.parent)) == set()
    pins = tmp_path / "ckpt" / "r" / "pins"
    pins.mkdir(parents=True)
    (pins / "step_00000005.json").write_text(text)
    assert pinned(RunDir(str(tmp_path / "ckpt"), "r")) == set()


@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "jobs/tiny.yaml", "--workers", HUGE],
        ["estimate", "jobs/tiny.yaml", "--mfu", HUGE],
        ["estimate", "jobs/tiny.yaml", "--node-mtbf-hours", "nan"],
        ["sweep", "jobs/tiny.yaml", "--grid", "optim.lr=1e-4,3e-4", "--samples", HUGE, "--dry-run"],
        ["stop", "some-run", "--at-step", HUGE],
        ["data", "prepare", "--input", "x", "--output", "y", "--vocab-size", HUGE, "--seq-len", "16"],
    ],
    ids=["estimate-workers", "estimate-mfu", "estimate-nan", "sweep-samples", "stop-at-step", "prepare-vocab"],
)
def test_a_number_option_of_thousands_of_digits_is_one_short_line(args: list[str]) -> None:
    """argparse echoed the whole 5,000-digit value back; a number option now says how long it is (exit 2)."""
    proc = subprocess.run([sys.executable, "-m", "raytrn", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-500:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and len(last) < 200, last
    assert "digits" in last or "not a finite number" in last, last
