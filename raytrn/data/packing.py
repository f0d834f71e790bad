"""Streaming packing of token streams into fixed-length training rows.

Documents (token-id arrays, EOS already appended) are concatenated into one stream and cut into
consecutive, non-overlapping rows of exactly ``row_len`` ids: no padding, rows cross document
boundaries, and the incomplete remainder at the very end is dropped (and counted). Pure numpy, no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

ROW_DTYPE = np.int32


class Packer:
    """Cut a stream of token arrays into rows of ``row_len`` int32 ids, holding back less than one row."""

    def __init__(self, row_len: int) -> None:
        if row_len <= 0:
            raise ValueError(f"row_len must be positive, got {row_len}")
        self.row_len = row_len
        self.num_rows = 0
        self.num_tokens_in = 0
        self._pending: list[np.ndarray] = []
        self._num_pending = 0

    @property
    def pending_tokens(self) -> int:
        """Tokens held back waiting for a full row; after the last push this is the dropped tail."""
        return self._num_pending

    def push(self, ids: np.ndarray | Iterable[int]) -> np.ndarray:
        """Add tokens to the stream; return the rows completed by them, shape ``(k, row_len)`` (k may be 0)."""
        arr = np.asarray(ids, dtype=ROW_DTYPE).reshape(-1)
        self.num_tokens_in += arr.size
        if arr.size:
            self._pending.append(arr)
            self._num_pending += arr.size
        if self._num_pending < self.row_len:
            return np.empty((0, self.row_len), dtype=ROW_DTYPE)
        stream = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        k = self._num_pending // self.row_len
        cut = k * self.row_len
        # Copy the remainder so the (possibly large) stream buffer is not kept alive by a small view.
        rest = stream[cut:].copy()
        self._pending = [rest] if rest.size else []
        self._num_pending = rest.size
        self.num_rows += k
        return stream[:cut].reshape(k, self.row_len)


#: The most token ids in one shard: its Parquet list offsets are int32.
MAX_SHARD_TOKENS = 2**31 - 1


def rows_per_shard(shard_size_mb: float, row_len: int) -> int:
    """Rows in a shard of at most ``shard_size_mb`` MiB of int32 token payload (at least one row), and of at most
    2**31 - 1 token ids: a shard's list offsets are int32 (8192 MiB of int32 ids would be 2**31, one too many)."""
    by_size = int(shard_size_mb * 2**20) // (ROW_DTYPE().itemsize * row_len)
    return max(1, min(by_size, MAX_SHARD_TOKENS // row_len))
