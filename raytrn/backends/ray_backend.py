"""raytrn's Ray Train backend for its torch.distributed accelerators (cpu, cuda; neuron builds on it): before the
training function runs, each worker gets its torch.distributed environment, forms its process group, and installs
the SIGTERM handler that turns the signal into a checkpoint (:func:`raytrn.sigterm.install_sigterm_handler`).

Ray Train's public ``Backend`` / ``BackendConfig``, not ``ray.train.torch.TorchConfig``: importing that module
imports torch (~1 s of the driver's start-up, which needs no torch), and its backend makes four round trips to the
workers where two do (rank 0's address and a free port, then every worker at once: environment, process group,
handler). Workers read their ranks from ``ray.train.get_context()``. A group's process group goes with its processes.

The variables a worker needs from the driver (the S3 endpoint, the sample trace) and ``run.tune_malloc``'s allocator
settings travel in the config and are set first, in the worker (:func:`prepare_worker`), not as a Ray runtime
environment: a worker with one starts through Ray's runtime env agent and ``setup_worker.py`` (~1 CPU-second and
~1.2 s more per worker, at every start and restart: docs/performance.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.train.backend import Backend as RayBackend
from ray.train.backend import BackendConfig

from raytrn.ahead import import_ahead, wait_for
from raytrn.backends.neuron_ray import free_ports

log = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """The process group every worker forms (``backend``: gloo, nccl, neuron) and its collectives' timeout; what
    each worker sets before it (:func:`prepare_worker`): ``worker_env`` (variables) and ``tune_malloc``; what it
    imports after it, beside Ray Train's set-up of its training function: ``ahead``."""

    backend: str = "gloo"
    timeout_s: float = 1800
    worker_env: dict[str, str] = field(default_factory=dict)
    tune_malloc: bool = False
    #: Modules each worker imports in the background once its process group is up (:func:`import_ahead`).
    ahead: tuple[str, ...] = ()
    #: Whether each worker imports torch and raytrn's training modules as its actor is constructed, before this
    #: backend sets it up (:mod:`raytrn.compat.worker`; every torch import of this backend's on the worker waits for
    #: that one: :func:`raytrn.ahead.wait_for`).
    import_at_construction: bool = True

    @property
    def backend_cls(self) -> type:
        return ProcessGroupBackend

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "timeout_s": self.timeout_s}

    @property
    def worker_timeout_s(self) -> float | None:
        """How long a worker may leave Ray Train's health checks unanswered before it counts failed (None: Ray's
        own, 600 s: a group restarted over a frozen worker has the hang watchdog of the others)."""
        return None


class ProcessGroupBackend(RayBackend):  # type: ignore[misc]
    #: As Ray's torch backend: each GPU worker sees its node's GPUs of the group (NCCL's peer access).
    share_cuda_visible_devices = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        master_addr, ports = worker_group.execute_single(0, free_ports, 1)
        c = backend_config
        warn_without_handler(
            worker_group.execute(
                start_worker, master_addr, ports[0], c.backend, c.timeout_s, c.worker_env, c.tune_malloc, c.ahead
            )
        )

    # No ``on_shutdown``: Ray kills the workers right after it, and destroying a process group whose peer is gone
    # or frozen waits for Ray's process-group shutdown timeout (30 s) before a restarted group can start.


def warn_without_handler(installed: list[bool]) -> None:
    """One warning when some workers of a group (``installed``: each one's answer) have no SIGTERM handler."""
    if not all(installed):
        log.warning("SIGTERM handler not installed on %d of %d workers", installed.count(False), len(installed))


def torch_distributed_env(master_addr: str, master_port: int) -> dict[str, str]:
    """This worker's torch.distributed variables (``torchrun``'s names) from its Ray Train context."""
    import ray.train

    ctx = ray.train.get_context()
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(ctx.get_world_rank()),
        "WORLD_SIZE": str(ctx.get_world_size()),
        "LOCAL_RANK": str(ctx.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
        "NODE_RANK": str(ctx.get_node_rank()),
    }


def prepare_worker(env: Mapping[str, str], tune_malloc: bool) -> None:
    """First on a worker's main thread, before the training thread exists: the driver's ``env`` and, with
    ``tune_malloc``, the allocator settings (:func:`raytrn.backends.host_malloc.tune_this_process`; an allocator
    setting of the worker's own environment wins)."""
    os.environ.update(env)
    if tune_malloc:
        from raytrn.backends.host_malloc import tune_this_process

        tune_this_process()


def start_worker(
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    tune_malloc: bool = False,
    ahead: Sequence[str] = (),
) -> bool:
    """On a worker's main thread: the driver's variables and the allocator (:func:`prepare_worker`), its
    torch.distributed environment, the SIGTERM handler, then its process group, then the imports ``ahead`` of the
    training function (:func:`import_ahead`). Returns whether the handler is installed."""
    from raytrn.sigterm import install_sigterm_handler

    prepare_worker(env or {}, tune_malloc)
    os.environ.update(torch_distributed_env(master_addr, master_port))
    installed = install_sigterm_handler()
    init_process_group(backend, timeout_s)
    import_ahead(ahead)  # after the rendezvous: these imports do not delay the other workers' process group
    return installed


def init_process_group(backend: str, timeout_s: float) -> None:
    """``init_process_group(backend, init_method="env://")`` from the worker's variables (once per process)."""
    from datetime import timedelta

    wait_for("torch")  # its import ahead, if any, first (raytrn.ahead: never a torch submodule beside it)
    import torch.distributed as dist

    if backend == "nccl":  # as Ray's torch backend: the worker's own GPU before NCCL starts
        import ray.train.torch
        import torch

        torch.cuda.set_device(ray.train.torch.get_device())
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=timeout_s),
        )
