"""Ray's own lines: where a run's go (a log file beside the run, or Ray's log directory under a Ray job), which of them
stay on the terminal, and how raytrn's own log records in Ray's workers and actors are marked so the driver keeps them.
:func:`raytrn.runtime.ensure_ray` applies :func:`route_ray_output` as it starts or connects to Ray.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from raytrn.compat import RayPrint, node_logs_dir, quiet_ray_train_logs, route_worker_output, write_worker_lines

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


#: Where ``raytrn train`` and ``raytrn sweep`` keep Ray's lines (``<dir>/<run or sweep name>.log``), relative to
#: the directory they run in, like ``checkpoints/`` and ``mlruns/``.
RAY_LOG_DIR = "logs"
#: Forwarded lines that stay on the terminal: raytrn's own (its prints, and its log records in workers and
#: actors, :func:`mark_raytrn_logs`) and a worker killed for memory (the raylet says so).
USER_LINES = re.compile(r"^raytrn\b|running low on memory|out of memory|OutOfMemoryError", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def route_ray_output(name: str, *, verbose: bool = False, directory: str = RAY_LOG_DIR) -> str | None:
    """Once :func:`raytrn.runtime.ensure_ray` starts (or connects to) Ray in this process: Ray's own lines go to a log
    file (appended; its path printed once), not between raytrn's on the terminal. They are the workers' and actors'
    forwarded output (Ray Train's worker-group start, ranks, a failed worker's traceback, a killed one's stack frames,
    Ray Data's notices), the raylet's warnings and the driver's ``ray`` logger below ERROR (the token-auth notice).
    The terminal keeps raytrn's own lines (one per failure, resize or notice: :mod:`raytrn.train.events`), the errors
    that need the user (:data:`USER_LINES`) and Ray's driver-side errors.

    On a stdout that is not a terminal, the lines Ray prints here come without its colour codes
    (``RAY_COLOR_PREFIX=0`` unless set). The file: ``<directory>/<name>.log`` (returned); in a Ray job's driver
    (``ray job submit``, ``raytrn submit``, a sweep's driver), ``raytrn-<name>.log`` in Ray's own log directory of
    the driver's node, beside the job's driver log (``ray logs`` and the dashboard list it; its path is known once
    connected: None is returned). Nothing changes with ``verbose`` (None), nor when Ray is connected already (a
    test's or notebook's Ray): ``ensure_ray`` then starts nothing. Nothing is written before Ray starts (a job
    refused first leaves no file).
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


def start_routing() -> None:
    """Apply :func:`route_ray_output` before ``ray.init`` (once); :func:`routing_started` after it."""
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


def routing_started() -> None:
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
