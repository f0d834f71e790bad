"""Qwen3-MoE's memory and FLOPs terms: Qwen3's attention, and an MLP of a router and ``num_experts`` stacked
experts of which a token is computed with ``num_experts_per_tok`` (its active parameters: FLOPs and MFU count those,
memory every expert)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from raytrn.models.qwen3 import estimate as qwen3
from raytrn.models.registry import LayerActivations, LayerParams

if TYPE_CHECKING:
    from raytrn.config import ModelConfig


def layer_params(cfg: ModelConfig) -> LayerParams:
    """Qwen3's attention and norms; the router ``[experts, hidden]`` and the experts' gate, up and down."""
    experts, top_k, width = cfg.expert_sizes
    h = cfg.hidden_size
    expert, router = 3 * h * width, experts * h
    return replace(
        qwen3.layer_params(cfg),
        mlp=router + experts * expert,
        active_mlp=router + top_k * expert,
        experts=experts * expert,
        router=router,
    )


def layer_activations(cfg: ModelConfig, tp: int) -> LayerActivations:
    """Qwen3's attention; the MLP's, a token: the two softmaxes over the router's logits (routing, load-balancing
    loss), the block's flattened input and output, and each routed copy of the token (its row, gate and up, SiLU,
    their product, the expert's output), ``moe_capacity_factor`` copies of it (1 when dropless). The experts are
    not split over TP; LoRA leaves them frozen with nothing less kept."""
    count, top_k, width = cfg.expert_sizes
    h, factor = cfg.hidden_size, cfg.moe_capacity_factor or 1.0
    mlp = 2 * count + 2 * h + int(factor * top_k * (2 * h + 4 * width))
    return LayerActivations(attention=qwen3.layer_activations(cfg, tp).attention, mlp=mlp)
