"""Llama- and Qwen3-family decoders (``model.family``): the builder (:mod:`raytrn.models.decoder`, plain PyTorch)
and the Hugging Face view of the same model (``LlamaConfig`` / ``Qwen3Config``, export), used only where
``transformers`` is wanted.

Sizes come from the job spec (``model.preset`` fills them from :data:`raytrn.config.presets.PRESETS`).
:func:`model_stats` gives parameter counts and training FLOPs per token (6N + attention term) for MFU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrn.config import ModelConfig


#: ``model.family`` -> the Hugging Face architecture of its export.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(cfg: ModelConfig):
    """The HF ``LlamaConfig`` or ``Qwen3Config`` for a raytrn model config."""
    # rope_theta in the 4.x keyword form: transformers 5 folds it into rope_parameters, and the
    # Neuron DLAMI's venvs may still carry 4.x.
    sizes = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="sdpa",
        use_cache=False,
    )
    if cfg.family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**sizes, attention_bias=False, use_sliding_window=False)  # type: ignore[arg-type]
    from transformers import LlamaConfig

    return LlamaConfig(**sizes, rope_scaling=cfg.rope_scaling)  # type: ignore[arg-type,call-arg]


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised decoder of ``cfg.family`` (:mod:`raytrn.models.decoder`, plain PyTorch with HF's
    parameter names); the same seed gives the same weights, and the same weights as HF's ``LlamaForCausalLM`` /
    ``Qwen3ForCausalLM``."""
    import torch

    from raytrn.models.decoder import Decoder, LlamaForCausalLM  # torch (~1.9 s, measured): model_stats needs none

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
            rope_scaling=cfg.rope_scaling,
            head_dim=cfg.head_size,
            qk_norm=cfg.family == "qwen3",
        )
        model = LlamaForCausalLM(decoder, tie_word_embeddings=cfg.tie_word_embeddings)
    return model.to(device=device, dtype=dtype)


def save_hf(
    cfg: ModelConfig, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], out_dir: str | None, *, specs: Any = None
) -> None:
    """Write a model's state (of :func:`build_model`'s model) as a Hugging Face checkpoint of its family: ``config.json``
    + ``model.safetensors``, loadable with ``AutoModelForCausalLM.from_pretrained``.

    ``tensors``: a state dict, or (name, CPU tensor) pairs arriving one at a time (a sharded model gathered
    tensor by tensor: only one full tensor is in memory at a time), with ``specs`` {name: (dtype, shape)} in
    the same order. ``out_dir=None`` only consumes the pairs (a rank that takes part in the gathers but does not
    write). A tied output head is written once, as the embedding (HF re-ties it).
    """
    if isinstance(tensors, Mapping):
        specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        tensors = tensors.items()
    assert specs is not None, "specs are needed for streamed tensors"
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    specs = {name: spec for name, spec in specs.items() if name not in skip}
    written = write_safetensors(None if out_dir is None else os.path.join(out_dir, "model.safetensors"), specs,
                                ((n, t) for n, t in tensors if n not in skip))  # fmt: skip
    if out_dir is None or not written:
        return
    config = hf_config(cfg)
    dtypes = {dtype for dtype, _ in specs.values()}
    config.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    config.architectures = [ARCHITECTURES[cfg.family]]
    config.save_pretrained(out_dir)


_SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def write_safetensors(path: str | None, specs: dict[str, Any], tensors: Iterable[tuple[str, Any]]) -> bool:
    """Stream tensors into a ``.safetensors`` file: the header from ``specs`` {name: (dtype, shape)} first, then
    each tensor's bytes as it arrives (in ``specs``' order). Every item is consumed even when writing fails or
    ``path`` is None (the producer may be a collective gather); returns whether the file was written, and
    re-raises a write error once all items are consumed."""
    import json
    import math
    import struct

    import torch

    header, start = {}, 0
    for name, (dtype, shape) in specs.items():
        size = math.prod(shape) * _element_size(dtype)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[str(dtype)],
            "shape": list(shape),
            "data_offsets": [start, start + size],
        }
        start += size
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    error: BaseException | None = None
    f = None
    try:
        if path is not None:
            f = open(path, "wb")
            f.write(struct.pack("<Q", len(blob)) + blob)
        for name, tensor in tensors:
            expected = specs.get(name)
            if expected is None or tuple(tensor.shape) != tuple(expected[1]) or tensor.dtype != expected[0]:
                raise ValueError(
                    f"{name}: tensor {tuple(tensor.shape)} {tensor.dtype} does not match its spec {expected}"
                )
            if f is not None and error is None:
                try:
                    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(memoryview(data))
                except OSError as e:  # keep consuming: the other ranks are still gathering
                    error = e
    finally:
        if f is not None:
            f.close()
    if error is not None:
        raise error
    return f is not None


def _element_size(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


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

    FLOPs/token = 6 * (N - N_embedding) + 12 * layers * heads * head_dim * seq_len (hidden for Llama), the usual dense-transformer
    estimate (PaLM appendix B; torchtitan): 6N for the matmuls' forward+backward, and the attention
    score/value matmuls that N does not count. The input embedding is a lookup, so it is excluded; an
    untied output head is a matmul and stays in N.
    """
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    head_dim = cfg.head_size
    q, kv = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim  # (q == h unless head_dim is its own)
    attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections (no biases)
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h + (2 * head_dim if cfg.family == "qwen3" else 0)  # + Qwen3's per-head query and key norms
    per_layer = attn + mlp + norms
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    n = layers * per_layer + embedding + head + h  # + final norm
    flops = 6 * (n - embedding) + 12 * layers * q * seq_len  # attention scores and values over the heads' width
    if cfg.tie_word_embeddings:
        flops += 6 * embedding  # the tied matrix is still used as the output matmul
    return ModelStats(num_params=n, num_embedding_params=embedding, flops_per_token=float(flops))
