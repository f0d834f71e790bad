"""trn1: torch-neuronx's XLA build (PJRT on NeuronCores) + neuronx-distributed, one Ray Train worker per NeuronCore.

``scaling.accelerator: neuron-xla``, **frozen**: AWS ended PyTorch/XLA training with Neuron 2.30 and NxD
Training with 2.31, and TorchNeuron (:mod:`raytrn.backends.neuron`) does not run on trn1. This path stays for
trn1 on Neuron <= 2.29 (torch 2.9 + torch-xla 2.9 + NxD), tested on torch-xla's CPU device (``make test-xla``);
it gets fixes, not features.

:class:`NeuronXlaBackend` is the XLA loop (see :mod:`raytrn.xla`) plus the Neuron layout checks.
:class:`NeuronXlaConfig` is raytrn's Ray Train backend config for it, used instead of Ray's
``TorchXLAConfig``, which is XRT-era: it ``pkill``s processes on every worker, and it sets neither
``NEURON_RT_ROOT_COMM_ID`` nor the PJRT variables (ray-project/ray#65070). Here each worker gets its
whole environment from :func:`~raytrn.xla.env.neuron_xla_worker_env` before it imports
``torch_xla``; then every worker joins the ``xla`` process group. Nothing is ever killed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray.train.backend import Backend as RayBackend
from ray.train.torch import TorchConfig

from raytrn.backends.neuron_env import check_neuron_job, cores_per_instance, require_layout
from raytrn.backends.neuron_ray import (
    WorkerInfo,
    config_dict,
    plan_worker_envs,
    set_up_workers,
    shut_down_process_group,
)
from raytrn.config.sizes import data_parallel_size
from raytrn.train.optim import lr_scheduler
from raytrn.train.schedule import Schedule
from raytrn.train.step import Training
from raytrn.xla.backend import XlaBackend, import_torch_xla
from raytrn.xla.checkpoints import NoCheckpoints, NxdCheckpoints
from raytrn.xla.env import neuron_xla_worker_env
from raytrn.xla.neuron_compile import FORWARD_ENV
from raytrn.xla.nxd import (
    build_nxd_config,
    build_parallel_model,
    build_parallel_optimizer,
    require_nxd,
    uses_nxd,
    vocab_parallel_loss,
)

if TYPE_CHECKING:
    from raytrn.checkpoint.store import Checkpoints
    from raytrn.config import JobSpec
    from raytrn.train.parallelize import Parallelized

logger = logging.getLogger(__name__)


class NeuronXlaBackend(XlaBackend):
    """torch-neuronx (XLA) on trn1: PJRT_DEVICE=NEURON, one worker per NeuronCore. Frozen."""

    name = "neuron-xla"
    default_resources = {"neuron_cores": 1}

    def check(self, job: JobSpec) -> list[str]:
        """The layout of every world size of the elastic range, the compile cache and compiler flags."""
        self.refuse_new_features(job)
        return check_neuron_job(job)

    def check_installed(self, job: JobSpec) -> None:
        """neuronx-distributed, when the job's ``parallel`` section needs it (:func:`.nxd.require_nxd`)."""
        require_nxd(job)

    def ray_backend_config(self, job: JobSpec) -> NeuronXlaConfig:
        instance_type, workers_per_node = require_layout(job)
        n = job.neuron
        return NeuronXlaConfig(
            instance_type=instance_type,
            workers_per_node=workers_per_node,
            lnc=n.lnc,
            tensor_parallel_size=job.parallel.tensor_parallel_size,
            compile_cache=n.compile_cache,
            socket_ifname=n.socket_ifname,
            stochastic_rounding=n.stochastic_rounding,
            cc_flags=n.cc_flags,
            run_id=job.run_name,
            extra_env={k: os.environ[k] for k in FORWARD_ENV if k in os.environ},
        )

    def build_training(
        self, job: JobSpec, *, world_size: int, schedule: Schedule | None = None, rank: int = 0
    ) -> Training:
        """NxD's tensor-parallel Llama + NxDOptimizer (ZeRO-1) when the job asks for ``parallel`` features;
        otherwise the plain XLA model."""
        if not uses_nxd(job):
            return super().build_training(job, world_size=world_size, schedule=schedule, rank=rank)
        self.seed(job.run.seed)
        nxd_config = build_nxd_config(job)
        model = build_parallel_model(job, nxd_config)
        optimizer = build_parallel_optimizer(job, nxd_config, model)

        def clip_and_step() -> Any:  # NxDOptimizer.step all-reduces over DP, clips and steps; .grad_norm after
            self.optimizer_step(optimizer)
            return optimizer.grad_norm

        return Training(
            model=model,
            optimizer=optimizer,
            scheduler=lr_scheduler(optimizer, schedule or Schedule.from_job(job)),
            grad_accum=job.data.grad_accum_for(data_parallel_size(job, world_size)),
            loss_fn=vocab_parallel_loss,
            clip_and_step=clip_and_step,
            checkpoints=self._checkpoints(NxdCheckpoints(job)),
            export=None,  # NxD's shards: no Hugging Face export from this layout
        )

    def checkpoints(self, job: JobSpec, par: Parallelized, *, rank: int) -> Checkpoints:
        return self._checkpoints(super().checkpoints(job, par, rank=rank))

    def _checkpoints(self, checkpoints: Checkpoints) -> Checkpoints:
        """``neuron_parallel_compile``'s trial run writes nothing (its outputs are invalid)."""
        return NoCheckpoints() if os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY") else checkpoints


# ---------------------------------------------------------------------------------------------------
# The Ray Train backend config


@dataclass(kw_only=True)
class NeuronXlaConfig(TorchConfig):
    """Ray Train backend config for Neuron: plain fields only, so it pickles to the Ray controller.

    A ``TorchConfig`` so that ``TorchTrainer`` accepts it (``backend`` is ``"xla"``); its Ray backend is
    :class:`_NeuronXlaRayBackend`.
    """

    backend: str | None = "xla"
    init_method: str = "xla://"
    #: e.g. trn1.32xlarge; with ``lnc``, the NeuronCores per node.
    instance_type: str
    #: Workers (NeuronCores used) per node.
    workers_per_node: int
    #: trn2 logical NeuronCore config; None: the instance default (trn2: 2; trn1 has none).
    lnc: int | None = None
    #: Consecutive ranks forming a tensor-parallel group; a group must sit on one node.
    tensor_parallel_size: int = 1
    #: ``neuron.compile_cache``: s3:// URI or absolute path (see ``compile_cache_env``).
    compile_cache: str | None = None
    socket_ifname: str = "eth0"
    stochastic_rounding: bool = True
    cc_flags: str | None = None
    #: ``TORCHELASTIC_RUN_ID``: fixed for the job.
    run_id: str = "raytrn"
    #: Driver variables every worker also gets (e.g. neuron_parallel_compile's graph-extraction switches:
    #: Ray workers do not inherit the driver's environment).
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cores_per_instance(self.instance_type, self.lnc)  # unknown instance type / LNC on trn1: fail on the driver

    @property
    def backend_cls(self) -> type:
        return _NeuronXlaRayBackend

    def to_dict(self) -> dict[str, Any]:
        return config_dict(self, super().to_dict())


def plan_xla_worker_envs(
    workers: list[WorkerInfo],
    config: NeuronXlaConfig,
    *,
    master_addr: str,
    master_port: int,
    root_comm_port: int,
) -> list[dict[str, str]]:
    """The environment of each worker, in the order of ``workers``; BackendError if Ray's placement is unusable
    (:func:`~raytrn.backends.neuron_ray.plan_worker_envs`)."""
    n = len(workers)

    def env_for(w: WorkerInfo) -> dict[str, str]:
        return (
            neuron_xla_worker_env(
                world_rank=w.world_rank,
                local_rank=w.local_rank,
                node_rank=w.node_rank,
                world_size=n,
                workers_per_node=config.workers_per_node,
                master_addr=master_addr,
                master_port=master_port,
                root_comm_port=root_comm_port,
                instance_type=config.instance_type,
                lnc=config.lnc,
                socket_ifname=config.socket_ifname,
                compile_cache=config.compile_cache,
                stochastic_rounding=config.stochastic_rounding,
                cc_flags=config.cc_flags,
                hostname=w.hostname,
                run_id=config.run_id,
            )
            | config.extra_env
        )

    return plan_worker_envs(
        workers,
        workers_per_node=config.workers_per_node,
        tensor_parallel_size=config.tensor_parallel_size,
        env_for=env_for,
    )


class _NeuronXlaRayBackend(RayBackend):
    """Sets each worker's Neuron environment, then forms the ``xla`` process group. Never kills processes."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        def plan(infos: list[WorkerInfo], master_addr: str, ports: list[int]) -> list[dict[str, str]]:
            # The store port and the root-communicator port, both free on rank 0's node at once.
            return plan_xla_worker_envs(
                infos, backend_config, master_addr=master_addr, master_port=ports[0], root_comm_port=ports[1]
            )

        envs = set_up_workers(worker_group, plan, 2)
        logger.info(
            "Neuron (XLA) environment set on %d workers: MASTER_ADDR=%s NEURON_RT_ROOT_COMM_ID=%s",
            len(envs),
            envs[0]["MASTER_ADDR"],
            envs[0]["NEURON_RT_ROOT_COMM_ID"],
        )

    def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_init_xla_process_group, timeout_s=backend_config.timeout_s)

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        shut_down_process_group(worker_group, "xla")


# -- run on the workers ------------------------------------------------------------------------------


def _init_xla_process_group(timeout_s: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import_torch_xla()  # a clear error when torch-neuronx is missing
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend and xla:// rendezvous)

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://", timeout=timedelta(seconds=timeout_s))
