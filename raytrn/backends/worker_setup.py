"""What the driver hands its training workers besides the plan: the variables they need from its environment (the S3
endpoint and region, the sample trace) and ``run.tune_malloc``'s allocator settings (:mod:`raytrn.backends.host_malloc`).

raytrn's own Ray Train backends (:class:`~raytrn.backends.ray_backend.ProcessGroupConfig` and its subclasses: cpu,
cuda, neuron, live recovery) take them in their config (the allocator settings as ``tune_malloc``) and set them first
on each worker's main thread (:func:`~raytrn.backends.ray_backend.prepare_worker`; glibc's ``mallopt`` for the
allocator). As a Ray runtime environment they would put every worker's
start through Ray's runtime env agent and ``setup_worker.py``: ~1 CPU-second and ~1.2 s more per worker, at every
start and restart (docs/performance.md). The XLA path's backend is Ray's own ``TorchConfig``; its workers get them
as ``worker_runtime_env``, as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from raytrn.backends.host_malloc import malloc_env, user_allocator_settings
from raytrn.data.order import PACE_ENV, SAMPLE_TRACE_ENV

if TYPE_CHECKING:
    from raytrn.backends.base import Backend
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: The S3 endpoint and region the driver uses reach the workers too (they write sharded checkpoints themselves).
S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")


def driver_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's variables every worker needs: its S3 endpoint and region (:data:`S3_ENV`; credentials are never
    copied), where to write the sample trace and the feed's pace (``RAYTRN_SAMPLE_TRACE``, ``RAYTRN_PACE_S``, see
    :mod:`raytrn.data.feed`)."""
    return {k: environ[k] for k in (*S3_ENV, SAMPLE_TRACE_ENV, PACE_ENV) if environ.get(k)}


def malloc_variables(job: JobSpec, backend: Backend, environ: Mapping[str, str]) -> dict[str, str]:
    """``run.tune_malloc``'s variables for the workers (:func:`~raytrn.backends.host_malloc.malloc_env`): the job's
    choice (None: the backend's default), none when the driver's ``environ`` has an allocator setting of the user's
    own (a submitted job's ``env_vars`` are in it: said once in the log)."""
    enabled = backend.tune_malloc if job.run.tune_malloc is None else job.run.tune_malloc
    env = malloc_env(environ, enabled=enabled)
    if enabled and not env:
        log.info("run.tune_malloc: keeping your allocator settings (%s)", ", ".join(user_allocator_settings(environ)))
    return env


def worker_setup(
    job: JobSpec,
    backend: Backend,
    config: Any,
    environ: Mapping[str, str] = os.environ,
    *,
    ahead: tuple[str, ...] = (),
) -> tuple[Any, dict[str, Any]]:
    """``(backend config, worker_runtime_env)`` for Ray Train: raytrn's own backend configs carry the driver's
    variables, the allocator choice and the modules the workers import ``ahead`` of the training function (the
    runtime env stays empty); any other (the XLA path's) gets the first two as a runtime env."""
    from raytrn.backends.ray_backend import ProcessGroupConfig

    variables, malloc = driver_variables(environ), malloc_variables(job, backend, environ)
    if isinstance(config, ProcessGroupConfig):
        return replace(config, worker_env=variables, tune_malloc=bool(malloc), ahead=ahead), {}
    env = {**malloc, **variables}
    return config, {"env_vars": env} if env else {}
