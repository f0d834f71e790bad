"""Validation of a pipelined model (``parallel.pipeline_parallel_size > 1``): the evaluator's micro-batches through
the stages, forward only, one micro-batch at a time.

Not through the schedule: torch's schedules keep every micro-batch's stage output of a group until the group ends
(pytorch/pytorch#128910), so the last stage would hold a whole step's logits at once (Llama 3.1 70B at 128
micro-batches of 4096 tokens: ~125 GiB), and torch 2.13's forward-only pass of the V-shaped schedules fails at
the V's turn. Instead every rank walks the same order, micro-batch by micro-batch and stage by stage: the rank
holding stage ``s`` runs it (its data- and tensor-parallel ranks with it: FSDP's gathers and TP's collectives run
as in training) on the tokens (stage 0) or on what the rank holding stage ``s - 1`` sends it (point to point over
the pipeline's group: a small header of dtypes and shapes, then the tensors), and sends its output on; the last
stage sums the cross entropy over the micro-batch's counted targets (:func:`raytrn.train.loss.summed_losses`, in
chunks; the language loss alone for a MoE model, as one process's validation). One micro-batch's activations are in
flight at a time; every stage works in turn (no overlap: an evaluation costs a whole model's forward per
micro-batch, not a pipelined one's), and no schedule state moves, so the next training step is the one it would
have been. Only the ranks holding the last stage return their sums; :class:`raytrn.train.evaluate.Evaluator` adds
every rank's, so the loss is the mean over the counted targets of every data-parallel rank's rows, as one
process's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from raytrn.data.batch import TokenBatch
from raytrn.train.loss import summed_losses

if TYPE_CHECKING:
    from raytrn.train.pipelined import Pipeline
    from raytrn.train.step import Training

#: What a stage may send on (its hidden states, packed rows' document numbers, a MoE model's routing sums).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
#: A header's slots: how many tensors, then for each its dtype, rank and up to 4 sizes.
MAX_TENSORS, MAX_DIMS = 4, 4
HEADER = 1 + MAX_TENSORS * (2 + MAX_DIMS)


def pipeline_loss_sums(
    t: Training, batches: Sequence[torch.Tensor | TokenBatch], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation cross entropy summed over the counted targets of ``batches`` (this data-parallel rank's
    validation micro-batches) and their count, float64 on ``device``: on the ranks holding the last stage; zeros on
    the others. A collective over the pipeline (and each stage's data- and tensor-parallel ranks): every rank calls
    it with its replica's micro-batches, forward only (the caller holds ``torch.no_grad`` and the model's eval mode)."""
    pipe: Pipeline = t.pipeline
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    last = pipe.num_stages - 1
    for batch in batches:
        tokens, mask, segments = _rows(batch)
        tokens = tokens.to(device)
        carried: tuple[torch.Tensor, ...] = ()
        for s in range(pipe.num_stages):
            owner = pipe.stage_owner[s]
            if owner != pipe.pp_rank:
                continue
            if s == 0:
                inputs: tuple[torch.Tensor, ...] = (tokens[:, :-1],)
                if segments is not None:
                    inputs += (segments.to(device)[:, :-1].contiguous(),)
            elif pipe.stage_owner[s - 1] == pipe.pp_rank:
                inputs = carried  # the stage before is this rank's too (a V's turn)
            else:
                inputs = _receive(pipe, pipe.stage_owner[s - 1], device)
            with torch.autocast(device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
                out = pipe.stages[s](*inputs)
            if s == last:
                logits = out[0] if isinstance(out, tuple) else out  # (a MoE model's: with its load-balancing loss)
                targets = tokens[:, 1:]
                counted = None if mask is None else mask.to(device)[:, 1:]
                summed, tokens_counted = summed_losses(logits, targets, counted)
                loss_sum += summed
                count += tokens_counted
                continue
            carried = out if isinstance(out, tuple) else (out,)
            if pipe.stage_owner[s + 1] != pipe.pp_rank:
                _send(pipe, carried, pipe.stage_owner[s + 1])
    return loss_sum, count


def _rows(batch: torch.Tensor | TokenBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A validation micro-batch's tokens, which of them count as targets (None: all) and its rows' document
    numbers (None: causal attention)."""
    if not isinstance(batch, TokenBatch):
        return batch, None, None
    return batch.tokens, batch.loss_mask, batch.segments


def _send(pipe: Pipeline, tensors: tuple[torch.Tensor, ...], to: int) -> None:
    """``tensors`` to pipeline rank ``to``: their header, then each (contiguous). What a header cannot describe is
    sent as a header of -1 first, so that the receiver fails too instead of waiting."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    device = tensors[0].device
    if len(tensors) > MAX_TENSORS or any(x.dim() > MAX_DIMS or x.dtype not in DTYPES for x in tensors):
        header[0] = -1
        torch.distributed.send(header.to(device), group=pipe.group, group_dst=to)
        raise ValueError(f"a stage's output to send: {[(x.dtype, tuple(x.shape)) for x in tensors]}")
    header[0] = len(tensors)
    for i, x in enumerate(tensors):
        at = 1 + i * (2 + MAX_DIMS)
        header[at], header[at + 1] = DTYPES.index(x.dtype), x.dim()
        header[at + 2 : at + 2 + x.dim()] = torch.tensor(x.shape)
    torch.distributed.send(header.to(device), group=pipe.group, group_dst=to)
    for x in tensors:
        torch.distributed.send(x.detach().contiguous(), group=pipe.group, group_dst=to)


def _receive(pipe: Pipeline, source: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What pipeline rank ``source`` sent with :func:`_send`."""
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    torch.distributed.recv(header, group=pipe.group, group_src=source)
    values: list[Any] = header.cpu().tolist()
    if values[0] < 0:
        raise ValueError(f"pipeline rank {source} could not send its stage's output (its error says what)")
    out = []
    for i in range(values[0]):
        at = 1 + i * (2 + MAX_DIMS)
        dtype, dims = DTYPES[values[at]], values[at + 1]
        x = torch.empty(values[at + 2 : at + 2 + dims], dtype=dtype, device=device)
        torch.distributed.recv(x, group=pipe.group, group_src=source)
        out.append(x)
    return tuple(out)
