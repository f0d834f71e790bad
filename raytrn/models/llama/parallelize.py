"""Llama's parallelization: Megatron-style tensor parallelism of every block (q/k/v and gate/up column-wise, o and
down row-wise), the embedding by vocabulary rows, the head by vocabulary columns, norms replicated
(:mod:`raytrn.models.parallel`). No experts: no expert parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.parallel import apply_tensor_parallel, attention_plan, dense_mlp_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tie_word_embeddings: bool) -> None:
    """Llama's plan over ``tp_mesh`` (the attention's and the dense MLP's projections split)."""
    plan = {**attention_plan(), **dense_mlp_plan()}
    apply_tensor_parallel(model, tp_mesh, layer_plan=plan, qk_norm=False, tie_word_embeddings=tie_word_embeddings)
