"""Qwen3's decoder: the shared one (:mod:`raytrn.models.decoder`) with per-head query and key norms (``qk_norm``);
its ``head_dim`` comes with the sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.models.build import decoder_sizes

if TYPE_CHECKING:
    from raytrn.config import ModelConfig
    from raytrn.models.decoder import Decoder


def build_decoder(cfg: ModelConfig) -> Decoder:
    """Qwen3's decoder, not yet initialised (:func:`raytrn.models.build_model` does it)."""
    from raytrn.models.decoder import Decoder  # torch (~1.9 s): the estimate reads this family without it

    return Decoder(**decoder_sizes(cfg), qk_norm=True)
