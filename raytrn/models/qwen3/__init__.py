"""Qwen3 dense (``model.family: qwen3``; transformers' ``Qwen3ForCausalLM``): Llama's decoder with each head's query
and key RMS-normed before RoPE (``q_norm``, ``k_norm``) and a head width of its own (``head_dim``). Its pieces:
:mod:`.model`, :mod:`.parallelize`, :mod:`.hf`, :mod:`.estimate`.
"""

from raytrn.models.qwen3 import estimate, hf, model, parallelize
from raytrn.models.registry import ModelSpec

SPEC = ModelSpec(
    name="qwen3",
    build_decoder=model.build_decoder,
    tensor_parallel=parallelize.tensor_parallel,
    architecture=hf.ARCHITECTURE,
    hf_config=hf.hf_config,
    layer_params=estimate.layer_params,
    layer_activations=estimate.layer_activations,
)
