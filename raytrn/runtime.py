"""Connecting to Ray: reuse the current connection, a cluster named by RAY_ADDRESS, or start a local one."""

from __future__ import annotations

import logging
import math
import os
import subprocess
from collections.abc import Mapping, MutableMapping

from raytrn.compat import PREEMPTION_WATCHER_ENV
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
LOCAL_RAY_DEFAULTS = {PREEMPTION_WATCHER_ENV: "0"}


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


# Settings of this shell the job needs on the cluster: where to track, how to reach S3 / the model hub.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = ("MLFLOW_", "AWS_", "RAYTRN_")
FORWARDED_ENV_NAMES: tuple[str, ...] = ("HF_TOKEN", "HF_ENDPOINT")
# They name files on this machine, meaningless on the cluster (which uses its instance role instead).
NOT_FORWARDED: frozenset[str] = frozenset({"AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"})


def forwarded_env(environ: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` passed to the job (MLflow, AWS, HF token), plus ``extra`` (wins).

    ``raytrn submit`` puts them in the job's runtime env, which the cluster's dashboard shows to whoever can
    reach it; the tracking actor gets them too (:func:`raytrn.tracking.actor.driver_env`).
    """
    env = {
        k: v
        for k, v in environ.items()
        if (k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES) and k not in NOT_FORWARDED
    }
    env.update(extra or {})
    return env


def git_commit(path: str | os.PathLike[str]) -> str | None:
    """HEAD of the repository at ``path`` (with ``-dirty`` when it has uncommitted changes), or None."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def process_started_at() -> float:
    """When this process started (wall clock): ``raytrn train``'s start for the driver, a worker group's start
    for a training worker."""
    import psutil

    return float(psutil.Process().create_time())
