"""Qwen3's Hugging Face adapter: the export names ``Qwen3ForCausalLM`` with a ``Qwen3Config`` (no attention biases,
no sliding window: what raytrn implements); parameter names are transformers'. (Reading its ``config.json``:
:mod:`raytrn.config.hf_config`, with the family's registry row.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.models.export import hf_sizes

if TYPE_CHECKING:
    from raytrn.config import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"


def hf_config(cfg: ModelConfig) -> Any:
    """The ``Qwen3Config`` of a ``model`` section."""
    from transformers import Qwen3Config  # transformers (~4.5 s): the export and the tests only

    return Qwen3Config(**hf_sizes(cfg), attention_bias=False, use_sliding_window=False)
