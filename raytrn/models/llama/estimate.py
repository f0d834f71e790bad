"""Llama's memory and FLOPs terms (:mod:`raytrn.models.stats`, :mod:`raytrn.estimate.memory`), counted from
:mod:`raytrn.models.decoder`: GQA attention (q, k, v, o projections, no biases) and a SiLU MLP (gate, up, down)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.registry import LayerActivations, LayerParams

if TYPE_CHECKING:
    from raytrn.config import ModelConfig


def layer_params(cfg: ModelConfig) -> LayerParams:
    """A layer's q/k/v/o projections, gate/up/down and its two norms."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    mlp = 3 * h * f  # gate, up, down
    return LayerParams(attention=h * q + 2 * h * kv + q * h, mlp=mlp, active_mlp=mlp, norms=2 * h)


def layer_activations(cfg: ModelConfig, tp: int) -> LayerActivations:
    """As :class:`raytrn.models.decoder.DecoderLayer` saves them, a token: q/k/v and q/k after RoPE, SDPA's output
    and o_proj's input (4 q + 3 kv); gate, up, SiLU(gate) and their product (4 f); all split over TP. A frozen MLP
    keeps no down projection input (f)."""
    q, kv, f = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.intermediate_size
    return LayerActivations(attention=(4 * q + 3 * kv) // tp, mlp=4 * f // tp, frozen_mlp=f // tp)
