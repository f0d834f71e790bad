"""Context parallelism (:mod:`raytrn.models.context_parallel`): the zigzag shards as pure functions, then real gloo
ranks (one spawn of 4, no Ray) running tiny decoders at CP 2 and CP 4 on packed rows of several documents with
padding, at a length neither CP's chunks divide: gathered logits, the loss over the whole sequence and every
parameter's gradient (summed over the CP ranks) within 2e-5 of one process running the same model on the whole rows.
The model attends as a ring when given a :class:`RingContext`; training with it (``parallel.context_parallel_size``)
is ``tests/unit/test_context_parallel_training.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from raytrn.config.sizes import padded_length
from raytrn.models.context_parallel import (
    ContextParallel,
    RingContext,
    gather_sequence,
    ring_attention,
    shard,
    shard_batch,
    unshard,
    zigzag_index,
)
from raytrn.models.decoder import Decoder, LlamaForCausalLM, document_mask, document_positions
from raytrn.train.loss import masked_loss_sum
from tests.unit.gloo_ranks import init_gloo, spawn_ranks

pytestmark = pytest.mark.unit

WORLD = 4
SEQ = 37  # the model's inputs a row: CP 2 pads them to 40 (4 chunks of 10), CP 4 to 40 (8 chunks of 5)
VOCAB = 96
TOLERANCE = 2e-5
DEADLINE_S = 120  # the spawn (imports and all) takes ~10 s on 2 free cores
#: Each row's documents (token counts) and padding after them: SEQ + 1 tokens a row.
PACKED = (((9, 14, 11), 4), ((3, 17, 6, 8), 4))
#: name -> the decoder's attention: GQA (tiny's 4 heads over 2), plain multi-head, Qwen3's (own head width, qk norms).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(num_heads=4, num_kv_heads=2),
    "llama-mha": dict(num_heads=4, num_kv_heads=4),
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=24, qk_norm=True),
}
#: name -> (config, the ranks of its CP group, its rows: packed, packed with a loss mask, or plain causal text).
CASES: dict[str, tuple[str, tuple[int, ...], str]] = {
    "gqa-cp2": ("llama-gqa", (0, 1), "packed"),
    "qwen3-cp2": ("qwen3", (2, 3), "packed"),  # the other pair of ranks: a group's ranks are not the world's
    "mha-cp4": ("llama-mha", (0, 1, 2, 3), "masked"),
    "causal-cp4": ("llama-gqa", (0, 1, 2, 3), "causal"),
}


def tiny_model(config: str) -> LlamaForCausalLM:
    """A 2-layer decoder, the same weights in every process (seeded)."""
    torch.manual_seed(0)
    decoder = Decoder(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, rope_theta=10000.0,
                      eps=1e-6, **CONFIGS[config])  # fmt: skip
    return LlamaForCausalLM(decoder, tie_word_embeddings=False)


def rows(kind: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Tokens ``[2, SEQ + 1]``, their loss mask and segments (None where ``kind`` has none), as a TokenBatch holds
    them: packed rows of 3-4 documents then padding (segment 0, out of the loss)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    if kind == "causal":
        return tokens, None, None
    segments = torch.stack([
        torch.cat([*(torch.full((n,), doc) for doc, n in enumerate(documents, 1)), torch.zeros(pad, dtype=torch.long)])
        for documents, pad in PACKED
    ])  # fmt: skip
    mask = segments > 0
    if kind == "masked":  # instruction rows: some targets of each document are prompts
        mask &= torch.rand(segments.shape, generator=gen) > 0.3
    return tokens, mask, segments


def one_process(case: str) -> dict[str, Any]:
    """The unmodified model on the whole rows: logits, the mean loss over the targets, every parameter's gradient."""
    config, _, kind = CASES[case]
    model = tiny_model(config)
    tokens, mask, segments = rows(kind)
    logits = model(tokens[:, :-1], None if segments is None else segments[:, :-1]).logits
    targets = torch.ones_like(tokens[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:]
    loss = masked_loss_sum(logits, tokens[:, 1:], targets) / targets.sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def cp_run(case: str, group: Any) -> dict[str, Any]:
    """The same on this rank's shard, every rank of ``group`` together: gathered logits, the whole sequence's loss
    (this rank's sum over the group's count of targets), the gradients summed over the group."""
    import torch.distributed as dist

    config, _, kind = CASES[case]
    model = tiny_model(config)
    tokens, mask, segments = rows(kind)
    cp = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group))
    part, context = cp.shard(tokens, loss_mask=mask, segments=segments)
    logits = model(part.input_ids, context=context).logits
    count = part.loss_mask.sum().float()
    dist.all_reduce(count, group=group)
    loss = masked_loss_sum(logits, part.targets, part.loss_mask) / count
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            grads[name] = p.grad
    return {"logits": gather_sequence(logits.detach(), group, SEQ), "loss": mean, "grads": grads,
            "targets": count, "local_tokens": part.input_ids.shape[1]}  # fmt: skip


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    """Every case whose group holds this rank; each group's first rank saves the results."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted({r for _, r, _ in CASES.values()})}
        for case, (_, ranks, _) in CASES.items():
            if rank in ranks:
                out = cp_run(case, groups[ranks])
                if rank == ranks[0]:
                    torch.save(out, Path(tmp) / f"{case}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cp")
    spawn_ranks(_rank, WORLD, str(tmp), deadline_s=DEADLINE_S)
    return tmp


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_one_process(ranks_out: Path, case: str) -> None:
    """Logits, the loss over the whole sequence and every gradient within 2e-5 of one process; the padding added
    for the chunks left out of the loss."""
    got = torch.load(ranks_out / f"{case}.pt", weights_only=False)
    want = one_process(case)
    size = len(CASES[case][1])
    assert got["local_tokens"] == padded_length(SEQ, size) // size and SEQ % (2 * size)
    _, mask, _ = rows(CASES[case][2])
    assert got["targets"] == (SEQ * 2 if mask is None else mask[:, 1:].sum())
    torch.testing.assert_close(got["logits"], want["logits"], rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(got["loss"].float(), want["loss"], rtol=TOLERANCE, atol=TOLERANCE)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(
            got["grads"][name], grad, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_zigzag_layout() -> None:
    """2 x CP chunks of the padded row; rank r holds chunks r and 2 x CP - 1 - r."""
    assert [padded_length(37, size) for size in (1, 2, 3, 4)] == [38, 40, 42, 40]
    assert zigzag_index(40, 0, 2).tolist() == [*range(0, 10), *range(30, 40)]
    assert zigzag_index(40, 1, 2).tolist() == [*range(10, 20), *range(20, 30)]
    assert zigzag_index(40, 3, 4).tolist() == [*range(15, 20), *range(20, 25)]
    with pytest.raises(ValueError, match="does not split into 8 chunks"):
        zigzag_index(37, 0, 4)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_and_unshard_round_trip(size: int) -> None:
    """Sharding pads with the value given; unsharding the ranks' shards gives the rows back, trailing dims too."""
    x = torch.arange(2 * SEQ * 3).view(2, SEQ, 3)
    shards = [shard(x, rank, size, value=-1) for rank in range(size)]
    assert all(s.shape == (2, padded_length(SEQ, size) // size, 3) for s in shards)
    assert int(sum((s == -1).sum() for s in shards)) == 2 * 3 * (padded_length(SEQ, size) - SEQ)
    torch.testing.assert_close(unshard(shards, SEQ), x)
    assert unshard(shards).shape[1] == padded_length(SEQ, size)


def test_shard_batch_keeps_documents_positions_and_targets() -> None:
    """Inputs and targets shifted as the training step does; positions from the whole row (they restart at every
    document); the padding segment 0 and out of the loss; every target once over the ranks."""
    tokens, mask, segments = rows("masked")
    assert tokens is not None and mask is not None and segments is not None
    parts = [shard_batch(tokens, rank, 2, loss_mask=mask, segments=segments) for rank in range(2)]
    torch.testing.assert_close(unshard([p.input_ids for p in parts], SEQ), tokens[:, :-1])
    torch.testing.assert_close(unshard([p.targets for p in parts], SEQ), tokens[:, 1:])
    torch.testing.assert_close(unshard([p.segments for p in parts], SEQ), segments[:, :-1])
    torch.testing.assert_close(unshard([p.positions for p in parts], SEQ), document_positions(segments[:, :-1]))
    torch.testing.assert_close(unshard([p.loss_mask for p in parts], SEQ), mask[:, 1:])
    padding = unshard([p.segments for p in parts])[:, SEQ:]
    assert padding.numel() and not padding.any() and not unshard([p.loss_mask for p in parts])[:, SEQ:].any()
    plain = shard_batch(tokens, 0, 2)  # text: one document a row, every target counts
    assert plain.segments[:, :10].eq(1).all() and plain.loss_mask[:, :10].all()
    assert plain.positions[:, :10].tolist() == [list(range(10))] * 2


def test_ring_attention_in_one_process_is_sdpa_under_the_document_mask() -> None:
    """Without a process group the ring is one block: SDPA's outputs and gradients under the document mask (GQA,
    padding attending to itself only, no NaN)."""
    gen = torch.Generator().manual_seed(3)
    _, _, segments = rows("packed")
    assert segments is not None
    seg = segments[:, :-1][:, :36]
    q = torch.randn(2, 4, 36, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 36, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = ring_attention(q, k, v, seg, scale=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(seg), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, expected in zip(got_grads, torch.autograd.grad(want, (q, k, v), grad), strict=True):
        torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="not a zigzag shard"):
        ring_attention(q[:, :, :35], k[:, :, :35], v[:, :, :35], seg[:, :35])


def test_the_model_with_a_ring_context_in_one_process_is_the_model() -> None:
    """CP 1: the model given a :class:`RingContext` (RoPE at the shard's positions, the ring in place of SDPA) gives
    its own logits on the whole rows, the padding added for the chunks after them."""
    model = tiny_model("qwen3")
    tokens, mask, segments = rows("masked")
    part = shard_batch(tokens, 0, 1, loss_mask=mask, segments=segments)
    with torch.no_grad():
        got = model(part.input_ids, context=RingContext(part.segments, part.positions)).logits
        want = model(tokens[:, :-1], None if segments is None else segments[:, :-1]).logits
    assert got.shape[1] == padded_length(SEQ, 1) > SEQ
    torch.testing.assert_close(got[:, :SEQ], want, rtol=TOLERANCE, atol=TOLERANCE)
