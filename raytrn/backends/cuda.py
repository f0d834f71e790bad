"""One worker per GPU, NCCL collectives; also runs one process without Ray (bench/gpu.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrn.backends.base import Backend, in_ray_train_worker

if TYPE_CHECKING:
    import torch


class CudaBackend(Backend):
    name = "cuda"
    default_resources = {"GPU": 1}
    use_gpu = True
    process_group_backend = "nccl"
    autocast_supported = True
    compile_options: dict[str, Any] | None = {}  # inductor
    fused_optim = True

    def device(self) -> torch.device:
        """The worker's GPU from Ray Train; outside a Ray Train worker (one process), the current CUDA device."""
        import torch

        if not in_ray_train_worker():
            return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        import ray.train.torch

        return ray.train.torch.get_device()

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def peak_memory_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device())) if torch.cuda.is_available() else None
