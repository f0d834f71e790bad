"""The registry of model families: the one list (``Family``, :data:`FAMILIES`) that the job schema
(``model.family``), the presets, ``init_from``'s ``config.json`` reader, the model registry
(:mod:`raytrn.models.registry`: builder, parallelization, export, estimate terms) read.

A row holds what the config layer must know of a family to load a job without torch or the model code: its name
(Hugging Face's ``model_type``), what it is, whether its MLPs are routed experts, and how its ``config.json`` reads.
Everything else of the family lives in its folder, ``raytrn/models/<name>/``, found by that name
(``tests/unit/test_families.py`` checks that the rows and the folders agree). Adding a family: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

#: ``model.family`` values: Hugging Face's ``model_type`` of each family's ``config.json``.
Family = Literal["llama", "qwen3", "qwen3_moe"]


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """What the config layer knows of a family."""

    name: Family
    #: What it is, for ``model.family``'s help (docs/job-spec.md).
    summary: str
    #: The published models it reads with ``init_from`` (named when a ``config.json`` is of another family).
    checkpoints: str
    #: Routed experts as every MLP: the ``model.num_experts`` fields and expert parallelism apply.
    moe: bool = False
    #: ``config.json`` keys raytrn's decoder implements at one value only, beyond every family's
    #: (:data:`raytrn.config.hf_config.PLAIN`): another value is refused, as training with it ignored would be wrong.
    plain: tuple[tuple[str, Any], ...] = ()
    #: ``model`` fields read from ``config.json`` beyond :data:`raytrn.config.hf_config.FIELDS`, with the value
    #: its transformers config class takes when the key is absent.
    defaults: tuple[tuple[str, Any], ...] = ()
    #: ``(other spelling, key)``: a key's other name (transformers 5's), read when the key itself is absent.
    aliases: tuple[tuple[str, str], ...] = ()


FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec(name="llama", summary="Llama 2, 3, 3.x", checkpoints="Llama 2, 3, 3.1, 3.2"),
        FamilySpec(
            name="qwen3",
            summary="Qwen3 dense: queries and keys RMS-normed per head, head_dim of its own",
            checkpoints="Qwen3 dense",
        ),
        FamilySpec(
            name="qwen3_moe",
            summary="Qwen3-MoE: Qwen3's attention, routed experts as every MLP",
            checkpoints="Qwen3-MoE",
            moe=True,
            plain=(("decoder_sparse_step", 1), ("mlp_only_layers", [])),  # every layer sparse, as published
            defaults=(("norm_topk_prob", False),),  # Qwen3MoeConfig's default
            aliases=(("num_local_experts", "num_experts"),),  # transformers 5's name for it
        ),
    )
}
assert tuple(FAMILIES) == get_args(Family), "Family and FAMILIES name the same families, in the same order"


def moe_families() -> list[str]:
    """The families whose MLPs are routed experts (named where a dense family is given an expert field)."""
    return [name for name, spec in FAMILIES.items() if spec.moe]
