"""What both Trainium Ray Train backends do on the workers before training: find out where Ray placed each
worker, check the placement, set each worker's environment, and tear the process group down.

:mod:`raytrn.backends.neuron` (TorchNeuron, trn2/trn3) and :mod:`raytrn.xla.neuron_xla` (the frozen
XLA path, trn1) differ only in the environment they compute (pure functions in
:mod:`raytrn.backends.neuron_env`) and the process group they form. Nothing here ever kills a process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from raytrn.backends.neuron_env import check_tp_groups
from raytrn.errors import BackendError

logger = logging.getLogger(__name__)


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
    #: ``NEURON_RT_VISIBLE_CORES`` as Ray set it from the worker's ``neuron_cores`` (None: Ray assigned none).
    visible_cores: str | None = None


def plan_worker_envs(
    workers: list[WorkerInfo],
    *,
    workers_per_node: int,
    tensor_parallel_size: int,
    env_for: Callable[[WorkerInfo], dict[str, str]],
) -> list[dict[str, str]]:
    """``env_for(worker)`` for each worker, in the order of ``workers``; BackendError if Ray's placement is unusable.

    Checks what Ray actually placed: ranks 0..n-1, ``workers_per_node`` workers on every node (or one
    partial node), no tensor-parallel group across nodes, and no NeuronCore given to two workers of a node.
    """
    n = len(workers)
    by_rank = sorted(workers, key=lambda w: w.world_rank)
    if [w.world_rank for w in by_rank] != list(range(n)) or any(w.world_size != n for w in workers):
        raise BackendError(f"worker ranks {sorted(w.world_rank for w in workers)} are not 0..{n - 1}")
    per_node = Counter(w.node_id for w in by_rank)
    expected = min(workers_per_node, n)
    hosts = {w.node_id: w.hostname for w in by_rank}
    if any(count != expected for count in per_node.values()):
        placed = ", ".join(f"{hosts[node]}: {count}" for node, count in per_node.items())
        raise BackendError(
            f"Ray placed {n} workers unevenly over {len(per_node)} node(s) ({placed}); Neuron needs "
            f"scaling.workers_per_node={workers_per_node} workers on every node (or one partial node). "
            "Make sure each node's NeuronCores are free for this job"
        )
    check_tp_groups([w.node_id for w in by_rank], tensor_parallel_size)
    seen: dict[tuple[str, str], int] = {}
    for w in by_rank:
        if w.visible_cores is None:
            continue
        other = seen.setdefault((w.node_id, w.visible_cores), w.world_rank)
        if other != w.world_rank:
            raise BackendError(
                f"ranks {other} and {w.world_rank} on {w.hostname} were both given NeuronCore(s) "
                f"{w.visible_cores} by Ray; each worker needs its own core (scaling.resources_per_worker: "
                "neuron_cores: 1)"
            )
    return [env_for(w) for w in workers]


def config_dict(config: Any, base: dict[str, Any]) -> dict[str, Any]:
    """A backend config's ``to_dict``: ``base`` (``TorchConfig``'s) plus every field the subclass adds, copied."""
    import dataclasses

    out = dict(base)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out.setdefault(f.name, dict(value) if isinstance(value, dict) else value)
    return out


def set_up_workers(
    worker_group: Any, plan: Callable[[list[WorkerInfo], str, list[int]], list[dict[str, str]]], ports: int
) -> list[dict[str, str]]:
    """Ask every worker where it runs, take ``ports`` free ports on rank 0's node, and apply
    ``plan(workers, master_addr, ports)``'s environments, each to its worker. Returns the environments."""
    infos: list[WorkerInfo] = worker_group.execute(describe_worker)
    rank0 = next((i for i, w in enumerate(infos) if w.world_rank == 0), None)
    if rank0 is None:
        raise BackendError("no worker has world rank 0")
    master_addr, free = worker_group.execute_single(rank0, free_ports, ports)
    envs = plan(infos, master_addr, free)
    ray.get([worker_group.execute_single_async(i, apply_env, env) for i, env in enumerate(envs)])
    return envs


def shut_down_process_group(worker_group: Any, what: str) -> None:
    """Destroy each worker's default process group, waiting at most Ray Train's process-group shutdown timeout."""
    from ray.exceptions import GetTimeoutError
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )

    timeout_s = float(
        os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
    )
    try:
        ray.get(worker_group.execute_async(destroy_process_group), timeout=timeout_s)
    except GetTimeoutError:
        logger.warning("destroying the %s process group timed out after %.0f s", what, timeout_s)


# -- run on the workers ------------------------------------------------------------------------------


def describe_worker() -> WorkerInfo:
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
        visible_cores=os.environ.get("NEURON_RT_VISIBLE_CORES") or None,
    )


def free_ports(count: int) -> tuple[str, list[int]]:
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


def apply_env(env: dict[str, str]) -> None:
    """Set the worker's environment. torch-xla reads it once, at import (TorchNeuron, which PyTorch's device
    autoload may import with torch, reads it when the runtime starts: at the first neuron tensor)."""
    if "torch_xla" in sys.modules:
        logger.warning("torch_xla was imported before the Neuron environment was set; PJRT may ignore it")
    os.environ.update(env)


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
