"""Qwen3-MoE (``model.family: qwen3_moe``): the same model as transformers' ``Qwen3MoeForCausalLM``, its sizes, its
two dispatches, and one clear error for each bad config."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from raytrn.config import ModelConfig
from raytrn.models import build_model, model_stats
from raytrn.models.moe import Experts, capacity

pytestmark = pytest.mark.unit


def moe(**changes: Any) -> ModelConfig:
    """A tiny Qwen3-MoE: 8 experts of width 64, 2 a token, heads of their own width (4 x 32)."""
    return ModelConfig(preset="tiny-qwen3-moe", **{"vocab_size": 512, **changes})


def real_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


CASES = [
    pytest.param({}, id="untied-gqa-normed"),
    pytest.param({"tie_word_embeddings": True, "norm_topk_prob": False}, id="tied-unnormed"),
    pytest.param({"num_experts": 4, "num_experts_per_tok": 1, "num_key_value_heads": None}, id="top1-mha"),
    pytest.param(
        {
            "hidden_size": 96,
            "moe_intermediate_size": 40,
            "num_layers": 3,
            "vocab_size": 300,
            "head_dim": 40,
            "num_experts": 6,
            "num_experts_per_tok": 3,
        },
        id="odd-sizes",
    ),  # fmt: skip
    pytest.param({"dtype": "bfloat16", "num_key_value_heads": 1, "num_experts_per_tok": 4}, id="bf16-mqa-top4"),
]


def _hf(cfg: ModelConfig, experts: str = "eager"):
    """transformers' model of ``cfg``, seeded as raytrn builds its own; ``experts``: its experts' implementation
    (``eager``: the per-expert loop raytrn's dropless dispatch is, op for op; transformers' default on CPU is
    ``grouped_mm``, the same sums in another order)."""
    from transformers import Qwen3MoeForCausalLM

    from raytrn.models.export import hf_config

    torch.manual_seed(3)
    hf = Qwen3MoeForCausalLM(hf_config(cfg))
    hf.config._experts_implementation = experts
    inv_freq = hf.model.rotary_emb.inv_freq
    hf = hf.to(torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32)
    hf.model.rotary_emb.inv_freq = inv_freq  # float32 RoPE frequencies, as from_pretrained leaves them (and raytrn)
    return hf


@pytest.mark.parametrize("changes", CASES)
def test_same_model_as_hf(changes: dict[str, Any]) -> None:
    """raytrn's decoder is HF's Qwen3MoeForCausalLM (SDPA): same seed -> the same weights under the same names
    (stacked experts and the router included), the same parameter count, the same logits, load-balancing loss
    (HF's with output_router_logits) and gradients of the loss with it."""
    cfg = moe(**changes)
    ours = build_model(cfg, seed=3)
    hf = _hf(cfg)
    mine, theirs = ours.state_dict(), hf.state_dict()
    assert list(mine) == list(theirs)
    assert mine["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size
    )  # fmt: skip
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert model_stats(cfg, seq_len=64).num_params == real_params(ours) == real_params(hf)

    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    a = ours(input_ids=ids)
    b = hf(input_ids=ids, labels=ids, output_router_logits=True)
    assert torch.equal(a.logits, b.logits)
    assert a.aux_loss is not None and torch.allclose(a.aux_loss, b.aux_loss, rtol=1e-6, atol=0)
    assert a.expert_load.shape == (cfg.num_layers, cfg.num_experts)
    assert a.expert_load.sum(-1).tolist() == [3 * 40 * cfg.num_experts_per_tok] * cfg.num_layers  # every assignment
    with torch.no_grad():  # transformers' default implementation: the same model, sums in another order
        grouped = _hf(cfg, experts="grouped_mm")(input_ids=ids).logits
        torch.testing.assert_close(
            a.logits, grouped, **({"rtol": 2e-2, "atol": 2e-2} if cfg.dtype == "bfloat16" else {})
        )
    (a.logits.float().square().mean() + cfg.router_aux_loss_coef * a.aux_loss).backward()
    (b.logits.float().square().mean() + cfg.router_aux_loss_coef * b.aux_loss).backward()
    grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad.float(), grads[name].grad.float(), rtol=1e-5, atol=1e-7), name


def test_a_dense_model_has_no_routing_outputs() -> None:
    out = build_model(ModelConfig(preset="tiny-qwen3", vocab_size=512), seed=0)(input_ids=torch.zeros(1, 4, dtype=int))
    assert out.aux_loss is None and out.expert_load is None and out.dropped is None


def test_with_slots_for_every_assignment_the_capacity_dispatch_is_the_dropless_one() -> None:
    """Fixed shapes, same arithmetic: a capacity factor that gives every assignment a slot drops none, and the
    logits and gradients are the dropless model's (to float rounding: batched matmuls instead of per-expert ones)."""
    cfg = moe()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    dropless, fixed = build_model(cfg, seed=5), build_model(moe(moe_capacity_factor=cfg.num_experts / 2), seed=5)
    a, b = dropless(input_ids=ids), fixed(input_ids=ids)
    assert float(b.dropped) == 0.0
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-6)
    a.logits.square().mean().backward()
    b.logits.square().mean().backward()
    for (name, p), q in zip(dropless.named_parameters(), fixed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_over_capacity_the_later_choices_and_tokens_are_dropped_and_shapes_stay_fixed() -> None:
    """Every token picks expert 0 first: with 3 slots per expert, tokens 0-2's first choices are kept and the
    others' dropped (their output then comes from their second choice only); the shapes are those of the slots,
    whatever the routing."""
    torch.manual_seed(0)
    experts = Experts(hidden_size=8, intermediate_size=4, num_experts=4)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(6, 8)
    indices = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])
    weights = torch.full((6, 2), 0.5)
    out, dropped = experts.with_capacity(x, indices, weights, capacity=3)
    assert float(dropped) == 3  # the first choices of tokens 3, 4, 5
    second_only = torch.where(torch.arange(6)[:, None] < 3, weights, weights * torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(out, experts.dropless(x, indices, second_only))
    assert capacity(tokens=6, top_k=2, num_experts=4, factor=1.0) == 3
    assert capacity(tokens=1, top_k=1, num_experts=64, factor=0.5) == 1


@pytest.mark.parametrize(
    ("preset", "total", "active"), [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)]
)
def test_presets_have_the_published_sizes_and_count_active_parameters(preset: str, total: float, active: float):
    """The model cards' counts (total, activated), transformers' count for the same config (on the meta device),
    and FLOPs per token from the active parameters only."""
    from transformers import Qwen3MoeForCausalLM

    from raytrn.models.export import hf_config

    cfg = ModelConfig(preset=preset)
    stats = model_stats(cfg, seq_len=4096)
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 128 and cfg.num_experts_per_tok == 8
    assert stats.num_params == pytest.approx(total, rel=0.02)
    assert stats.num_active_params == pytest.approx(active, rel=0.03)
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_config(cfg))
    assert stats.num_params == real_params(hf)
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.head_size * 4096
    assert stats.flops_per_token == 6 * (stats.num_active_params - stats.num_embedding_params) + attention
    assert "active a token" in stats.describe()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) is more than num_experts \(8\)"),
        ({"num_experts": None}, r"a qwen3_moe model needs model.num_experts"),
        ({"preset": None, "family": "qwen3_moe", "hidden_size": 64, "intermediate_size": 64, "num_layers": 1,
          "num_attention_heads": 4, "vocab_size": 64}, r"needs model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size"),
        ({"preset": "tiny", "num_experts": 8}, r"model.num_experts: only a qwen3_moe model has experts"),
        ({"preset": "tiny-qwen3", "moe_capacity_factor": 1.25}, r"moe_capacity_factor: only a qwen3_moe model"),
        ({"moe_capacity_factor": 0}, r"greater than 0"),
    ],
)  # fmt: skip
def test_bad_expert_settings_are_one_clear_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig(**{"preset": "tiny-qwen3-moe", **changes})


def _job(tmp_path, *overrides: str) -> Any:
    from pathlib import Path

    from raytrn.config import load_job

    repo = Path(__file__).resolve().parents[2]
    return load_job(
        repo / "jobs" / "tiny.yaml",
        ["data.manifest=unused", "data.seq_len=16", "model.family=qwen3_moe", "model.preset=tiny-qwen3-moe",
         "model.vocab_size=512", "scaling.min_workers=1", "scaling.max_workers=1", f"checkpoint.storage={tmp_path}",
         "tracking.run_name=r", *overrides],
        resolve=False,
    )  # fmt: skip


def test_a_training_step_adds_the_weighted_aux_loss_and_reports_the_routing(tmp_path) -> None:
    """The gradients are those of loss + router_aux_loss_coef * aux_loss (the router's, which the language-model
    loss reaches only through the top-k weights, differ with the coefficient); the logged loss is the
    language-model loss alone; router_aux_loss, moe_dropped_fraction and each layer's expert load are metrics."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.train.build import build_training
    from raytrn.train.step import read_metrics, train_step

    rows = torch.randint(0, 512, (16, 17), generator=torch.Generator().manual_seed(0))
    results, routers = [], []
    for coef in ("0", "0.5"):
        t = build_training(_job(tmp_path, f"model.router_aux_loss_coef={coef}", "optim.weight_decay=0"), CpuBackend(),
                           world_size=1)  # fmt: skip
        assert t.aux_loss_coef == float(coef)
        before = t.model.model.layers[0].mlp.gate.weight.detach().clone()
        results.append(train_step(t, iter([rows]), CpuBackend()))
        routers.append(t.model.model.layers[0].mlp.gate.weight.detach() - before)
    assert not torch.equal(routers[0], routers[1])
    plain, weighted = (read_metrics(r, world_size=1) for r in results)
    assert plain["loss"] == weighted["loss"]  # the same forward: the loss logged has no aux term
    assert plain["router_aux_loss"] == weighted["router_aux_loss"] >= 1.0  # E * sum f*P: 1 when balanced
    assert plain["moe_dropped_fraction"] == 0.0  # dropless
    loads = {k: v for k, v in plain.items() if k.startswith("expert_load/")}
    assert sorted(loads) == ["expert_load/layer_00", "expert_load/layer_01"]
    assert all(1.0 <= v <= 8.0 for v in loads.values())  # max over mean, of 8 experts

    fixed = build_training(_job(tmp_path, "model.moe_capacity_factor=0.5"), CpuBackend(), world_size=1)
    dropped = read_metrics(train_step(fixed, iter([rows]), CpuBackend()), world_size=1)["moe_dropped_fraction"]
    assert 0.5 <= dropped < 1.0  # half the slots the assignments need: at least half of them dropped


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("parallel.data_parallel=fsdp", "parallel.expert_parallel_size=3"),
         r"parallel.expert_parallel_size 3 does not divide model.num_experts \(8\)"),
        (("parallel.expert_parallel_size=2",), r"needs parallel.data_parallel: fsdp"),
        (("model.num_experts_per_tok=9",), r"num_experts_per_tok"),
        (("scaling.accelerator=neuron", "scaling.resources_per_worker={neuron_cores: 1}"),
         r"needs model.moe_capacity_factor \(e.g. 1.25\)"),
    ],
)  # fmt: skip
def test_what_a_moe_job_cannot_train_with_is_refused_when_it_loads(tmp_path, overrides, message) -> None:
    from raytrn.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _job(tmp_path, *overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 6 workers / TP 1 = 6 data-parallel ranks: not EP 4 x something
        (("scaling.min_workers=6", "scaling.max_workers=6", "parallel.expert_parallel_size=4"),
         r"6 worker\(s\) .* is not a multiple of TP 1 x parallel.expert_parallel_size 4 = 4"),
        (("scaling.min_workers=4", "scaling.max_workers=8", "parallel.expert_parallel_size=2",
          "data.allow_variable_global_batch=true"), r"elastic job .* needs scaling.workers_per_node"),
        (("scaling.min_workers=6", "scaling.max_workers=6", "parallel.expert_parallel_size=2",
          "parallel.tensor_parallel_size=2"), r"6 worker\(s\) .* TP 2 x parallel.expert_parallel_size 2 = 4"),
    ],
)  # fmt: skip
def test_expert_parallel_sizes_are_checked_before_any_worker_starts(tmp_path, overrides, message) -> None:
    """EP takes its ranks from the data-parallel ones: every world size holds whole TP x EP blocks, and an elastic
    EP job resizes by whole nodes."""
    from raytrn.errors import ConfigError
    from raytrn.train.checks import check_spec

    with pytest.raises(ConfigError, match=message):
        check_spec(_job(tmp_path, "parallel.data_parallel=fsdp", "data.global_batch_size=null", *overrides))


def test_expert_parallel_layouts_are_accepted_and_described(tmp_path) -> None:
    from raytrn.config.sizes import world_sizes
    from raytrn.train.checks import check_spec

    job = _job(tmp_path, "parallel.data_parallel=fsdp", "parallel.expert_parallel_size=2",
               "parallel.tensor_parallel_size=2", "scaling.min_workers=4", "scaling.max_workers=16",
               "scaling.workers_per_node=4", "data.allow_variable_global_batch=true", "data.global_batch_size=null")  # fmt: skip
    assert world_sizes(job) == [4, 8, 12, 16]  # whole nodes, each 2 TP groups x EP 2
    [line] = check_spec(job)
    assert "tensor parallel 2 (DTensor), expert parallel 2 (4 experts a rank, all-to-all)" in line, line
    with pytest.raises(Exception, match="dense model has no experts"):
        _job(tmp_path, "model.family=qwen3", "model.preset=tiny-qwen3", "parallel.expert_parallel_size=2")


def test_export_writes_the_published_per_expert_tensors_and_loads_in_transformers(tmp_path) -> None:
    """save_hf writes Qwen3MoeForCausalLM's checkpoint as the published ones are (one tensor per expert and
    projection), which transformers loads (merging them into its stacked experts) into the same model."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from raytrn.models.export import save_hf

    cfg = moe(num_experts=4)
    model = build_model(cfg, seed=4).eval()
    with torch.no_grad():  # trained weights, not the init
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    save_hf(cfg, model.state_dict(), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 64)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
        assert torch.equal(f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight"), gate_up[3, 64:])
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded.config._experts_implementation = "eager"
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
