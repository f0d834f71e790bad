"""``raytrn data prepare``: text files -> tokenizer + packed Parquet shards + manifest.json.

:mod:`.command` runs the job (:func:`prepare_dataset`), in order: :mod:`.inputs` finds, checks and reads the input
files; :mod:`.tokenizer` trains or loads the tokenizer; :mod:`.pipeline` tokenizes the files on Ray Data and packs
the stream into rows; :mod:`.writer` writes the shards and moves the finished dataset into the output directory.
"""

from raytrn.data.prepare.command import MAX_SHARD_SIZE_MB, prepare_dataset
from raytrn.data.prepare.inputs import (
    ACCEPTED_EXTENSIONS,
    TEXT_EXTENSIONS,
    InputFile,
    check_inputs,
    discover_inputs,
    fingerprint_inputs,
    in_validation,
    iter_documents,
)
from raytrn.data.prepare.tokenizer import (
    EOS_CANDIDATES,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    check_vocab_size,
    find_eos,
    load_tokenizer,
    load_tokenizer_config,
    train_tokenizer,
)
from raytrn.data.prepare.writer import JOURNAL_NAME, STAGING_PREFIX

__all__ = [
    "ACCEPTED_EXTENSIONS",
    "EOS_CANDIDATES",
    "JOURNAL_NAME",
    "MAX_SHARD_SIZE_MB",
    "MIN_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "STAGING_PREFIX",
    "TEXT_EXTENSIONS",
    "InputFile",
    "check_inputs",
    "check_vocab_size",
    "discover_inputs",
    "find_eos",
    "fingerprint_inputs",
    "in_validation",
    "iter_documents",
    "load_tokenizer",
    "load_tokenizer_config",
    "prepare_dataset",
    "train_tokenizer",
]
