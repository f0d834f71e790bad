"""Qwen3's memory and FLOPs terms: Llama's, with each layer's per-head query and key norms (their weights, and
their inputs and outputs kept for backward)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from raytrn.models.llama import estimate as llama

if TYPE_CHECKING:
    from raytrn.config import ModelConfig
    from raytrn.models.registry import LayerActivations, LayerParams


def layer_params(cfg: ModelConfig) -> LayerParams:
    """Llama's layer with a ``head_dim``-wide query norm and key norm."""
    dense = llama.layer_params(cfg)
    return replace(dense, norms=dense.norms + 2 * cfg.head_size)


def layer_activations(cfg: ModelConfig, tp: int) -> LayerActivations:
    """Llama's, with the query and key norms' inputs and outputs (split over TP with the heads)."""
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    dense = llama.layer_activations(cfg, tp)
    return replace(dense, attention=dense.attention + 2 * (q + kv) // tp)
