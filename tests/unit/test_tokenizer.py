"""Tokenizer training is deterministic; EOS detection and tokenizer errors are clear."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from raytrn.data.prepare import discover_inputs, find_eos, iter_documents, load_tokenizer, train_tokenizer
from raytrn.errors import DataError

pytestmark = pytest.mark.unit

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"

_TRAIN_IN_SUBPROCESS = """
import sys
from raytrn.data.prepare import discover_inputs, iter_documents, train_tokenizer
docs = [d for f in discover_inputs([sys.argv[1]]) for d in iter_documents(f.path, f.kind)]
sys.stdout.write(train_tokenizer(docs, int(sys.argv[2])).to_str(pretty=True))
"""


def _corpus_docs() -> list[str]:
    return [d for f in discover_inputs([str(CORPUS)]) for d in iter_documents(f.path, f.kind)]


def test_bpe_training_is_deterministic() -> None:
    docs = _corpus_docs()
    first = train_tokenizer(docs, 600).to_str(pretty=True)
    assert train_tokenizer(iter(docs), 600).to_str(pretty=True) == first
    # Another process: other hash seeds, and a single rayon thread instead of one per core.
    env = dict(os.environ, PYTHONHASHSEED="7", RAYON_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _TRAIN_IN_SUBPROCESS, str(CORPUS), "600"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == first


def test_trained_tokenizer_round_trips_and_has_eos_first() -> None:
    docs = _corpus_docs()
    tok = train_tokenizer(docs, 600)
    assert tok.get_vocab_size() == 600
    assert find_eos(tok) == ("<|endoftext|>", 0)
    text = "Café 東京 🙂 checkpoint\n\n  resume"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_vocab_too_small() -> None:
    with pytest.raises(DataError, match=r"--vocab-size 256 is too small.*at least 257"):
        train_tokenizer(["hello"], 256)


def _word_level(*tokens: str) -> Tokenizer:
    return Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", "hello", *tokens])}, unk_token="<unk>"))


@pytest.mark.parametrize(
    "tokens,expected",
    [
        (("</s>", "<|endoftext|>"), ("<|endoftext|>", 3)),  # <|endoftext|> wins over </s>
        (("</s>",), ("</s>", 2)),
        (("<|end_of_text|>", "</s>"), ("</s>", 3)),
        (("<|end_of_text|>",), ("<|end_of_text|>", 2)),
    ],
)
def test_eos_detection(tokens: tuple[str, ...], expected: tuple[str, int]) -> None:
    assert find_eos(_word_level(*tokens)) == expected


def test_no_eos_names_the_tried_tokens() -> None:
    with pytest.raises(DataError, match=r"no EOS token \(tried <\|endoftext\|>, </s>, <\|end_of_text\|>\)"):
        find_eos(_word_level("<s>"))


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--tokenizer .*nope\.json: cannot read \(No such file"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match=r"not a valid HF tokenizers JSON file"):
        load_tokenizer(str(bad))
    good = tmp_path / "good.json"
    _word_level("</s>").save(str(good))
    tok, raw = load_tokenizer(str(good))
    assert raw == good.read_bytes() and tok.token_to_id("</s>") == 2
