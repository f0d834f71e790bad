"""One optimizer step, shared by the Ray Train loop and ``raytrn precheck`` (so precheck checks the real step).

The step reads top to bottom: micro-batches forward/backward (accumulating gradients, reduced on the
last), clip and optimizer step (as the backend built them), schedule, then ``backend.sync()`` — the end of
the step's lazy graph on XLA. Nothing here reads a value back to the host: metrics stay lazy until the loop logs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from raytrn.backends.base import Backend
    from raytrn.config import JobSpec
    from raytrn.train.checkpointing import Checkpoints
    from raytrn.train.schedule import Schedule


@dataclass(kw_only=True)
class Training:
    """What a worker trains with, as its backend built it (:meth:`raytrn.backends.Backend.build_training`)."""

    model: torch.nn.Module  # laid out for the job (DDP, FSDP, tensor parallel; NxD on the XLA path)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_accum: int
    #: All-reduce where the backend needs it, clip, optimizer step; returns the grad norm before clipping.
    clip_and_step: Callable[[], torch.Tensor]
    #: Writes and reads the training state (:mod:`raytrn.train.checkpointing`).
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


@dataclass(kw_only=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches (lazy on XLA)
    grad_norm: torch.Tensor  # before clipping (lazy on XLA)
    data_wait_s: float  # time spent waiting for batches


def build_training(
    job: JobSpec, backend: Backend, *, world_size: int, schedule: Schedule | None = None, rank: int = 0
) -> Training:
    """``backend``'s :class:`Training` for ``job`` at this world size (see ``Backend.build_training``)."""
    return backend.build_training(job, world_size=world_size, schedule=schedule, rank=rank)


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
        # DDP/FSDP reduce gradients on the last micro-batch only.
        last = micro == t.grad_accum - 1
        with nullcontext() if last else t.no_sync():
            # Mixed precision: forward in bf16, weights fp32; backward outside autocast (it follows the forward).
            with torch.autocast(inputs.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
                logits = model(input_ids=inputs).logits
                loss = t.loss_fn(logits, targets)
            (loss / t.grad_accum).backward()
        loss_sum = loss_sum + loss.detach()
    loss_mean = loss_sum / t.grad_accum  # before the sync: part of the step's graph, read later for free
    grad_norm = t.clip_and_step()
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
