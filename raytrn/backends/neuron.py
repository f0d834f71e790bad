"""Trainium2/3: TorchNeuron, native PyTorch on the ``neuron`` device, one Ray Train worker per logical NeuronCore.

``scaling.accelerator: neuron``. TorchNeuron (``torch-neuronx`` >= 2.13, Neuron 2.33+, trn2/trn3 only) is a
PyTorch device backend: the model, DDP/FSDP2/DTensor layout, DCP checkpoints and the step are the same code
cpu and cuda run (:class:`~raytrn.backends.base.Backend`); what differs is the device, the ``neuron`` process
group, ``torch.compile(backend="neuron")`` for ``run.compile``, ``torch.autocast(device_type="neuron")`` for
``model.autocast``, and each worker's environment (:func:`~raytrn.backends.neuron_env.torchneuron_worker_env`,
set by :class:`TorchNeuronConfig` before the process group forms and before any neuron tensor exists).

Ray has no Train backend for TorchNeuron (its ``TorchXLAConfig`` is XLA-only): :class:`TorchNeuronConfig` is
raytrn's. The trn1 XLA path is :mod:`raytrn.xla.neuron_xla`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ray.train.backend import Backend as RayBackend

from raytrn.ahead import import_ahead
from raytrn.backends.base import Backend
from raytrn.backends.neuron_env import (
    check_neuron_job,
    check_stack,
    cores_per_instance,
    require_layout,
    torchneuron_worker_env,
)
from raytrn.backends.neuron_ray import (
    WorkerInfo,
    config_dict,
    plan_worker_envs,
    set_up_workers,
)
from raytrn.backends.ray_backend import ProcessGroupConfig, init_process_group, prepare_worker
from raytrn.errors import BackendUnavailableError

if TYPE_CHECKING:
    import torch

    from raytrn.config import JobSpec

logger = logging.getLogger(__name__)

#: The oldest ``torch-neuronx`` that is TorchNeuron; 2.9.x and older are the PyTorch/XLA build of the same name.
MIN_TORCH_NEURONX = (2, 13)
#: The TorchNeuron virtual environment of AWS's Neuron DLAMI ("Deep Learning AMI Neuron torch-neuronx 2.14.0").
TORCHNEURON_VENV = "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"


def check_torch_neuronx_version(version: str | None) -> None:
    """BackendUnavailableError unless ``version`` (of the installed ``torch-neuronx``; None: not installed) is
    TorchNeuron's, saying which environment to use."""
    venv = (
        f"on a trn2/trn3 instance, use the Neuron DLAMI's TorchNeuron environment (`source {TORCHNEURON_VENV}/bin/"
        "activate`), or install torch-neuronx 2.13.x (with torch 2.13) or 2.14.x from AWS's Neuron package index"
    )
    if version is None:
        raise BackendUnavailableError(
            f"scaling.accelerator='neuron' needs TorchNeuron (torch-neuronx >= 2.13), which is not installed here: {venv}"
        )
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if numbers < MIN_TORCH_NEURONX:
        raise BackendUnavailableError(
            f"torch-neuronx {version} is the PyTorch/XLA build, not TorchNeuron (>= 2.13): on trn1 use "
            f"scaling.accelerator: neuron-xla; for trn2/trn3, {venv}"
        )


def import_torch_neuronx() -> ModuleType:
    """``torch_neuronx`` (TorchNeuron), or a clear error naming the environment to use."""
    try:
        version: str | None = importlib.metadata.version("torch-neuronx")
    except importlib.metadata.PackageNotFoundError:
        version = None
    check_torch_neuronx_version(version)
    import torch_neuronx  # registers the neuron device and process group (also autoloaded by torch)

    return torch_neuronx


class NeuronBackend(Backend):
    """TorchNeuron on trn2/trn3: device ``neuron``, process group ``neuron``, one worker per logical NeuronCore."""

    name = "neuron"
    default_resources = {"neuron_cores": 1}
    process_group_backend = "neuron"
    autocast_supported = True  # torch.autocast(device_type="neuron"), or FSDP's MixedPrecisionPolicy
    #: ``dynamic=True`` is rejected by the neuron backend; every new shape is a new compile.
    compile_options: dict[str, Any] | None = {"backend": "neuron", "fullgraph": True, "dynamic": False}
    fused_optim = False  # a fused AdamW for neuron is not confirmed: optim.fused is ignored with a warning

    def check(self, job: JobSpec) -> list[str]:
        """The instance family (trn2/trn3), one worker per logical core of every node, every world size of the
        elastic range, the NEFF cache and compiler flags."""
        return check_neuron_job(job)

    def ignored_settings(self, job: JobSpec) -> list[str]:
        """Also the XLA path's ``neuron`` settings, when a job sets them: TorchNeuron has no use for them."""
        unused = {
            "neuron.stochastic_rounding": "bf16 compute comes from model.autocast (float32 master weights)",
            "neuron.socket_ifname": "the neuron process group bootstraps from MASTER_ADDR",
        }
        return super().ignored_settings(job) + [
            f"{key} is ignored on scaling.accelerator='neuron' (neuron-xla only): {why}"
            for key, why in unused.items()
            if key.split(".")[1] in job.neuron.model_fields_set
        ]

    def ray_backend_config(self, job: JobSpec) -> TorchNeuronConfig:
        instance_type, workers_per_node = require_layout(job)
        n = job.neuron
        return TorchNeuronConfig(
            instance_type=instance_type,
            workers_per_node=workers_per_node,
            lnc=n.lnc,
            tensor_parallel_size=job.parallel.tensor_parallel_size,
            compile_cache=n.compile_cache,
            cc_flags=n.cc_flags,
        )

    def device(self) -> torch.device:
        """``neuron:0``: each worker sees exactly its own NeuronCore (``NEURON_RT_VISIBLE_CORES``)."""
        return _neuron_device()

    def device_memory(self) -> dict[str, float]:
        """The device allocator's memory, after ``torch.neuron.synchronize()`` (the allocator is asynchronous)."""
        import torch

        neuron: Any = torch.neuron  # type: ignore[attr-defined]
        return neuron_memory_metrics(neuron)

    def peak_memory_bytes(self) -> int | None:
        import torch

        neuron: Any = torch.neuron  # type: ignore[attr-defined]
        neuron.synchronize()  # the allocator is asynchronous
        return int(neuron.max_memory_allocated())


@functools.cache
def _neuron_device() -> torch.device:
    """Checked once per process (the step asks for the device every step); a failed check is not cached."""
    import torch

    import_torch_neuronx()
    return torch.device("neuron", 0)


def neuron_memory_metrics(neuron: Any) -> dict[str, float]:
    """``torch.neuron``'s allocator counters as system metrics (MB), read after a synchronize."""
    neuron.synchronize()
    mb = 1e6
    return {
        "neuron_memory_allocated_megabytes": neuron.memory_allocated() / mb,
        "neuron_max_memory_allocated_megabytes": neuron.max_memory_allocated() / mb,
        "neuron_memory_reserved_megabytes": neuron.memory_reserved() / mb,
    }


# ---------------------------------------------------------------------------------------------------
# The Ray Train backend config


@dataclass(kw_only=True)
class TorchNeuronConfig(ProcessGroupConfig):
    """Ray Train backend config for TorchNeuron: plain fields only, so it pickles to the Ray controller.

    ``backend`` is the process group (``neuron``; the tests run the same code on ``gloo``). Its Ray backend is
    :class:`_TorchNeuronRayBackend`.
    """

    backend: str = "neuron"
    #: e.g. trn2.48xlarge; with ``lnc``, the logical NeuronCores per node (64 at LNC=2, 128 at LNC=1).
    instance_type: str
    #: Workers per node: the node's logical NeuronCores.
    workers_per_node: int
    #: ``neuron.lnc``; None: the instance default (2).
    lnc: int | None = None
    #: Consecutive ranks forming a tensor-parallel group; a group must sit on one node.
    tensor_parallel_size: int = 1
    #: ``neuron.compile_cache``: the NEFF cache directory (see ``neff_cache_env``).
    compile_cache: str | None = None
    cc_flags: str | None = None
    #: Not as the actor is constructed: torch autoloads torch_neuronx as it is imported, and the workers' NEURON_*
    #: variables are set after that, by :class:`_TorchNeuronRayBackend` (the job's loop is still imported ahead).
    import_at_construction: bool = False
    #: More variables for every worker (Ray workers do not inherit the driver's environment).
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_stack("neuron", self.instance_type)  # trn1 or an unknown type: fail on the driver
        cores_per_instance(self.instance_type, self.lnc)

    @property
    def backend_cls(self) -> type:
        return _TorchNeuronRayBackend

    def to_dict(self) -> dict[str, Any]:
        return config_dict(self, super().to_dict())


def plan_torchneuron_worker_envs(
    workers: list[WorkerInfo], config: TorchNeuronConfig, *, master_addr: str, master_port: int
) -> list[dict[str, str]]:
    """The environment of each worker, in the order of ``workers``; BackendError if Ray's placement is unusable."""
    n = len(workers)

    def env_for(w: WorkerInfo) -> dict[str, str]:
        return (
            torchneuron_worker_env(
                world_rank=w.world_rank,
                local_rank=w.local_rank,
                node_rank=w.node_rank,
                world_size=n,
                workers_per_node=config.workers_per_node,
                master_addr=master_addr,
                master_port=master_port,
                instance_type=config.instance_type,
                lnc=config.lnc,
                visible_cores=w.visible_cores,
                compile_cache=config.compile_cache,
                cc_flags=config.cc_flags,
                hostname=w.hostname,
            )
            | config.extra_env
        )

    return plan_worker_envs(
        workers,
        workers_per_node=config.workers_per_node,
        tensor_parallel_size=config.tensor_parallel_size,
        env_for=env_for,
    )


class _TorchNeuronRayBackend(RayBackend):
    """Sets each worker's environment, then forms the process group (``env://``), before the training function
    runs: TorchNeuron refuses to start when a neuron tensor exists before ``init_process_group``."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        def plan(infos: list[WorkerInfo], master_addr: str, ports: list[int]) -> list[dict[str, str]]:
            return plan_torchneuron_worker_envs(infos, backend_config, master_addr=master_addr, master_port=ports[0])

        envs = set_up_workers(worker_group, plan, 1)
        logger.info(
            "TorchNeuron environment set on %d workers: MASTER_ADDR=%s:%s, LNC=%s",
            len(envs),
            envs[0]["MASTER_ADDR"],
            envs[0]["MASTER_PORT"],
            envs[0]["NEURON_LOGICAL_NC_CONFIG"],
        )
        c = backend_config
        installed = worker_group.execute(_start_worker, c.backend, c.timeout_s, c.worker_env, c.tune_malloc, c.ahead)
        if not all(installed):
            logger.warning("SIGTERM handler not installed on %d of %d workers", installed.count(False), len(installed))


def _start_worker(
    backend: str, timeout_s: float, env: dict[str, str], tune_malloc: bool, ahead: tuple[str, ...] = ()
) -> bool:
    """On a worker's main thread, its environment set: the driver's variables and the allocator
    (:func:`prepare_worker`), the SIGTERM handler, then the process group (``init_process_group(backend,
    init_method="env://")``), then the imports ``ahead`` of the training function. Returns whether the handler is
    installed."""
    from raytrn.sigterm import install_sigterm_handler

    prepare_worker(env, tune_malloc)
    installed = install_sigterm_handler()
    if backend == "neuron":
        import_torch_neuronx()  # a clear error when TorchNeuron is missing; registers the backend
    init_process_group(backend, timeout_s)
    import_ahead(ahead)  # after the rendezvous (raytrn.ahead.import_ahead)
    return installed
