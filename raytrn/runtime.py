"""Connecting to Ray: reuse the current connection, a cluster named by RAY_ADDRESS, or start a local one."""

from __future__ import annotations

import logging
import math
import os


def ensure_ray(min_cpus: float = 0) -> None:
    """Initialise Ray once per process.

    Inside ``ray job submit`` (RAY_ADDRESS is set) this connects to the cluster; on a laptop with no
    cluster it starts an embedded local Ray with at least ``min_cpus`` logical CPUs (so that training
    workers that take every core still leave a slot for Ray Data's read tasks). An existing
    connection (tests, notebooks) is reused.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:  # "local": never attach to a stale cluster by accident; set RAY_ADDRESS to use one
        cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
        ray.init(address="local", num_cpus=cpus, logging_level=logging.WARNING)
