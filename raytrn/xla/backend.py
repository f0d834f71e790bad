"""XLA backends: the code path torch-neuronx's XLA build runs, shared by ``neuron-xla`` (trn1) and ``xla-cpu``.

On XLA the loop builds a lazy graph; :meth:`XlaBackend.sync` cuts it once per optimizer step, batches
arrive through ``MpDeviceLoader``, gradients are all-reduced by ``xm.reduce_gradients`` (no DDP) and
checkpoints are moved to the CPU before they are written, as one ``state.pt`` resumed through Ray Train
(:mod:`raytrn.xla.checkpoints`: no commit manifests on this path). ``torch_xla`` is imported lazily:
workers must get their PJRT environment before the XLA runtime starts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ray.train.backend import Backend as RayBackend
from ray.train.torch import TorchConfig

from raytrn.backends.base import Backend
from raytrn.errors import BackendError, BackendUnavailableError
from raytrn.train.build import build_native
from raytrn.train.parallelize import Parallelized
from raytrn.train.precheck_compiled import _odd_one_out, report_and_batches
from raytrn.train.precheck_report import XLA_MODE, MemoryEstimate, PrecheckReport, StepRecord
from raytrn.train.step import read_metrics, train_step
from raytrn.xla.checkpoints import StateFileCheckpoints
from raytrn.xla.nxd import check_parallel
from raytrn.xla.resume import RecordedResume

if TYPE_CHECKING:
    import torch

    from raytrn.checkpoint.store import Checkpoints
    from raytrn.config import JobSpec
    from raytrn.train.schedule import Schedule
    from raytrn.train.step import Training


def import_torch_xla() -> Any:
    """``torch_xla``, or a clear error naming what to install."""
    try:
        import torch_xla

        return torch_xla
    except ImportError as e:
        raise BackendUnavailableError(
            f"this accelerator needs torch-xla ({e}); on a trn instance use the Neuron DLAMI's PyTorch venv, "
            "on CPU install torch==2.9.0 torch-xla==2.9.0 (`make venv-xla`)"
        ) from None


class XlaBackend(Backend):
    """torch-xla on a PJRT device; subclasses say which device and how workers are wired."""

    name = "xla"
    probes_memory = False  # frozen path: no new features
    skips_nonfinite_steps = False  # a host read of the grad norm mid-step would split the lazy graph (frozen path)

    def resume_format(self) -> RecordedResume:
        """``state.pt`` / NxD checkpoints, resumed through Ray Train's latest (:mod:`raytrn.xla.resume`)."""
        return RecordedResume()

    def precheck(self, job: JobSpec, **kwargs: Any) -> Any:
        """``raytrn precheck``'s step run for this path: on torch-xla's CPU device (:func:`precheck_xla`)."""
        return precheck_xla(job, **kwargs)

    def check_layout(self, job: JobSpec) -> list[str]:
        """The XLA path's own rules for the ``parallel`` section (neuronx-distributed's layouts on neuron-xla, one
        plain worker on xla-cpu): :func:`raytrn.xla.nxd.check_parallel`."""
        return check_parallel(job, require_installed=False)

    def refuse_new_features(self, job: JobSpec) -> None:
        """The XLA path is frozen: fine-tuning features (Hugging Face init, instruction data, LoRA, validation)
        are for the torch.distributed backends; BackendError naming the first one asked for."""
        asked = {
            "model.init_from": job.model.init_from,
            "model.lora": getattr(job.model, "lora", None),
            "data.validation": getattr(job.data, "validation", None),
            "data.attention: document": getattr(job.data, "attention", "causal") == "document" or None,
            f"model.family: {job.model.family}": job.model.family != "llama" or None,
        }
        for name, value in asked.items():
            if value:
                raise BackendError(
                    f"{name} is not supported on scaling.accelerator={self.name!r} (the XLA path is frozen: fixes only); "
                    "use cpu, cuda or neuron (TorchNeuron)"
                )

    def device(self) -> torch.device:
        return import_torch_xla().device()

    def build_training(
        self, job: JobSpec, *, world_size: int, schedule: Schedule | None = None, rank: int = 0
    ) -> Training:
        """The native build (:func:`raytrn.train.build.build_native`) with this path's layout and ``state.pt``."""
        return build_native(
            job, self, world_size=world_size, schedule=schedule, rank=rank, layout=self.parallelize,
            checkpoints=self.checkpoints,
        )  # fmt: skip

    def parallelize(
        self, model: torch.nn.Module, job: JobSpec, *, world_size: int, compile: dict[str, Any] | None
    ) -> Parallelized:
        """No wrapper on XLA: :meth:`reduce_gradients` all-reduces over the XLA process group instead (model
        parallelism is neuronx-distributed's, see ``NeuronXlaBackend.build_training``)."""
        return Parallelized(model=model.to(self.device()), mesh=None, data_parallel="none", tensor_parallel_size=1)

    def checkpoints(self, job: JobSpec, par: Parallelized, *, rank: int) -> Checkpoints:
        """The whole state in ``state.pt``, written by rank 0 (the frozen XLA path's format)."""
        return StateFileCheckpoints(self.to_cpu)

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """All-reduce (mean) gradients over the replicas; before clipping, as xm.optimizer_step would."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.world_size() > 1:
            xm.reduce_gradients(optimizer)

    def sync(self) -> None:
        # The end of the step's lazy graph: one graph per optimizer step, compiled once.
        import_torch_xla().sync()

    def wrap_batches(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Prefetch batches onto the device in a background thread (``MpDeviceLoader``)."""
        import torch_xla.distributed.parallel_loader as pl

        return iter(pl.MpDeviceLoader(batches, self.device()))

    def to_cpu(self, obj: Any) -> Any:
        """A copy of a (nested) state dict with every XLA tensor moved to the CPU, for torch.save."""
        return _cpu(obj)

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        import_torch_xla()  # the runtime must be up before xm.set_rng_state
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)


class XlaCpuBackend(XlaBackend):
    """torch-xla on ``PJRT_DEVICE=CPU``: the Neuron code path without Neuron, one worker.

    CPU PJRT forms no multi-process collective (each process sees world size 1), so this backend runs
    exactly one worker; multi-worker paths are covered by gloo (cpu) in tests.
    """

    name = "xla-cpu"
    default_resources = {"CPU": 1}

    def ray_backend_config(self, job: JobSpec) -> Any:
        return XlaCpuConfig()

    def check(self, job: JobSpec) -> list[str]:
        self.refuse_new_features(job)
        s = job.scaling
        if s.max_size != 1 or s.min_workers != 1:
            raise BackendError(
                f"scaling.accelerator='xla-cpu' runs exactly 1 worker (CPU PJRT forms no multi-process collective), "
                f"got min_workers={s.min_workers}, max_workers={s.max_workers}; set both to 1"
            )
        return []


def _xla_cpu_env() -> None:
    os.environ["PJRT_DEVICE"] = "CPU"


class _XlaCpuRayBackend(RayBackend):
    """Sets PJRT_DEVICE=CPU on the (single) worker before torch_xla starts; no process group needed."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_xla_cpu_env)


class XlaCpuConfig(TorchConfig):
    """Ray Train backend config for ``xla-cpu``. (Ray's TorchXLAConfig is XRT-era and pkills processes.)

    A TorchConfig subclass because Train V2 reads TorchConfig fields; the backend itself forms no
    process group (one worker).
    """

    @property
    def backend_cls(self) -> type:
        return _XlaCpuRayBackend


def _cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------------------------------
# raytrn precheck on this path: the job's step on torch-xla's PJRT_DEVICE=CPU, counting compiles, host-device
# transfers (which cut XLA's lazy graph) and graph hashes per step (the report is raytrn.train.precheck's).


def precheck_xla(
    job: JobSpec, *, steps: int, warmup_steps: int, batches: Iterator[Any] | None, memory: MemoryEstimate
) -> PrecheckReport:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import_torch_xla()
    import torch_xla.debug.metrics as met  # after the runtime is configured

    backend = _recording_backend()
    t = backend.build_training(job, world_size=job.scaling.min_workers if job.data.global_batch_size else 1)
    # Each micro-batch is its own graph on XLA: 2 of them show the first-vs-accumulating variants.
    t.grad_accum = min(t.grad_accum, 2)
    # Shapes recorded as the step consumes them (the device loader prefetches ahead of the step).
    report, device_batches, shapes = report_and_batches(
        job, warmup_steps=warmup_steps, batches=batches, memory=memory, mode=XLA_MODE, wrap=backend.wrap_batches
    )

    def counters() -> tuple[int, int]:
        transfers = met.metric_data("TransferFromDeviceTime")
        return int(met.counter_value("UncachedCompile") or 0), int(transfers[0] if transfers else 0)

    for step in range(1, steps + 1):
        compiles0, syncs0 = counters()
        n_shapes = len(shapes)
        result = train_step(t, device_batches, backend)
        logged = step % job.run.log_every == 0
        if logged:
            read_metrics(result, 1)  # the loop's metric read, at the loop's cadence
        compiles1, syncs1 = counters()
        report.records.append(
            StepRecord(
                step=step,
                compiles=compiles1 - compiles0,
                host_syncs=syncs1 - syncs0,
                graph_hash=backend.last_hash,
                input_shape=_odd_one_out(shapes[n_shapes:], shapes[0]),
                logged=logged,
            )
        )
    return report


def _recording_backend() -> Any:
    """xla-cpu, noting the hash of the graph that updates the parameters at the end of each step."""

    class RecordingBackend(XlaCpuBackend):
        last_hash = "-"
        _params: list[Any] = []

        def reduce_gradients(self, optimizer: Any) -> None:
            self._params = [p for group in optimizer.param_groups for p in group["params"]]
            super().reduce_gradients(optimizer)

        def sync(self) -> None:
            import torch_xla

            self.last_hash = hashlib.sha1(bytes(torch_xla._XLAC._get_graph_hash(self._params))).hexdigest()[:16]
            super().sync()

    return RecordingBackend()
