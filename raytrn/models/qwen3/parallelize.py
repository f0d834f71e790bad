"""Qwen3's parallelization: Llama's tensor-parallel plan, with each rank's heads' query and key norms as DTensors
sharded on the heads dimension (their weights' gradients summed over the TP group). No experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.parallel import apply_tensor_parallel, attention_plan, dense_mlp_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tie_word_embeddings: bool) -> None:
    """Qwen3's plan over ``tp_mesh``."""
    plan = {**attention_plan(), **dense_mlp_plan()}
    apply_tensor_parallel(model, tp_mesh, layer_plan=plan, qk_norm=True, tie_word_embeddings=tie_word_embeddings)
