"""The function Ray Train runs on every worker: what the driver hands Ray Train.

It imports the training loop on the worker, so that the driver, which never trains, does not pay the loop's
imports (torch, its distributed checkpointing, Ray Data: ~1.7 s measured here) before it asks for a worker.
"""

from __future__ import annotations

from typing import Any


def train_fn(config: dict[str, Any]) -> None:
    """Train the job of the driver's plan (``config``) on this worker (:func:`raytrn.train.loop.train_loop_per_worker`;
    under ``scaling.recovery: live``, :func:`raytrn.train.live_loop.live_loop_per_worker`)."""
    from raytrn.train.plan import WorkerPlan

    if WorkerPlan.from_config(config).job.scaling.recovery == "live":
        from raytrn.train.live_loop import live_loop_per_worker

        live_loop_per_worker(config)
        return
    from raytrn.train.loop import train_loop_per_worker  # the worker's imports (see the module docstring)

    train_loop_per_worker(config)
