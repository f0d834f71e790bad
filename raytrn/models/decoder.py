"""A Llama, Qwen3 or Qwen3-MoE decoder in plain PyTorch, numerically the same as HF ``LlamaForCausalLM`` /
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` with SDPA attention. Llama and Qwen3 differ only in attention: Qwen3
RMS-normalises each head's query and key (``q_norm``, ``k_norm``, before RoPE) and its head width is a size of its
own (``head_dim``). Qwen3-MoE is Qwen3 with a sparse MLP of routed experts (:mod:`raytrn.models.moe`).

Why not the HF class itself: importing ``transformers``' Llama costs a training worker ~4.5 CPU-seconds at
start-up (it also pulls in ``torch.distributed.tensor``), and on a 2-core machine that is seconds before the
first step. This module needs only ``torch``. It keeps what training needs and nothing
else: no KV cache, no padding masks (raytrn's rows are packed, unpadded and causal), default RoPE.

Compatibility is by construction and tested (``tests/unit/test_model.py``):

- parameter names are HF's (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``...), so
  checkpoints, ``adamw_param_groups`` and the Hugging Face export (:func:`raytrn.models.export.save_hf`) see
  the same state dict;
- the same seed gives the same weights as HF's (same module creation order, then HF's ``_init_weights``
  pass: normal(0, 0.02) for linear and embedding weights, children before parents), so golden losses hold;
- the forward is HF's op for op: RMSNorm in float32, RoPE cos/sin in float32 cast to the activations'
  dtype, ``scaled_dot_product_attention(is_causal=True, enable_gqa=...)``, SiLU MLP. Bit-identical logits
  and gradients (float32 and bfloat16) are tested.

Context parallelism: given an :class:`AttentionContext` (a rank's share of a sequence split over ranks:
:class:`raytrn.models.context_parallel.RingContext`), the forward takes RoPE at the context's positions and every
attention from the context (a ring over its ranks) instead of SDPA; everything else is the same code.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from raytrn.models.moe import Experts, RouterStats, SparseMoeBlock, TopKRouter, load_balancing_loss

#: HF ``LlamaConfig.initializer_range``'s default, the std of every linear and embedding weight at init.
INIT_STD = 0.02


class CausalLMOutput(NamedTuple):
    """What the forward returns (a tuple, so DDP, ``torch.compile`` and pytrees handle it): ``.logits``
    [batch, seq, vocab], as HF's output object names them. A MoE model adds ``.aux_loss``, the load-balancing loss
    (HF's, not yet scaled by ``router_aux_loss_coef``), and ``.expert_load`` [moe layers, experts], the top-k
    assignments each expert got (no gradient), with ``.dropped``, the assignments over capacity."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    dropped: torch.Tensor | None = None


class AttentionContext(Protocol):
    """How a rank attends when the model runs on its share of a sequence (context parallelism): its tokens'
    ``positions`` in their documents (RoPE), and ``attention`` of its queries ``[batch, heads, tokens, head_dim]``
    over the whole sequence's keys and values (causal, within each document), as one process's SDPA would give it."""

    @property
    def positions(self) -> torch.Tensor: ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...


class MoeOptions(NamedTuple):
    """A Qwen3-MoE decoder's sparse MLP (every layer's: Qwen3-MoE's ``decoder_sparse_step`` 1, no
    ``mlp_only_layers``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    capacity_factor: float | None = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of RoPE at each token's position (``0..seq-1``, or per-token ``positions``: they restart at every
    document of a packed row), computed in float32 and cast to the activations' dtype. The frequencies are not a
    buffer, so they stay float32 in a bfloat16 model (as in a HF model loaded with ``from_pretrained``;
    ``.to(bfloat16)`` on a HF model rounds them). ``scaling``: Llama 3.x's ``llama3`` frequency scaling, as
    transformers' ``_compute_llama3_parameters``."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        dim = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        if not self.scaling:
            return inv_freq
        factor, low, high = self.scaling["factor"], self.scaling["low_freq_factor"], self.scaling["high_freq_factor"]
        old_context = self.scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by ``factor``; short ones kept; in between, interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        freqs = positions[..., None].float() * self.inv_freq(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1 or batch, 1, seq, head_dim]: broadcast over heads
    return (x * cos) + (_rotate_half(x) * sin)


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows: ``[batch, 1, seq, seq]``, True where query ``i`` may attend to key ``j``:
    ``j <= i`` in the same document (``segments``: a document number per token). A token never sees another
    document; padding (segment 0) sees only itself (its loss is masked; no row is empty, so no NaN)."""
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    alone = torch.eye(seq, dtype=torch.bool, device=segments.device)
    pad = (segments == 0)[:, :, None]
    return ((same & causal & ~pad) | (alone & pad)).unsqueeze(1)


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (``0, 1, ...`` restarting where the segment changes)."""
    seq = segments.shape[1]
    index = torch.arange(seq, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first


class Attention(nn.Module):
    """Llama's attention; with ``qk_norm_eps`` Qwen3's (``q_norm``/``k_norm``: RMSNorm over each head's query and
    key, before RoPE; created after the projections, HF's order)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm_eps: float | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.num_kv_groups = num_heads // num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        batch, seq = x.shape[:2]
        shape = (batch, seq, -1, self.head_dim)
        q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [batch, heads, seq, head_dim]
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        gqa = self.num_kv_groups > 1
        if context is not None:  # this rank's queries over the whole sequence (context parallelism: a ring)
            out = context.attention(q, k, v, self.scaling)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, is_causal=seq > 1, enable_gqa=gqa)
        else:  # packed documents: causal within each, never across (document_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).contiguous().reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        head_dim: int,
        qk_norm: bool = False,
        moe: MoeOptions | None = None,
    ):
        super().__init__()
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, eps if qk_norm else None)
        self.mlp: nn.Module = (
            MLP(hidden_size, intermediate_size)
            if moe is None
            else SparseMoeBlock(
                hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.capacity_factor
            )
        )
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """The layer's output; a MoE layer's with its routing's sums."""
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, context)
        out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm: HF's ``LlamaModel`` / ``Qwen3Model`` (the ``model.`` prefix of the
    names). ``head_dim``: default ``hidden_size / num_heads``; ``qk_norm``: Qwen3's per-head query and key norms."""

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        rope_theta: float,
        eps: float,
        rope_scaling: dict[str, float] | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        moe: MoeOptions | None = None,
    ) -> None:
        super().__init__()
        head_dim = head_dim or hidden_size // num_heads
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden_size, intermediate_size, num_heads, num_kv_heads, eps, head_dim, qk_norm, moe)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, eps)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_theta, rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        segments: torch.Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        """The final hidden states, and each MoE layer's routing sums (none for a dense model). ``segments``: a
        document number per token of packed rows (0: padding): attention stays inside each document and positions
        restart at each (:func:`document_mask`); None: plain causal attention. ``context``: ``input_ids`` are this
        rank's share of the sequence (context parallelism): positions and attention are the context's (its
        documents; ``segments`` unused)."""
        x = self.embed_tokens(input_ids)
        if context is not None:
            rope, mask = self.rotary_emb(x, context.positions), None
        elif segments is None:
            rope, mask = self.rotary_emb(x), None
        else:
            rope, mask = self.rotary_emb(x, document_positions(segments)), document_mask(segments)
        routing: list[RouterStats] = []
        for layer in self.layers:
            out = layer(x, rope, mask, context)  # positional: activation checkpointing's wrapper passes them on
            if isinstance(out, tuple):
                x, stats = out
                routing.append(stats)
            else:
                x = out
        return self.norm(x), routing


@torch.no_grad()
def _init_weights(module: nn.Module) -> None:
    """HF's ``_init_weights`` pass: children before parents, normal(0, INIT_STD) for every linear and embedding
    weight in that order (norm weights start at one already). The same order draws the same random numbers."""
    for child in module.children():
        _init_weights(child)
    if isinstance(module, (nn.Linear, nn.Embedding, TopKRouter)):
        module.weight.normal_(mean=0.0, std=INIT_STD)
    elif isinstance(module, Experts):
        module.gate_up_proj.normal_(mean=0.0, std=INIT_STD)
        module.down_proj.normal_(mean=0.0, std=INIT_STD)


class LlamaForCausalLM(nn.Module):
    """``decoder`` plus output head; ``tie_word_embeddings`` shares the embedding matrix with the head.

    Takes the decoder freshly built (torch's default inits) and initialises it here, then builds and
    initialises the head: HF's order, so that the same seed gives HF's weights.
    """

    def __init__(self, decoder: Decoder, *, tie_word_embeddings: bool) -> None:
        super().__init__()
        self.model = decoder
        _init_weights(self.model)
        embed = decoder.embed_tokens
        self.lm_head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
        _init_weights(self.lm_head)
        if tie_word_embeddings:
            self.lm_head.weight = embed.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, segments: torch.Tensor | None = None, context: AttentionContext | None = None
    ) -> CausalLMOutput:
        hidden, routing = self.model(input_ids, segments, context)
        logits = self.lm_head(hidden)
        if not routing:
            return CausalLMOutput(logits=logits)
        experts = routing[0].counts.shape[0]
        return CausalLMOutput(
            logits=logits,
            aux_loss=load_balancing_loss(routing, experts),
            expert_load=torch.stack([s.counts for s in routing]),
            dropped=sum((s.dropped for s in routing), torch.zeros((), device=logits.device)),
        )
