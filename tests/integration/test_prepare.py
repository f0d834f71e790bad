"""`raytrn data prepare` end to end on a real local Ray, checked against an independent reference tokenization."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raytrn.data.manifest import load_manifest
from raytrn.data.prepare import prepare_dataset, train_tokenizer
from raytrn.errors import DataError

pytestmark = pytest.mark.integration

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
SEQ_LEN = 32
VOCAB = 600
SHARD_MB = 0.01  # 79 rows of 33 tokens per shard: several shards from the small corpus


def _prepare(output: Path, **kwargs) -> object:
    args = {
        "inputs": [str(CORPUS), str(CORPUS / "records" / "*.parquet")],  # overlapping inputs are de-duplicated
        "output": str(output),
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB,
        "shard_size_mb": SHARD_MB,
        "progress": False,
    }
    args.update(kwargs)
    if "tokenizer" in kwargs:
        args["vocab_size"] = None
    return prepare_dataset(**args)


def _reference_documents(root: Path) -> list[str]:
    """Read the corpus with the documented rules, written independently of raytrn.data.prepare."""
    paths = sorted(
        os.path.join(d, name)
        for d, _, names in os.walk(root)
        for name in names
        if name.endswith((".txt", ".md", ".rst", ".py", ".text", ".jsonl", ".parquet"))
    )
    docs: list[str] = []
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs += [json.loads(line)["text"] for line in f if line.strip()]
        elif path.endswith(".parquet"):
            docs += pq.read_table(path).column("text").to_pylist()
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
    return [d for d in docs if d]


def _read_rows(manifest) -> np.ndarray:
    tables = [pq.read_table(p) for p in manifest.shard_paths()]
    for t in tables:
        assert t.schema == pa.schema([("input_ids", pa.list_(pa.int32()))])
    rows = [np.asarray(t.column("input_ids").to_pylist(), dtype=np.int32) for t in tables]
    return np.concatenate(rows)


def _dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + "."))


@pytest.fixture(scope="module")
def dataset(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "ds"
    return out, _prepare(out)


def test_manifest_fields(dataset) -> None:
    out, manifest = dataset
    data = json.loads((out / "manifest.json").read_text())
    assert data["format"] == "raytrn.packed/v1"
    assert (data["seq_len"], data["row_len"], data["column"], data["dtype"]) == (
        SEQ_LEN,
        SEQ_LEN + 1,
        "input_ids",
        "int32",
    )
    assert data["num_tokens"] == data["num_rows"] * (SEQ_LEN + 1)
    assert 0 <= data["dropped_tail_tokens"] <= SEQ_LEN
    assert data["rows_per_shard"] == int(SHARD_MB * 2**20) // (4 * (SEQ_LEN + 1))
    assert len(data["shards"]) > 2
    assert [s["path"] for s in data["shards"]] == [f"shard-{i:05d}.parquet" for i in range(len(data["shards"]))]
    assert all(s["rows"] == data["rows_per_shard"] for s in data["shards"][:-1])
    assert sum(s["rows"] for s in data["shards"]) == data["num_rows"]
    assert all(s["bytes"] == (out / s["path"]).stat().st_size for s in data["shards"])
    tok = data["tokenizer"]
    assert tok["file"] == "tokenizer.json" and tok["trained"] is True
    assert (tok["eos_token"], tok["eos_id"], tok["vocab_size"]) == ("<|endoftext|>", 0, VOCAB)
    src = data["source"]
    assert src["inputs"] == [str(CORPUS), str(CORPUS / "records" / "*.parquet")]
    assert src["num_files"] == 9  # README.md, 5 texts (one empty), guide.rst, records.jsonl, table.parquet
    assert src["num_documents"] == len(_reference_documents(CORPUS))
    assert len(src["fingerprint"]) == 64
    assert data["created_by"].startswith("raytrn ")
    assert load_manifest(str(out)) == manifest
    assert "seq_len 32" in manifest.describe()


def test_rows_equal_reference_tokenization(dataset) -> None:
    out, manifest = dataset
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    stream = [i for doc in _reference_documents(CORPUS) for i in [*tok.encode(doc, add_special_tokens=False).ids, eos]]
    rows = _read_rows(manifest)
    assert rows.shape == (manifest.num_rows, SEQ_LEN + 1)
    assert manifest.num_rows == len(stream) // (SEQ_LEN + 1)
    assert manifest.dropped_tail_tokens == len(stream) % (SEQ_LEN + 1)
    np.testing.assert_array_equal(rows.reshape(-1), np.asarray(stream[: rows.size], dtype=np.int32))


def test_rerun_elsewhere_is_byte_identical(dataset, tmp_path) -> None:
    out, _ = dataset
    _prepare(tmp_path / "again")
    assert _dir_bytes(tmp_path / "again") == _dir_bytes(out)


def test_same_output_again_is_up_to_date(dataset, capsys) -> None:
    out, manifest = dataset
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert _prepare(out) == manifest
    assert f"{out}: up to date (same input, seq_len, tokenizer and settings)" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_given_tokenizer_reproduces_the_trained_run(dataset, tmp_path) -> None:
    out, manifest = dataset
    given = tmp_path / "my-tokenizer.json"
    shutil.copy(out / "tokenizer.json", given)
    m2 = _prepare(tmp_path / "given", tokenizer=str(given))
    assert m2.tokenizer.trained is False and m2.tokenizer.sha256 == manifest.tokenizer.sha256
    assert m2.source.fingerprint != manifest.source.fingerprint  # the tokenizer choice is part of it
    assert [s.bytes for s in m2.shards] == [s.bytes for s in manifest.shards]
    np.testing.assert_array_equal(_read_rows(m2), _read_rows(manifest))


def _tree(path: Path) -> dict[str, bytes | str]:
    """Everything under ``path``: file bytes, and symlink targets (never followed)."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in sorted(dirnames + filenames):
            full = Path(dirpath) / name
            rel = str(full.relative_to(path))
            out[rel] = (
                f"-> {os.readlink(full)}" if full.is_symlink() else (full.read_bytes() if full.is_file() else "dir")
            )
    return out


def _user_files(root: Path) -> Path:
    """The reproduction from the issue: a directory with src/notes.txt and a README."""
    (root / "src").mkdir(parents=True)
    (root / "src" / "notes.txt").write_text("my notes")
    (root / "README").write_text("my project")
    return root


def _dataset_files(manifest) -> list[str]:
    return sorted(["manifest.json", "tokenizer.json", *(s.path for s in manifest.shards)])


def test_different_dataset_is_refused_then_overwritten(dataset, tmp_path) -> None:
    target = tmp_path / "ds"
    shutil.copytree(dataset[0], target)
    before = _dir_bytes(target)
    inode = target.stat().st_ino
    with pytest.raises(DataError, match=r"refusing to overwrite a different dataset.*--overwrite"):
        _prepare(target, seq_len=16)
    assert _dir_bytes(target) == before
    m = _prepare(target, seq_len=16, overwrite=True)
    assert load_manifest(str(target)).seq_len == m.seq_len == 16
    # Replaced in place (the directory itself stays), only the new dataset's files, nothing beside it.
    assert target.stat().st_ino == inode
    assert sorted(p.name for p in target.iterdir()) == _dataset_files(m)
    assert _siblings(target) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_raytrn_did_not_write_is_never_replaced(tmp_path, overwrite: bool) -> None:
    target = _user_files(tmp_path / "project")
    before = _tree(target)
    with pytest.raises(DataError) as e:
        _prepare(target, overwrite=overwrite)
    msg = str(e.value)
    assert "not a raytrn dataset" in msg and "README, src" in msg
    assert "never deletes files it did not write" in msg and "choose an empty or new directory" in msg
    assert "pass --overwrite" not in msg
    assert _tree(target) == before and _siblings(target) == []


def test_cli_refuses_output_dot_in_a_project_with_overwrite(tmp_path) -> None:
    """`raytrn data prepare --output . --overwrite` run in a project directory: exit 2, nothing touched."""
    project = _user_files(tmp_path / "project")
    (project / "data.txt").write_text("some text to tokenize " * 50)
    before = _tree(project)
    cmd = [sys.executable, "-m", "raytrn.cli", "data", "prepare", "--input", ".", "--output", ".",
           "--seq-len", "8", "--vocab-size", "300", "--overwrite", "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("raytrn: error: --output .: not a raytrn dataset") and "Traceback" not in proc.stderr
    assert _tree(project) == before


def test_symlinked_output(dataset, tmp_path) -> None:
    """A symlink to someone's directory is refused like the directory; a symlink to a dataset is replaced in
    place: the link stays a link, the data lands where it points."""
    mine = _user_files(tmp_path / "mine")
    link = tmp_path / "link"
    link.symlink_to(mine)
    before = _tree(mine)
    with pytest.raises(DataError, match="not a raytrn dataset"):
        _prepare(link, overwrite=True)
    assert _tree(mine) == before and link.is_symlink()

    real = tmp_path / "real-ds"
    shutil.copytree(dataset[0], real)
    ds_link = tmp_path / "ds-link"
    ds_link.symlink_to(real)
    m = _prepare(ds_link, seq_len=16, overwrite=True)
    assert ds_link.is_symlink() and os.readlink(ds_link) == str(real)
    assert load_manifest(str(real)).seq_len == 16 == m.seq_len
    assert _siblings(ds_link) == [] and _siblings(real) == []


def test_a_dataset_with_foreign_files_is_not_replaced(dataset, tmp_path) -> None:
    target = tmp_path / "ds"
    shutil.copytree(dataset[0], target)
    (target / "notes.txt").write_text("mine")
    before = _tree(target)
    with pytest.raises(DataError, match=r"also files raytrn did not write \(notes\.txt\)"):
        _prepare(target, seq_len=16, overwrite=True)
    assert _tree(target) == before
    # The same dataset is still recognised as up to date (nothing to write).
    assert _prepare(target) == load_manifest(str(target))


def test_output_dot_in_an_empty_directory_keeps_the_directory(ray_session, tmp_path, monkeypatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    m = prepare_dataset(inputs=[str(CORPUS / "text")], output=".", seq_len=16, vocab_size=300, progress=False)
    assert here.stat().st_ino == inode and os.getcwd() == str(here)
    assert load_manifest(".").num_rows == m.num_rows > 0
    assert sorted(p.name for p in here.iterdir()) == _dataset_files(m)


def test_an_interrupted_replacement_is_finished_by_the_next_overwrite(dataset, tmp_path, monkeypatch) -> None:
    """Killed while moving the new files in: no manifest, a journal; the next --overwrite finishes the job and
    removes exactly the files the journal names."""
    from raytrn.data.prepare import writer as prep

    target = tmp_path / "ds"
    shutil.copytree(dataset[0], target)
    real_replace, calls = os.replace, []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == 4:  # the journal, then two files: then "the machine dies"
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(prep.os, "replace", flaky_replace)
    with pytest.raises(KeyboardInterrupt):
        _prepare(target, seq_len=16, overwrite=True)
    monkeypatch.setattr(prep.os, "replace", real_replace)
    assert not (target / "manifest.json").exists() and (target / prep.JOURNAL_NAME).exists()
    with pytest.raises(DataError, match="an interrupted replacement of a dataset.*pass --overwrite"):
        _prepare(target, seq_len=16)
    m = _prepare(target, seq_len=16, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == _dataset_files(m)
    assert load_manifest(str(target)).seq_len == 16


def test_output_inside_input_is_not_read_back(ray_session, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(CORPUS / "text", corpus)
    m = prepare_dataset(inputs=[str(corpus)], output=str(corpus / "packed"), seq_len=16, vocab_size=300, progress=False)
    again = prepare_dataset(
        inputs=[str(corpus)], output=str(corpus / "packed"), seq_len=16, vocab_size=300, progress=False
    )
    assert again == m and m.source.num_files == 5


def test_bad_jsonl_in_a_ray_worker_is_one_clear_error(ray_session, tmp_path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    tokenizer = tmp_path / "tok.json"
    train_tokenizer(["some text"], 300).save(str(tokenizer))
    with pytest.raises(DataError, match=r'a\.jsonl:2: no "text" field \(found: txt\)'):
        prepare_dataset(
            inputs=[str(tmp_path / "in")],
            output=str(tmp_path / "out"),
            seq_len=4,
            tokenizer=str(tokenizer),
            progress=False,
        )
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []


def test_too_few_tokens(ray_session, tmp_path) -> None:
    with pytest.raises(DataError, match=r"only [\d,]+ tokens .* seq_len \+ 1 = 100001; use a smaller --seq-len"):
        _prepare(tmp_path / "new" / "out", seq_len=100_000)
    assert not (tmp_path / "new").exists()


# --- the real CLI: exit code 2, one line on stderr, nothing left behind; these fail before Ray starts ------


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raytrn.cli", "data", "prepare", *args, "--no-progress"]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("empty_dir", "directory has no input files (accepted extensions: .txt"),
        ("glob_nothing", "the glob matched no files"),
        ("no_such_path", "no such file or directory"),
        ("empty_files", "input file(s) are all empty"),
        ("bad_jsonl", "b.jsonl:3: not valid JSON"),
        ("parquet_without_text", 'has no "text" column (columns: body)'),
        ("vocab_too_small", "--vocab-size 100 is too small"),
    ],
)
def test_cli_errors(tmp_path: Path, case: str, message: str) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    vocab = "300"
    spec = str(inp)
    if case == "glob_nothing":
        spec = str(inp / "*.nothing")
    elif case == "no_such_path":
        spec = str(tmp_path / "missing")
    elif case == "empty_files":
        _write(inp / "a.txt", "")
        _write(inp / "sub" / "b.md", "")
    elif case == "bad_jsonl":
        _write(inp / "b.jsonl", '{"text": "one"}\n\n{"text": "two"\n')
    elif case == "parquet_without_text":
        pq.write_table(pa.table({"body": ["x"]}), inp / "t.parquet")
    elif case == "vocab_too_small":
        _write(inp / "a.txt", "hello")
        vocab = "100"
    out = tmp_path / "out" / "ds"
    proc = _cli("--input", spec, "--output", str(out), "--seq-len", "8", "--vocab-size", vocab)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("raytrn: error: "), proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_up_to_date_is_fast_and_quiet(dataset) -> None:
    out, manifest = dataset
    args = ["--output", str(out), "--seq-len", str(SEQ_LEN), "--vocab-size", str(VOCAB)]
    proc = _cli(
        "--input",
        str(CORPUS),
        "--input",
        str(CORPUS / "records" / "*.parquet"),
        *args,
        "--shard-size-mb",
        str(SHARD_MB),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"{out}: up to date (same input, seq_len, tokenizer and settings)\n"
    assert proc.stdout.strip() == manifest.describe()
    assert glob.glob(f"{out}.*") == []
