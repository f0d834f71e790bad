"""Model sizes and FLOPs from the config match the real HF model; building is seeded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from raytrn.config import ModelConfig
from raytrn.models import PRESETS, build_model, model_stats

pytestmark = pytest.mark.unit


def tiny(**changes: Any) -> ModelConfig:
    return ModelConfig(preset="tiny", **changes)


def real_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({}, id="untied-gqa"),
        pytest.param({"tie_word_embeddings": True}, id="tied-gqa"),
        pytest.param({"num_key_value_heads": None}, id="untied-mha"),
        pytest.param({"num_key_value_heads": 1, "tie_word_embeddings": True}, id="tied-mqa"),
        pytest.param({"hidden_size": 96, "intermediate_size": 200, "num_layers": 3, "vocab_size": 300}, id="odd-sizes"),
    ],
)
def test_param_count_matches_the_built_model(changes: dict[str, Any]) -> None:
    cfg = tiny(**changes)
    model = build_model(cfg, seed=0)
    stats = model_stats(cfg, seq_len=64)
    assert stats.num_params == real_params(model)
    assert stats.num_embedding_params == model.get_input_embeddings().weight.numel()
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == cfg.tie_word_embeddings


def test_tiny_preset_uses_gqa() -> None:
    cfg = tiny()
    assert cfg.kv_heads < cfg.num_attention_heads
    assert tiny(num_key_value_heads=None).kv_heads == cfg.num_attention_heads


@pytest.mark.parametrize(("preset", "published"), [("llama3-8b", 8.03e9), ("llama3.2-1b", 1.24e9)])
def test_published_sizes(preset: str, published: float) -> None:
    stats = model_stats(ModelConfig(preset=preset), seq_len=2048)
    assert stats.num_params == pytest.approx(published, rel=0.01)
    assert stats.num_embedding_params == PRESETS[preset]["vocab_size"] * PRESETS[preset]["hidden_size"]


def test_exact_llama3_8b_count() -> None:
    # 8,030,261,248: the parameter count of Meta-Llama-3-8B.
    assert model_stats(ModelConfig(preset="llama3-8b"), seq_len=8192).num_params == 8_030_261_248


@pytest.mark.parametrize("seq_len", [128, 8192])
def test_flops_per_token(seq_len: int) -> None:
    for cfg in (tiny(), ModelConfig(preset="llama3-8b")):
        s = model_stats(cfg, seq_len)
        attention = 12 * cfg.num_layers * cfg.hidden_size * seq_len
        assert s.flops_per_token == 6 * (s.num_params - s.num_embedding_params) + attention
    # Tied: the embedding matrix is also the output matmul, so all of N counts.
    cfg = tiny(tie_word_embeddings=True)
    s = model_stats(cfg, 128)
    assert s.flops_per_token == 6 * s.num_params + 12 * cfg.num_layers * cfg.hidden_size * 128


def test_flops_grow_with_seq_len() -> None:
    cfg = tiny()
    assert model_stats(cfg, 256).flops_per_token > model_stats(cfg, 128).flops_per_token


def test_describe() -> None:
    text = model_stats(ModelConfig(preset="llama3-8b"), seq_len=8192).describe()
    assert text.startswith("8,030.3M parameters (525.3M embedding), ")
    assert text.endswith(" GFLOPs/token (train)")


def test_build_is_seeded() -> None:
    cfg = tiny()
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_build_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(tiny(), seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_is_honoured(dtype: str, torch_dtype: torch.dtype) -> None:
    model = build_model(tiny(dtype=dtype), seed=0)
    assert {p.dtype for p in model.parameters()} == {torch_dtype}


def test_forward_gives_logits_per_position() -> None:
    cfg = tiny()
    model = build_model(cfg, seed=0).eval()
    batch, seq = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (batch, seq, cfg.vocab_size)
    assert torch.isfinite(out.logits).all()
    # A freshly initialised model is close to uniform: loss ~ ln(vocab).
    assert out.loss.item() == pytest.approx(torch.log(torch.tensor(float(cfg.vocab_size))).item(), rel=0.1)


def test_static_causal_mask_gives_identical_logits(monkeypatch) -> None:
    """raytrn skips HF's host-side mask inspection (a sync per forward on XLA); the result must not change."""
    import torch
    from transformers.models.llama import modeling_llama

    from raytrn.config import ModelConfig
    from raytrn.models import build_model

    model = build_model(ModelConfig(preset="tiny", vocab_size=512), seed=0).eval()
    patched = modeling_llama.create_causal_mask
    assert patched._raytrn_static
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = model(input_ids=ids).logits
        monkeypatch.setattr(modeling_llama, "create_causal_mask", patched._raytrn_original)
        reference = model(input_ids=ids).logits
        # A padding mask still goes through HF's own code path.
        monkeypatch.setattr(modeling_llama, "create_causal_mask", patched)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        padded = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(fast, reference)
    assert not torch.equal(padded[0], reference[0]) and torch.equal(padded[1:], reference[1:])
