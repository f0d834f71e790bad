"""Qwen3-MoE's parallelization: tensor parallelism of attention as Qwen3's (the router and the experts replicated
over the TP group: the experts are narrow, 768 wide in the 30B), and expert parallelism, each layer's experts spread
over EP data-parallel ranks (:mod:`raytrn.models.expert_parallel`, torchtitan's layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.parallel import apply_tensor_parallel, attention_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tie_word_embeddings: bool) -> None:
    """Attention split over ``tp_mesh`` with its query and key norms; the MLP is :func:`expert_parallel`'s."""
    plan = attention_plan()
    apply_tensor_parallel(model, tp_mesh, layer_plan=plan, qk_norm=True, tie_word_embeddings=tie_word_embeddings)


def expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every layer's experts over the experts' mesh ``(dp_mod_ep, ep, tp)`` (see the module)."""
    from raytrn.models.expert_parallel import apply_expert_parallel  # torch: the estimate reads this family without it

    apply_expert_parallel(model, mesh)
