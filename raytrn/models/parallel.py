"""The pieces of a tensor-parallel plan every family composes its own from (``raytrn/models/<family>/parallelize.py``):
Megatron-style column- and row-wise projections, the embedding and head, norms replicated.
The model code (:mod:`raytrn.models.decoder`) knows nothing of this; :mod:`raytrn.train.parallelize` applies a
family's plan to the built model, before activation checkpointing, ``torch.compile`` and FSDP (torchtitan's order).
torch's distributed modules are imported where a plan is applied: a family's folder is read without torch
(:mod:`raytrn.models.registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def attention_plan() -> dict[str, ParallelStyle]:
    """q/k/v column-wise (each rank its heads), o row-wise (the partial sums reduced)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }


def dense_mlp_plan() -> dict[str, ParallelStyle]:
    """gate/up column-wise, down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    layer_plan: dict[str, ParallelStyle],
    qk_norm: bool,
    tie_word_embeddings: bool,
) -> None:
    """TP over ``tp_mesh``: ``layer_plan`` in every decoder layer, the embedding by vocabulary rows and the head by
    vocabulary columns (logits gathered), norms replicated (``qk_norm``: each head's query and key norms, over this
    rank's heads). Activations stay replicated between blocks (no sequence parallel)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    decoder: Any = model.model
    ends = {  # a pipeline stage may hold neither (raytrn.models.pipeline)
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),  # logits gathered: the loss is the usual one
    }
    held = {"model.embed_tokens": decoder.embed_tokens, "lm_head": getattr(model, "lm_head", None)}
    present = {name: style for name, style in ends.items() if held[name] is not None}
    if present:
        parallelize_module(model, tp_mesh, present)  # type: ignore[arg-type]
    layer: Any
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, layer_plan)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            replicate(norm, tp_mesh)
        if qk_norm:  # over each head of this rank's heads [b, s, heads, d]
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                replicate(norm, tp_mesh, sharded_dim=2)
    if decoder.norm is not None:
        replicate(decoder.norm, tp_mesh)
    if tie_word_embeddings:  # each module got its own copy of the shared matrix: share it again (both Shard(0))
        model.lm_head.weight = decoder.embed_tokens.weight  # type: ignore[union-attr]


def replicate(module: nn.Module, mesh: DeviceMesh, *, sharded_dim: int | None = None) -> None:
    """Parameters as replicated DTensors (so every parameter lives on the same mesh, as FSDP and the grad norm
    need), taking and returning plain tensors: the activations around it are replicated already, or, with
    ``sharded_dim``, split along that dimension over the TP ranks (Qwen3's query and key norms see only this rank's
    heads: as DTensors their weights' gradients are summed over the TP group, not left each rank's part)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    placement = Replicate() if sharded_dim is None else Shard(sharded_dim)

    def to_dtensor(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(x, mesh, [placement], run_check=False) for x in inputs)

    def to_local(_mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)  # type: ignore[arg-type]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's blocks in order: what FSDP wraps, activation checkpointing recomputes and a per-block
    ``torch.compile`` compiles, one at a time."""
    layers: Any = model.model.layers  # type: ignore[union-attr]  # a stage's: a ModuleDict by the whole model's indices
    return list(layers.values()) if hasattr(layers, "values") else list(layers)
