"""Building what a worker trains with: model, layout, optimizer, schedule, step and checkpoints -> :class:`Training`.

The model is built for one device (:mod:`raytrn.models`), LoRA adapters are added, then the layout is applied
(:mod:`raytrn.train.parallelize`: tensor parallel, activation checkpointing, compile, FSDP2 or DDP), the optimizer
built over what trains, and the checkpoint format chosen (sharded DCP, :mod:`raytrn.checkpoint`). The backend
answers only device questions (device, mixed precision, compile options, how gradients are reduced and stepped).
A backend that lays out or checkpoints its own way (the frozen XLA path) provides ``build_training`` and calls
:func:`build_native` with its own ``layout`` and ``checkpoints``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from raytrn.backends.base import Backend
from raytrn.checkpoint.sharded import DcpCheckpoints
from raytrn.checkpoint.store import Checkpoints
from raytrn.config import JobSpec
from raytrn.config.sizes import data_parallel_size, hsdp_shard_size
from raytrn.models import build_model
from raytrn.models.lora import apply_lora
from raytrn.train.loss import cross_entropy
from raytrn.train.optim import build_adamw, lr_scheduler
from raytrn.train.parallelize import Parallelized, grad_norm_and_clip, parallelize
from raytrn.train.pipelined import parallelize_pipeline
from raytrn.train.schedule import Schedule
from raytrn.train.step import Training

log = logging.getLogger(__name__)

#: (model, job, world_size, compile options) -> the laid-out model.
Layout = Callable[..., Parallelized]
#: (job, laid-out model, rank) -> how state is checkpointed.
CheckpointFormat = Callable[..., Checkpoints]


def build_training(
    job: JobSpec, backend: Backend, *, world_size: int, schedule: Schedule | None = None, rank: int = 0
) -> Training:
    """``backend``'s :class:`Training` for ``job`` at this world size (default schedule: the job's)."""
    own = getattr(backend, "build_training", None)
    if own is not None:  # the frozen XLA path builds its own (its layouts and state.pt / NxD checkpoints)
        training: Training = own(job, world_size=world_size, schedule=schedule, rank=rank)
        return training
    return build_native(job, backend, world_size=world_size, schedule=schedule, rank=rank)


def build_native(
    job: JobSpec,
    backend: Backend,
    *,
    world_size: int,
    schedule: Schedule | None = None,
    rank: int = 0,
    layout: Layout | None = None,
    checkpoints: CheckpointFormat | None = None,
) -> Training:
    """Seeded model laid out over ``world_size`` workers, AdamW, the learning-rate ``schedule``, the step's clip and
    optimizer step, and the checkpoint format (``layout``/``checkpoints``: the native ones unless given)."""
    backend.seed(job.run.seed)
    for warning in backend.ignored_settings(job):
        log.warning(warning)
    compile_ = backend.compile_options if job.run.compile else None
    model = build_model(job.model, seed=job.run.seed).to(backend.device())
    if job.model.lora is not None:  # adapters before the layout (the model code is single-device)
        apply_lora(model, job.model.lora, seed=job.run.seed)
    par = (layout or native_layout(backend))(model, job, world_size=world_size, compile=compile_)
    optimizer = build_adamw(par.model, job, fused=backend.fused_optim and job.optim.fused)
    params = [p for p in par.model.parameters() if p.requires_grad]
    return Training(
        model=par.model,
        optimizer=optimizer,
        scheduler=lr_scheduler(optimizer, schedule or Schedule.from_job(job)),
        grad_accum=job.data.grad_accum_for(data_parallel_size(job, world_size)),
        # compiled, the fp32 upcast fuses into the loss
        loss_fn=torch.compile(cross_entropy, **compile_) if compile_ is not None else cross_entropy,
        autocast_dtype=None if par.sharded else backend.autocast_dtype(job),  # FSDP: its MixedPrecisionPolicy
        no_sync=par.no_sync,
        clip_and_step=clip_and_step(
            backend, optimizer, params, job.optim.grad_clip_norm, pp_group=getattr(par.pipeline, "group", None)
        ),
        checkpoints=(checkpoints or sharded_checkpoints)(job, par, rank=rank),
        export=par.pipeline.export if par.pipeline is not None else par.full_state_items,
        world_size=world_size,
        data_parallel_size=data_parallel_size(job, world_size),
        aux_loss_coef=job.model.router_aux_loss_coef if job.model.is_moe else 0.0,
        pipeline=par.pipeline,
        context_parallel=par.context,
    )


def native_layout(backend: Backend) -> Layout:
    """Tensor parallel, activation checkpointing, compile, then FSDP2 or DDP (:mod:`raytrn.train.parallelize`)."""

    def lay_out(model: torch.nn.Module, job: JobSpec, *, world_size: int, compile: dict[str, Any] | None) -> Any:
        pipelined = job.parallel.pipeline_parallel_size > 1 and world_size > 1 and torch.distributed.is_initialized()
        return (parallelize_pipeline if pipelined else parallelize)(
            model,
            job,
            device=backend.device(),
            world_size=world_size,
            compile=compile,
            mixed_precision=backend.autocast_dtype(job),
        )

    return lay_out


def sharded_checkpoints(job: JobSpec, par: Parallelized, *, rank: int) -> Checkpoints:
    """Sharded, reshardable ``torch.distributed.checkpoint`` checkpoints (every rank writes its shards)."""
    tp = par.tensor_parallel_size
    layout: dict[str, Any] = {"data_parallel": par.data_parallel, "tensor_parallel_size": tp}
    if job.parallel.expert_parallel_size > 1:  # recorded (a checkpoint loads at any EP size)
        layout["expert_parallel_size"] = job.parallel.expert_parallel_size
    shard = hsdp_shard_size(job)
    if par.data_parallel == "hsdp" and shard:  # recorded too: DCP reshards hsdp <-> fsdp <-> ddp
        layout["hsdp_shard_size"] = shard
    pp = job.parallel.pipeline_parallel_size if par.pipeline is not None else 1
    if pp > 1:  # recorded (a checkpoint loads at any pipeline size: the whole model's names)
        layout["pipeline_parallel_size"] = pp
    if par.context is not None:  # recorded (the state is the model's alone: it loads at any CP size)
        layout["context_parallel_size"] = par.context.size
    plain = tp == 1 and not par.sharded and pp == 1
    return DcpCheckpoints(job, rank=rank, plain_layout=plain, layout=layout)


def clip_and_step(
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    *,
    pp_group: Any = None,
) -> Callable[[], torch.Tensor]:
    """The step's end: reduce gradients where the backend must (XLA: before clipping; DDP/FSDP did it in backward),
    clip, optimizer step; returns the grad norm before clipping.

    A norm that is not finite (a NaN or inf loss or gradient anywhere: the gradients are reduced, so every rank
    computes the same norm) skips the optimizer update: weights and optimizer state stay as the last finite step
    left them (:class:`raytrn.train.guard.NonFiniteGuard` counts it). With the fused AdamW kernel (``optim.fused``
    on cuda) the skip stays on the device: the kernel reads the flag as ``found_inf`` (as under a ``GradScaler``)
    and the step has no host sync; otherwise the flag is read on the host, once per step. Not on the frozen XLA
    paths (``backend.skips_nonfinite_steps``)."""
    on_device = skips_on_device(optimizer)

    def step() -> torch.Tensor:
        backend.reduce_gradients(optimizer)
        norm = grad_norm_and_clip(params, max_norm, pp_group)
        if backend.skips_nonfinite_steps:
            if on_device:
                optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)  # type: ignore[attr-defined]
            elif not bool(torch.isfinite(norm)):
                return norm
        backend.optimizer_step(optimizer)
        return norm

    return step


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step by itself when given ``found_inf`` (torch's fused Adam/AdamW kernels: the
    flag stays on the device). Any other optimizer refuses the attribute, so the step is skipped on the host."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )
