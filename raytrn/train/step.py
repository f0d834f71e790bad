"""One optimizer step, shared by the Ray Train loop and ``raytrn precheck`` (so precheck checks the real step).

The step reads top to bottom: micro-batches forward/backward (accumulating gradients, reduced on the
last), clip and optimizer step (as the backend built them), schedule, then ``backend.sync()`` — the end of
the step's lazy graph on XLA. Nothing here reads a value back to the host: metrics stay lazy until the loop logs them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from raytrn.data.batch import TokenBatch
from raytrn.models.context_parallel import ContextParallel
from raytrn.train.loss import cross_entropy, masked_loss_sum

if TYPE_CHECKING:
    from raytrn.backends.base import Backend
    from raytrn.checkpoint.store import Checkpoints


@dataclass(kw_only=True)
class Training:
    """What a worker trains with, as :func:`raytrn.train.build.build_training` built it for the job's backend."""

    model: torch.nn.Module  # laid out for the job (DDP, FSDP, tensor parallel; NxD on the XLA path)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_accum: int
    #: All-reduce where the backend needs it, clip, optimizer step; returns the grad norm before clipping.
    clip_and_step: Callable[[], torch.Tensor]
    #: Writes and reads the training state (:mod:`raytrn.checkpoint.store`).
    checkpoints: Checkpoints
    #: (logits, targets) -> mean loss; vocab-parallel cross entropy under NxD tensor parallelism.
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default_factory=lambda: cross_entropy)
    #: Forward under torch.autocast in this dtype (float32 master weights); None: no autocast.
    autocast_dtype: torch.dtype | None = None
    #: Around every micro-batch but a step's last: gradients accumulate without a collective.
    no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext
    #: The full model state, one (name, CPU tensor) at a time, for the Hugging Face export; every rank iterates
    #: (sharded tensors are gathered). None: the layout cannot export (NxD).
    export: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
    #: Workers, and model replicas among them (tensor- and context-parallel groups share one): the loss of masked
    #: data is normalised over the global batch.
    world_size: int = 1
    data_parallel_size: int = 1
    #: A MoE model's ``router_aux_loss_coef``: the load-balancing loss it returns is added, so weighted, to the loss
    #: the gradients are taken of (the loss logged stays the language-modelling loss).
    aux_loss_coef: float = 0.0
    #: This rank's part of a pipeline (:class:`raytrn.train.pipelined.Pipeline`): the step runs its schedule.
    pipeline: Any = None
    #: This rank's context-parallel group: each micro-batch's rows are split over it (:func:`forward`).
    context_parallel: ContextParallel | None = None

    @property
    def gradient_ranks(self) -> int:
        """The ranks DDP/FSDP average gradients over: the data-parallel ones, times the context-parallel ones (each
        of which holds a share of the same rows)."""
        cp = self.context_parallel.size if self.context_parallel is not None else 1
        return self.data_parallel_size * cp


@dataclass(kw_only=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches (lazy on XLA)
    grad_norm: torch.Tensor  # before clipping (lazy on XLA)
    data_wait_s: float  # time spent waiting for batches
    #: Time in the forward passes (and loss): this rank's own work, no collective under DDP (raytrn.train.stragglers).
    forward_s: float = 0.0
    #: Tokens the loss was taken on over the whole global batch (masked data); None: every token (text).
    trained_tokens: int | None = None
    #: A MoE model's routing over the step (:class:`Routing`); None for a dense one.
    routing: Routing | None = None


@dataclass
class Routing:
    """A MoE model's routing summed over a step's micro-batches (on the device, read on log steps only)."""

    aux_loss: torch.Tensor  # the load-balancing loss, summed over the micro-batches (unweighted)
    expert_load: torch.Tensor  # [moe layers, experts]: top-k assignments each expert got
    dropped: torch.Tensor  # assignments dropped for capacity
    micro_batches: int = 0

    def add(self, out: Any) -> None:
        self.aux_loss = self.aux_loss + out.aux_loss.detach()
        self.expert_load = self.expert_load + out.expert_load
        self.dropped = self.dropped + out.dropped
        self.micro_batches += 1

    @classmethod
    def of(cls, out: Any) -> Routing | None:
        """Sums for ``out``'s routing; None for a dense model (or the XLA path's HF output, which has none)."""
        if getattr(out, "aux_loss", None) is None:
            return None
        return cls(torch.zeros_like(out.aux_loss), torch.zeros_like(out.expert_load), torch.zeros_like(out.dropped))


def with_aux_loss(t: Training, loss: torch.Tensor, out: Any, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The loss to take gradients of: ``loss`` plus a MoE model's load-balancing loss weighted by
    ``router_aux_loss_coef`` (and ``scale``, the micro-batch's share of the step)."""
    if not t.aux_loss_coef or getattr(out, "aux_loss", None) is None:
        return loss
    return loss + (t.aux_loss_coef * scale) * out.aux_loss


def forward(
    t: Training, batch: torch.Tensor | TokenBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
    """Logits of a micro-batch's inputs, its targets, the targets' mask (None: all count), and the model's whole
    output (a MoE model's routing: :class:`raytrn.models.decoder.CausalLMOutput`).

    Context parallelism: this rank's zigzag share of the rows' tokens (every rank of its group calls this together:
    attention is a ring over them), and a mask always, the padding added for the chunks out of it: sums over the
    group's shares are the micro-batch's (validation's loss too, :mod:`raytrn.train.evaluate`)."""
    if isinstance(batch, TokenBatch):
        tokens, mask, segments = batch.tokens, batch.loss_mask, batch.segments
    else:
        tokens, mask, segments = batch, None, None
    kwargs: dict[str, Any]
    if t.context_parallel is not None:
        part, context = t.context_parallel.shard(tokens, loss_mask=mask, segments=segments)
        inputs, targets, mask, kwargs = part.input_ids, part.targets, part.loss_mask, {"context": context}
    else:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mask = None if mask is None else mask[:, 1:]
        kwargs = {"segments": segments[:, :-1]} if segments is not None else {}
    with torch.autocast(inputs.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
        out = t.model(input_ids=inputs, **kwargs)
    return out.logits, targets, mask, out


def global_count(local: torch.Tensor, t: Training) -> torch.Tensor:
    """Targets of the whole global batch (every data-parallel rank's; tensor- and context-parallel ranks hold the
    same rows)."""
    total = local.clone()
    if torch.distributed.is_available() and torch.distributed.is_initialized() and t.world_size > 1:
        torch.distributed.all_reduce(total)  # a collective: every rank, every masked step
        total = total / (t.world_size // t.data_parallel_size)
    return total.clamp(min=1)


def train_step(t: Training, batches: Iterator[torch.Tensor | TokenBatch], backend: Backend) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches of shape [micro_batch, seq_len + 1].

    Masked data (instruction rows): the loss is the mean over the trained tokens of the whole global batch, not a
    mean of per-row or per-micro-batch means: the step's micro-batches are drawn first, their targets counted and
    summed over the data-parallel ranks, and each micro-batch's loss sum is scaled so that the gradient averaging of
    DDP/FSDP yields exactly that mean. Context parallelism takes every step that way (each rank's loss the sum over
    its share of the targets; for text rows the same as the mean of the micro-batches' means)."""
    if t.pipeline is not None:  # raytrn.train.pipelined: the schedule runs the micro-batches
        result: StepResult = t.pipeline.train_step(t, batches, backend)
        return result
    model = t.model
    model.train()
    t0 = time.perf_counter()
    first = next(batches)
    if (isinstance(first, TokenBatch) and first.loss_mask is not None) or t.context_parallel is not None:
        step_batches: list[Any] = [first, *(next(batches) for _ in range(t.grad_accum - 1))]
        return _masked_step(t, step_batches, backend, data_wait=time.perf_counter() - t0)
    pending: list[Any] = [first]
    loss_sum = torch.zeros((), device=backend.device())
    data_wait = time.perf_counter() - t0
    forward_s = 0.0
    routing: Routing | None = None
    for micro in range(t.grad_accum):
        t0 = time.perf_counter()
        batch = pending.pop() if pending else next(batches)  # already on the device (backend.wrap_batches)
        data_wait += time.perf_counter() - t0
        # DDP/FSDP reduce gradients on the last micro-batch only.
        last = micro == t.grad_accum - 1
        with nullcontext() if last else t.no_sync():
            # Mixed precision: forward in bf16, weights fp32; backward outside autocast (it follows the forward).
            t0 = time.perf_counter()
            logits, targets, _, out = forward(t, batch)
            with torch.autocast(logits.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
                loss = t.loss_fn(logits, targets)
            forward_s += time.perf_counter() - t0
            (with_aux_loss(t, loss, out) / t.grad_accum).backward()
        loss_sum = loss_sum + loss.detach()
        routing = routing or Routing.of(out)
        if routing is not None:
            routing.add(out)
    loss_mean = loss_sum / t.grad_accum  # before the sync: part of the step's graph, read later for free
    grad_norm = t.clip_and_step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    backend.sync()  # XLA: the step's graph ends here (compiled once, then cached)
    return StepResult(loss=loss_mean, grad_norm=grad_norm, data_wait_s=data_wait, forward_s=forward_s, routing=routing)


def skip_step(t: Training, batches: Iterator[torch.Tensor | TokenBatch]) -> None:
    """A step that trains nothing: its ``grad_accum`` micro-batches are drawn (the data position moves on) and the
    learning-rate schedule steps, as after a step whose update was skipped (a non-finite rollback's,
    :mod:`raytrn.train.guard`)."""
    for _ in range(t.grad_accum):
        next(batches)
    with warnings.catch_warnings():  # no optimizer.step() yet in this process: intended, not torch's ordering slip
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        t.scheduler.step()


def _masked_step(t: Training, micro: list[Any], backend: Backend, *, data_wait: float) -> StepResult:
    """The loss as the sum over the step's targets divided by their count over the global batch: masked rows, and
    any rows under context parallelism (:func:`forward` gives each rank its share of the targets)."""
    masked = [isinstance(b, TokenBatch) and b.loss_mask is not None for b in micro]
    assert all(masked) or not any(masked), "a step mixes masked and unmasked micro-batches"
    device = backend.device()
    if masked[0]:
        local = torch.stack([b.loss_mask[:, 1:].sum() for b in micro]).sum().to(device=device, dtype=torch.float32)
        total = global_count(local, t)
    else:  # text rows: every target counts, as many on every data-parallel rank (no collective)
        targets = sum((b.tokens if isinstance(b, TokenBatch) else b)[:, 1:].numel() for b in micro)
        total = torch.tensor(float(targets * t.data_parallel_size), device=device)
    # DDP/FSDP average gradients over the DP (x CP) ranks: scale each rank's sum by their number / total to get
    # sum(all) / total.
    scale = t.gradient_ranks / total
    loss_sum = torch.zeros((), device=device)
    forward_s = 0.0
    routing: Routing | None = None
    for k, batch in enumerate(micro):
        last = k == len(micro) - 1
        with nullcontext() if last else t.no_sync():
            t0 = time.perf_counter()
            logits, targets, mask, out = forward(t, batch)
            assert mask is not None
            loss = masked_loss_sum(logits, targets, mask) * scale
            forward_s += time.perf_counter() - t0
            with_aux_loss(t, loss, out, 1.0 / len(micro)).backward()
        loss_sum = loss_sum + loss.detach()
        routing = routing or Routing.of(out)
        if routing is not None:
            routing.add(out)
    grad_norm = t.clip_and_step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    backend.sync()
    # Per rank: its sum x DP (x CP) / total; the loop's mean over the world (read_metrics: every tensor-parallel copy
    # counted alike) is then sum(all) / total.
    return StepResult(
        loss=loss_sum,
        grad_norm=grad_norm,
        data_wait_s=data_wait,
        forward_s=forward_s,
        trained_tokens=int(total.item()) if masked[0] else None,  # a host read: the step's count, all-reduced
        routing=routing,
    )


def read_metrics(result: StepResult, world_size: int) -> dict[str, float]:
    """Loss (mean over workers) and grad norm as Python floats: a host-device sync, so only on log steps."""
    loss = result.loss
    if world_size > 1 and torch.distributed.is_initialized():
        loss = loss.clone()
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM)
        loss = loss / world_size
    metrics = {"loss": loss.item(), "grad_norm": float(result.grad_norm)}
    if result.routing is not None:
        metrics.update(routing_metrics(result.routing, world_size))
    return metrics


def routing_metrics(routing: Routing, world_size: int) -> dict[str, float]:
    """A MoE step's routing over every worker (a collective on log steps): ``router_aux_loss`` (the mean
    load-balancing loss, unweighted), ``moe_dropped_fraction`` (assignments dropped for capacity) and per MoE layer
    ``expert_load/layer_NN``: the most tokens any expert got over the mean (1.0: balanced; num_experts: one expert
    took every token)."""
    packed = torch.cat([routing.aux_loss.reshape(1), routing.dropped.reshape(1), routing.expert_load.reshape(-1)])
    if world_size > 1 and torch.distributed.is_initialized():
        packed = packed.clone()
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM)
    values = packed.cpu()
    load = values[2:].view_as(routing.expert_load)
    metrics = {
        "router_aux_loss": float(values[0]) / (max(routing.micro_batches, 1) * world_size),
        "moe_dropped_fraction": float(values[1]) / max(float(load.sum()), 1.0),
    }
    for layer, counts in enumerate(load):
        metrics[f"expert_load/layer_{layer:02d}"] = float(counts.max() / counts.mean().clamp(min=1e-9))
    return metrics
