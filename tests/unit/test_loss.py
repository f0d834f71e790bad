"""The chunked loss (raytrn.train.loss) against autograd's cross entropy: the same losses and gradients, and only
the logits and their gradient kept for backward (not float32 copies of every logit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raytrn.config import sizes
from raytrn.train.loss import cross_entropy, masked_loss_sum, summed_losses

pytestmark = pytest.mark.unit

TOKENS, VOCAB = 67, 101  # a last chunk shorter than the others


def _saved(fn, *args) -> list[torch.Tensor]:
    """The tensors ``fn(*args)`` saves for backward."""
    saved: list[torch.Tensor] = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*args)
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["mean", "masked-sum"])
def test_chunked_loss_equals_autograds_and_keeps_only_the_gradient(monkeypatch, dtype, masked) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    mask = torch.rand(TOKENS, generator=gen) > 0.3

    def loss(x: torch.Tensor) -> torch.Tensor:
        return masked_loss_sum(x, targets, mask) if masked else cross_entropy(x, targets)

    whole = logits.clone().requires_grad_()
    expected = loss(whole)
    (expected * 1.7).backward()
    assert sizes.loss_chunk_rows(TOKENS, VOCAB) is None  # the reference is autograd's, in one piece
    reference = F.cross_entropy(logits.float(), targets, reduction="none")
    assert expected.item() == pytest.approx((reference[mask].sum() if masked else reference.mean()).item(), rel=1e-6)

    monkeypatch.setattr(sizes, "LOSS_CHUNK_LOGITS", 10 * VOCAB)  # chunks of 10 rows: 7 of them
    assert sizes.loss_chunk_rows(TOKENS, VOCAB) == 10
    chunked = logits.clone().requires_grad_()
    got = loss(chunked)
    (got * 1.7).backward()
    assert got.dtype == torch.float32 and got.item() == pytest.approx(expected.item(), rel=1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(chunked.grad, whole.grad, **tol)
    assert torch.equal(chunked.detach(), logits)  # the logits are not touched (fp32: no copy is free to overwrite)
    (kept,) = [t for t in _saved(loss, logits.clone().requires_grad_()) if t.numel() == TOKENS * VOCAB]
    assert kept.dtype == dtype  # the gradient, in the logits' dtype: no fp32 log-softmax of every logit
    monkeypatch.undo()
    full = {(t.untyped_storage().data_ptr(), t.dtype) for t in _saved(loss, logits.clone().requires_grad_())
            if t.numel() == TOKENS * VOCAB}  # fmt: skip
    assert [d for _, d in full] == [torch.float32]  # autograd's keeps the fp32 log-softmax


def test_a_train_step_with_the_loss_in_chunks_trains_like_one_piece(monkeypatch, tmp_path) -> None:
    """Three steps of the tiny model, the loss in one piece and in chunks: the same losses and weights."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.train.build import build_training
    from raytrn.train.step import train_step

    job = load_job("jobs/tiny.yaml", ["data.manifest=unused", "data.seq_len=32", "data.micro_batch_size=4",
                   f"checkpoint.storage={tmp_path}"], resolve=False)  # fmt: skip

    def run() -> tuple[list[float], list[torch.Tensor]]:
        t = build_training(job, CpuBackend(), world_size=1)
        gen = torch.Generator().manual_seed(1)
        batches = iter([torch.randint(0, 64, (4, 33), generator=gen) for _ in range(3 * job.data.grad_accum)])
        losses = [train_step(t, batches, CpuBackend()).loss.item() for _ in range(3)]
        return losses, [p.detach().clone() for p in t.model.parameters()]

    one_losses, one_weights = run()
    monkeypatch.setattr(sizes, "LOSS_CHUNK_LOGITS", 40 * job.model.vocab_size)  # 4 chunks a micro-batch
    assert sizes.loss_chunk_rows(4 * 32, job.model.vocab_size) == 40
    chunked_losses, chunked_weights = run()
    assert chunked_losses == pytest.approx(one_losses, rel=1e-5)
    for a, b in zip(chunked_weights, one_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_validation_sums_the_same_loss_in_chunks_without_a_gradient(monkeypatch, masked) -> None:
    """Validation's summed loss (no gradient, so the training loss's chunking does not apply to it) takes the same
    chunks: never a float32 copy of every logit, and the same sum and count as autograd's in one piece."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, TOKENS, VOCAB, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (2, TOKENS), generator=gen)
    mask = torch.rand(2, TOKENS, generator=gen) > 0.3 if masked else None
    reference = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    weights = mask.reshape(-1).double() if mask is not None else torch.ones(2 * TOKENS, dtype=torch.float64)
    expected = (reference.double() * weights).sum()
    whole, count = summed_losses(logits, targets, mask)
    assert (whole.dtype, count.item()) == (torch.float64, weights.sum().item())
    assert whole.item() == pytest.approx(expected.item(), rel=1e-6)

    monkeypatch.setattr(sizes, "LOSS_CHUNK_LOGITS", 10 * VOCAB)  # chunks of 10 rows
    widest: list[int] = []
    real = F.cross_entropy

    def spy(x, *args, **kwargs):
        widest.append(x.size(0))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", spy)
    chunked, chunk_count = summed_losses(logits, targets, mask)
    assert max(widest) == 10 and len(widest) == -(-2 * TOKENS // 10), widest  # one float32 chunk at a time
    assert chunk_count.item() == count.item() and chunked.item() == pytest.approx(whole.item(), rel=1e-6)
