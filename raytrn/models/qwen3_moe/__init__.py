"""Qwen3-MoE (``model.family: qwen3_moe``; transformers' ``Qwen3MoeForCausalLM``): Qwen3's attention, and every
layer's MLP a sparse block of routed experts (the shared one, :mod:`raytrn.models.moe`). Its pieces: :mod:`.model`,
:mod:`.parallelize` (tensor parallelism of attention, expert parallelism), :mod:`.hf` (one tensor per expert in
its checkpoints), :mod:`.estimate` (the active parameters a token computes with).
"""

from raytrn.models.qwen3_moe import estimate, hf, model, parallelize
from raytrn.models.registry import ModelSpec

SPEC = ModelSpec(
    name="qwen3_moe",
    build_decoder=model.build_decoder,
    tensor_parallel=parallelize.tensor_parallel,
    expert_parallel=parallelize.expert_parallel,
    architecture=hf.ARCHITECTURE,
    hf_config=hf.hf_config,
    export_config=hf.export_config,
    hub_tensors=hf.hub_tensors,
    layer_params=estimate.layer_params,
    layer_activations=estimate.layer_activations,
)
