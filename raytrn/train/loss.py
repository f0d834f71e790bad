"""The next-token loss, in float32, without float32 copies of every logit when the vocabulary is large.

A micro-batch's logits are ``tokens x vocab``: 8,192 tokens of Llama 3's 128,256-entry vocabulary are 1.05e9 logits.
Autograd's cross entropy keeps a float32 log-softmax of all of them for backward (4 bytes a logit) and backward adds
two more float32 copies (the log-softmax's gradient and the logits'): 12 GiB beside the bf16 logits on a 24 GiB
NeuronCore. Above :data:`raytrn.config.sizes.LOSS_CHUNK_LOGITS` logits the loss runs over chunks of rows instead, computing each chunk's
gradient with its loss (softmax minus the one-hot target, in float32, stored in the logits' dtype): the float32
copies exist for one chunk at a time and backward only scales the stored gradient (the fused cross entropy of
Liger-Kernel and torchtune's chunked loss, without their kernels). The same maths as autograd's, summed in another
order. :mod:`raytrn.estimate.memory` counts both. Validation (:func:`summed_losses`, no gradient) takes the same
chunks, so an evaluation never needs more memory for its logits than the training step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from raytrn.config import sizes


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 logits)."""
    flat, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    rows = chunk_rows(flat)
    if rows is not None:
        return _ChunkedCrossEntropy.apply(flat, flat_targets, None, rows) / flat.size(0)
    return F.cross_entropy(flat.float(), flat_targets)


def masked_loss_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross entropy (fp32 logits) over the targets ``mask`` selects."""
    flat, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    weights = mask.reshape(-1).to(torch.float32)
    rows = chunk_rows(flat)
    if rows is not None:
        return _ChunkedCrossEntropy.apply(flat, flat_targets, weights, rows)
    losses = F.cross_entropy(flat.float(), flat_targets, reduction="none")
    return (losses * weights).sum()


@torch.no_grad()
def summed_losses(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token cross entropy (fp32 logits) summed over the targets ``mask`` selects (all without one), and
    their count, both float64; no gradient. Above the chunk limit a chunk of rows at a time, as training's loss."""
    flat, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    weights = None if mask is None else mask.reshape(-1).to(torch.float32)
    rows = sizes.loss_chunk_rows(flat.size(0), flat.size(-1)) or max(1, flat.size(0))
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start in range(0, flat.size(0), rows):
        losses = F.cross_entropy(
            flat[start : start + rows].float(), flat_targets[start : start + rows], reduction="none"
        )
        if weights is not None:
            losses = losses * weights[start : start + rows]
        total += losses.sum().double()
    count = weights.sum().double() if weights is not None else torch.tensor(float(flat.size(0)), dtype=torch.float64)
    return total, count.to(logits.device)


def chunk_rows(flat: torch.Tensor) -> int | None:
    """Rows a chunk of a ``[tokens, vocab]`` micro-batch's loss takes; None: in one piece (small enough, or no
    gradient wanted)."""
    if not flat.requires_grad:
        return None
    return sizes.loss_chunk_rows(flat.size(0), flat.size(-1))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(logits_i, target_i)`` over rows, a chunk of ``rows`` at a time; the gradient is computed in
    forward and kept (in the logits' dtype) for backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None, rows: int
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits)
        for start in range(0, logits.size(0), rows):
            part = logits[start : start + rows].to(torch.float32, copy=True)  # (never the logits themselves)
            target = targets[start : start + rows].unsqueeze(1)
            lse = torch.logsumexp(part, dim=-1, keepdim=True)
            losses = (lse - part.gather(1, target)).squeeze(1)
            probs = part.sub_(lse).exp_()  # in place: the chunk's one float32 copy becomes the softmax
            probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))
            if weights is not None:
                w = weights[start : start + rows]
                losses = losses * w
                probs.mul_(w.unsqueeze(1))
            total = total + losses.sum()
            grad[start : start + rows] = probs
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None
