"""Llama-, Qwen3- and Qwen3-MoE-family decoders (``model.family``): the builder (:mod:`raytrn.models.decoder`, plain
PyTorch) and the Hugging Face view of the same model (``LlamaConfig`` / ``Qwen3Config`` / ``Qwen3MoeConfig``,
export), used only where ``transformers`` is wanted.

Sizes come from the job spec (``model.preset`` fills them from :data:`raytrn.config.presets.PRESETS`).
:func:`model_stats` gives parameter counts and training FLOPs per token (6N + attention term) for MFU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrn.config.families import FAMILIES

if TYPE_CHECKING:
    import torch

    from raytrn.config import ModelConfig


#: ``model.family`` -> the Hugging Face architecture of its export.
ARCHITECTURES = {name: spec.architecture for name, spec in FAMILIES.items()}


def hf_config(cfg: ModelConfig):
    """The HF ``LlamaConfig``, ``Qwen3Config`` or ``Qwen3MoeConfig`` for a raytrn model config."""
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
    if cfg.is_moe:
        from transformers import Qwen3MoeConfig

        experts, top_k, width = cfg.expert_sizes
        return Qwen3MoeConfig(
            **sizes,  # type: ignore[arg-type]
            attention_bias=False,
            use_sliding_window=False,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=width,
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
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

    from raytrn.models.decoder import Decoder, LlamaForCausalLM, MoeOptions  # torch (~1.9 s): model_stats needs none

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
            qk_norm=cfg.qk_norm,
            moe=MoeOptions(*cfg.expert_sizes, cfg.norm_topk_prob, cfg.moe_capacity_factor) if cfg.is_moe else None,
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
    write). A tied output head is written once, as the embedding (HF re-ties it). A MoE model's stacked experts are
    written one expert at a time, as the published checkpoints have them (:func:`hub_tensors`).
    """
    if isinstance(tensors, Mapping):
        specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        tensors = tensors.items()
    assert specs is not None, "specs are needed for streamed tensors"
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    specs = {n: (dtype, tuple(t.shape)) for n, t, dtype in _hub_specs(specs) if n not in skip}
    written = write_safetensors(None if out_dir is None else os.path.join(out_dir, "model.safetensors"), specs,
                                ((n, t) for n, t in hub_tensors(tensors) if n not in skip))  # fmt: skip
    if out_dir is None or not written:
        return
    config = hf_config(cfg)
    dtypes = {dtype for dtype, _ in specs.values()}
    config.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    config.architectures = [ARCHITECTURES[cfg.family]]
    config.save_pretrained(out_dir)
    if cfg.is_moe:  # transformers 5 writes num_local_experts; the published configs (and transformers 4) num_experts
        import json

        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            written = json.load(f)
        written["num_experts"] = cfg.num_experts
        with open(path, "w") as f:
            json.dump(written, f, indent=2, sort_keys=True)
            f.write("\n")


#: A MoE layer's stacked experts (raytrn's and transformers 5's names).
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def hub_tensors(tensors: Iterable[tuple[str, Any]], *, first_expert: int = 0) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs with each stacked-experts tensor split into the published checkpoints' per-expert
    ones (what transformers 4 and 5, and serving engines, load): ``gate_up_proj`` [E, 2I, H] into
    ``experts.{e}.gate_proj.weight`` and ``up_proj.weight`` [I, H]; ``down_proj`` [E, H, I] into
    ``experts.{e}.down_proj.weight``. Other tensors pass as they are. ``first_expert``: the number of the
    tensors' first expert (a shard of the experts)."""
    for name, tensor in tensors:
        prefix, stacked = split_stacked(name)
        if stacked is None:
            yield name, tensor
        elif stacked == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{first_expert + e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}.{first_expert + e}.up_proj.weight", tensor[e, half:]
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{first_expert + e}.down_proj.weight", tensor[e]


def _hub_specs(specs: Mapping[str, tuple[Any, tuple[int, ...]]]) -> Iterator[tuple[str, Any, Any]]:
    """:func:`hub_tensors` on specs: ``(name, a meta tensor of the shape, dtype)``."""
    import torch

    meta = ((name, torch.empty(shape, dtype=dtype, device="meta")) for name, (dtype, shape) in specs.items())
    for name, tensor in hub_tensors(meta):
        yield name, tensor, tensor.dtype


def split_stacked(name: str) -> tuple[str, str | None]:
    """``("model.layers.3.mlp.experts", "gate_up_proj")`` for a stacked-experts tensor, ``(name, None)`` else."""
    for stacked in _STACKED:
        if name.endswith("." + stacked) or name == stacked:
            experts, _, kind = stacked.rpartition(".")
            return name[: len(name) - len(stacked)] + experts, kind
    return name, None


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
    #: Parameters a token is computed with: num_params less the experts it is not routed to (a MoE model's).
    num_active_params: int = 0

    def describe(self) -> str:
        active = (
            f", {self.num_active_params / 1e6:,.1f}M active a token"
            if self.num_active_params and self.num_active_params != self.num_params
            else ""
        )
        return (
            f"{self.num_params / 1e6:,.1f}M parameters "
            f"({self.num_embedding_params / 1e6:,.1f}M embedding{active}), "
            f"{self.flops_per_token / 1e9:,.2f} GFLOPs/token (train)"
        )


def model_stats(cfg: ModelConfig, seq_len: int) -> ModelStats:
    """Parameter count and training FLOPs/token, from the config alone (no weights allocated).

    FLOPs/token = 6 * (N - N_embedding) + 12 * layers * heads * head_dim * seq_len (hidden for Llama), the usual dense-transformer
    estimate (PaLM appendix B; torchtitan): 6N for the matmuls' forward+backward, and the attention
    score/value matmuls that N does not count. The input embedding is a lookup, so it is excluded; an
    untied output head is a matmul and stays in N.

    A MoE model counts every expert in the parameters, and in the FLOPs only the active ones: the router and the
    ``num_experts_per_tok`` experts a token goes to (``num_active_params``; MFU is taken on those).
    """
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    head_dim = cfg.head_size
    q, kv = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim  # (q == h unless head_dim is its own)
    attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections (no biases)
    if cfg.is_moe:
        experts, top_k, width = cfg.expert_sizes
        expert, router = 3 * h * width, experts * h
        mlp, active_mlp = router + experts * expert, router + top_k * expert
    else:
        mlp = active_mlp = 3 * h * f  # gate, up, down
    norms = 2 * h + (2 * head_dim if cfg.qk_norm else 0)  # + Qwen3's per-head query and key norms
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    n = layers * (attn + mlp + norms) + embedding + head + h  # + final norm
    active = n - layers * (mlp - active_mlp)
    flops = 6 * (active - embedding) + 12 * layers * q * seq_len  # attention scores and values over the heads' width
    if cfg.tie_word_embeddings:
        flops += 6 * embedding  # the tied matrix is still used as the output matmul
    return ModelStats(
        num_params=n, num_embedding_params=embedding, flops_per_token=float(flops), num_active_params=active
    )
