"""Pipeline parallelism: a model cut into stages by decoder layers, and the stages run by one of
``torch.distributed.pipelining``'s schedules.

**Stages.** A model of ``L`` decoder layers in ``S`` stages (``S = pipeline_parallel_size x stages_per_rank``):
stage ``s`` holds a contiguous run of layers (:func:`stage_layers`), the first also the token embedding, the last
also the final norm and the output head. A stage is the model itself with everything else removed
(:class:`PipelineStageModel`): its parameters keep the whole model's names (``model.layers.7.mlp.up_proj.weight``
on whichever stage holds layer 7), so a ``torch.distributed.checkpoint`` saved at one pipeline size loads at any
other, and at none (DCP matches by name; torchtitan does the same with its ``ModuleDict`` of layers).

**Packed rows.** The document numbers of packed rows (``segments``) travel with the activations from stage to
stage (an integer tensor: the schedule sends it but takes no gradient of it), so every stage masks attention to each
document and restarts positions at each, as the whole model does.

**Which ranks hold which stages** (:func:`stage_indices`): the loop schedules (1F1B, GPipe, interleaved 1F1B,
interleaved zero bubble) put stage ``s`` on rank ``s mod P``; the V-shaped ones (ZBV zero bubble, DualPipeV) put
stages ``r`` and ``2P - 1 - r`` on rank ``r``, so the first and last stages share rank 0.

Not here: tied input and output embeddings (the embedding and the head are on different stages: refused by
:mod:`raytrn.config.layout`). A MoE model's stages carry the routing sums along with the activations, so the last
stage computes the load-balancing loss over every layer exactly (:class:`PipelineStageModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from raytrn.config.stages import SCHEDULES, stage_indices, stage_layers
from raytrn.models.decoder import LlamaForCausalLM, document_mask, document_positions


class PipelineStageModel(nn.Module):
    """One stage of a :class:`~raytrn.models.decoder.LlamaForCausalLM`: ``model`` (the decoder, holding only this
    stage's layers under their own indices; the embedding on the first stage, the final norm on the last) and, on
    the last stage, ``lm_head``.

    Input: token ids (first stage) or the previous stage's hidden states, then what travels with them: the rows'
    ``segments`` when they are packed documents, and for a MoE model the routing sums of every layer before this
    stage (``counts`` and ``probs`` [experts]: :class:`~raytrn.models.moe.RouterStats` summed; ``probs`` carries
    its gradient back through the stages). Output: the same tuple, this stage's layers added; the last stage's is
    the logits, and for a MoE model ``(logits, load-balancing loss)`` over every layer of the model: exactly
    :func:`~raytrn.models.moe.load_balancing_loss`, whose product of sums over all layers no single stage has."""

    def __init__(self, full: LlamaForCausalLM, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        decoder = full.model
        self.num_layers = len(decoder.layers)  # the whole model's (the load-balancing loss's denominator)
        decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})  # type: ignore[assignment]
        if not first:
            decoder.embed_tokens = None  # type: ignore[assignment]
        if not last:
            decoder.norm = None  # type: ignore[assignment]
        self.model = decoder
        self.lm_head = full.lm_head if last else None
        self.first, self.last, self.layers = first, last, layers
        self.moe = any(hasattr(layer.mlp, "experts") for layer in decoder.layers.values())  # type: ignore[operator]
        #: A MoE stage's routing of each forward call, in order: its MoE layers' whole-model indices, then per call
        #: their top-k counts [MoE layers of the stage, experts] and the assignments dropped for capacity (the
        #: step's metrics take a step's last calls: :func:`raytrn.train.pipelined.pipeline_routing`).
        self.moe_layers = [int(k) for k, layer in decoder.layers.items() if hasattr(layer.mlp, "experts")]  # type: ignore[operator]
        self.routing: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> Any:
        decoder: Any = self.model
        # (segments?) (counts, probs)?: a MoE model's stages always pass the routing sums, so the count tells
        routing = rest[-2:] if self.moe and not self.first else ()
        segments = (rest[:-2] if routing else rest)[0] if len(rest) in (1, 3) else None
        if self.first:
            x = decoder.embed_tokens(x)
        if segments is None:
            rope, mask = decoder.rotary_emb(x), None
        else:
            rope, mask = decoder.rotary_emb(x, document_positions(segments)), document_mask(segments)
        counts, probs = routing if routing else (None, None)
        tokens = 0
        loads, dropped = [], None
        for layer in decoder.layers.values():
            out = layer(x, rope, mask)
            if isinstance(out, tuple):
                x, stats = out
                counts = stats.counts if counts is None else counts + stats.counts
                probs = stats.probs if probs is None else probs + stats.probs
                tokens = stats.tokens
                loads.append(stats.counts.detach())
                dropped = stats.dropped.detach() if dropped is None else dropped + stats.dropped.detach()
            else:
                x = out
        if loads and torch.is_grad_enabled():  # a training forward's (not a validation's)
            assert dropped is not None
            self.routing.append((torch.stack(loads), dropped))
        # sent on as they came: a slice of the step's rows (``[:, :-1]``) is not contiguous beyond one row a
        # micro-batch, and a process group sends only contiguous tensors
        carried = () if segments is None else (segments.contiguous(),)
        if self.moe:
            assert counts is not None and probs is not None
            carried = (*carried, counts, probs)
        if not self.last:
            return (x, *carried) if carried else x
        assert self.lm_head is not None
        logits = self.lm_head(decoder.norm(x))
        if not self.moe:
            return logits
        assert counts is not None and probs is not None
        rows = (tokens or x.shape[0] * x.shape[1]) * self.num_layers  # HF's: every layer's tokens
        return logits, (counts / rows * (probs / rows)).sum() * counts.shape[0]


def split_model(full: LlamaForCausalLM, stage: int, num_stages: int) -> PipelineStageModel:
    """Stage ``stage`` of ``num_stages`` cut from ``full`` (which it consumes: the other stages' modules are
    dropped). Each stage of a rank needs its own copy of the whole model to cut from."""
    if full.lm_head.weight is full.model.embed_tokens.weight and num_stages > 1:
        raise ValueError("tied input and output embeddings cannot be pipelined: they sit on the first and last stage")
    ranges = stage_layers(len(full.model.layers), num_stages)
    return PipelineStageModel(full, ranges[stage], first=stage == 0, last=stage == num_stages - 1)


def build_schedule(stages: Sequence[Any], schedule: str, *, microbatches: int, loss: Callable[..., Any]) -> Any:
    """``schedule``'s runner over this rank's ``stages`` (``torch.distributed.pipelining.PipelineStage`` s);
    gradients averaged over the micro-batches (``scale_grads``)."""
    from torch.distributed import pipelining

    name, per_rank, _ = SCHEDULES[schedule]
    cls = getattr(pipelining, name)
    if per_rank == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=True)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss, scale_grads=True)


def pipeline_targets(targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The targets the schedule's loss takes: ``-100`` where ``mask`` (the trained targets) is False."""
    return targets if mask is None else targets.masked_fill(~mask.bool(), -100)


__all__ = [
    "SCHEDULES",
    "PipelineStageModel",
    "build_schedule",
    "pipeline_targets",
    "split_model",
    "stage_indices",
    "stage_layers",
]
