"""Llama's Hugging Face adapter: the export names ``LlamaForCausalLM`` with a ``LlamaConfig``; raytrn's parameter
names are transformers' (:mod:`raytrn.models.decoder`), so nothing is renamed. (Reading a Llama ``config.json``:
:mod:`raytrn.config.hf_config`, with the family's registry row.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.models.export import hf_sizes

if TYPE_CHECKING:
    from raytrn.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"


def hf_config(cfg: ModelConfig) -> Any:
    """The ``LlamaConfig`` of a ``model`` section (Llama 3.x's RoPE scaling with it)."""
    from transformers import LlamaConfig  # transformers (~4.5 s): the export and the tests only

    return LlamaConfig(**hf_sizes(cfg), rope_scaling=cfg.rope_scaling)  # type: ignore[call-arg]  # (4.x keyword)
