"""One worker per GPU, NCCL collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.backends.base import Backend

if TYPE_CHECKING:
    import torch


class CudaBackend(Backend):
    name = "cuda"
    default_resources = {"GPU": 1}
    use_gpu = True
    process_group_backend = "nccl"

    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
