"""glibc malloc settings for training workers whose step tensors live in host memory (``run.tune_malloc``).

Ray Train runs the training function in a thread, not in the worker's main thread. glibc gives such a thread its own
arena, made of 64 MB ``mmap``-ed heaps that go back to the kernel as soon as they are free again; it serves a large
block (over a threshold that starts at 128 kB and rises to 32 MB at most) with an ``mmap`` of its own, unmapped at
``free``; and it returns freed memory to the kernel by a threshold it keeps adjusting. A training step allocates and
frees the same activations every step, so on a CPU worker they page-fault back in every step: measured on
``jobs/tiny.yaml`` with one worker (2 cores) 110-140k minor faults/s in the training thread with glibc's defaults, 0
with these settings, 9,200-10,000 tokens/s against 7,000-7,200 (docs/performance.md).

The settings (:data:`TUNED`): one arena (``M_ARENA_MAX``); blocks up to 1 GB from the arena, not mapped one by one
(``M_MMAP_THRESHOLD``: the tiny job's logits, 16 x 128 x 4096 floats, are 32 MB, exactly glibc's usual maximum, and
were mapped and unmapped every step until 2026-12-02 with a 32 MB threshold); free memory kept up to 1 GB
(``M_TRIM_THRESHOLD``) and 64 MB at an arena's top (``M_TOP_PAD``: a thread arena's heap is then never unmapped when
it falls free). An allocator choice of the user's own wins: any ``MALLOC_*`` or ``GLIBC_TUNABLES`` variable, or a
preloaded jemalloc / tcmalloc / mimalloc, turns them off.

How they reach a worker: raytrn's own Ray Train backends call :func:`tune_this_process` (glibc's ``mallopt``) on each
worker's main thread before the training thread exists, so the workers need no Ray runtime environment for them: a
Ray worker started with one goes through Ray's ``setup_worker.py`` and the runtime env agent first (~1 CPU-second and
~1.2 s more to start, measured: docs/performance.md). By then Ray's own threads have arenas, so the training thread
may get one of those, not the main arena: ``M_TOP_PAD`` is what keeps such an arena's heaps mapped, and a block over
a heap's 64 MB is still mapped and unmapped there (set the variables yourself, in the workers' environment, for steps
with blocks that big: glibc reads them at process start and every thread then uses the main arena). The XLA path's Ray
Train backend is Ray's own; its workers get the variables through ``worker_runtime_env`` (:func:`malloc_env`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

TUNED: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
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
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


def tune_this_process(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set :data:`TUNED` in this running process with glibc's ``mallopt`` (call it before the threads it is for
    exist: a thread's arena is chosen at its first allocation), unless ``environ`` has an allocator setting of the
    user's own. On success the variables are put in ``environ`` too (:func:`describe` reads them; child processes
    start with them). False, changing nothing, where the C library is not glibc or refuses one."""
    if user_allocator_settings(environ):
        return False
    try:
        # the symbols the process has loaded (the C library's among them): ctypes.util.find_library would run
        # ``ldconfig -p`` (a process at every worker start: seen in the startup test's census)
        mallopt = ctypes.CDLL(None).mallopt
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
