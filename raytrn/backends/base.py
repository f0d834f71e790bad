"""The backend interface and the plain PyTorch (DDP) implementation shared by cpu and cuda."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Backend:
    """How the loop runs on one kind of accelerator. Subclasses override what differs."""

    name: str = "base"
    #: The Ray resource a worker needs by default.
    default_resources: dict[str, float] = {"CPU": 1}
    use_gpu: bool = False

    # -- driver side ---------------------------------------------------------------------------
    def ray_backend_config(self) -> Any:
        """The Ray Train backend config (process group setup)."""
        from ray.train.torch import TorchConfig

        return TorchConfig(backend=self.process_group_backend)

    process_group_backend: str = "gloo"

    # -- worker side ---------------------------------------------------------------------------
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move to the device and wrap for data parallelism (DDP when world size > 1)."""
        import ray.train.torch

        return ray.train.torch.prepare_model(model, move_to_device=self.device())

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def sync(self) -> None:
        """End of a step's graph. A no-op for eager backends; XLA backends cut the lazy graph here."""

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
