"""Building a model of any family: its decoder (the family's :attr:`~raytrn.models.registry.ModelSpec.build_decoder`)
seeded, given its output head and HF's initialisation, in the job's dtype. Model code is single-device; parallelism
is applied afterwards (:mod:`raytrn.train.parallelize`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.models.registry import model_spec

if TYPE_CHECKING:
    import torch

    from raytrn.config import ModelConfig


def decoder_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of :class:`raytrn.models.decoder.Decoder` every family takes from its ``model``
    section (a family adds what of the decoder it changes)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.kv_heads,
        rope_theta=cfg.rope_theta,
        eps=cfg.rms_norm_eps,
        rope_scaling=cfg.rope_scaling,
        head_dim=cfg.head_size,
    )


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised decoder of ``cfg.family`` (:mod:`raytrn.models.decoder`, plain PyTorch with HF's
    parameter names); the same seed gives the same weights, and the same weights as HF's ``LlamaForCausalLM`` /
    ``Qwen3ForCausalLM``."""
    import torch

    from raytrn.models.decoder import LlamaForCausalLM  # torch (~1.9 s): model_stats needs none

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    build_decoder = model_spec(cfg.family).build_decoder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(build_decoder(cfg), tie_word_embeddings=cfg.tie_word_embeddings)
    return model.to(device=device, dtype=dtype)
