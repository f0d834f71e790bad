"""Trainium: torch-neuronx (XLA on NeuronCores), one Ray Train worker per NeuronCore.

:class:`NeuronBackend` is the XLA loop (see :mod:`raytrn.backends.xla`) plus the Neuron layout checks.
:class:`NeuronXlaConfig` is raytrn's Ray Train backend config for it, used instead of Ray's
``TorchXLAConfig``, which is XRT-era: it ``pkill``s processes on every worker, and it sets neither
``NEURON_RT_ROOT_COMM_ID`` nor the PJRT variables (ray-project/ray#65070). Here each worker gets its
whole environment from :func:`~raytrn.backends.neuron_env.neuron_worker_env` before it imports
``torch_xla``; then every worker joins the ``xla`` process group. Nothing is ever killed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.train.backend import Backend as RayBackend
from ray.train.torch import TorchConfig

from raytrn.backends.neuron_compile import FORWARD_ENV
from raytrn.backends.neuron_env import (
    cc_flags_for,
    check_layout,
    check_tp_groups,
    compile_cache_env,
    cores_per_instance,
    neuron_worker_env,
)
from raytrn.backends.nxd import (
    NxdCheckpoints,
    build_nxd_config,
    build_parallel_model,
    build_parallel_optimizer,
    uses_nxd,
    vocab_parallel_loss,
)
from raytrn.backends.xla import XlaBackend, import_torch_xla
from raytrn.errors import BackendError

if TYPE_CHECKING:
    from raytrn.config import JobSpec
    from raytrn.train.checkpointing import Checkpoints
    from raytrn.train.parallelize import Parallelized
    from raytrn.train.schedule import Schedule
    from raytrn.train.step import Training

logger = logging.getLogger(__name__)


class NeuronBackend(XlaBackend):
    """torch-neuronx on a trn instance: PJRT_DEVICE=NEURON, one worker per NeuronCore."""

    name = "neuron"
    default_resources = {"neuron_cores": 1}

    def check(self, job: JobSpec) -> list[str]:
        """The layout of every world size of the elastic range, the compile cache and compiler flags."""
        s, n = job.scaling, job.neuron
        instance_type, workers_per_node = _require_layout(job)
        try:
            notes = check_layout(
                min_workers=s.min_workers,
                max_workers=s.max_size,
                workers_per_node=workers_per_node,
                instance_type=instance_type,
                lnc=n.lnc,
                tensor_parallel_size=job.parallel.tensor_parallel_size,
            )
            compile_cache_env(n.compile_cache, hostname="<host>")
            flags = cc_flags_for(n.cc_flags, n.lnc)
        except BackendError as e:
            raise BackendError(f"{job.source}: {e}") from None
        resources = s.resources_per_worker
        if resources is not None and resources.get("neuron_cores") != 1:
            notes.append(
                f"scaling.resources_per_worker={resources} does not request neuron_cores: 1; each worker still "
                "uses one NeuronCore, which Ray then does not reserve for it (add neuron_cores: 1)"
            )
        if n.compile_cache is not None and flags and "--cache_dir" in flags:
            notes.append("neuron.cc_flags sets --cache_dir, which takes precedence over neuron.compile_cache")
        return notes

    def ray_backend_config(self, job: JobSpec) -> NeuronXlaConfig:
        instance_type, workers_per_node = _require_layout(job)
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
        from raytrn.train.optim import lr_scheduler
        from raytrn.train.schedule import Schedule
        from raytrn.train.sizes import data_parallel_size
        from raytrn.train.step import Training

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
        from raytrn.train.checkpointing import NoCheckpoints

        return NoCheckpoints() if os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY") else checkpoints


def _require_layout(job: JobSpec) -> tuple[str, int]:
    s = job.scaling
    missing = [f for f in ("instance_type", "workers_per_node") if getattr(s, f) is None]
    if missing:
        raise BackendError(
            f"{job.source}: scaling.accelerator='neuron' needs {' and '.join('scaling.' + f for f in missing)} "
            "(one worker per NeuronCore): set e.g. scaling.instance_type: trn1.32xlarge and "
            "scaling.workers_per_node: 32"
        )
    assert s.instance_type is not None and s.workers_per_node is not None
    return s.instance_type, s.workers_per_node


# ---------------------------------------------------------------------------------------------------
# The Ray Train backend config


@dataclass(kw_only=True)
class NeuronXlaConfig(TorchConfig):
    """Ray Train backend config for Neuron: plain fields only, so it pickles to the Ray controller.

    A ``TorchConfig`` so that ``TorchTrainer`` accepts it (``backend`` is ``"xla"``); its Ray backend is
    :class:`_NeuronRayBackend`.
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
        return _NeuronRayBackend

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "instance_type": self.instance_type,
            "workers_per_node": self.workers_per_node,
            "lnc": self.lnc,
            "tensor_parallel_size": self.tensor_parallel_size,
            "compile_cache": self.compile_cache,
            "socket_ifname": self.socket_ifname,
            "stochastic_rounding": self.stochastic_rounding,
            "cc_flags": self.cc_flags,
            "run_id": self.run_id,
            "extra_env": dict(self.extra_env),
        }


@dataclass(frozen=True)
class WorkerInfo:
    """Where one Ray Train worker runs, as reported by the worker itself."""

    world_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    node_id: str
    node_ip: str
    hostname: str


def plan_worker_envs(
    workers: list[WorkerInfo],
    config: NeuronXlaConfig,
    *,
    master_addr: str,
    master_port: int,
    root_comm_port: int,
) -> list[dict[str, str]]:
    """The environment of each worker, in the order of ``workers``; BackendError if Ray's placement is unusable.

    Checks what Ray actually placed: ranks 0..n-1, ``workers_per_node`` workers on every node (or one
    partial node), and no tensor-parallel group across nodes.
    """
    n = len(workers)
    by_rank = sorted(workers, key=lambda w: w.world_rank)
    if [w.world_rank for w in by_rank] != list(range(n)) or any(w.world_size != n for w in workers):
        raise BackendError(f"worker ranks {sorted(w.world_rank for w in workers)} are not 0..{n - 1}")
    per_node = Counter(w.node_id for w in by_rank)
    expected = min(config.workers_per_node, n)
    if any(count != expected for count in per_node.values()):
        hosts = {w.node_id: w.hostname for w in by_rank}
        placed = ", ".join(f"{hosts[node]}: {count}" for node, count in per_node.items())
        raise BackendError(
            f"Ray placed {n} workers unevenly over {len(per_node)} node(s) ({placed}); Neuron needs "
            f"scaling.workers_per_node={config.workers_per_node} workers on every node (or one partial node). "
            "Make sure each node's NeuronCores are free for this job"
        )
    check_tp_groups([w.node_id for w in by_rank], config.tensor_parallel_size)
    return [
        neuron_worker_env(
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
        for w in workers
    ]


class _NeuronRayBackend(RayBackend):
    """Sets each worker's Neuron environment, then forms the ``xla`` process group. Never kills processes."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        infos: list[WorkerInfo] = worker_group.execute(_describe_worker)
        rank0 = next((i for i, w in enumerate(infos) if w.world_rank == 0), None)
        if rank0 is None:
            raise BackendError("no worker has world rank 0")
        # The store port and the root-communicator port, both free on rank 0's node at once.
        master_addr, (master_port, free_port) = worker_group.execute_single(rank0, _free_ports, 2)
        envs = plan_worker_envs(
            infos,
            backend_config,
            master_addr=master_addr,
            master_port=master_port,
            root_comm_port=free_port,
        )
        ray.get([worker_group.execute_single_async(i, _apply_env, env) for i, env in enumerate(envs)])
        logger.info(
            "Neuron environment set on %d workers: MASTER_ADDR=%s NEURON_RT_ROOT_COMM_ID=%s",
            len(envs),
            master_addr,
            envs[rank0]["NEURON_RT_ROOT_COMM_ID"],
        )

    def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_init_xla_process_group, timeout_s=backend_config.timeout_s)

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        timeout_s = float(
            os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        )
        try:
            ray.get(worker_group.execute_async(_destroy_process_group), timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("destroying the xla process group timed out after %.0f s", timeout_s)


# -- run on the workers ------------------------------------------------------------------------------


def _describe_worker() -> WorkerInfo:
    import socket

    import ray.train

    ctx = ray.train.get_context()
    return WorkerInfo(
        world_rank=ctx.get_world_rank(),
        local_rank=ctx.get_local_rank(),
        node_rank=ctx.get_node_rank(),
        world_size=ctx.get_world_size(),
        local_world_size=ctx.get_local_world_size(),
        node_id=ray.get_runtime_context().get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        hostname=socket.gethostname(),
    )


def _free_ports(count: int) -> tuple[str, list[int]]:
    """This node's IP and ``count`` distinct free ports (all sockets held open together, so no repeats)."""
    import socket

    addr = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("", 0))
        return addr, [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _apply_env(env: dict[str, str]) -> None:
    if "torch_xla" in sys.modules:
        logger.warning("torch_xla was imported before the Neuron environment was set; PJRT may ignore it")
    os.environ.update(env)


def _init_xla_process_group(timeout_s: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import_torch_xla()  # a clear error when torch-neuronx is missing
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend and xla:// rendezvous)

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://", timeout=timedelta(seconds=timeout_s))


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
