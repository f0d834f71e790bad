"""Model presets: named sizes of the Llama family (``model.preset``), as data.

A preset fills the ``model`` section's sizes (explicit fields win); with ``model.init_from`` its values are
checked against the checkpoint's ``config.json`` (:mod:`raytrn.config.hf_config`).
"""

from __future__ import annotations

from typing import Any

# Published architecture hyper-parameters (HF config.json of each model family member).
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train on two CPU cores in about a minute.
    "tiny": dict(
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
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),  # fmt: skip
    ),
    # Llama 3.1 8B: Llama 3 8B's sizes, a 128k context with RoPE scaling (its config.json).
    "llama3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),  # fmt: skip
    ),
    # Llama 3 8B.
    "llama3-8b": dict(
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
