"""The model families raytrn implements: the one list that the job schema (``model.family``), ``init_from``'s
``config.json`` reader, the model builder and the export read.

Adding a family: a row here (its name is Hugging Face's ``model_type``), its presets
(:mod:`raytrn.config.presets`), and its builder and export in :mod:`raytrn.models` (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

#: ``model.family`` values: Hugging Face's ``model_type`` of each family's ``config.json``.
Family = Literal["llama", "qwen3", "qwen3_moe"]


@dataclass(frozen=True)
class FamilySpec:
    """What sets a family apart where raytrn branches on it."""

    name: Family
    #: The Hugging Face architecture an export names in ``config.json`` (``architectures``).
    architecture: str
    #: Queries and keys RMS-normed per head (Qwen3's attention).
    qk_norm: bool = False
    #: Routed experts as every MLP.
    moe: bool = False


FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec("llama", "LlamaForCausalLM"),
        FamilySpec("qwen3", "Qwen3ForCausalLM", qk_norm=True),
        FamilySpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    )
}
assert tuple(FAMILIES) == get_args(Family), "Family and FAMILIES name the same families, in the same order"
