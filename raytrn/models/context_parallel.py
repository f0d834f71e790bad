"""Context parallelism: a sequence split over the ranks of a process group, attention computed as a ring.

torch's ``context_parallel`` dispatches on CUDA's SDPA kernels only; this is the same algorithm in plain PyTorch on
a ``torch.distributed`` group (gloo on CPU, nccl on CUDA, TorchNeuron's on neuron), exact to float rounding against
one process running :class:`raytrn.models.decoder.LlamaForCausalLM` on the whole rows
(``tests/unit/test_context_parallel.py``; trained through the job setting ``parallel.context_parallel_size`` in
``tests/unit/test_context_parallel_training.py``).

**Sharding (load-balanced).** A row of ``seq`` tokens is padded to a multiple of ``2 * size`` and cut into
``2 * size`` chunks of ``c`` tokens; rank ``r`` holds chunks ``r`` and ``2 * size - 1 - r`` (the zigzag of
Megatron and torchtitan), so under a causal mask every rank has the same attention work. The padding is segment 0
(it attends only to itself, as :func:`~raytrn.models.decoder.document_mask` has it) and out of the loss; RoPE
positions are each token's place in its document, computed on the whole row before sharding
(:func:`shard_batch`).

**Ring attention.** :func:`ring_attention` is an ``autograd.Function``. Forward: each rank keeps its queries and
passes its keys, values and segments round the ring (``batch_isend_irecv``, posted before a block's compute so the
transfer overlaps it); each block's scores (float32, or the inputs' dtype if wider) are merged into the output by
their log-sum-exp (the online softmax of flash attention), under the exact mask of one process: causal by global
index, within one document, padding alone. The zigzag halves a block: a source rank before this one contributes
its first chunk to all the queries, one after it all its keys to the second chunk only. Backward runs the ring
again, recomputing each block's probabilities from the saved log-sum-exp, and passes each source's key/value
gradient accumulators round with its keys until they reach their owner (flash attention's ring backward). GQA: a
query head ``h`` reads key head ``h // (heads / kv_heads)``, as SDPA's ``enable_gqa``, without copying the keys.

Memory (``2c = padded seq / size`` tokens a rank): its own ``q, k, v`` ``[batch, heads, 2c, head_dim]``, one
incoming ``k, v`` of the same size, the float32 output accumulator and log-sum-exp, and one block's float32 scores
``[batch, heads, 2c, 2c]`` (at most; half of that off the diagonal) - no fused kernel: a block's scores are
materialised, as SDPA's math path does. Nothing of size ``seq`` is held. Saved for backward: ``q, k, v``, the output
and its log-sum-exp; backward adds float32 ``dq`` and the ``dk, dv`` accumulators (its own and one incoming).
Communication per layer and rank: forward ``size - 1`` transfers of the local ``k, v`` (and int64 segments);
backward the same plus ``size`` transfers of the float32 ``dk, dv``. Compute: the diagonal block and ``size - 1``
half blocks, the same on every rank.

**The seam.** The model (:mod:`raytrn.models.decoder`) takes a :class:`RingContext` (its
``AttentionContext``): RoPE at the shard's positions, every attention :func:`ring_attention` over the group instead
of SDPA; nothing else of the model changes, so activation checkpointing, FSDP2, DDP and tensor parallelism apply as
they do without it. :class:`ContextParallel` is a rank's place in its group (built from the mesh by
:mod:`raytrn.train.parallelize`): the training step (:mod:`raytrn.train.step`) cuts each micro-batch with it and
takes the loss of its shard's targets, the padding left out.

**Where this runs.** Everywhere raytrn's torch.distributed backends run: cpu (gloo, tested), cuda (nccl) and neuron
(TorchNeuron's group; its point-to-point transfers not yet tried on a device). On CUDA torch's own
``context_parallel`` (SDPA's flash and efficient kernels) would be faster; raytrn runs this ring there too, for one
code path (docs/training.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from raytrn.config.sizes import padded_length
from raytrn.models.decoder import document_positions

#: P2P tags: keys/values and their gradient accumulators travel the same ring as separate messages.
_KV_TAG, _GRAD_TAG = 1, 2


# --- sharding ------------------------------------------------------------------------------------------------------


def pad_sequence(x: torch.Tensor, size: int, value: float | int = 0) -> torch.Tensor:
    """``x`` ``[batch, seq, ...]`` padded with ``value`` along ``seq`` to :func:`~raytrn.config.sizes.padded_length`."""
    seq = x.shape[1]
    extra = padded_length(seq, size) - seq
    if extra == 0:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def zigzag_index(padded: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global indices (into the padded row) of rank ``rank``'s tokens: chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size``."""
    if padded % (2 * size):
        raise ValueError(f"a padded length of {padded} does not split into {2 * size} chunks")
    c = padded // (2 * size)
    first, second = rank * c, (2 * size - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def shard(x: torch.Tensor, rank: int, size: int, value: float | int = 0) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` ``[batch, seq, ...]``: padded with ``value``, then its two zigzag chunks."""
    padded = pad_sequence(x, size, value)
    return padded.index_select(1, zigzag_index(padded.shape[1], rank, size, x.device))


def unshard(shards: Sequence[torch.Tensor], seq: int | None = None) -> torch.Tensor:
    """The rows whose zigzag shards are ``shards`` (rank order), cropped to ``seq`` tokens (None: padded length)."""
    c = shards[0].shape[1] // 2  # rank r's halves are chunks r and 2 * size - 1 - r
    whole = torch.cat([local[:, :c] for local in shards] + [local[:, c:] for local in reversed(shards)], dim=1)
    return whole if seq is None else whole[:, :seq]


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup | None = None, seq: int | None = None
) -> torch.Tensor:
    """Every rank's shard of ``local``'s rows, gathered and put back in order (a collective; no gradient)."""
    _, size = _rank_size(group)
    if size == 1:
        return local if seq is None else local[:, :seq]
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard(parts, seq)


class ContextShard(NamedTuple):
    """One CP rank's share of a micro-batch, every tensor ``[batch, 2c]``: the model's inputs and their targets, the
    targets' loss mask (False on the padding), segments (0 on the padding) and RoPE positions (each token's place
    in its document, as one process computes them on the whole row)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor


def shard_batch(
    tokens: torch.Tensor,
    rank: int,
    size: int,
    *,
    loss_mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> ContextShard:
    """Rank ``rank``'s share of a micro-batch as the training step reads one (:class:`raytrn.data.batch.TokenBatch`:
    ``tokens`` ``[batch, seq + 1]``, ``loss_mask`` and ``segments`` the same shape or None): shifted into inputs
    and targets, padded and sharded. Without ``segments`` the row is one document (plain causal attention); without
    ``loss_mask`` every target counts. The padding never does."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seg = torch.ones_like(inputs) if segments is None else segments[:, :-1]
    mask = torch.ones_like(targets, dtype=torch.bool) if loss_mask is None else loss_mask[:, 1:].bool()
    padded_seg = pad_sequence(seg, size)  # positions from the whole row, before it is split
    positions = document_positions(padded_seg)
    index = zigzag_index(padded_seg.shape[1], rank, size, tokens.device)
    return ContextShard(
        input_ids=shard(inputs, rank, size),
        targets=shard(targets, rank, size),
        loss_mask=shard(mask, rank, size, False),
        segments=padded_seg.index_select(1, index),
        positions=positions.index_select(1, index),
    )


# --- ring attention ------------------------------------------------------------------------------------------------


def _rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and its size; (0, 1) without a process group (one process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _Transfer(NamedTuple):
    """Tensors in flight round the ring: ``sent`` (kept referenced until the transfer is over), ``received`` (to
    read after :meth:`wait`) and the requests."""

    sent: list[torch.Tensor]
    received: list[torch.Tensor]
    requests: list[Any]

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


class _Ring:
    """Point-to-point transfers to the next rank of ``group`` and from the previous one (group ranks mapped to
    global ones, as P2P ops want)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size

    def shift(self, tensors: list[torch.Tensor], tag: int) -> _Transfer:
        """Start sending ``tensors`` (contiguous) to the next rank and receiving the previous rank's into new
        buffers."""
        assert all(t.is_contiguous() for t in tensors)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return _Transfer(tensors, received, dist.batch_isend_irecv(ops))


def _blocks(rank: int, source: int, c: int) -> tuple[slice, slice]:
    """The query and key rows of rank ``rank``'s block against source ``source``'s keys that the causal mask can
    let through: the whole diagonal block; a source before this rank: its first chunk (its second lies after both
    of ours); a source after it: our second chunk only (our first lies before both of its)."""
    if source == rank:
        return slice(0, 2 * c), slice(0, 2 * c)
    if source < rank:
        return slice(0, 2 * c), slice(0, c)
    return slice(c, 2 * c), slice(0, 2 * c)


def _allowed(q_index: torch.Tensor, k_index: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, 1, q, k]``: :func:`~raytrn.models.decoder.document_mask` of these global indices: key before
    query in the same document; padding (segment 0) sees only itself."""
    causal = k_index[None, :] <= q_index[:, None]
    alone = k_index[None, :] == q_index[:, None]
    same = q_seg[:, :, None] == k_seg[:, None, :]
    pad = (q_seg == 0)[:, :, None]
    return ((same & causal & ~pad) | (alone & pad))[:, None, None]


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax sums and gradient accumulators are kept in: float32, or the inputs' if wider."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores ``[batch, kv_heads, groups, q, k]`` (in :func:`_accumulate`'s dtype) of grouped queries against one
    key block, -inf where the mask forbids."""
    acc = _accumulate(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    return s.masked_fill(~allowed, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows the block's mask empties) as 0, so that ``exp(score - lse)`` is 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


class _Block(NamedTuple):
    """The rows of this rank's queries (``qs``) and of a source rank's keys (``ks``) that meet in a step of the ring,
    those keys and values, and the block's mask (:func:`_allowed`)."""

    qs: slice
    ks: slice
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor


def _ring_blocks(
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    group: dist.ProcessGroup | None,
    ring: _Ring | None = None,
) -> Iterator[_Block]:
    """Each step's block of the ring (the source rank's keys held then). The next source's keys travel while the
    caller computes a block."""
    rank, size = _rank_size(group)
    if ring is None and size > 1:
        ring = _Ring(group, rank, size)
    n = k.shape[-2]
    q_index = zigzag_index(n * size, rank, size, k.device)
    held = [k.contiguous(), v.contiguous(), segments.contiguous()]
    for step in range(size):
        source = (rank - step) % size
        travelling = ring.shift(held, _KV_TAG) if ring is not None and step < size - 1 else None
        kb, vb, kseg = held
        qs, ks = _blocks(rank, source, n // 2)
        k_index = zigzag_index(n * size, source, size, k.device)
        yield _Block(
            qs, ks, kb[..., ks, :], vb[..., ks, :], _allowed(q_index[qs], k_index[ks], segments[:, qs], kseg[:, ks])
        )
        if travelling is not None:
            held = travelling.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention of grouped queries ``[batch, kv_heads, groups, 2c, head_dim]`` against keys and values
    ``[batch, kv_heads, 2c, head_dim]`` held round the ring; the output as the queries."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor,
        group: dist.ProcessGroup | None,
        scale: float,
    ) -> torch.Tensor:
        acc = _accumulate(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for qs, _, kb, vb, allowed in _ring_blocks(k, v, segments, group):
            s = _scores(q[..., qs, :], kb, allowed, scale)
            block_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(block_lse)[..., None])
            block_out = torch.matmul(p, vb.to(acc).unsqueeze(2))
            # online softmax: rescale what is there and what comes to their common log-sum-exp
            merged = torch.logaddexp(lse[..., qs], block_lse)
            safe = _finite(merged)
            out[..., qs, :] = (
                out[..., qs, :] * torch.exp(lse[..., qs] - safe)[..., None]
                + block_out * torch.exp(block_lse - safe)[..., None]
            )
            lse[..., qs] = merged
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, segments, result, lse)
        ctx.group, ctx.scale = group, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, segments, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = _rank_size(group)
        ring = _Ring(group, rank, size) if size > 1 else None
        acc = _accumulate(q.dtype)
        dout = grad_out.to(acc)
        delta = (dout * out.to(acc)).sum(-1)  # rowsum(dO * O): the softmax's backward term
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        grads: _Transfer | None = None  # the key/value gradient sums arriving for this step's source
        for qs, ks, kb, vb, allowed in _ring_blocks(k, v, segments, group, ring):
            qb, kf, vf = q[..., qs, :].to(acc), kb.to(acc).unsqueeze(2), vb.to(acc).unsqueeze(2)
            p = torch.exp(_scores(qb, kb, allowed, scale) - lse[..., qs, None])  # masked: exp(-inf) = 0
            do = dout[..., qs, :]
            ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta[..., qs, None])
            dq[..., qs, :] += torch.matmul(ds, kf) * scale
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            dk[..., ks, :] = torch.matmul(ds.transpose(-1, -2), qb).sum(2) * scale  # summed over a kv head's queries
            dv[..., ks, :] = torch.matmul(p.transpose(-1, -2), do).sum(2)
            if grads is not None:  # the previous rank's sums for this source, sent after its own block
                earlier_dk, earlier_dv = grads.wait()
                dk, dv = dk + earlier_dk, dv + earlier_dv
            if ring is not None:
                grads = ring.shift([dk, dv], _GRAD_TAG)  # on to the next rank; after the last step, home
        if grads is not None:
            dk, dv = grads.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@torch.compiler.disable  # eager between compiled pieces: dynamo cannot trace point-to-point transfers
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, as one process's SDPA under
    :func:`~raytrn.models.decoder.document_mask` would give it for these rows.

    ``q`` ``[batch, heads, 2c, head_dim]``, ``k``/``v`` ``[batch, kv_heads, 2c, head_dim]`` (``heads`` a multiple of
    ``kv_heads``: GQA), ``segments`` ``[batch, 2c]``: this rank's zigzag shard (:func:`shard_batch`) of ``group``
    (None: the default group; one process without one). ``scale``: default ``head_dim ** -0.5``. Differentiable in
    ``q``, ``k`` and ``v``; every rank of ``group`` calls it together (the ring's transfers). Under ``torch.compile``
    (``run.compile``: a compiled decoder block) it runs eagerly, the block's graph broken around it."""
    batch, heads, n, head_dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != (n, head_dim):
        raise ValueError(
            f"ring_attention: queries {tuple(q.shape)} do not fit keys {tuple(k.shape)}, values {tuple(v.shape)}"
        )
    if n % 2 or segments.shape != (batch, n):
        raise ValueError(
            f"ring_attention: {n} local tokens with segments {tuple(segments.shape)} are not a zigzag shard"
        )
    grouped = q.unflatten(1, (kv_heads, heads // kv_heads))  # query head h reads key head h // groups (SDPA's GQA)
    out = _RingAttention.apply(grouped, k, v, segments, group, head_dim**-0.5 if scale is None else scale)
    return out.flatten(1, 2)


# --- the seam ------------------------------------------------------------------------------------------------------


class RingContext(NamedTuple):
    """A rank's share of a sequence as the model attends over it (:class:`raytrn.models.decoder.AttentionContext`):
    its tokens' ``segments`` and RoPE ``positions`` (:class:`ContextShard`'s) and the ``group`` the ring runs
    over."""

    segments: torch.Tensor
    positions: torch.Tensor
    group: dist.ProcessGroup | None = None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return ring_attention(q, k, v, self.segments, self.group, scale=scale)


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group (``parallel.context_parallel_size`` ranks, TP apart: the ``cp`` dimension
    of the ``(dp, cp, tp)`` mesh, :func:`raytrn.train.parallelize.context_parallel`), its rank in it and its size."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def shard(
        self, tokens: torch.Tensor, *, loss_mask: torch.Tensor | None = None, segments: torch.Tensor | None = None
    ) -> tuple[ContextShard, RingContext]:
        """This rank's :func:`shard_batch` of a micro-batch, and the context the model attends over it with."""
        part = shard_batch(tokens, self.rank, self.size, loss_mask=loss_mask, segments=segments)
        return part, RingContext(part.segments, part.positions, self.group)
