"""Packing is exact: every token once, in order, in rows of exactly row_len; only the final tail is dropped."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from raytrn.data.packing import ROW_DTYPE, Packer, rows_per_shard

pytestmark = pytest.mark.unit


def pack_all(docs: Iterable[np.ndarray | Iterable[int]], row_len: int) -> tuple[np.ndarray, int]:
    """Pack everything at once with one Packer: ``(rows of shape (n, row_len), dropped_tail_tokens)``."""
    packer = Packer(row_len)
    blocks = [packer.push(doc) for doc in docs]
    rows = np.concatenate(blocks) if blocks else np.empty((0, row_len), dtype=ROW_DTYPE)
    return rows, packer.pending_tokens


def _docs(lengths: list[int], start: int = 0) -> list[np.ndarray]:
    """Documents whose tokens are consecutive integers, so order and uniqueness are visible in the output."""
    docs, n = [], start
    for length in lengths:
        docs.append(np.arange(n, n + length, dtype=np.int32))
        n += length
    return docs


def _check_exact(docs: list[np.ndarray], row_len: int) -> None:
    stream = np.concatenate(docs) if docs else np.empty(0, np.int32)
    rows, dropped = pack_all(docs, row_len)
    num_rows = stream.size // row_len
    assert rows.dtype == np.int32
    assert rows.shape == (num_rows, row_len)
    assert dropped == stream.size - num_rows * row_len
    assert 0 <= dropped < row_len
    np.testing.assert_array_equal(rows.reshape(-1), stream[: num_rows * row_len])
    # Pushed one document at a time (as prepare streams them), the rows are the same.
    packer = Packer(row_len)
    streamed = np.concatenate([packer.push(d) for d in docs] or [np.empty((0, row_len), np.int32)])
    np.testing.assert_array_equal(streamed, rows)


@pytest.mark.parametrize(
    "lengths,row_len",
    [
        ([], 4),
        ([0, 0, 0], 4),
        ([3], 4),  # fewer tokens than one row: nothing, all dropped
        ([4], 4),  # exactly one row
        ([1] * 9, 4),  # tiny documents
        ([10], 3),  # one document longer than several rows
        ([2, 0, 7, 0, 0, 1, 13, 4], 5),  # mixed, with empty documents
        ([100, 1, 1, 100], 7),
        ([5, 5, 5], 1),  # row_len 1
        ([17], 17),
    ],
)
def test_packing_is_exact(lengths: list[int], row_len: int) -> None:
    _check_exact(_docs(lengths), row_len)


@pytest.mark.parametrize("seed", range(20))
def test_packing_is_exact_on_random_streams(seed: int) -> None:
    rng = np.random.default_rng(seed)
    row_len = int(rng.integers(1, 40))
    lengths = [int(x) for x in rng.choice([0, 1, 2, row_len - 1, row_len, row_len + 1, 3 * row_len + 2, 50], 30)]
    _check_exact(_docs(lengths), row_len)


def test_packer_streams_with_bounded_pending() -> None:
    packer = Packer(8)
    total_rows = 0
    for doc in _docs([3, 3, 3, 20, 0, 5, 1]):
        rows = packer.push(doc)
        total_rows += len(rows)
        assert rows.shape[1:] == (8,)
        assert packer.pending_tokens < 8  # never holds a full row back
    assert packer.num_rows == total_rows == 35 // 8
    assert packer.num_tokens_in == 35
    assert packer.pending_tokens == 35 % 8


def test_packer_does_not_alias_pending_with_returned_rows() -> None:
    packer = Packer(4)
    first = packer.push(np.arange(6, dtype=np.int32))
    second = packer.push(np.arange(100, 102, dtype=np.int32))
    np.testing.assert_array_equal(first, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(second, [[4, 5, 100, 101]])


def test_packer_accepts_lists_and_other_int_dtypes() -> None:
    rows, dropped = pack_all([[1, 2, 3], np.array([4, 5], dtype=np.int64)], 2)
    assert rows.dtype == np.int32
    np.testing.assert_array_equal(rows, [[1, 2], [3, 4]])
    assert dropped == 1


def test_packer_rejects_non_positive_row_len() -> None:
    with pytest.raises(ValueError, match="row_len"):
        Packer(0)


@pytest.mark.parametrize(
    "shard_size_mb,row_len,expected",
    [
        (64.0, 129, (64 * 2**20) // (4 * 129)),
        (1.0, 1024, 256),
        (0.000001, 2049, 1),  # at least one row
        (0.5, 65, (2**19) // (4 * 65)),
        (8192.0, 1, 2**31 - 1),  # by size 2**31 ids: one more than the shard's int32 list offsets can address
        (8192.0, 129, (2**31 - 1) // 129),
    ],
)
def test_rows_per_shard(shard_size_mb: float, row_len: int, expected: int) -> None:
    assert rows_per_shard(shard_size_mb, row_len) == expected
    assert rows_per_shard(shard_size_mb, row_len) * row_len < 2**31
