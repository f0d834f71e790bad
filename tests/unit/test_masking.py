"""Instruction data at the model: the loss counts only the targets the mask selects, as the mean over the whole
global batch; document masking makes a packed row compute exactly what its examples compute alone. One process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raytrn.backends.cpu import CpuBackend
from raytrn.config import load_job
from raytrn.data.batch import TokenBatch
from raytrn.data.instruct import Example, RowPacker
from raytrn.models import build_model
from raytrn.train.build import build_training
from raytrn.train.step import train_step

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SEQ = 24


def job(*overrides: str) -> Any:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=unused", f"data.seq_len={SEQ}", "model.vocab_size=512", "data.micro_batch_size=2",
         "data.grad_accum=2", "optim.grad_clip_norm=null", *overrides],
        resolve=False,
    )  # fmt: skip


def batch(seed: int, trained: list[int]) -> TokenBatch:
    """Two rows; row k trains on its last ``trained[k]`` targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (2, SEQ + 1), generator=g)
    mask = torch.zeros(2, SEQ + 1, dtype=torch.bool)
    for k, n in enumerate(trained):
        mask[k, SEQ + 1 - n :] = True
    return TokenBatch(tokens, mask, None)


def test_the_loss_is_the_mean_over_the_trained_tokens_of_the_whole_batch() -> None:
    """Not a mean of per-micro-batch means: micro-batches with 3 and 20 trained targets weigh 3 : 20."""
    j = job()
    t = build_training(j, CpuBackend(), world_size=1)
    micro = [batch(1, [1, 2]), batch(2, [10, 10])]
    reference = build_model(j.model, seed=j.run.seed)
    reference.load_state_dict(t.model.state_dict())
    total, count = torch.zeros(()), 0
    for b in micro:
        logits = reference(input_ids=b.tokens[:, :-1]).logits
        losses = F.cross_entropy(logits.reshape(-1, 512), b.tokens[:, 1:].reshape(-1), reduction="none")
        m = b.loss_mask[:, 1:].reshape(-1)  # type: ignore[index]
        total, count = total + losses[m].sum(), count + int(m.sum())
    (total / count).backward()
    result = train_step(t, iter(micro), CpuBackend())
    assert result.trained_tokens == 23
    assert float(result.loss) == pytest.approx(float(total / count), rel=1e-6)
    # The step took the gradient of that mean (AdamW's first step moves each weight by ~lr * sign(grad)).
    moved = t.model.model.layers[0].mlp.up_proj.weight - reference.model.layers[0].mlp.up_proj.weight
    grad = reference.model.layers[0].mlp.up_proj.weight.grad
    assert grad is not None and torch.equal(torch.sign(moved)[grad.abs() > 1e-6], -torch.sign(grad)[grad.abs() > 1e-6])


def test_no_untrained_target_ever_contributes() -> None:
    """Changing the targets the mask excludes (here: the last token of the prompt part, which is no later token's
    input) changes neither the loss nor the step."""
    j = job("data.grad_accum=1")

    def run(tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
        t = build_training(j, CpuBackend(), world_size=1)
        mask = torch.zeros(2, SEQ + 1, dtype=torch.bool)
        mask[:, :12] = True  # the first 11 targets trained; targets 12.. (tokens 12..24) not
        result = train_step(t, iter([TokenBatch(tokens, mask, None)]), CpuBackend())
        return float(result.loss), t.model.model.layers[1].self_attn.q_proj.weight.detach().clone()

    tokens = torch.randint(0, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    other = tokens.clone()
    other[:, -1] = (other[:, -1] + 7) % 512  # an untrained target only
    (a, wa), (b, wb) = run(tokens), run(other)
    assert a == b and torch.equal(wa, wb)


def test_a_packed_row_computes_what_its_examples_compute_alone() -> None:
    """Document masking: attention never crosses an example and positions restart per example."""
    j = job("model.rope_theta=500.0")
    model = build_model(j.model, seed=3).eval()
    g = torch.Generator().manual_seed(9)
    examples = [torch.randint(0, 512, (n,), generator=g) for n in (7, 11, 5)]
    row = torch.cat([*examples, torch.zeros(1, dtype=torch.long)]).unsqueeze(0)  # 23 tokens + 1 padding
    segments = torch.tensor([[1] * 7 + [2] * 11 + [3] * 5 + [0]])
    with torch.no_grad():
        packed = model(input_ids=row, segments=segments).logits[0]
        alone = [model(input_ids=e.unsqueeze(0)).logits[0] for e in examples]
    starts = [0, 7, 18]
    for start, e, logits in zip(starts, examples, alone, strict=True):
        torch.testing.assert_close(packed[start : start + len(e)], logits, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(packed).all()  # the padding position attends to itself: no NaN


def test_rows_pack_whole_examples_and_never_train_on_an_examples_first_token() -> None:
    packer = RowPacker(row_len=10, pad_id=0, packing=True)

    def ex(n: int, trained: int) -> Example:
        return Example(
            np.arange(1, n + 1, dtype=np.int32), np.r_[np.zeros(n - trained), np.ones(trained)].astype(np.int8)
        )

    rows = packer.push(ex(4, 2)) + packer.push(ex(5, 5)) + packer.push(ex(3, 1)) + packer.flush()
    (ids1, mask1, seg1), (ids2, mask2, seg2) = rows
    assert ids1.tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 5, 0] and seg1.tolist() == [1] * 4 + [2] * 5 + [0]
    assert mask1.tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 1, 0]  # the second example's first token: masked
    assert ids2.tolist()[:3] == [1, 2, 3] and seg2.tolist() == [1] * 3 + [0] * 7
    padded = RowPacker(row_len=10, pad_id=0, packing=False)
    assert len(padded.push(ex(4, 2)) + padded.push(ex(5, 5)) + padded.flush()) == 2
    assert padded.push(ex(12, 1)) == [] and padded.truncated == 1 and padded.skipped == 1  # cut: nothing left
    assert packer.examples == 3 and packer.trained_tokens == 2 + 4 + 1


def test_text_with_document_attention_starts_a_document_after_every_eos() -> None:
    """data.attention: document on pretraining text: segment ids from the EOS tokens (an EOS ends its document)."""
    from raytrn.data.batch import to_torch
    from raytrn.data.source import MicroBatch

    tokens = np.array([[5, 6, 0, 7, 8, 0, 9], [0, 1, 2, 3, 0, 0, 4]], dtype=np.int32)
    batch = to_torch(MicroBatch(tokens=tokens, row_ids=np.arange(2)), document=True, eos_id=0)
    assert isinstance(batch, TokenBatch) and batch.loss_mask is None
    assert batch.segments.tolist() == [[1, 1, 1, 2, 2, 2, 3], [1, 2, 2, 2, 2, 3, 4]]
    plain = to_torch(MicroBatch(tokens=tokens, row_ids=np.arange(2)), document=False, eos_id=0)
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.int64
