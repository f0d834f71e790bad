"""Llama (``model.family: llama``; transformers' ``LlamaForCausalLM``: Llama 2, 3, 3.1, 3.2 and their fine-tunes).
The base of raytrn's decoder (GQA attention, SiLU MLP, RMSNorm, RoPE with Llama 3.x scaling): Qwen3 and Qwen3-MoE
start from it. Its pieces: :mod:`.model`, :mod:`.parallelize`, :mod:`.hf`, :mod:`.estimate`.
"""

from raytrn.models.llama import estimate, hf, model, parallelize
from raytrn.models.registry import ModelSpec

SPEC = ModelSpec(
    name="llama",
    build_decoder=model.build_decoder,
    tensor_parallel=parallelize.tensor_parallel,
    architecture=hf.ARCHITECTURE,
    hf_config=hf.hf_config,
    layer_params=estimate.layer_params,
    layer_activations=estimate.layer_activations,
)
