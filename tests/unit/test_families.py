"""Issue 47, "model families as folders": the families are listed once (raytrn.config.families), each is a folder
(raytrn/models/<family>/: its model, parallelization, Hugging Face adapter, estimate terms) found by its name, and
every reader — the job schema, the presets, init_from's config.json reader, the builder, the estimate, the export —
reads that one list. A family registered in a test is picked up by all of them with no edit elsewhere."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from pathlib import Path
from typing import get_args

import pytest

import raytrn.models
from raytrn.config import families
from raytrn.config.hf_config import model_fields
from raytrn.config.model import ModelConfig
from raytrn.config.presets import PRESETS
from raytrn.errors import ConfigError
from raytrn.models import build_model, model_stats
from raytrn.models.registry import ModelSpec, model_spec

pytestmark = pytest.mark.unit

MODELS = Path(raytrn.models.__file__).parent


def _tiny(family: str) -> ModelConfig:
    preset = next(key for key, p in PRESETS.items() if key.startswith("tiny") and p["family"] == family)
    return ModelConfig(preset=preset, vocab_size=512)


def test_one_list_of_families() -> None:
    names = tuple(families.FAMILIES)
    assert get_args(families.Family) == names
    assert get_args(ModelConfig.model_fields["family"].annotation) == names
    # every family is a folder, and every folder a family (the folder's name is the registry's)
    folders = {p.parent.name for p in MODELS.glob("*/__init__.py")}
    assert folders == set(names)
    for name, row in families.FAMILIES.items():
        spec = model_spec(name)
        assert isinstance(spec, ModelSpec) and spec.name == name
        # every family has a tiny preset to build and test with, and its flags are what its folder does
        cfg = _tiny(name)
        assert cfg.is_moe == row.moe == (spec.expert_parallel is not None)
    # every preset names a registered family
    assert {p["family"] for p in PRESETS.values()} <= set(names)
    with pytest.raises(ValueError, match="'mistral' is not registered"):
        model_spec("mistral")


def test_the_export_names_each_familys_transformers_class() -> None:
    import transformers

    for name in families.FAMILIES:
        spec = model_spec(name)
        assert hasattr(transformers, spec.architecture), spec
        assert spec.hf_config(_tiny(name)).model_type == name  # the adapter's config is the family's model_type


def test_each_familys_parameters_are_its_models() -> None:
    """The estimate terms (model_stats) count what the family's builder builds."""
    for name in families.FAMILIES:
        cfg = _tiny(name)
        model = build_model(cfg, seed=0)
        assert model_stats(cfg, 64).num_params == sum(p.numel() for p in model.parameters()), name


def test_reading_a_family_needs_no_torch() -> None:
    """``raytrn estimate`` reads every family's terms without importing torch (seconds of start-up)."""
    code = (
        "import sys; from raytrn.config import ModelConfig, PRESETS; from raytrn.models import model_stats; "
        "from raytrn.models.registry import model_spec; from raytrn.config.families import FAMILIES; "
        "[model_spec(f) for f in FAMILIES]; [model_stats(ModelConfig(preset=p), 128) for p in PRESETS]; "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_every_family_cuts_into_pipeline_stages_by_the_whole_models_names() -> None:
    """A stage of any family keeps its layers under their indices in the whole model (DCP reshards across pipeline
    sizes by name); uneven splits put the extra layers on the middle stages (the ends carry embedding and head)."""
    from raytrn.config.stages import stage_indices, stage_layers
    from raytrn.models.pipeline import split_model

    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert stage_indices("interleaved_1f1b", 1, 2) == [1, 3] and stage_indices("zbv_zero_bubble", 0, 2) == [0, 3]
    with pytest.raises(ValueError, match="5 decoder layers cannot make 6 pipeline stages"):
        stage_layers(5, 6)
    for preset in ("tiny", "tiny-qwen3"):
        cfg = ModelConfig(preset=preset, vocab_size=512, num_layers=5, tie_word_embeddings=False)
        whole = {n for n, _ in build_model(cfg, seed=0).named_parameters()}
        cut = [{n for n, _ in split_model(build_model(cfg, seed=0), s, 2).named_parameters()} for s in range(2)]
        assert cut[0] | cut[1] == whole and not cut[0] & cut[1]
        assert (
            "model.embed_tokens.weight" in cut[0]
            and "lm_head.weight" in cut[1]
            and "model.layers.3.mlp.up_proj.weight" in cut[1]
        )


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> str:
    """A family registered only here: Qwen3's model under another name, with a config.json variant of its own to
    refuse. Its registry row and its folder (a module in sys.modules), nothing else."""
    row = families.FamilySpec(name="stand_in", summary="a test's", checkpoints="Stand-In", plain=(("odd", False),))  # type: ignore[arg-type]
    monkeypatch.setitem(families.FAMILIES, "stand_in", row)
    folder = types.ModuleType("raytrn.models.stand_in")
    folder.SPEC = dataclasses.replace(model_spec("qwen3"), name="stand_in", architecture="StandInForCausalLM")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "raytrn.models.stand_in", folder)
    return "stand_in"


def test_a_registered_family_is_read_everywhere(stand_in: str, tmp_path: Path) -> None:
    import json

    from raytrn.models.export import save_hf

    # init_from's config.json reader: the family's model_type, its own refusals
    config = {"model_type": stand_in, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48, "vocab_size": 512}  # fmt: skip
    assert model_fields(config, where="t")["family"] == stand_in
    with pytest.raises(ConfigError, match="config.json has odd: True"):
        model_fields({**config, "odd": True}, where="t")
    with pytest.raises(ConfigError, match=r"'qwen3_moe', 'stand_in' \(.*Qwen3-MoE, Stand-In, and their fine-tunes"):
        model_fields({**config, "model_type": "mistral"}, where="t")
    # the config's flags, the builder, the estimate and the export: the family's folder (the schema's Literal is the
    # one line of the registry a real family adds; a stand-in bypasses it)
    fields = {k: v for k, v in _tiny("qwen3").model_dump().items() if k != "preset"}
    cfg = ModelConfig.model_construct(**{**fields, "family": stand_in})
    assert not cfg.is_moe
    qwen3 = model_stats(_tiny("qwen3"), 64)
    assert model_stats(cfg, 64) == qwen3 != model_stats(_tiny("llama"), 64)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == qwen3.num_params
    save_hf(cfg, model.state_dict(), str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["StandInForCausalLM"]


def test_the_estimate_reads_a_registered_family(stand_in: str, tmp_path: Path) -> None:
    from raytrn.config import load_job
    from raytrn.estimate.memory import estimate_memory

    job = load_job(
        str(Path(__file__).parents[2] / "jobs" / "tiny.yaml"),
        ["model.family=qwen3", "model.preset=tiny-qwen3"],
        resolve=False,
    )
    ours = job.model_copy(update={"model": ModelConfig.model_construct(**{**dict(job.model), "family": stand_in})})
    assert estimate_memory(ours, 2).as_dict() == estimate_memory(job, 2).as_dict()
