"""One optimizer step, shared by the Ray Train loop and ``raytrn precheck`` (so precheck checks the real step).

The step reads top to bottom: micro-batches forward/backward (accumulating gradients), all-reduce
(XLA), clip, optimizer step, schedule, then ``backend.sync()`` — the end of the step's lazy graph on
XLA. Nothing here reads a value back to the host: metrics stay lazy until the loop logs them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raytrn.backends.base import Backend
from raytrn.config import JobSpec
from raytrn.models import build_model
from raytrn.train.optim import build_adamw, lr_scheduler
from raytrn.train.schedule import Schedule
from raytrn.train.sizes import data_parallel_size

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Training:
    """What a worker trains with: model (wrapped for data parallelism), optimizer, schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_accum: int
    grad_clip_norm: float | None
    #: (logits, targets) -> mean loss; vocab-parallel cross entropy under tensor parallelism.
    loss_fn: Any = None
    #: The optimizer's step() all-reduces and clips itself (NxDOptimizer) and exposes ``grad_norm``.
    fused_optimizer: bool = False
    #: Every rank holds a shard of the state: checkpoints are saved by all ranks (NxD), not rank 0.
    sharded: bool = False
    #: Forward/backward under torch.autocast in this dtype (float32 master weights); None: no autocast.
    autocast_dtype: torch.dtype | None = None


@dataclass(kw_only=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches (lazy on XLA)
    grad_norm: torch.Tensor  # before clipping (lazy on XLA)
    data_wait_s: float  # time spent waiting for batches


def build_training(job: JobSpec, backend: Backend, *, world_size: int, schedule: Schedule | None = None) -> Training:
    """Seeded model, AdamW and learning-rate ``schedule`` (default: the job's) for ``job`` at this world size.

    The backend may build a model-parallel one instead (neuronx-distributed on Neuron).
    """
    backend.seed(job.run.seed)
    for warning in backend.ignored_settings(job):
        log.warning(warning)
    cuda = backend.cuda_speedups  # model.autocast, optim.fused, run.compile apply
    parts = backend.build_parallel_parts(job)
    if parts is None:
        model = build_model(job.model, seed=job.run.seed)
        if cuda and job.run.compile:
            model.compile()  # in place, before DDP: state_dict keys stay those of the plain model
        model = backend.prepare_model(model)
        parts = {"model": model, "optimizer": build_adamw(model, job, fused=cuda and job.optim.fused)}
        if cuda and job.run.compile:
            parts["loss_fn"] = torch.compile(cross_entropy)  # fuses the fp32 upcast into the loss
    return Training(
        **parts,
        autocast_dtype=torch.bfloat16 if cuda and job.model.autocast == "bfloat16" else None,
        scheduler=lr_scheduler(parts["optimizer"], schedule or Schedule.from_job(job)),
        grad_accum=job.data.grad_accum_for(data_parallel_size(job, world_size)),
        grad_clip_norm=job.optim.grad_clip_norm,
    )


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 logits)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def train_step(t: Training, batches: Iterator[torch.Tensor], backend: Backend) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches of shape [micro_batch, seq_len + 1]."""
    model = t.model
    model.train()
    loss_sum = torch.zeros((), device=backend.device())
    data_wait = 0.0
    for micro in range(t.grad_accum):
        t0 = time.perf_counter()
        batch = next(batches)  # already on the device (backend.wrap_batches)
        data_wait += time.perf_counter() - t0
        inputs, targets = batch[:, :-1], batch[:, 1:]
        # DDP all-reduces gradients on the last micro-batch only.
        last = micro == t.grad_accum - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():  # type: ignore[operator]
            # Mixed precision: forward in bf16, weights fp32; backward outside autocast (it follows the forward).
            with torch.autocast(inputs.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
                logits = model(input_ids=inputs).logits
                loss = (t.loss_fn or cross_entropy)(logits, targets)
            (loss / t.grad_accum).backward()
        loss_sum = loss_sum + loss.detach()
    loss_mean = loss_sum / t.grad_accum  # before the sync: part of the step's graph, read later for free
    if t.fused_optimizer:  # NxD: all-reduce over DP, clip and step in one call
        backend.optimizer_step(t.optimizer)
        grad_norm = t.optimizer.grad_norm  # type: ignore[attr-defined]
    else:
        backend.reduce_gradients(t.optimizer)  # XLA: all-reduce before clipping; DDP did it in backward
        grad_norm = _clip(model, t.grad_clip_norm)
        backend.optimizer_step(t.optimizer)
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    backend.sync()  # XLA: the step's graph ends here (compiled once, then cached)
    return StepResult(loss=loss_mean, grad_norm=grad_norm, data_wait_s=data_wait)


def read_metrics(result: StepResult, world_size: int) -> dict[str, float]:
    """Loss (mean over workers) and grad norm as Python floats: a host-device sync, so only on log steps."""
    loss = result.loss
    if world_size > 1 and torch.distributed.is_initialized():
        loss = loss.clone()
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM)
        loss = loss / world_size
    return {"loss": loss.item(), "grad_norm": float(result.grad_norm)}


def _clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
