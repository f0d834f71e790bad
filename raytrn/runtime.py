"""Connecting to Ray: reuse the current connection, a cluster named by RAY_ADDRESS, or start a local one."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import MutableMapping

from raytrn.errors import RaytrnError


def ensure_ray(min_cpus: float = 0) -> bool:
    """Initialise Ray once per process.

    Inside ``ray job submit`` (RAY_ADDRESS is set) this connects to the cluster; on a laptop with no
    cluster it starts an embedded local Ray with at least ``min_cpus`` logical CPUs (so that training
    workers that take every core still leave a slot for Ray Data's read tasks). An existing
    connection (tests, notebooks) is reused. Returns True when it started an embedded local Ray.
    """
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, TimeoutError, ValueError) as e:
            raise RaytrnError(
                f"cannot connect to the Ray cluster at RAY_ADDRESS={address!r}: {e}; check the address (and the "
                "SSH tunnel, e.g. `ray dashboard cluster.yaml`), or unset RAY_ADDRESS to run on a local Ray"
            ) from None
        return False
    # address="local": never attach to a stale cluster by accident; set RAY_ADDRESS to use one.
    set_local_ray_defaults(os.environ)
    cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
    ray.init(address="local", num_cpus=cpus, logging_level=logging.WARNING)
    return True


#: Ray settings for an embedded local Ray (the user's own values win): one machine cannot be preempted, so
#: Ray Train's preemption watcher (an actor polling the nodes) would only cost start-up time.
LOCAL_RAY_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def set_local_ray_defaults(environ: MutableMapping[str, str]) -> None:
    """Apply :data:`LOCAL_RAY_DEFAULTS` to ``environ`` where unset (before ``ray.init`` starts the processes)."""
    for key, value in LOCAL_RAY_DEFAULTS.items():
        environ.setdefault(key, value)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast with a clear message: ray.init retries an unreachable GCS for minutes."""
    import socket

    if address.startswith(("http://", "https://")):
        raise RaytrnError(
            f"RAY_ADDRESS={address!r} is a dashboard (job submission) URL, not a cluster address; submit the job "
            f"with `ray job submit --address {address} --working-dir . -- raytrn train JOB.yaml`, or unset "
            "RAY_ADDRESS to run on a local Ray"
        )
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RaytrnError(f"RAY_ADDRESS={address!r}: expected HOST:PORT of the Ray head (GCS), e.g. 10.0.0.5:6379")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RaytrnError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address!r} ({e}); check the address, or unset RAY_ADDRESS "
            "to run on a local Ray"
        ) from None
