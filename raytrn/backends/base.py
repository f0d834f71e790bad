"""The backend interface and the plain PyTorch (DDP) implementation shared by cpu and cuda."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrn.config import JobSpec


class Backend:
    """How the loop runs on one kind of accelerator. Subclasses override what differs."""

    name: str = "base"
    #: The Ray resource a worker needs by default.
    default_resources: dict[str, float] = {"CPU": 1}
    use_gpu: bool = False
    #: Applies the CUDA speed settings (model.autocast, optim.fused, run.compile); others ignore them with a warning.
    cuda_speedups: bool = False
    #: ``run.tune_malloc`` defaults to on: the step's tensors are allocated and freed in host memory.
    tune_malloc: bool = False

    # -- driver side ---------------------------------------------------------------------------
    def worker_resources(self, job: JobSpec) -> dict[str, float]:
        """The Ray resources of one training worker: the job's, else this accelerator's default (a GPU worker
        always holds one GPU); zero amounts dropped, as Ray Train does."""
        resources = dict(job.scaling.resources_per_worker or self.default_resources)
        if self.use_gpu:
            resources.setdefault("GPU", 1)
        return {k: v for k, v in resources.items() if v}

    def ray_backend_config(self, job: JobSpec) -> Any:
        """The Ray Train backend config (process group setup) for ``job``."""
        from ray.train.torch import TorchConfig

        return TorchConfig(backend=self.process_group_backend)

    process_group_backend: str = "gloo"

    # -- worker side ---------------------------------------------------------------------------
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move to the device and wrap for data parallelism (DDP when world size > 1).

        Outside a Ray Train worker (one process, e.g. ``bench/gpu.py``) there is nothing to wrap: only move.
        """
        if not in_ray_train_worker():
            return model.to(self.device())
        import ray.train.torch

        return ray.train.torch.prepare_model(model, move_to_device=self.device())

    def build_parallel_parts(self, job: JobSpec) -> dict[str, Any] | None:
        """Model, optimizer and step flags of a model-parallel setup (neuronx-distributed), or None for plain
        data parallelism. Keys: model, optimizer, and optionally loss_fn, fused_optimizer, sharded (see Training)."""
        return None

    def check(self, job: JobSpec) -> list[str]:
        """Backend-specific checks of a job (layout, worker counts): notes to show, or BackendError."""
        return []

    def ignored_settings(self, job: JobSpec) -> list[str]:
        """Warnings for job settings this backend does not apply (the CUDA speed settings off cuda)."""
        if self.cuda_speedups:
            return []
        asked = {
            "model.autocast": job.model.autocast if job.model.autocast != "none" else None,
            "optim.fused": job.optim.fused or None,
            "run.compile": job.run.compile or None,
        }
        hint = {
            "neuron": "; on Trainium use model.dtype: bfloat16 (with neuron.stochastic_rounding)",
            "xla-cpu": "; XLA compiles whole steps by itself",
        }.get(self.name, "")
        return [
            f"{key}={value!r} is ignored on scaling.accelerator={self.name!r}: it applies to 'cuda' only{hint}"
            for key, value in asked.items()
            if value is not None
        ]

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """All-reduce gradients before clipping. DDP already did it during backward."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def sync(self) -> None:
        """End of a step's graph. A no-op for eager backends; XLA backends cut the lazy graph here."""

    def wrap_batches(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Where host batches become device batches (XLA: a prefetching device loader)."""
        device = self.device()
        return (b.to(device, non_blocking=True) for b in batches)

    def to_cpu(self, obj: Any) -> Any:
        """State (dicts of tensors) as saveable CPU objects."""
        return obj

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)


def in_ray_train_worker() -> bool:
    """Whether this process runs a Ray Train training function (so Ray's device and DDP helpers apply).

    A process that never imported Ray is not one; Ray stays an optional import for single-process use.
    """
    if "ray" not in sys.modules:  # a Ray Train worker imported Ray long before it runs the loop
        return False
    import ray.train

    try:
        ray.train.get_context()
    except RuntimeError:  # "cannot be used outside of a Ray Train training function"
        return False
    return True
