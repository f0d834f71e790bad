"""Connecting to Ray: reuse the current connection, a cluster named by RAY_ADDRESS, or start a local one (its Ray
lines kept off the terminal: :mod:`raytrn.ray_output`); the job's environment and paths as a Ray job sees them.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import subprocess
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from raytrn.compat import PREEMPTION_WATCHER_ENV, PRESTART_WORKERS_ENV, agent_on_any_port, stop_local_monitor
from raytrn.config import relative_local_paths
from raytrn.errors import RaytrnError
from raytrn.ray_output import quiet_local_token_notice, routing_started, start_routing
from raytrn.uris import redact_uri

if TYPE_CHECKING:
    from raytrn.config import JobSpec


def ensure_ray(min_cpus: float = 0) -> bool:
    """Initialise Ray once per process.

    Inside ``ray job submit`` (RAY_ADDRESS is set) this connects to the cluster; on a laptop with no
    cluster it starts an embedded local Ray with at least ``min_cpus`` logical CPUs (the training workers'
    CPUs, which may exceed the machine's cores). An existing
    connection (tests, notebooks) is reused. Returns True when it started an embedded local Ray.
    """
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    dashboard = False if address else local_ray_dashboard(os.environ)  # a bad value: refused before anything starts
    start_routing()
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, TimeoutError, ValueError) as e:
            raise RaytrnError(
                f"cannot connect to the Ray cluster at RAY_ADDRESS={redact_uri(address)!r}: {e}; check the address (and the "
                "SSH tunnel, e.g. `ray dashboard cluster.yaml`), or unset RAY_ADDRESS to run on a local Ray"
            ) from None
        routing_started()
        return False
    # address="local": never attach to a stale cluster by accident; set RAY_ADDRESS to use one.
    set_local_ray_defaults(os.environ)
    quiet_local_token_notice()
    cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
    with agent_on_any_port():  # not Ray's fixed one: another Ray here holding it would stall the start ~3.4 s
        started = ray.init(address="local", num_cpus=cpus, logging_level=logging.WARNING, include_dashboard=dashboard)
    atexit.register(stop_local_monitor)  # before Ray's shutdown at exit (registered first): 1 s sooner
    routing_started()
    if dashboard and started.dashboard_url:
        print(f"raytrn: Ray dashboard: http://{started.dashboard_url}", flush=True)
    return True


def starts_local_ray() -> bool:
    """Whether :func:`ensure_ray` would start an embedded local Ray: not connected yet, and no ``RAY_ADDRESS``."""
    import ray

    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


def connect(address: str | None) -> None:
    """Connect to the running Ray cluster at ``address`` (else RAY_ADDRESS): one clear error when there is none."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise RaytrnError(
            "no Ray cluster to talk to: set RAY_ADDRESS (the cluster's HOST:PORT, e.g. 10.0.0.5:6379) or pass --address"
        )
    os.environ["RAY_ADDRESS"] = address
    ensure_ray()


#: Ray settings for an embedded local Ray (the user's own values win): one machine cannot be preempted, so
#: Ray Train's preemption watcher (an actor polling the nodes) would only cost start-up time; and the raylet's idle
#: workers prestarted for the first driver (one per CPU) would only compete with the run's start for the CPU (cold
#: `raytrn train jobs/tiny.yaml` to its first step: 20.0-22.5 s instead of 22.6-25.4 here, docs/performance.md).
LOCAL_RAY_DEFAULTS = {PREEMPTION_WATCHER_ENV: "0", PRESTART_WORKERS_ENV: "0"}


#: ``RAYTRN_RAY_DASHBOARD=1`` (``raytrn train --ray-dashboard``): an embedded local Ray with its dashboard. Without it
#: the local Ray starts its dashboard process with no modules (``ray.init(include_dashboard=False)``): nothing of a
#: run uses them there, and their eleven processes cost ~3 CPU-seconds and 2-4 s of ``ray.init`` here (8.0-9.9 s
#: against 6.0-6.1 s, alternated; docs/performance.md). A cluster's dashboard (``ray start``) is not raytrn's to set.
DASHBOARD_ENV = "RAYTRN_RAY_DASHBOARD"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def local_ray_dashboard(environ: Mapping[str, str]) -> bool:
    """Whether an embedded local Ray starts with its dashboard (:data:`DASHBOARD_ENV`); one clear error for a value
    that is neither on nor off."""
    value = environ.get(DASHBOARD_ENV, "").strip().lower()
    if value not in _ON + _OFF:
        raise RaytrnError(
            f"{DASHBOARD_ENV}={environ[DASHBOARD_ENV]!r}: expected 1 (an embedded local Ray starts with its dashboard) "
            "or 0 (without, the default); unset it or pass `raytrn train --ray-dashboard`"
        )
    return value in _ON


def set_local_ray_defaults(environ: MutableMapping[str, str]) -> None:
    """Apply :data:`LOCAL_RAY_DEFAULTS` to ``environ`` where unset (before ``ray.init`` starts the processes)."""
    for key, value in LOCAL_RAY_DEFAULTS.items():
        environ.setdefault(key, value)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast with a clear message: ray.init retries an unreachable GCS for minutes."""
    import socket

    if address.lower().startswith(("http://", "https://")):
        raise RaytrnError(
            f"RAY_ADDRESS={redact_uri(address)!r} is a dashboard (job submission) URL, not a cluster address; submit the job "
            f"with `ray job submit --address {redact_uri(address)} --working-dir . -- raytrn train JOB.yaml`, or unset "
            "RAY_ADDRESS to run on a local Ray"
        )
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RaytrnError(
            f"RAY_ADDRESS={redact_uri(address)!r}: expected HOST:PORT of the Ray head (GCS), e.g. 10.0.0.5:6379"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RaytrnError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={redact_uri(address)!r} ({e}); check the address, or unset RAY_ADDRESS "
            "to run on a local Ray"
        ) from None


# Settings of this shell the job needs on the cluster: where to track, how to reach S3 / the model hub.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = ("MLFLOW_", "AWS_", "RAYTRN_")
FORWARDED_ENV_NAMES: tuple[str, ...] = ("HF_TOKEN", "HF_ENDPOINT")
#: The MLflow *server's* settings (its admin password, session secret, auth config and database URI, with the
#: database's password): a job is a client and never needs them, and a job's runtime env is readable by anyone
#: who can reach the cluster's dashboard.
MLFLOW_SERVER_SECRETS: frozenset[str] = frozenset(
    {
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
        "MLFLOW_AUTH_CONFIG_PATH",
        "MLFLOW_BACKEND_STORE_URI",
    }
)
# AWS_PROFILE names a profile of this machine's AWS files, meaningless on the cluster (which uses its instance role
# instead); RAYTRN_LOCAL_CLUSTER marks the processes of a local simulator (raytrn.cluster.local.MARKER_ENV), which
# only it may carry.
NOT_FORWARDED: frozenset[str] = frozenset({"AWS_PROFILE", "RAYTRN_LOCAL_CLUSTER"}) | MLFLOW_SERVER_SECRETS
#: Variables that name a file of the machine they are set on (AWS's config, credentials and web-identity token
#: files, CA bundle; MLflow's client certificates): a laptop's path, which the cluster does not have. Left out, with
#: any other forwarded variable whose value is a path that exists here (:func:`unforwarded_paths`).
LAPTOP_PATH_VARS: frozenset[str] = frozenset(
    {
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CA_BUNDLE",
        "MLFLOW_TRACKING_CLIENT_CERT_PATH",
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
    }
)


def forwarded_env(
    environ: Mapping[str, str], extra: Mapping[str, str] | None = None, *, same_machine: bool = False
) -> dict[str, str]:
    """The variables of ``environ`` passed to the job (MLflow, AWS, HF token), plus ``extra`` (wins: ``--env``).

    Paths of this machine (:func:`unforwarded_paths`) are left out unless the job runs on ``same_machine`` (the
    local simulator shares this filesystem). ``raytrn submit`` puts them in the job's runtime env, which the
    cluster's dashboard shows to whoever can reach it; the tracking actor gets them too
    (:func:`raytrn.tracking.actor.driver_env`).
    """
    env = {k: v for k, v in environ.items() if _forwardable(k) and (same_machine or not _laptop_path(k, v))}
    env.update(extra or {})
    return env


def unforwarded_paths(
    environ: Mapping[str, str], extra: Mapping[str, str] | None = None, *, same_machine: bool = False
) -> list[str]:
    """The variables :func:`forwarded_env` leaves out because they name a path of this machine: one of
    :data:`LAPTOP_PATH_VARS`, or a value that is an absolute path existing here (the cluster's own paths, such as
    a shared filesystem's, do not exist here and are forwarded). Given in ``extra``, a variable is forwarded."""
    if same_machine:
        return []
    return sorted(k for k, v in environ.items() if _forwardable(k) and k not in (extra or {}) and _laptop_path(k, v))


def _forwardable(key: str) -> bool:
    return (key.startswith(FORWARDED_ENV_PREFIXES) or key in FORWARDED_ENV_NAMES) and key not in NOT_FORWARDED


def _laptop_path(key: str, value: str) -> bool:
    if key in LAPTOP_PATH_VARS:
        return True
    path = os.path.expanduser(value.strip())
    return os.path.isabs(path) and os.path.exists(path)


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


def ray_job_working_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The working directory of this process when it is the driver of a Ray job submitted with a working dir
    (``ray job submit --working-dir``, ``raytrn submit``): a temporary copy of the upload that disappears with
    the job. None otherwise."""
    import json

    environ = os.environ if environ is None else environ
    try:
        config = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except json.JSONDecodeError:
        return None
    runtime_env = config.get("runtime_env") if isinstance(config, dict) else None
    if isinstance(runtime_env, dict) and runtime_env.get("working_dir"):
        return os.getcwd()
    return None


def check_paths_for_ray_job(job: JobSpec, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when ``job`` (unresolved: ``load_job(..., resolve=False)``) runs as a Ray job in a temporary
    working dir and names local paths relative to it: the dataset is not there (``data/`` is not uploaded),
    and checkpoints or an MLflow store written there vanish with the job. Nothing is checked elsewhere."""
    environ = os.environ if environ is None else environ
    wd = ray_job_working_dir(environ)
    if wd is None:
        return
    found = relative_local_paths(job)
    if job.tracking.enabled and job.tracking.mlflow_uri is None and not environ.get("MLFLOW_TRACKING_URI"):
        found["tracking.mlflow_uri"] = "null with no MLFLOW_TRACKING_URI here (the default sqlite:///mlruns/mlflow.db)"
    if found:
        raise relative_paths_error(
            f"{job.source}: this job runs in Ray's temporary copy of the uploaded working dir ({wd})",
            found,
            "(and an MLflow server: tracking.mlflow_uri, or MLFLOW_TRACKING_URI on the cluster). `raytrn submit` "
            "to the local simulator (`raytrn cluster up --local`) makes them absolute for you",
        )


def relative_paths_error(what: str, found: Mapping[str, str], fix: str) -> RaytrnError:
    """The one message for relative local paths a job cannot use where it runs (``raytrn submit`` to a cluster,
    a driver in a Ray job's temporary working dir): ``what`` happened, the fields, and how to fix them."""
    listed = "\n  ".join(f"{k}: {v}" for k, v in found.items())
    return RaytrnError(
        f"{what}, so these relative local paths would point inside a temporary copy of the working dir (data/, "
        f"checkpoints/ and mlruns/ are not uploaded) and what is written there is lost when the job ends:\n  "
        f"{listed}\nUse s3://BUCKET/PREFIX or an absolute path on the cluster's shared filesystem {fix}"
    )


def run_started_at() -> float:
    """When this process's run started (wall clock): the process's start for its first run (``raytrn train``: its
    imports count), the call's moment for a later one in the same process (a test's, a notebook's)."""
    global _runs_started
    _runs_started += 1
    return process_started_at() if _runs_started == 1 else time.time()


_runs_started = 0


def process_started_at() -> float:
    """When this process started (wall clock): ``raytrn train``'s start for the driver, a worker group's start
    for a training worker."""
    import psutil

    return float(psutil.Process().create_time())


def ray_job_submission_id() -> str | None:
    """The Ray job id when running under `ray job submit` (Ray puts it in the job config's metadata)."""
    if os.environ.get("RAY_JOB_SUBMISSION_ID"):
        return os.environ["RAY_JOB_SUBMISSION_ID"]
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    except json.JSONDecodeError:
        return None
    return (config.get("metadata") or {}).get("job_submission_id")


def trial_id() -> str:
    """The Ray Tune trial this process runs (a sweep's trial), or "" outside one."""
    try:
        from ray import tune

        return str(tune.get_context().get_trial_id() or "")
    except Exception:  # not in a trial
        return ""


def on_this_node() -> dict[str, Any]:
    """Ray options that place an actor on this process's node, strictly: the job's own actors (tracking,
    progress) live and die with the driver, never on a worker node an elastic job may lose. (A *soft* node
    affinity does not hold for zero-CPU actors: Ray spreads them over the cluster.)"""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=False
        )
    }
