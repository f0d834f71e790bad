"""``model.init_from``: a Hugging Face Llama checkpoint (made here with ``transformers``, random weights) as the
job's model config and starting weights. Logits equal HF's exactly (float32); bad checkpoints are refused with
the field or tensor named. One process; the sharded layouts are in tests/integration/test_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.config import load_job
from raytrn.errors import CheckpointError, ConfigError
from raytrn.models import build_model
from raytrn.models.hf import load_weights

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # fmt: skip


def hf_checkpoint(out: Path, *, tie: bool = False, rope_scaling: dict | None = None, shard: bool = False) -> Any:
    """A tiny random HF Llama saved to ``out`` (safetensors; sharded with an index when ``shard``); the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, rope_scaling=dict(rope_scaling) if rope_scaling else None, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, max_shard_size="200KB" if shard else "5GB")
    return model


def job_for(checkpoint: Path, *overrides: str) -> Any:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["model.family=null", "model.preset=null", "model.hidden_size=null", "model.intermediate_size=null", "model.num_layers=null",
         "model.num_attention_heads=null", "model.num_key_value_heads=null", "model.vocab_size=null",
         f"model.init_from={checkpoint}", "data.manifest=unused", *overrides],
        resolve=False,
    )  # fmt: skip


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "kind", ["untied", "tied", "llama3-rope", "sharded"], ids=lambda k: k
)  # the shapes a real Llama checkpoint comes in
def test_logits_equal_hf_exactly(tmp_path: Path, kind: str) -> None:
    hf = hf_checkpoint(
        tmp_path,
        tie=kind == "tied",
        rope_scaling=LLAMA3_ROPE if kind == "llama3-rope" else None,
        shard=kind == "sharded",
    )
    if kind == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    job = job_for(tmp_path)
    m = job.model
    assert (m.hidden_size, m.num_layers, m.kv_heads, m.vocab_size, m.rope_theta) == (64, 2, 2, 512, 50000.0)
    assert m.tie_word_embeddings == (kind == "tied")
    assert m.rope_scaling == (LLAMA3_ROPE if kind == "llama3-rope" else None)
    ours = build_model(m, seed=0).eval()
    assert load_weights(ours, str(tmp_path), tied=m.tie_word_embeddings, source="t") > 0
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(1))  # past 32: scaled RoPE matters
    assert torch.equal(logits_of(ours, ids), logits_of(hf, ids))
    if kind == "tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def qwen3_checkpoint(out: Path, *, tie: bool) -> Any:
    """A tiny random HF Qwen3 (heads 48 wide against a width of 64) saved to ``out``; the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # per-head norms that are not all ones: their loading matters
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_qwen3_checkpoint_sets_the_family_and_loads_exactly(tmp_path: Path, tie: bool) -> None:
    hf = qwen3_checkpoint(tmp_path, tie=tie)
    m = job_for(tmp_path).model
    assert (m.family, m.head_size, m.kv_heads, m.rope_theta, m.tie_word_embeddings) == ("qwen3", 48, 2, 1e6, tie)
    ours = build_model(m, seed=0).eval()
    assert load_weights(ours, str(tmp_path), tied=m.tie_word_embeddings, source="t") > 0
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_of(ours, ids), logits_of(hf, ids))


def qwen3_moe_checkpoint(out: Path) -> Any:
    """A tiny random HF Qwen3-MoE (6 experts, 2 a token) saved to ``out`` by transformers (one tensor per expert,
    ``num_local_experts`` in config.json: transformers 5's spelling); the model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(7)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6, attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    model.config._experts_implementation = "eager"  # the per-expert loop raytrn's dropless dispatch is, op for op
    model.save_pretrained(out)
    return model


def test_a_qwen3_moe_checkpoint_loads_its_experts_into_the_stacked_ones_exactly(tmp_path: Path) -> None:
    hf = qwen3_moe_checkpoint(tmp_path)
    m = job_for(tmp_path).model
    assert (m.family, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (
        "qwen3_moe", 6, 2, 48, True
    )  # fmt: skip
    ours = build_model(m, seed=0).eval()
    assert (
        load_weights(ours, str(tmp_path), tied=False, source="t") == len(ours.state_dict()) - 2 * 2 + 2 * 3 * 6
    )  # 3 per expert
    theirs = hf.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_of(ours, ids), logits_of(hf, ids))


def test_a_preset_of_another_family_than_the_checkpoint_is_refused(tmp_path: Path) -> None:
    qwen3_checkpoint(tmp_path, tie=False)
    with pytest.raises(ConfigError, match="model.family is 'llama' but .*config.json says 'qwen3'.*of that family"):
        load_job(REPO / "jobs" / "tiny.yaml", [f"model.init_from={tmp_path}", "data.manifest=x"], resolve=False)
    with pytest.raises(ConfigError, match="model.head_dim is 16 but .*config.json says 48"):
        job_for(tmp_path, "model.head_dim=16")


def test_a_bf16_checkpoint_loads_into_a_float32_model(tmp_path: Path) -> None:
    hf = hf_checkpoint(tmp_path / "f32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ours = build_model(job_for(tmp_path / "bf16").model, seed=0)
    load_weights(ours, str(tmp_path / "bf16"), tied=False, source="t")
    q = ours.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.float32
    assert torch.equal(q, hf.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16).float())


def test_train_export_and_transformers_reads_the_trained_weights(tmp_path: Path) -> None:
    """init -> a few AdamW steps -> Hugging Face export -> AutoModelForCausalLM gives the trained weights."""
    from transformers import AutoModelForCausalLM

    from raytrn.backends.cpu import CpuBackend
    from raytrn.models.export import save_hf
    from raytrn.train.build import build_training
    from raytrn.train.step import train_step

    hf_checkpoint(tmp_path / "init", rope_scaling=LLAMA3_ROPE)
    job = job_for(tmp_path / "init", "data.seq_len=16", f"checkpoint.storage={tmp_path / 'ckpt'}")
    t = build_training(job, CpuBackend(), world_size=1)
    load_weights(t.model, str(tmp_path / "init"), tied=False, source="t")
    before = t.model.model.layers[1].mlp.down_proj.weight.detach().clone()
    rows = torch.randint(0, 512, (job.data.micro_batch_size * 3, 17), generator=torch.Generator().manual_seed(0))
    batches = iter(rows.split(job.data.micro_batch_size))
    for _ in range(3):
        train_step(t, batches, CpuBackend())
    after = dict(t.model.state_dict())
    assert not torch.equal(after["model.layers.1.mlp.down_proj.weight"], before)
    (tmp_path / "out").mkdir()
    save_hf(job.model, after, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert back.config.rope_scaling["rope_type"] == "llama3"  # the scaling travels with the export
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, after[name]), name


def test_sizes_the_job_gives_must_match_the_checkpoint(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path)
    assert job_for(tmp_path, "model.hidden_size=64").model.hidden_size == 64  # agreeing: fine
    with pytest.raises(ConfigError) as e:
        job_for(tmp_path, "model.num_layers=4")
    assert "model.num_layers is 4 but" in str(e.value) and "config.json says 2" in str(e.value)
    with pytest.raises(ConfigError, match="model.hidden_size is 128 but .* says 64"):  # the preset tiny
        load_job(REPO / "jobs" / "tiny.yaml", [f"model.init_from={tmp_path}", "data.manifest=x"], resolve=False)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "gpt2"}, "model_type is 'gpt2'; raytrn's decoder implements 'llama', 'qwen3'"),
        ({"attention_bias": True}, "attention_bias: True; raytrn's decoder implements attention_bias: false only"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
         "RoPE scaling 'yarn' is not implemented"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "'llama3' RoPE scaling without factor"),
    ],
    ids=["not-supported", "attention-bias", "yarn", "llama3-incomplete"],
)  # fmt: skip
def test_a_checkpoint_raytrn_cannot_train_is_refused(tmp_path: Path, edit: dict, message: str) -> None:
    hf_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=message):
        job_for(tmp_path)


def test_missing_checkpoint_and_missing_weights_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config.json not found .*missing.*init_from is a Hugging Face checkpoint"):
        job_for(tmp_path / "nowhere")
    hf_checkpoint(tmp_path / "ckpt")
    job = job_for(tmp_path / "ckpt")
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"has no \*.safetensors weights"):
        load_weights(build_model(job.model, seed=0), str(tmp_path / "ckpt"), tied=False, source="t")


def test_a_tensor_of_another_shape_is_named(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path)
    job = job_for(tmp_path, "model.intermediate_size=null")
    wider = job.model.model_copy(update={"intermediate_size": 192})  # what a mismatched config would build
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(160, 64\)"):
        load_weights(build_model(wider, seed=0), str(tmp_path), tied=False, source="t")
