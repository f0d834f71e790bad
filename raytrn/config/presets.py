"""Model presets: named sizes of the registered families (``model.preset``), as data.

A preset names its family (a row of :data:`raytrn.config.families.FAMILIES`) and fills the ``model`` section's sizes
(explicit fields win); with ``model.init_from`` its values are checked against the checkpoint's ``config.json``
(:mod:`raytrn.config.hf_config`). Every family has a ``tiny*`` preset to build and test with
(``tests/unit/test_families.py``).
"""

from __future__ import annotations

from typing import Any

from raytrn.config.families import FAMILIES


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.1 and 3.2's long-context RoPE scaling (their config.json): ``factor`` x the 8,192 positions of
    pre-training."""
    return dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


# Published architecture hyper-parameters (HF config.json of each model family member).
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train on two CPU cores in about a minute.
    "tiny": dict(
        family="llama",
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=512,
        rope_theta=10000.0,
    ),
    # Llama 3.2 1B.
    "llama3.2-1b": dict(
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        # Llama 3.2's config.json: long-context RoPE scaling (checked against init_from's config.json).
        rope_scaling=_llama3_rope(32.0),
    ),
    # Llama 3.1 8B: Llama 3 8B's sizes, a 128k context with RoPE scaling (its config.json).
    "llama3.1-8b": dict(
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0),
    ),
    # Llama 3.1 70B: 80 layers of width 8192, 64 query and 8 kv heads, the 128k context (its config.json).
    "llama3.1-70b": dict(
        family="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0),
    ),
    # Llama 3 8B.
    "llama3-8b": dict(
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, *, tied: bool) -> dict[str, Any]:
    """A Qwen3 dense model's config.json: 128-wide heads, 8 kv heads, a 151,936-token vocabulary, RoPE base 1e6,
    a 40,960-token context."""
    return dict(
        family="qwen3",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )


PRESETS.update({
    # Qwen3's attention at the tiny preset's sizes: heads of their own width (4 x 48 against a width of 128).
    "tiny-qwen3": {**_qwen3(128, 384, 2, 4, tied=False), "num_key_value_heads": 2, "head_dim": 48,
                   "vocab_size": 4096, "max_position_embeddings": 512},
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
})  # fmt: skip


def _qwen3_moe(hidden: int, intermediate: int, layers: int, heads: int, expert_width: int) -> dict[str, Any]:
    """A Qwen3-MoE model's config.json: Qwen3's attention with 4 kv heads, 128 experts a layer of which each token
    takes 8, every layer sparse (``intermediate_size`` is the width a dense layer would have: none here)."""
    return dict(
        _qwen3(hidden, intermediate, layers, heads, tied=False),
        family="qwen3_moe",
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=expert_width,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )


PRESETS.update({
    # Qwen3-MoE at the tiny preset's sizes: 8 experts of width 64, 2 a token (a fraction of the tiny model's
    # compute per token, ~4x its MLP parameters).
    "tiny-qwen3-moe": {**_qwen3_moe(128, 384, 2, 4, 64), "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
                       "num_experts_per_tok": 2, "vocab_size": 4096, "max_position_embeddings": 512},
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 48, 32, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 94, 64, 1536),
})  # fmt: skip

assert all(p["family"] in FAMILIES for p in PRESETS.values()), "every preset names a registered family"
