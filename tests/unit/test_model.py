"""Model sizes and FLOPs from the config match the real HF model; building is seeded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from raytrn.config import PRESETS, ModelConfig
from raytrn.models import build_model, model_stats

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
        logits = model(input_ids=ids).logits
    assert logits.shape == (batch, seq, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    # A freshly initialised model is close to uniform: loss ~ ln(vocab).
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(torch.log(torch.tensor(float(cfg.vocab_size))).item(), rel=0.1)


def test_forward_is_causal() -> None:
    """Changing a later token never changes the logits of earlier positions."""
    model = build_model(tiny(vocab_size=512), seed=0).eval()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 512
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert torch.equal(a[:, :15], b[:, :15])
    assert not torch.equal(a[:, 15:], b[:, 15:])


def qwen3(**changes: Any) -> ModelConfig:
    """A tiny Qwen3: heads of their own width (4 x 48 = 192 against a width of 128), RoPE base 1e6."""
    sizes = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=48, vocab_size=512, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
    return ModelConfig(family="qwen3", **{**sizes, **changes})


QWEN3_CASES = [
    pytest.param({}, id="untied-gqa"),
    pytest.param({"tie_word_embeddings": True}, id="tied-gqa"),
    pytest.param({"num_key_value_heads": None, "head_dim": None}, id="mha-hidden-over-heads"),
    pytest.param(
        {"hidden_size": 96, "intermediate_size": 200, "num_layers": 3, "vocab_size": 300, "head_dim": 40},
        id="odd-sizes",
    ),  # fmt: skip
    pytest.param({"dtype": "bfloat16", "num_key_value_heads": 1}, id="bf16-mqa"),
]


HF_CASES = [
    pytest.param({}, id="untied-gqa"),
    pytest.param({"tie_word_embeddings": True}, id="tied-gqa"),
    pytest.param({"num_key_value_heads": None}, id="mha"),
    pytest.param({"hidden_size": 96, "intermediate_size": 200, "num_layers": 3, "vocab_size": 300}, id="odd-sizes"),
    pytest.param({"dtype": "bfloat16", "rope_theta": 500000.0}, id="bf16"),
]


@pytest.mark.parametrize(
    ("family", "changes"),
    [pytest.param("llama", c.values[0], id=f"llama-{c.id}") for c in HF_CASES]
    + [pytest.param("qwen3", c.values[0], id=f"qwen3-{c.id}") for c in QWEN3_CASES],
)
def test_same_model_as_hf(family: str, changes: dict[str, Any]) -> None:
    """raytrn's plain-PyTorch decoder is HF's LlamaForCausalLM / Qwen3ForCausalLM (SDPA): same seed -> the same
    weights under the same names (Qwen3's q_norm and k_norm included), the same parameter count, and bit-identical
    logits and gradients. Golden losses and checkpoints rely on it."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    from raytrn.models.export import hf_config

    cfg = tiny(**changes) if family == "llama" else qwen3(**changes)
    ours = build_model(cfg, seed=3)
    torch.manual_seed(3)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    hf = (LlamaForCausalLM if family == "llama" else Qwen3ForCausalLM)(hf_config(cfg))
    inv_freq = hf.model.rotary_emb.inv_freq
    hf = hf.to(dtype)
    hf.model.rotary_emb.inv_freq = inv_freq  # float32 RoPE frequencies, as from_pretrained leaves them (and raytrn)
    mine, theirs = ours.state_dict(), hf.state_dict()
    assert list(mine) == list(theirs)
    assert ("model.layers.0.self_attn.q_norm.weight" in mine) == (family == "qwen3")
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert model_stats(cfg, seq_len=64).num_params == real_params(ours) == real_params(hf)

    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    a, b = ours(input_ids=ids).logits, hf(input_ids=ids).logits
    assert torch.equal(a, b)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[name].grad), name


@pytest.mark.parametrize(
    "changes", [{}, {"tie_word_embeddings": True, "dtype": "bfloat16"}], ids=["untied", "tied-bf16"]
)
def test_export_loads_in_transformers(tmp_path, changes: dict[str, Any]) -> None:
    """save_hf writes a checkpoint transformers' AutoModelForCausalLM loads into the same model."""
    from transformers import AutoModelForCausalLM

    from raytrn.models.export import save_hf

    cfg = tiny(vocab_size=512, **changes)
    model = build_model(cfg, seed=4).eval()
    with torch.no_grad():  # trained weights, not the init: the norms must round-trip too
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.01)
    save_hf(cfg, model.state_dict(), str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()  # the dtype config.json records
    assert loaded.dtype == next(model.parameters()).dtype
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_building_needs_no_transformers() -> None:
    """The training worker builds its model without importing transformers (seconds of CPU at start-up)."""
    import subprocess
    import sys

    code = (
        "import sys; from raytrn.config import ModelConfig; from raytrn.models import build_model; "
        "m = build_model(ModelConfig(preset='tiny'), seed=0); m(input_ids=__import__('torch').zeros(1, 4, dtype=int)); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("preset", "total", "non_embedding"),
    [("qwen3-0.6b", 0.6e9, 0.44e9), ("qwen3-1.7b", 1.7e9, 1.4e9), ("qwen3-4b", 4.0e9, 3.6e9),
     ("qwen3-8b", 8.2e9, 6.95e9), ("qwen3-14b", 14.8e9, 13.2e9), ("qwen3-32b", 32.8e9, 31.2e9)],
)  # fmt: skip
def test_qwen3_presets_have_the_published_sizes(preset: str, total: float, non_embedding: float) -> None:
    """The model cards' counts (total; without the embedding and an untied output head)."""
    cfg = ModelConfig(preset=preset)
    stats = model_stats(cfg, seq_len=4096)
    head = 0 if cfg.tie_word_embeddings else stats.num_embedding_params
    assert cfg.family == "qwen3" and cfg.head_size == 128
    assert stats.num_params == pytest.approx(total, rel=0.02)
    assert stats.num_params - stats.num_embedding_params - head == pytest.approx(non_embedding, rel=0.02)


def test_qwen3_preset_counts_equal_transformers() -> None:
    """The preset's parameter count is what transformers counts for the same config (built on the meta device)."""
    from transformers import Qwen3ForCausalLM

    from raytrn.models.export import hf_config

    cfg = ModelConfig(preset="qwen3-0.6b")
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(hf_config(cfg))
    assert model_stats(cfg, seq_len=4096).num_params == real_params(hf)


def test_qwen3_export_loads_in_transformers(tmp_path) -> None:
    """save_hf writes a Qwen3 checkpoint (architectures: Qwen3ForCausalLM) that transformers loads into the same
    model: identical logits."""
    import json

    from transformers import AutoModelForCausalLM

    from raytrn.models.export import save_hf

    cfg = qwen3(tie_word_embeddings=True)
    model = build_model(cfg, seed=4).eval()
    with torch.no_grad():  # trained weights, not the init: the per-head norms must round-trip too
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    save_hf(cfg, model.state_dict(), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 48
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_a_family_the_preset_contradicts_is_one_clear_error() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="family 'llama' but preset 'qwen3-8b' is a qwen3 model"):
        ModelConfig(preset="qwen3-8b", family="llama")
    with pytest.raises(ValidationError, match="must be divisible by num_attention_heads .*or set head_dim"):
        ModelConfig(preset="tiny", hidden_size=130)
    assert qwen3().head_size == 48 and qwen3(head_dim=None).head_size == 32
