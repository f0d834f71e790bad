"""Ray Train's worker actor, which starts raytrn's imports as it is constructed (a private Ray Train class).

Ray Train V2 makes every training worker an actor of ``RayTrainWorker`` (``WorkerGroup._worker_cls``), then sets it up
in round trips from the controller (its metadata, its train context, its log paths, the backend's process group)
before it starts the training function, which imports the training loop (torch, its distributed checkpointing,
raytrn's training modules). This subclass, of the same name, starts those imports in a thread of the worker as its
actor is constructed (:mod:`raytrn.ahead`), so that they run during that set-up. The hosted controller's worker
groups make their workers of it when the backend is raytrn's own (its functions wait for torch's import before they
touch torch: :func:`raytrn.ahead.wait_for`); the XLA path's (Ray's ``TorchConfig``) keeps Ray's class.

Public alternative: none. Ray Train has no option for its worker class; a runtime environment's
``worker_process_setup_hook`` would run code as the process starts, but every worker with a runtime environment starts
through Ray's runtime env agent (~1 CPU-second and ~1.2 s more per worker: docs/performance.md).
"""

from __future__ import annotations

from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker as _RayTrainWorker

from raytrn.ahead import import_ahead

#: What every raytrn training loop imports (both of :data:`raytrn.train.entry.LOOPS`), torch first: ~3.3 of the ~3.5
#: CPU-seconds either loop's import takes in a Ray Train worker (the rest, the loop itself, follows the process group).
AT_CONSTRUCTION = ("torch", "raytrn.train.build", "raytrn.train.checkpointer", "raytrn.checkpoint.sharded")


class RayTrainWorker(_RayTrainWorker):  # type: ignore[misc]
    """Ray Train's worker (its name kept: process titles, Ray's dashboard), importing :data:`AT_CONSTRUCTION` ahead."""

    def __init__(self) -> None:
        super().__init__()
        import_ahead(AT_CONSTRUCTION)
