"""Qwen3-MoE's decoder: Qwen3's (per-head query and key norms) with every MLP a sparse block of routed experts
(:class:`raytrn.models.moe.SparseMoeBlock`: Qwen3-MoE's ``decoder_sparse_step`` 1, no ``mlp_only_layers``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.build import decoder_sizes

if TYPE_CHECKING:
    from raytrn.config import ModelConfig
    from raytrn.models.decoder import Decoder


def build_decoder(cfg: ModelConfig) -> Decoder:
    """Qwen3-MoE's decoder, not yet initialised (:func:`raytrn.models.build_model` does it)."""
    from raytrn.models.decoder import Decoder, MoeOptions  # torch (~1.9 s): the estimate reads this family without it

    moe = MoeOptions(*cfg.expert_sizes, cfg.norm_topk_prob, cfg.moe_capacity_factor)
    return Decoder(**decoder_sizes(cfg), qk_norm=True, moe=moe)
