"""Qwen3-MoE's Hugging Face adapter: the export names ``Qwen3MoeForCausalLM`` with a ``Qwen3MoeConfig`` and writes
``num_experts`` in ``config.json`` as the published checkpoints do; the stacked experts (raytrn's and transformers
5's ``mlp.experts.gate_up_proj`` / ``down_proj``) are written one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight``, ...: :func:`raytrn.models.export.hub_tensors`), which transformers 4 and 5
and serving engines load. (Reading its ``config.json``: :mod:`raytrn.config.hf_config`, with the family's registry
row: ``num_local_experts``, ``norm_topk_prob``'s default, every layer sparse.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.models.export import hf_sizes
from raytrn.models.export import hub_tensors as hub_tensors  # the parameter names: one tensor per expert

if TYPE_CHECKING:
    from raytrn.config import ModelConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"


def hf_config(cfg: ModelConfig) -> Any:
    """The ``Qwen3MoeConfig`` of a ``model`` section: every layer sparse (``decoder_sparse_step`` 1)."""
    from transformers import Qwen3MoeConfig  # transformers (~4.5 s): the export and the tests only

    experts, top_k, width = cfg.expert_sizes
    return Qwen3MoeConfig(
        **hf_sizes(cfg),
        attention_bias=False,
        use_sliding_window=False,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def export_config(cfg: ModelConfig) -> dict[str, Any]:
    """``num_experts``: transformers 5 writes ``num_local_experts``; the published configs (and transformers 4)
    ``num_experts``."""
    return {"num_experts": cfg.num_experts}
