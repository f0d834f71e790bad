"""The backend interface and the plain PyTorch (DDP) implementation shared by cpu and cuda."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrn.config import JobSpec


class Backend:
    """How the loop runs on one kind of accelerator. Subclasses override what differs."""

    name: str = "base"
    #: Lazy-tensor backend: steps end with sync(), host reads (.item()) are potential recompiles.
    is_xla: bool = False
    #: The Ray resource a worker needs by default.
    default_resources: dict[str, float] = {"CPU": 1}
    use_gpu: bool = False

    # -- driver side ---------------------------------------------------------------------------
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
        """Move to the device and wrap for data parallelism (DDP when world size > 1)."""
        import ray.train.torch

        return ray.train.torch.prepare_model(model, move_to_device=self.device())

    def build_parallel_parts(self, job: JobSpec) -> dict[str, Any] | None:
        """Model, optimizer and step flags of a model-parallel setup (neuronx-distributed), or None for plain
        data parallelism. Keys: model, optimizer, and optionally loss_fn, fused_optimizer, sharded (see Training)."""
        return None

    def check(self, job: JobSpec) -> list[str]:
        """Backend-specific checks of a job (layout, worker counts): notes to show, or BackendError."""
        return []

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
