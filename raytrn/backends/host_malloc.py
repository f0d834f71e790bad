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

They reach the worker processes through Ray's ``worker_runtime_env``, so they are in place when the process starts
(glibc reads them once, then). glibc's ``mallopt`` sets the same parameters in a running process (in a bare Ray
actor, called before a thread starts, its steps stopped faulting as with the variables: docs/performance.md); the
workers do not use it yet.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def describe(environ: Mapping[str, str]) -> str:
    """What this process's allocator runs with, for the run's ``worker.malloc`` tag."""
    settings = user_allocator_settings(environ)
    if not settings:
        return "glibc defaults"
    return " ".join(s if "=" in s else f"{s}={environ[s]}" for s in settings)
