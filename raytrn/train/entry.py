"""The function Ray Train runs on every worker: what the driver hands Ray Train.

It imports the training loop on the worker, so that the driver, which never trains, does not pay the loop's
imports (torch, its distributed checkpointing, Ray Data: ~1.7 s measured here) before it asks for a worker.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: The training loop of each ``scaling.recovery``, and its function: the module is what each worker's backend
#: imports beside Ray Train's set-up of the worker (``ProcessGroupConfig.ahead``), before this function runs.
LOOPS = {
    "restart": ("raytrn.train.loop", "train_loop_per_worker"),
    "live": ("raytrn.train.live_loop", "live_loop_per_worker"),
}


def loop_of(job: JobSpec) -> tuple[str, str]:
    """The loop ``job``'s workers run: its module and function (:data:`LOOPS`)."""
    return LOOPS["live" if job.scaling.recovery == "live" else "restart"]


def loop_module(job: JobSpec) -> str:
    """The module of the loop ``job``'s workers run (:func:`loop_of`)."""
    return loop_of(job)[0]


def train_fn(config: dict[str, Any]) -> None:
    """Train the job of the driver's plan (``config``) on this worker (:func:`raytrn.train.loop.train_loop_per_worker`;
    under ``scaling.recovery: live``, :func:`raytrn.train.live_loop.live_loop_per_worker`)."""
    from raytrn.train.plan import WorkerPlan

    try:
        module, function = loop_of(WorkerPlan.from_config(config).job)  # the worker's imports (the module docstring)
        getattr(importlib.import_module(module), function)(config)
    finally:
        posts_submitted()


def posts_submitted() -> None:
    """Wait until this worker's last fire-and-forget posts (rank 0's final metrics and goodput: :mod:`raytrn.tracking.
    sender`) are submitted, before Ray Train hears that the worker is done: the driver reads the board then."""
    from raytrn.tracking.sender import sender

    try:
        sender().drain()
    except Exception as e:  # noqa: BLE001 - never in place of the training's own outcome
        log.warning("some of this worker's progress posts were not sent: %s", e)
