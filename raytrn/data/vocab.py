"""Whether two ``tokenizer.json`` files tokenize alike: the same token ids for the same text.

A dataset made for a model from ``model.init_from`` must be tokenized with that model's tokenizer. Comparing the
files' bytes refuses too much: an exported model's ``tokenizer.json`` may differ in what does not change a single id
(a post-processor that adds nothing, the decoder, padding and truncation settings, key order, whitespace). What does
is compared here: the model (its type, vocabulary and merges), the added tokens (content and id), the normalizer and
the pre-tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

#: The parts of a ``tokenizer.json`` (Hugging Face ``tokenizers``) that decide which ids a text becomes.
ENCODING_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer")


def encoding_of(text: str) -> dict[str, Any] | None:
    """The parts of a ``tokenizer.json`` that decide its ids (:data:`ENCODING_PARTS`), normalized for comparison;
    None when ``text`` is not a tokenizer file."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return None
    parts = {key: data.get(key) for key in ENCODING_PARTS}
    added = parts["added_tokens"] if isinstance(parts["added_tokens"], list) else []
    parts["added_tokens"] = sorted(
        (int(t.get("id", -1)), str(t.get("content", ""))) for t in added if isinstance(t, dict)
    )
    model = dict(data["model"])
    merges = model.get("merges")
    if isinstance(merges, list):  # "a b" (older files) and ["a", "b"] (newer) are the same merge
        model["merges"] = [" ".join(m) if isinstance(m, list) else m for m in merges]
    parts["model"] = model
    return parts


def same_encoding(ours: str, theirs: str) -> bool:
    """Whether two ``tokenizer.json`` texts give the same ids for every text (byte-equal files do)."""
    if ours == theirs:
        return True
    a, b = encoding_of(ours), encoding_of(theirs)
    return a is not None and a == b


def differences(ours: str, theirs: str) -> list[str]:
    """Which of :data:`ENCODING_PARTS` differ (for the error message); ["the file"] when one is not a tokenizer."""
    a, b = encoding_of(ours), encoding_of(theirs)
    if a is None or b is None:
        return ["the file"]
    out = []
    for key in ENCODING_PARTS:
        if a[key] == b[key]:
            continue
        if key == "model" and isinstance(a[key], dict) and isinstance(b[key], dict):
            out += [f"model.{k}" for k in sorted(set(a[key]) | set(b[key])) if a[key].get(k) != b[key].get(k)]
        else:
            out.append(key)
    return out
