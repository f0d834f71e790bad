"""Qwen3-MoE's sparse MLP in plain PyTorch: a top-k router and stacked experts, numerically HF
``Qwen3MoeSparseMoeBlock``'s (transformers 5: ``mlp.gate.weight`` [experts, hidden], ``mlp.experts.gate_up_proj``
[experts, 2 * moe_intermediate, hidden] and ``mlp.experts.down_proj`` [experts, hidden, moe_intermediate]).

Two dispatches of the same routing:

- **dropless** (``capacity_factor`` None; cpu and cuda): every token reaches its ``top_k`` experts; each expert
  computes on the tokens routed to it, HF's loop op for op (so logits and gradients equal HF's). The shapes
  depend on the routing, which is fine for eager PyTorch and would be a new graph per step on Neuron.
- **capacity** (``capacity_factor`` c): every expert has ``ceil(c * tokens * top_k / experts)`` slots; the
  assignments fill them in order of choice (every token's first choice before any second) then of token, and an
  assignment past its expert's slots is dropped (that expert adds nothing to the token; the residual carries it).
  Every tensor's shape depends only on the micro-batch's, so a Neuron graph compiles once. With slots for every
  assignment nothing is dropped and the result is the dropless one.

**Expert parallelism** (``parallel.expert_parallel_size``): the layer's experts are spread over a group of ranks,
each holding a block of them; :mod:`raytrn.models.expert_parallel` sets :attr:`Experts.exchange`, and both dispatches
send each assignment's row to the rank of its expert and its result back (an all-to-all each way). The model
code only calls :class:`Exchange`; the collectives live there.

Each block also returns what the load-balancing loss and the expert-load metrics need (:class:`RouterStats`):
the loss is HF's ``load_balancing_loss_func`` (Switch Transformer's, over every MoE layer's tokens), computed
from per-layer sums so that no router logits are kept for it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class RouterStats(NamedTuple):
    """One MoE layer's routing, summed over its tokens: ``probs`` [experts] the softmax of the router's logits
    (in their dtype, then float32: HF's aux loss; differentiable), ``counts`` [experts] the top-k assignments per
    expert (float32, no gradient), ``dropped`` assignments dropped for capacity (a float32 scalar), ``tokens``."""

    probs: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor
    tokens: int


class Exchange(Protocol):
    """Moves rows between the ``size`` ranks an expert-parallel group spreads a layer's experts over (rank ``r``
    holds experts ``r * E / size`` to ``(r + 1) * E / size - 1``): :class:`raytrn.models.expert_parallel.AllToAll`."""

    size: int

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` [experts]: the rows this rank sends each expert; returns [size, experts / size], the rows every
        rank sends this rank's experts (no gradient)."""
        ...

    def rows(self, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """``send[r]`` rows to rank ``r`` (in rank order), ``receive[r]`` from it; differentiable (the gradient
        goes back the same way)."""
        ...


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: itself, or its shard of a DTensor (tensor or expert parallelism lay the MoE
    parameters out as DTensors; the computation here is on the rows and experts this rank holds)."""
    to_local: Any = getattr(param, "to_local", None)
    return param if to_local is None else to_local()


class TopKRouter(nn.Module):
    """HF ``Qwen3MoeTopKRouter``: softmax in float32 over ``num_experts`` logits, the ``top_k`` largest, and with
    ``norm_topk_prob`` those renormalised to sum to one; the weights in the logits' dtype."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob = top_k, num_experts, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, local(self.weight))  # [tokens, experts]
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), indices


class Experts(nn.Module):
    """``num_experts`` SiLU MLPs stacked in two 3-D parameters (HF ``Qwen3MoeExperts``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        #: Expert parallelism: how rows reach the ranks holding their experts; None: this rank holds them all.
        self.exchange: Exchange | None = None

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' output for ``x``'s routing and the assignments dropped: dropless, or with ``capacity`` slots an
        expert. (A module call, not a method: FSDP gathers the experts in its forward hooks, which ``torch.compile``
        traces through as for every other FSDP module.)"""
        if capacity is None:
            return self.dropless(x, indices, weights), x.new_zeros((), dtype=torch.float32)
        return self.with_capacity(x, indices, weights, capacity)

    def dropless(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every assignment computed, expert by expert in ascending order (HF's loop: a token's outputs are added
        in its experts' order)."""
        if self.exchange is not None:
            return self._dropless_spread(x, indices, weights, self.exchange)
        gate_up_proj, down_proj = local(self.gate_up_proj), local(self.down_proj)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(indices, num_classes=self.num_experts).permute(2, 1, 0)  # [experts, top_k, tokens]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for (expert,) in hit.tolist():
            choice, token = torch.where(mask[expert])
            gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down_proj[expert]) * weights[token, choice, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _dropless_spread(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, exchange: Exchange
    ) -> torch.Tensor:
        """The dropless dispatch over an expert-parallel group: the assignments sorted by expert, each rank's share
        sent to it, computed there expert by expert (every sender's rows of an expert together), sent back and
        added to their tokens with the router's weights."""
        experts, top_k = self.num_experts, indices.shape[1]
        held = experts // exchange.size
        expert = indices.reshape(-1)  # token-major: token t's choices at t * top_k ...
        order = torch.argsort(expert, stable=True)
        token = torch.div(order, top_k, rounding_mode="floor")
        with torch.no_grad():
            counts = torch.bincount(expert, minlength=experts)
            arriving = exchange.counts(counts)  # [ranks, held]: what each rank sends this rank's experts
        send = counts.view(exchange.size, held).sum(1).tolist()
        receive = arriving.sum(1).tolist()
        rows = exchange.rows(x[token], send, receive)  # grouped by sender, then by expert
        # By expert, then by sender: each expert's rows in one piece.
        segments = arriving.reshape(-1).tolist()
        starts = [0]
        for n in segments[:-1]:
            starts.append(starts[-1] + n)
        by_expert = [
            torch.arange(starts[r * held + e], starts[r * held + e] + segments[r * held + e], device=x.device)
            for e in range(held)
            for r in range(exchange.size)
        ]
        perm = torch.cat(by_expert) if by_expert else torch.zeros(0, dtype=torch.long, device=x.device)
        gate_up_proj, down_proj = local(self.gate_up_proj), local(self.down_proj)
        outputs = []
        for e, part in enumerate(rows[perm].split(arriving.sum(0).tolist())):
            gate, up = F.linear(part, gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down_proj[e]))
        y = torch.cat(outputs)[torch.argsort(perm)]  # back to the order the rows arrived in
        y = exchange.rows(y, receive, send)  # back to their tokens' ranks, in the order sent
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))

    def with_capacity(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed shapes: ``capacity`` slots per expert, filled by choice then token; the rest dropped. Returns the
        output and the number of assignments dropped."""
        tokens, top_k = indices.shape
        experts, hidden = self.num_experts, x.shape[-1]
        expert = indices.t().reshape(-1)  # [top_k * tokens]: every token's first choice, then every second...
        token = torch.arange(tokens, device=x.device).repeat(top_k)
        with torch.no_grad():
            onehot = F.one_hot(expert, num_classes=experts)
            position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # the assignment's place in its expert's queue
            keep = position < capacity
            slot = torch.where(keep, expert * capacity + position, experts * capacity)  # dropped: a spare row
        buffer = x.new_zeros(experts * capacity + 1, hidden).index_copy(0, slot, x[token])
        h = buffer[:-1].view(experts, capacity, hidden)
        y = self._slots(h).reshape(experts * capacity, hidden)
        y = torch.cat([y, y.new_zeros(1, hidden)])[slot]  # back to the assignments (dropped: zeros)
        y = y * (weights.t().reshape(-1) * keep.to(weights.dtype))[:, None]
        return y.view(top_k, tokens, hidden).sum(0).to(x.dtype), (~keep).sum().float()

    def _slots(self, h: torch.Tensor) -> torch.Tensor:
        """Every expert on its ``capacity`` slots, [experts, capacity, hidden]; under expert parallelism each rank
        receives every rank's slots of its experts (equal sizes: fixed shapes still) and sends the results back."""
        gate_up_proj, down_proj = local(self.gate_up_proj), local(self.down_proj)
        exchange = self.exchange
        experts, slots, hidden = h.shape
        if exchange is not None:
            ranks, held = exchange.size, experts // exchange.size
            even = [held * slots] * ranks
            h = exchange.rows(h.reshape(experts * slots, hidden), even, even)  # [ranks, held, slots] rows
            h = h.view(ranks, held, slots, hidden).transpose(0, 1).reshape(held, ranks * slots, hidden)
        gate, up = torch.bmm(h, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, down_proj.transpose(1, 2))
        if exchange is not None:
            y = y.view(held, ranks, slots, hidden).transpose(0, 1).reshape(experts * slots, hidden)
            y = exchange.rows(y, even, even).view(experts, slots, hidden)
        return y


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert: ``ceil(factor * tokens * top_k / num_experts)`` (at least one)."""
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


class SparseMoeBlock(nn.Module):
    """HF ``Qwen3MoeSparseMoeBlock`` (``experts`` then ``gate``, HF's creation order): the router picks each token's
    experts, the experts' outputs are summed with the router's weights. ``capacity_factor``: see the module."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, weights, indices = self.gate(flat)
        slots = None
        if self.capacity_factor is not None:
            slots = capacity(flat.shape[0], self.gate.top_k, self.gate.num_experts, self.capacity_factor)
        out, dropped = self.experts(flat, indices, weights, slots)
        # The load-balancing loss's sums, as HF's load_balancing_loss_func takes them from the logits: a softmax
        # in their dtype and its own top-k (with bfloat16 logits, not always the router's float32 one).
        probs = F.softmax(logits, dim=-1)
        with torch.no_grad():
            chosen = torch.topk(probs, self.gate.top_k, dim=-1).indices.reshape(-1)
            counts = torch.zeros(self.gate.num_experts, dtype=torch.float32, device=x.device)
            counts.index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        stats = RouterStats(probs.float().sum(dim=0), counts, dropped, flat.shape[0])
        return out.reshape(shape), stats


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` over every MoE layer (no padding mask: packed rows have none):
    ``num_experts * sum_e f_e * P_e``, with ``f_e`` the fraction of the top-k assignments that went to expert e and
    ``P_e`` its mean router probability, both over all layers' tokens."""
    rows = sum(s.tokens for s in stats)
    zero = stats[0].counts.new_zeros(num_experts)
    counts = sum((s.counts for s in stats), zero) / rows  # layer by layer, HF's order
    probs = sum((s.probs for s in stats), zero) / rows
    return (counts * probs).sum() * num_experts
