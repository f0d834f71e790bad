"""glibc malloc settings for training workers whose step tensors live in host memory (``run.tune_malloc``).

Ray Train runs the training function in a thread, not in the worker's main thread. glibc gives such a
thread its own arena, made of 64 MB ``mmap``-ed heaps that are unmapped as soon as they are free again,
and it returns freed memory to the kernel by a threshold it keeps adjusting. A training step allocates
and frees the same activations every step, so on a CPU worker they page-fault back in every step:
measured on ``jobs/tiny.yaml`` (2 cores) 90k minor faults/s and 20% of the training thread's time in the
kernel, against 2 faults/s and 99% user time with these settings (README: Benchmarks).

The settings: one arena (the main one, ``brk``-based, as a plain script's main thread gets), a fixed
``mmap`` threshold (glibc's own dynamic maximum, 32 MB: bigger blocks are still mapped and unmapped),
and no trimming of free memory below 1 GB (the next step needs it again). An allocator choice of the
user's own wins: any ``MALLOC_*`` or ``GLIBC_TUNABLES`` variable, or a preloaded jemalloc / tcmalloc /
mimalloc, turns them off.

How they reach a worker: glibc reads the ``MALLOC_*`` variables once, at process start, and its ``mallopt`` sets the
same parameters in a running process. raytrn's own Ray Train backends call :func:`tune_this_process` on each
worker's main thread before the training thread exists (whose arena is the point), so the workers need no Ray
runtime environment for them: a Ray worker started with one goes through Ray's ``setup_worker.py`` and the runtime
env agent first (~1 CPU-second and ~1.2 s more to start, measured: docs/performance.md). The XLA path's Ray Train
backend is Ray's own; its workers still get the variables through ``worker_runtime_env`` (:func:`malloc_env`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

TUNED: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_allocator_settings(environ: Mapping[str, str]) -> list[str]:
    """The allocator settings already in ``environ`` (names, sorted): a user's choice that raytrn keeps."""
    found = sorted(k for k in environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    preload = environ.get("LD_PRELOAD", "")
    found += [f"LD_PRELOAD={lib}" for lib in _PRELOADED_ALLOCATORS if lib in preload]
    return found


def malloc_env(environ: Mapping[str, str], *, enabled: bool) -> dict[str, str]:
    """The variables to set on the training workers: :data:`TUNED`, or none when ``enabled`` is false or
    the user has set an allocator of their own (``environ`` is the driver's; a submitted job's ``env_vars``
    are in it)."""
    if not enabled or user_allocator_settings(environ):
        return {}
    return dict(TUNED)


#: glibc's ``mallopt`` parameters (``malloc.h``) for the variables of :data:`TUNED`.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


def tune_this_process(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set :data:`TUNED` in this running process with glibc's ``mallopt`` (call it before the threads it is for
    exist: a thread's arena is chosen at its first allocation), unless ``environ`` has an allocator setting of the
    user's own. On success the variables are put in ``environ`` too (:func:`describe` reads them; child processes
    start with them). False, changing nothing, where the C library is not glibc or refuses one."""
    if user_allocator_settings(environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:  # not glibc (musl has no mallopt, macOS's libc neither)
        log.debug("run.tune_malloc: no mallopt in this C library (%s): glibc defaults kept", e)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for name, param in _MALLOPT.items():
        if mallopt(param, int(TUNED[name])) != 1:
            log.warning("run.tune_malloc: glibc refused %s=%s; this worker's allocator is not tuned", name, TUNED[name])
            return False
    environ.update(TUNED)
    return True


def describe(environ: Mapping[str, str]) -> str:
    """What this process's allocator runs with, for the run's ``worker.malloc`` tag."""
    settings = user_allocator_settings(environ)
    if not settings:
        return "glibc defaults"
    return " ".join(s if "=" in s else f"{s}={environ[s]}" for s in settings)
