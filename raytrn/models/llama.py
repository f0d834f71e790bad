"""Llama-family decoders: presets, the builder (:mod:`raytrn.models.decoder`, plain PyTorch) and the
Hugging Face view of the same model (``LlamaConfig``, export), used only where ``transformers`` is wanted.

Sizes come from the job spec (``model.preset`` fills them from :data:`PRESETS`). :func:`model_stats`
gives parameter counts and training FLOPs per token (6N + attention term) for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrn.config import ModelConfig

# Published architecture hyper-parameters (HF config.json of each model family member).
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train on two CPU cores in about a minute.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=512,
        rope_theta=10000.0,
    ),
    # Llama 3.2 1B.
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Llama 3 / 3.1 8B.
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def hf_config(cfg: ModelConfig):
    """The HF ``LlamaConfig`` for a raytrn model config."""
    from transformers import LlamaConfig

    # rope_theta in the 4.x keyword form: transformers 5 folds it into rope_parameters, and the
    # Neuron DLAMI's venvs may still carry 4.x.
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="sdpa",
        use_cache=False,
    )


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised Llama (:mod:`raytrn.models.decoder`, plain PyTorch with HF's parameter names);
    the same seed gives the same weights, and the same weights as HF's ``LlamaForCausalLM``."""
    import torch

    from raytrn.models.decoder import Decoder, LlamaForCausalLM

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        decoder = Decoder(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.kv_heads,
            rope_theta=cfg.rope_theta,
            eps=cfg.rms_norm_eps,
        )
        model = LlamaForCausalLM(decoder, tie_word_embeddings=cfg.tie_word_embeddings)
    return model.to(device=device, dtype=dtype)


def save_hf(cfg: ModelConfig, state_dict: dict[str, Any], out_dir: str) -> None:
    """Write ``state_dict`` (of :func:`build_model`'s model, on the CPU) as a Hugging Face Llama checkpoint:
    ``config.json`` + ``model.safetensors``, loadable with ``AutoModelForCausalLM.from_pretrained``.

    The HF model is made on the meta device (no memory, no init): only its config and its saving code are used.
    """
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config(cfg))
    hf.to(next(iter(state_dict.values())).dtype)  # config.json records the model's dtype
    hf.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    num_params: int
    num_embedding_params: int
    flops_per_token: float  # training (forward + backward) FLOPs per token at the given seq_len

    def describe(self) -> str:
        return (
            f"{self.num_params / 1e6:,.1f}M parameters "
            f"({self.num_embedding_params / 1e6:,.1f}M embedding), "
            f"{self.flops_per_token / 1e9:,.2f} GFLOPs/token (train)"
        )


def model_stats(cfg: ModelConfig, seq_len: int) -> ModelStats:
    """Parameter count and training FLOPs/token, from the config alone (no weights allocated).

    FLOPs/token = 6 * (N - N_embedding) + 12 * layers * hidden * seq_len, the usual dense-transformer
    estimate (PaLM appendix B; torchtitan): 6N for the matmuls' forward+backward, and the attention
    score/value matmuls that N does not count. The input embedding is a lookup, so it is excluded; an
    untied output head is a matmul and stays in N.
    """
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    head_dim = h // cfg.num_attention_heads
    kv = cfg.kv_heads * head_dim
    attn = h * h + 2 * h * kv + h * h  # q, k, v, o projections (Llama has no biases)
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h
    per_layer = attn + mlp + norms
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    n = layers * per_layer + embedding + head + h  # + final norm
    flops = 6 * (n - embedding) + 12 * layers * h * seq_len
    if cfg.tie_word_embeddings:
        flops += 6 * embedding  # the tied matrix is still used as the output matmul
    return ModelStats(num_params=n, num_embedding_params=embedding, flops_per_token=float(flops))
