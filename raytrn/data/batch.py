"""Micro-batches as the training step takes them: plain token tensors, or :class:`TokenBatch` with a loss mask and
document segments (instruction data, document attention). Conversions from the data path's blocks live here, so
the step (:mod:`raytrn.train.step`), the evaluation and ``raytrn precheck`` read batches the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raytrn.data.instruct import MASK_COLUMN, SEGMENT_COLUMN
from raytrn.errors import DataError

if TYPE_CHECKING:
    from raytrn.config import JobSpec


@dataclass
class TokenBatch:
    """A micro-batch that is not plain text: token ids ``[rows, seq_len + 1]`` with, per token, whether it is a target
    to train on (``loss_mask``, None: all) and its document (``segments``: 1, 2, ... per document of a row, 0 padding;
    None: plain causal attention)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    def to(self, device: Any, non_blocking: bool = False) -> TokenBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return TokenBatch(move(self.tokens), move(self.loss_mask), move(self.segments))  # type: ignore[arg-type]


def attention(job: JobSpec, manifest: Any) -> str:
    """``data.attention`` as it applies to ``manifest``: document for instruction data, causal for text, unless set."""
    return job.data.attention or ("document" if manifest.instruction else "causal")


def to_torch(batch: Any, *, document: bool, eos_id: int) -> Any:
    """A :class:`raytrn.data.source.MicroBatch` as the step takes it: an int64 tensor (plain text, causal), or a
    :class:`TokenBatch` with the loss mask and, with document attention, segment ids (for text: a new document after
    every EOS)."""
    tokens = torch.from_numpy(batch.tokens.astype(np.int64))
    mask = batch.extra.get(MASK_COLUMN)
    if mask is None and not document:
        return tokens
    segments = None
    if document:
        seg = batch.extra.get(SEGMENT_COLUMN)
        if seg is None:  # text: each EOS ends its document
            ends = batch.tokens == eos_id
            seg = 1 + np.concatenate([np.zeros((len(ends), 1), np.int64), np.cumsum(ends, axis=1)[:, :-1]], axis=1)
        segments = torch.from_numpy(seg.astype(np.int64))
    return TokenBatch(tokens, None if mask is None else torch.from_numpy(mask.astype(np.bool_)), segments)


def rows_tensor(table: Any, row_len: int) -> torch.Tensor:
    """The ``input_ids`` rows of an Arrow table as one int64 tensor [rows, row_len]."""
    column = table.column("input_ids").combine_chunks()
    values = column.flatten().to_numpy()  # flatten: only the rows of a sliced table
    if len(values) != len(column) * row_len:
        raise DataError(
            f"dataset rows are not {row_len} tokens (data.seq_len + 1) long; prepare the data with the job's seq_len"
        )
    return torch.from_numpy(values.reshape(len(column), row_len).astype(np.int64))
