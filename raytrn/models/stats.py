"""Parameter counts and training FLOPs per token of a ``model`` section, from the config alone (no torch, no
weights): what MFU, ``raytrn precheck`` and ``raytrn estimate`` count. A layer's parameters are its family's
(:attr:`raytrn.models.registry.ModelSpec.layer_params`); the embedding, head and final norm are every family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrn.models.registry import model_spec

if TYPE_CHECKING:
    from raytrn.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    num_params: int
    num_embedding_params: int
    flops_per_token: float  # training (forward + backward) FLOPs per token at the given seq_len
    #: Parameters a token is computed with: num_params less the experts it is not routed to (a MoE model's).
    num_active_params: int = 0

    def describe(self) -> str:
        active = (
            f", {self.num_active_params / 1e6:,.1f}M active a token"
            if self.num_active_params and self.num_active_params != self.num_params
            else ""
        )
        return (
            f"{self.num_params / 1e6:,.1f}M parameters "
            f"({self.num_embedding_params / 1e6:,.1f}M embedding{active}), "
            f"{self.flops_per_token / 1e9:,.2f} GFLOPs/token (train)"
        )


def model_stats(cfg: ModelConfig, seq_len: int) -> ModelStats:
    """Parameter count and training FLOPs/token, from the config alone (no weights allocated).

    FLOPs/token = 6 * (N - N_embedding) + 12 * layers * heads * head_dim * seq_len (hidden for Llama), the usual dense-transformer
    estimate (PaLM appendix B; torchtitan): 6N for the matmuls' forward+backward, and the attention
    score/value matmuls that N does not count. The input embedding is a lookup, so it is excluded; an
    untied output head is a matmul and stays in N.

    A MoE model counts every expert in the parameters, and in the FLOPs only the active ones: the router and the
    ``num_experts_per_tok`` experts a token goes to (``num_active_params``; MFU is taken on those).
    """
    h, layers = cfg.hidden_size, cfg.num_layers
    q = cfg.num_attention_heads * cfg.head_size  # (q == h unless head_dim is its own)
    layer = model_spec(cfg.family).layer_params(cfg)
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    n = layers * (layer.attention + layer.mlp + layer.norms) + embedding + head + h  # + final norm
    active = n - layers * (layer.mlp - layer.active_mlp)
    flops = 6 * (active - embedding) + 12 * layers * q * seq_len  # attention scores and values over the heads' width
    if cfg.tie_word_embeddings:
        flops += 6 * embedding  # the tied matrix is still used as the output matmul
    return ModelStats(
        num_params=n, num_embedding_params=embedding, flops_per_token=float(flops), num_active_params=active
    )
