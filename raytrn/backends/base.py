"""The backend interface, and its torch.distributed implementation shared by cpu and cuda.

A backend answers, for one kind of accelerator: the device and the process-group backend, the Ray Train backend
config, the worker's resources, the mixed-precision dtype and compile options it applies, and the step's hooks
(how gradients are reduced and the optimizer stepped, where a step's graph ends, how batches reach the device).
Building the training from these (model, layout, optimizer, checkpoints) is :mod:`raytrn.train.build`'s; the loop
itself has no backend ``if``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from raytrn.checkpoint.resume import ResumeFormat
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)


class Backend:
    """How the loop runs on one kind of accelerator. Subclasses override what differs."""

    name: str = "base"
    #: The Ray resource a worker needs by default.
    default_resources: dict[str, float] = {"CPU": 1}
    use_gpu: bool = False
    #: Applies ``model.autocast`` (``torch.autocast`` on this device, or FSDP's policy); others warn and ignore it.
    autocast_supported: bool = False
    #: ``run.compile``: the ``torch.compile`` options on this backend; None: ignored with a warning.
    compile_options: dict[str, Any] | None = None
    #: Applies ``optim.fused`` (the fused AdamW kernel); others warn and ignore it.
    fused_optim: bool = False
    #: ``run.tune_malloc`` defaults to on: the step's tensors are allocated and freed in host memory.
    tune_malloc: bool = False
    #: Each worker group measures a worker's memory once, against the estimate (:mod:`raytrn.train.memory_probe`).
    #: False on the frozen XLA path: no new features there.
    probes_memory: bool = True
    #: A step whose gradient norm is not finite skips its optimizer update, decided by one host read of the norm
    #: (:func:`raytrn.train.build.clip_and_step`). False on the frozen XLA paths: the read would cut the step's
    #: lazy graph in two.
    skips_nonfinite_steps: bool = True

    # -- driver and worker -----------------------------------------------------------------------
    def resume_format(self) -> ResumeFormat:
        """How this backend's checkpoints resume, for the driver and the workers alike
        (:mod:`raytrn.checkpoint.resume`): commit manifests and the in-memory tier; the frozen XLA path overrides it."""
        from raytrn.checkpoint.resume import CommittedResume  # pyarrow (~0.5 s): the CLI imports backends, not this

        return CommittedResume()

    # -- driver side ---------------------------------------------------------------------------
    def worker_resources(self, job: JobSpec) -> dict[str, float]:
        """The Ray resources of one training worker: the job's, else this accelerator's default (a GPU worker
        always holds one GPU); zero amounts dropped, as Ray Train does."""
        resources = dict(job.scaling.resources_per_worker or self.default_resources)
        if self.use_gpu:
            resources.setdefault("GPU", 1)
        return {k: v for k, v in resources.items() if v}

    def ray_backend_config(self, job: JobSpec) -> Any:
        """The Ray Train backend config (process group setup, then raytrn's worker set-up) for ``job``; under
        ``scaling.recovery: live`` replica groups whose workers form their own re-forming group
        (:mod:`raytrn.backends.live_ray`)."""
        if job.scaling.recovery == "live":
            from raytrn.backends.live_ray import LiveGroupConfig

            return LiveGroupConfig(backend=self.process_group_backend, timeout_s=job.scaling.peer_timeout_s)
        from raytrn.backends.ray_backend import ProcessGroupConfig

        return ProcessGroupConfig(backend=self.process_group_backend)

    process_group_backend: str = "gloo"

    # -- worker side ---------------------------------------------------------------------------
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def autocast_dtype(self, job: JobSpec) -> torch.dtype | None:
        """The mixed-precision compute dtype (``model.autocast``) where this backend applies it, else None."""
        import torch

        return torch.bfloat16 if self.autocast_supported and job.model.autocast == "bfloat16" else None

    def check(self, job: JobSpec) -> list[str]:
        """Backend-specific checks of a job (layout, worker counts): notes to show, or BackendError."""
        return []

    def check_installed(self, job: JobSpec) -> None:
        """BackendUnavailableError when something the job needs on this backend is not installed here (``raytrn
        validate`` shows it as a note: a trn job is validated on a laptop)."""

    def check_layout(self, job: JobSpec) -> list[str] | None:
        """This backend's own rules for the ``parallel`` section (info lines, or ConfigError); None: the
        torch.distributed layouts' (:func:`raytrn.config.layout.check_parallel`). Only the frozen XLA path has
        its own."""
        return None

    def ignored_settings(self, job: JobSpec) -> list[str]:
        """Warnings for job settings this backend does not apply (autocast, fused AdamW, torch.compile)."""
        asked = {
            "model.autocast": (job.model.autocast if job.model.autocast != "none" else None, self.autocast_supported),
            "optim.fused": (job.optim.fused or None, self.fused_optim),
            "run.compile": (job.run.compile or None, self.compile_options is not None),
        }
        where = {"model.autocast": "cuda and neuron", "optim.fused": "cuda", "run.compile": "cuda and neuron"}
        hint = {
            "neuron-xla": "; on trn1 use model.dtype: bfloat16 (with neuron.stochastic_rounding)",
            "xla-cpu": "; XLA compiles whole steps by itself",
        }.get(self.name, "")
        return [
            f"{key}={value!r} is ignored on scaling.accelerator={self.name!r}: it applies to {where[key]} only{hint}"
            for key, (value, applied) in asked.items()
            if value is not None and not applied
        ]

    def device_memory(self) -> dict[str, float]:
        """The device allocator's memory as system metrics (``neuron`` reads ``torch.neuron``); {} where the
        node's own monitors cover it (cuda: MLflow's GPU monitor) or there is no device memory."""
        return {}

    def peak_memory_bytes(self) -> int | None:
        """The device allocator's peak of allocated bytes in this process (what ``raytrn estimate``'s memory is
        checked against); None where no allocator counts them (cpu)."""
        return None

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
