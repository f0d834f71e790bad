"""A live replica's preemption notice: its node is being drained, or its process got a SIGTERM.

Ray Train V2 (2.60) runs no preemption watcher for replica groups (its controller turns it off when the backend
has ``has_replica_groups``), so a live job learns of a drain from raytrn's own: the driver, which serves the live
group's store, polls Ray's draining nodes every second and sets one store key per draining node
(:func:`raytrn.backends.live_ray.watch_draining`); each replica reads its own node's key once per step. A SIGTERM
to the worker (a scheduler's stop; raytrn's handler flags it, :mod:`raytrn.sigterm`) is a notice too.

A replica with a notice announces in its next step that it leaves after it (:meth:`LiveGroup.mark_leaving`), trains
its share of that step, and leaves; the others re-form without it at once and train on: the step in flight is not
redone and nobody waits for its heartbeat to stand still. When every replica has one, there is nothing to re-form:
they save a checkpoint of that step and wait for their nodes to go, as the restart path does on a notice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raytrn.sigterm import sigterm_received


class LiveNotice:
    """Whether this replica has a preemption notice (it stays once seen): ``reason`` says which, or None."""

    def __init__(self, store: Any, draining_key: str, sigterm: Callable[[], bool] = sigterm_received) -> None:
        self.store, self.draining_key, self._sigterm = store, draining_key, sigterm
        self._reason: str | None = None

    def reason(self) -> str | None:
        """``SIGTERM to this worker``, ``its node is draining`` or None (one store read a call until one is seen)."""
        if self._reason is None:
            if self._sigterm():
                self._reason = "SIGTERM to this worker"
            elif self.store.check([self.draining_key]):
                self._reason = "its node is draining"
        return self._reason


__all__ = ["LiveNotice"]
