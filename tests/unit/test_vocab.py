"""Issue 46, item 17: a dataset is checked against ``model.init_from``'s tokenizer by what decides the ids (vocabulary,
merges, added tokens, normalizer, pre-tokenizer), not by the file's bytes: an exported model's ``tokenizer.json``
with a no-op post-processor, another decoder or key order is the same tokenizer; another normalizer or merges is not.
Real tokenizer files (a byte-level BPE trained here with ``tokenizers``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from raytrn.data.vocab import differences, same_encoding
from raytrn.errors import DataError
from raytrn.train.checks import _check_tokenizer_of

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50 + ["import os, sys\n"] * 50, trainer)
    return tok


def _saved(tok: Tokenizer) -> str:
    return tok.to_str()


def _ids(text: str, sample: str) -> list[int]:
    return Tokenizer.from_str(text).encode(sample, add_special_tokens=False).ids


def test_what_does_not_change_an_id_is_the_same_tokenizer(trained: Tokenizer) -> None:
    ours = _saved(trained)
    exported = Tokenizer.from_str(ours)
    exported.post_processor = processors.ByteLevel(trim_offsets=False)  # what an exported model may carry
    exported.decoder = decoders.ByteLevel()
    theirs = json.loads(exported.to_str())
    theirs["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip
    reordered = json.dumps(dict(reversed(list(theirs.items()))), indent=2)
    assert hashlib.sha256(reordered.encode()).digest() != hashlib.sha256(ours.encode()).digest()
    assert same_encoding(ours, reordered)
    sample = "def g(y):\n    return os.path(y)\n"
    assert _ids(ours, sample) == _ids(reordered, sample)


def test_another_normalizer_or_vocabulary_is_another_tokenizer(trained: Tokenizer) -> None:
    ours = _saved(trained)
    lower = Tokenizer.from_str(ours)
    lower.normalizer = normalizers.Lowercase()
    assert not same_encoding(ours, lower.to_str()) and differences(ours, lower.to_str()) == ["normalizer"]
    data = json.loads(ours)
    data["model"]["merges"] = data["model"]["merges"][:-1]
    assert not same_encoding(ours, json.dumps(data)) and differences(ours, json.dumps(data)) == ["model.merges"]
    assert not same_encoding(ours, "{}") and differences(ours, "[" * 100000) == ["the file"]


def test_the_init_from_check_reads_the_encoding(trained: Tokenizer, tmp_path: Path) -> None:
    ours = _saved(trained)
    dataset = tmp_path / "data" / "tokenizer.json"
    dataset.parent.mkdir()
    dataset.write_text(ours)
    manifest = SimpleNamespace(tokenizer_path=str(dataset),
                               tokenizer=SimpleNamespace(sha256=hashlib.sha256(ours.encode()).hexdigest()))  # fmt: skip
    model = tmp_path / "model"
    model.mkdir()
    job = SimpleNamespace(model=SimpleNamespace(init_from=str(model)))
    exported = Tokenizer.from_str(ours)
    exported.post_processor = processors.ByteLevel(trim_offsets=False)
    (model / "tokenizer.json").write_text(exported.to_str())
    _check_tokenizer_of(job, manifest, "job.yaml")  # type: ignore[arg-type]  # refused before (another file hash)
    exported.normalizer = normalizers.Lowercase()
    (model / "tokenizer.json").write_text(exported.to_str())
    with pytest.raises(DataError, match=r"another tokenizer than model.init_from's .*they differ in normalizer\)"):
        _check_tokenizer_of(job, manifest, "job.yaml")  # type: ignore[arg-type]
