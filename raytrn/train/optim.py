"""AdamW and its learning-rate scheduler, as every backend builds them (NxD wraps the same parameter groups)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.train.schedule import Schedule

if TYPE_CHECKING:
    import torch

    from raytrn.config import JobSpec


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: weight decay on matrices, none on 1-D parameters (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_adamw(model: torch.nn.Module, job: JobSpec, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`adamw_param_groups`. ``fused``: one CUDA kernel for the whole update (``optim.fused``
    on cuda); otherwise torch's default implementation."""
    import torch

    o = job.optim
    groups = adamw_param_groups(model, o.weight_decay)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused or None)


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule) -> Any:
    """A ``LambdaLR`` following ``schedule`` (its state dict holds the step count; the schedule itself is stored
    in the checkpoint by raytrn, see :func:`raytrn.train.schedule.resolve_schedule`)."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
