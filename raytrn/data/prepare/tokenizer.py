"""The tokenizer of a dataset: a deterministic byte-level BPE trained on the input, or a given one (a tokenizer.json
or a Hugging Face tokenizer directory with its tokenizer_config.json), and the EOS token appended to documents.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from raytrn import jsonfile
from raytrn.data.manifest import TOKENIZER_CONFIG_NAME, TOKENIZER_NAME
from raytrn.errors import DataError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
SPECIAL_TOKENS = ["<|endoftext|>"]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 24  # = the job schema's bound on model.vocab_size (raytrn.config.model)


def train_tokenizer(documents: Iterable[str], vocab_size: int, *, show_progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` on ``documents``; deterministic for the same documents."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Deterministic: the alphabet is fixed (all 256 byte symbols) and merges are chosen by (count, pair ids),
    # independent of thread count and hash-map order; tests/unit/test_tokenizer.py checks it across processes.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer)
    return tok


def check_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE needs room for 256 byte tokens plus the special tokens, and no model takes more than
    :data:`MAX_VOCAB_SIZE` (the job schema's bound on ``model.vocab_size``)."""
    if vocab_size > MAX_VOCAB_SIZE:
        size = (
            f"{vocab_size:,}"
            if vocab_size.bit_length() < 64
            else f"an integer of {int(vocab_size.bit_length() * 0.30103) + 1:,} digits"
        )
        raise DataError(
            f"--vocab-size {size} is too large: a job's model.vocab_size takes at most {MAX_VOCAB_SIZE:,} (large LLM "
            "vocabularies are 32k-262k); try --vocab-size 4096"
        )
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 byte tokens + {', '.join(SPECIAL_TOKENS)}); try --vocab-size 4096"
        )


def load_tokenizer(path: str) -> tuple[Tokenizer, bytes]:
    """Load a HF ``tokenizers`` JSON file, or the ``tokenizer.json`` of a Hugging Face tokenizer directory; returns the
    tokenizer and the file's bytes (copied into the dataset)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, TOKENIZER_NAME)):
            raise DataError(
                f"--tokenizer {path}: a directory without {TOKENIZER_NAME}; give a Hugging Face tokenizer directory "
                "(tokenizer.json + tokenizer_config.json, as save_pretrained writes it) or a tokenizer.json file"
            )
        path = os.path.join(path, TOKENIZER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(
            f"--tokenizer {path}: cannot read ({e.strerror or e}); pass a HF tokenizers tokenizer.json, "
            "or --vocab-size V to train one"
        ) from None
    try:
        return Tokenizer.from_str(raw.decode("utf-8")), raw
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"--tokenizer {path}: not a valid HF tokenizers JSON file ({e})") from None


def load_tokenizer_config(path: str | None) -> tuple[dict[str, Any] | None, bytes]:
    """A tokenizer directory's ``tokenizer_config.json`` (special tokens, chat template) and its bytes; (None, b"")
    for a plain tokenizer.json or a directory without one."""
    if path is None or not os.path.isdir(os.path.expanduser(path)):
        return None, b""
    file = os.path.join(os.path.expanduser(path), TOKENIZER_CONFIG_NAME)
    if not os.path.isfile(file):
        return None, b""
    with open(file, "rb") as f:
        raw = f.read()
    try:
        config = jsonfile.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, or an integer of over 4,300 digits
        raise DataError(f"--tokenizer {path}: {TOKENIZER_CONFIG_NAME} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"--tokenizer {path}: {TOKENIZER_CONFIG_NAME} holds {type(config).__name__}, not an object")
    return config, raw


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def find_eos(tokenizer: Tokenizer, config: dict[str, Any] | None = None) -> tuple[str, int]:
    """The EOS token appended after every document (and every completion): the tokenizer config's ``eos_token``
    when it names one of its tokens, else the first of EOS_CANDIDATES in the vocabulary."""
    named = _token_text((config or {}).get("eos_token"))
    named_id = tokenizer.token_to_id(named) if named is not None else None
    if named is not None and named_id is not None:
        return named, int(named_id)
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, token_id
    raise DataError(
        f"the tokenizer has no EOS token (tried {', '.join(EOS_CANDIDATES)}); "
        "use a tokenizer with one of them, or --vocab-size V to train one"
    )
