"""Connecting to Ray: reuse the current connection, a cluster named by RAY_ADDRESS, or start a local one; and
keeping Ray's own lines off the terminal (:func:`route_ray_output`).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from raytrn.compat import (
    PREEMPTION_WATCHER_ENV,
    PRESTART_WORKERS_ENV,
    RayPrint,
    node_logs_dir,
    quiet_ray_train_logs,
    route_worker_output,
    stop_local_monitor,
    write_worker_lines,
)
from raytrn.config import relative_local_paths
from raytrn.errors import RaytrnError
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
    _start_routing()
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, TimeoutError, ValueError) as e:
            raise RaytrnError(
                f"cannot connect to the Ray cluster at RAY_ADDRESS={redact_uri(address)!r}: {e}; check the address (and the "
                "SSH tunnel, e.g. `ray dashboard cluster.yaml`), or unset RAY_ADDRESS to run on a local Ray"
            ) from None
        _routing_started()
        return False
    # address="local": never attach to a stale cluster by accident; set RAY_ADDRESS to use one.
    set_local_ray_defaults(os.environ)
    quiet_local_token_notice()
    cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
    started = ray.init(address="local", num_cpus=cpus, logging_level=logging.WARNING, include_dashboard=dashboard)
    atexit.register(stop_local_monitor)  # before Ray's shutdown at exit (registered first): 1 s sooner
    _routing_started()
    if dashboard and started.dashboard_url:
        print(f"raytrn: Ray dashboard: http://{started.dashboard_url}", flush=True)
    return True


#: How Ray 2.60's notice starts when a local Ray it starts turns token authentication on by default.
LOCAL_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _LocalTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(LOCAL_TOKEN_NOTICE)


def quiet_local_token_notice() -> None:
    """Keep Ray's notice that the embedded local Ray about to start uses token authentication (its own token, made
    for this machine: nothing for the user to do) off the terminal; where Ray's lines go to the run's log file
    (:func:`route_ray_output`) it stays there. Ray's other warnings (token authentication *disabled* among them)
    are untouched. Once per process: a filter on the ``ray`` logger's console handlers."""
    for handler in logging.getLogger("ray").handlers:
        console = isinstance(handler, logging.StreamHandler) and handler.stream is not _log_file
        if console and not any(isinstance(f, _LocalTokenNotice) for f in handler.filters):
            handler.addFilter(_LocalTokenNotice())


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


# -- Ray's own lines -------------------------------------------------------------------------------------

#: Where ``raytrn train`` and ``raytrn sweep`` keep Ray's lines (``<dir>/<run or sweep name>.log``), relative to
#: the directory they run in, like ``checkpoints/`` and ``mlruns/``.
RAY_LOG_DIR = "logs"
#: Forwarded lines that stay on the terminal: raytrn's own (its prints, and its log records in workers and
#: actors, :func:`mark_raytrn_logs`) and a worker killed for memory (the raylet says so).
USER_LINES = re.compile(r"^raytrn\b|running low on memory|out of memory|OutOfMemoryError", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def route_ray_output(name: str, *, verbose: bool = False, directory: str = RAY_LOG_DIR) -> str | None:
    """Once :func:`ensure_ray` starts (or connects to) Ray in this process: Ray's own lines go to a log file (appended;
    its path printed once), not between raytrn's on the terminal. They are the workers' and actors' forwarded output
    (Ray Train's worker-group start, ranks, a failed worker's traceback, a killed one's stack frames, Ray Data's
    notices), the raylet's warnings and the driver's ``ray`` logger below ERROR (the token-auth notice). The terminal
    keeps raytrn's own lines (one per failure, resize or notice: :mod:`raytrn.train.events`), the errors that need
    the user (:data:`USER_LINES`) and Ray's driver-side errors.

    On a stdout that is not a terminal, the lines Ray prints here come without its colour codes (``RAY_COLOR_PREFIX=0``
    unless set). The file: ``<directory>/<name>.log`` (returned); in a Ray job's driver (``ray job submit``, ``raytrn submit``, a
    sweep's driver), ``raytrn-<name>.log`` in Ray's own log directory of the driver's node, beside the job's driver
    log (``ray logs`` and the dashboard list it; its path is known once connected: None is returned). Nothing
    changes with ``verbose`` (None), nor when Ray is connected already (a test's or notebook's Ray): ``ensure_ray``
    then starts nothing. Nothing is written before Ray starts (a job refused first leaves no file).
    """
    global _ray_log_path, _verbose
    _verbose = verbose
    if not sys.stdout.isatty():  # Ray colours its lines' prefixes even for a file or a pipe (`ray job logs`, CI)
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if verbose:
        _ray_log_path = None
        return None
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        _ray_log_path = _InRayLogs(f"raytrn-{name}.log")
        return None
    path = os.path.abspath(os.path.join(directory, f"{name}.log"))
    _ray_log_path = path
    return path


class _InRayLogs:
    """A file named ``name`` in Ray's log directory of this node (known once connected)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> str | None:
        logs = node_logs_dir()
        return None if logs is None else os.path.join(logs, self.name)


_ray_log_path: str | _InRayLogs | None = None  # set by route_ray_output, applied by ensure_ray
_log_file: _PlainFile | None = None  # where Ray's lines go once ensure_ray applied route_ray_output
_verbose = False  # route_ray_output(verbose=True): Ray's lines stay on the terminal


def ray_train_console() -> logging.Handler:
    """Where Ray Train's controller, run in this process (:func:`raytrn.compat.hosted_trainer`), writes the lines it
    would print: the run's Ray log (:func:`route_ray_output`) when Ray's lines go there; all of them to stderr with
    ``--verbose``; else (a test's or notebook's Ray) stderr, warnings and errors only (raytrn prints its own line for
    each restart, resize and notice: :mod:`raytrn.train.events`)."""
    if _log_file is not None and _log_file.usable:
        handler: logging.Handler = logging.StreamHandler(_log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO if _verbose else logging.WARNING)
    return handler


def _start_routing() -> None:
    """Apply :func:`route_ray_output` before ``ray.init`` (once); :func:`_routing_started` after it."""
    global _ray_log_path, _log_file
    where, _ray_log_path = _ray_log_path, None
    if where is None:
        return
    if isinstance(where, str):
        try:
            os.makedirs(os.path.dirname(where), exist_ok=True)
        except OSError as e:  # not writable here: Ray's lines stay on the terminal
            _unroutable(where, e)
            return
    log_file = _PlainFile(where)
    if isinstance(where, str) and not log_file.open():
        return
    _log_file = log_file
    route_worker_output(_RayLines(log_file))
    ray_logger = logging.getLogger("ray")
    for handler in ray_logger.handlers:  # Ray's console handler: errors only
        if isinstance(handler, logging.StreamHandler):
            handler.setLevel(max(handler.level, logging.ERROR))
    file_handler = logging.StreamHandler(log_file)
    file_handler.setFormatter(logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
    ray_logger.addHandler(file_handler)
    if isinstance(where, str):
        print(f"raytrn: Ray's logs: {where}", flush=True)


def _routing_started() -> None:
    """After ``ray.init``: a file in Ray's log directory is opened now (its path printed, with how to read it)."""
    if _log_file is None or _log_file.path is not None:
        return
    if _log_file.open():
        name = os.path.basename(_log_file.path or "")
        print(f"raytrn: Ray's logs: {_log_file.path} (on the driver's node: `ray logs {name}`)", flush=True)


def _unroutable(path: str, e: OSError) -> None:
    print(f"raytrn: Ray's lines stay on the terminal ({path}: {e.strerror or e})", file=sys.stderr, flush=True)


def user_lines(lines: list[str]) -> list[str]:
    """The forwarded ``lines`` (one batch of one process) that stay on the terminal."""
    return [line for line in lines if USER_LINES.search(line)]


class _RayLines:
    """The handler of :func:`raytrn.compat.route_worker_output`: every batch to the log file, the lines that
    need the user to Ray's own printer too (every line, when the file could not be opened)."""

    def __init__(self, log_file: _PlainFile) -> None:
        self.log_file = log_file

    def __call__(self, data: dict[str, Any], ignore_prefix: bool, ray_print: RayPrint) -> None:
        if not self.log_file.usable:
            ray_print(data, ignore_prefix)
            return
        try:
            write_worker_lines(data, self.log_file, ignore_prefix)
        except Exception:  # the log file is best effort: never lose the terminal's lines over it
            pass
        if data.get("pid") == "autoscaler":
            return
        kept = user_lines(list(data.get("lines") or []))
        if kept:
            ray_print({**data, "lines": kept}, ignore_prefix)


class _PlainFile:
    """An appending, line-buffered text file that drops ANSI colour codes (Ray colours its prefixes). ``where``: its
    path, or a function that names it once it can (Ray's log directory, once connected); what is written before
    it is open waits in memory."""

    def __init__(self, where: str | Callable[[], str | None]) -> None:
        self._where = where
        self.path: str | None = None
        self._file: Any = None
        self._failed = False
        self._early: list[str] = []
        self._lock = threading.Lock()

    @property
    def usable(self) -> bool:
        """False once opening it failed (Ray's lines then stay on the terminal)."""
        return not self._failed

    def open(self) -> bool:
        """Open it now when its path is known; False (and one line on stderr) when it cannot be."""
        with self._lock:
            return self._open()

    def _open(self) -> bool:
        if self._file is not None or self._failed:
            return self._file is not None
        path = self._where if isinstance(self._where, str) else self._where()
        if path is None:
            return False
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process's life
        except OSError as e:
            self._failed = True
            _unroutable(path, e)
            return False
        self.path = path
        for text in self._early:
            self._file.write(text)
        self._early.clear()
        return True

    def write(self, text: str) -> int:
        text = _ANSI.sub("", text)
        with self._lock:
            if self._file is None and not self._open():
                if not self._failed:
                    self._early.append(text)
                return len(text)
            return int(self._file.write(text))

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()


#: The format of raytrn's log records in Ray workers and actors: the driver keeps ``^raytrn`` lines on the
#: terminal (:data:`USER_LINES`); every line of a record carries it (a traceback too).
RAYTRN_LOG_PREFIX = "raytrn: "
#: A routine record's (``extra=ROUTINE``: what raytrn does every checkpoint interval as the job asked, such as
#: retention's deletions): the run's Ray log keeps it, the terminal does not (it is not a :data:`USER_LINES` line).
ROUTINE_PREFIX = "(raytrn) "
_ROUTINE_KEY = "raytrn_routine"
ROUTINE = {_ROUTINE_KEY: True}


class _MarkedFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = ROUTINE_PREFIX if getattr(record, _ROUTINE_KEY, False) else RAYTRN_LOG_PREFIX
        first, *rest = super().format(record).splitlines() or [""]
        return "\n".join([prefix + first] + [prefix + "  " + line for line in rest])


def mark_raytrn_logs() -> None:
    """In a Ray worker or actor: print raytrn's log records to stderr as ``raytrn: LEVEL: message`` (once per
    process; not also through Ray Train's plain root handler), so the driver tells them from Ray's lines.
    Their level is the process's (the root logger's: INFO in a training worker, WARNING elsewhere). Anywhere
    else (the driver, a test calling an actor's class directly) raytrn's logging stays as it is."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    logger = logging.getLogger("raytrn")
    if any(isinstance(h.formatter, _MarkedFormatter) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_MarkedFormatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def worker_logging() -> None:
    """A training worker's logging: Ray Train's and Ray Data's chatty INFO loggers quieted, raytrn's marked."""
    quiet_ray_train_logs()
    mark_raytrn_logs()
