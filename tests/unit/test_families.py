"""Issue 47, item 5 (part): the model families are listed once (raytrn.config.families), and every reader of the
list — the job schema, init_from's config.json reader, the export — reads that one."""

from __future__ import annotations

from typing import get_args

import pytest

from raytrn.config import families
from raytrn.config.hf_config import FAMILIES as READ_FROM_CONFIG_JSON
from raytrn.config.model import ModelConfig
from raytrn.config.presets import PRESETS
from raytrn.models.llama import ARCHITECTURES

pytestmark = pytest.mark.unit


def test_one_list_of_families() -> None:
    names = tuple(families.FAMILIES)
    assert get_args(ModelConfig.model_fields["family"].annotation) == names
    assert READ_FROM_CONFIG_JSON == names
    assert tuple(ARCHITECTURES) == names
    # every family has a tiny preset to build and test with, and its flags are what its configs say
    for name, spec in families.FAMILIES.items():
        preset = next(p for key, p in PRESETS.items() if key.startswith("tiny") and p.get("family", "llama") == name)
        cfg = ModelConfig.model_validate({**preset, "vocab_size": 512})
        assert cfg.is_moe == spec.moe and cfg.qk_norm == spec.qk_norm


def test_the_export_names_each_familys_transformers_class() -> None:
    import transformers

    for spec in families.FAMILIES.values():
        assert hasattr(transformers, spec.architecture), spec
