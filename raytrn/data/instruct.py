"""Instruction data for fine-tuning: examples that are trained on only in part, packed into fixed-length rows.

Formats (``raytrn data prepare --format``), JSONL, one example a line:

- ``prompt-completion``: ``{"prompt": ..., "completion": ...}``: the prompt (with the tokenizer's BOS, as it
  encodes a text) is context, the completion and an EOS are trained on;
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer's chat template
  (jinja, as ``transformers`` renders it: ``apply_chat_template``); the assistant turns (their content and
  the template's end-of-turn) are trained on, everything else (system, user, the template's own tokens) is not.
  Which tokens are an assistant's: the text each assistant message adds to the rendering of the conversation up
  to it (rendered with the generation prompt), mapped to tokens by their character offsets.

Every example becomes ``ids`` and ``mask`` (1: this token is a target the loss is taken on). :class:`RowPacker`
cuts them into rows of exactly ``row_len`` (= seq_len + 1) tokens with a ``loss_mask`` and ``segment_ids`` (1, 2,
... per example in the row; 0 for padding): with packing, as many whole examples as fit, one after another, the
rest of the row padded; without, one example a row. An example longer than a row is cut to it (counted); one with
no token left to train on is skipped (counted). The first token of an example is never a target: it would be
predicted from the example before it, which document masking hides.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raytrn import jsonfile
from raytrn.errors import DataError

FORMATS = ("text", "prompt-completion", "chat")
INSTRUCTION_FORMATS = ("prompt-completion", "chat")
#: The columns of an instruction dataset's rows (besides ``input_ids``).
MASK_COLUMN, SEGMENT_COLUMN = "loss_mask", "segment_ids"


@dataclass
class Example:
    ids: np.ndarray  # int32 token ids
    mask: np.ndarray  # int8: 1 where the token is a target to train on


class BadLine(DataError):
    """A line that is not an example of its format (its file and line number in the message)."""


def parse_line(raw: bytes, fmt: str, *, where: str) -> Any:
    """The example a JSONL line holds (a (prompt, completion) pair or a message list); None for a blank line;
    BadLine otherwise."""
    line = raw.decode("utf-8", errors="replace")
    if not line.strip():
        return None
    try:
        obj = jsonfile.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    if fmt == "prompt-completion":
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise BadLine(
                f'{where}: --format prompt-completion needs string "prompt" and "completion" fields (found: '
                f"{', '.join(obj) or 'none'})"
            )
        return prompt, completion
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadLine(f'{where}: --format chat needs a non-empty "messages" list (found: {", ".join(obj) or "none"})')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadLine(f'{where}: messages[{i}] needs string "role" and "content" fields')
    if not any(m["role"] == "assistant" for m in messages):
        raise BadLine(f"{where}: no assistant message: nothing to train on")
    return messages


class Encoder:
    """Turns parsed examples into token ids and masks with the dataset's tokenizer (``tokenizer.json``, and for
    ``chat`` the ``tokenizer_config.json`` holding the chat template)."""

    def __init__(self, fmt: str, tokenizer_json: str, eos_id: int, tokenizer_config: dict[str, Any] | None) -> None:
        from tokenizers import Tokenizer

        self.fmt, self.eos_id = fmt, eos_id
        self.tok = Tokenizer.from_str(tokenizer_json)
        self.chat: Any = None
        if fmt == "chat":
            self.chat = chat_tokenizer(tokenizer_json, tokenizer_config)

    def encode(self, example: Any, *, where: str) -> Example:
        if self.fmt == "prompt-completion":
            prompt, completion = example
            p = self.tok.encode(prompt, add_special_tokens=True).ids
            c = [*self.tok.encode(completion, add_special_tokens=False).ids, self.eos_id]
            return Example(
                ids=np.asarray(p + c, dtype=np.int32),
                mask=np.concatenate([np.zeros(len(p), np.int8), np.ones(len(c), np.int8)]),
            )
        return self._chat(example, where=where)

    def _chat(self, messages: list[dict[str, str]], *, where: str) -> Example:
        try:
            text = self.chat.apply_chat_template(messages, tokenize=False)
            spans = []
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self.chat.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                upto = self.chat.apply_chat_template(messages[: i + 1], tokenize=False)
                if not (text.startswith(upto) and upto.startswith(before)):
                    raise BadLine(
                        f"{where}: the chat template renders a conversation differently from its beginning (message "
                        f"{i}): raytrn cannot tell the assistant's tokens"
                    )
                spans.append((len(before), len(upto)))
        except BadLine:
            raise
        except Exception as e:  # jinja's TemplateError and anything the template raises
            raise BadLine(f"{where}: the chat template failed to render: {e.__class__.__name__}: {e}") from None
        encoding = self.tok.encode(text, add_special_tokens=False)  # the template writes its special tokens
        mask = np.zeros(len(encoding.ids), np.int8)
        for k, (start, end) in enumerate(encoding.offsets):
            if any(start < hi and end > lo for lo, hi in spans):
                mask[k] = 1
        return Example(ids=np.asarray(encoding.ids, dtype=np.int32), mask=mask)


def chat_tokenizer(tokenizer_json: str, config: dict[str, Any] | None) -> Any:
    """A ``transformers`` tokenizer that renders chat templates as ``transformers`` does; DataError without one."""
    template = (config or {}).get("chat_template")
    if not template:
        raise DataError(
            "--format chat needs a tokenizer with a chat template: --tokenizer DIR, a Hugging Face tokenizer directory "
            "whose tokenizer_config.json has 'chat_template' (the tokenizer of the model you fine-tune)"
        )
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    special = {k: v for k, v in (config or {}).items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in special.items() if v}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json), chat_template=template, **special
    )


@dataclass
class RowPacker:
    """Rows of ``row_len`` tokens from examples (see the module docstring); ``pad_id`` fills what is left."""

    row_len: int
    pad_id: int
    packing: bool = True
    examples: int = 0
    truncated: int = 0
    skipped: int = 0
    rows: int = 0
    trained_tokens: int = 0
    _ids: list[np.ndarray] = field(default_factory=list)
    _mask: list[np.ndarray] = field(default_factory=list)
    _used: int = 0

    def push(self, example: Example) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Add an example; the rows (ids, loss_mask, segment_ids) it completed."""
        ids, mask = example.ids, example.mask.copy()
        if len(ids) > self.row_len:
            ids, mask = ids[: self.row_len], mask[: self.row_len]
            self.truncated += 1
        if len(mask):
            mask[0] = 0  # never predicted from inside its own example
        if not mask.any():
            self.skipped += 1
            return []
        self.examples += 1
        self.trained_tokens += int(mask.sum())
        done = []
        if self._ids and (not self.packing or self._used + len(ids) > self.row_len):
            done.append(self._close())
        self._ids.append(ids)
        self._mask.append(mask)
        self._used += len(ids)
        return done

    def flush(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The last, partly filled row (padded), if any."""
        return [self._close()] if self._ids else []

    def _close(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pad = self.row_len - self._used
        ids = np.concatenate([*self._ids, np.full(pad, self.pad_id, np.int32)])
        mask = np.concatenate([*self._mask, np.zeros(pad, np.int8)])
        segments = np.concatenate(
            [*(np.full(len(x), k, np.int32) for k, x in enumerate(self._ids, start=1)), np.zeros(pad, np.int32)]
        )
        self._ids, self._mask, self._used = [], [], 0
        self.rows += 1
        return ids, mask, segments


def iter_jsonl_examples(path: str, rel: str, fmt: str, *, skip_bad_lines: bool) -> Iterator[tuple[int, Any, str]]:
    """``(line number, parsed example or None, error)`` of a JSONL file; a bad line raises BadLine, or with
    ``skip_bad_lines`` comes back as ``(n, None, why)``."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                example = parse_line(raw, fmt, where=f"{rel}:{lineno}")
            except BadLine as e:
                if not skip_bad_lines:
                    raise
                yield lineno, None, str(e)
                continue
            if example is not None:
                yield lineno, example, ""
