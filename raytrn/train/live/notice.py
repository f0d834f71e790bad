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

A drain without a deadline does not end that wait: the replica that left waits in its train function for the run's
end, so its placement-group slot stays on the draining node, and a draining node takes no new work, so the node
stays busy until the run ends (docs/elasticity.md; with Ray Train's one placement group of before stop 92, even
after the replica's process exited: measured on a local Ray, an actor created in the slot never started). A drain's
deadline only says when the node will be shut down (a spot notice's: by the cloud); until then the same holds. The
replica says so once for a drain without one (:meth:`LiveNotice.warn_if_held`), with the ways out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from raytrn.sigterm import sigterm_received

log = logging.getLogger(__name__)


class LiveNotice:
    """Whether this replica has a preemption notice (it stays once seen): ``reason`` says which, or None."""

    def __init__(self, store: Any, draining_key: str, sigterm: Callable[[], bool] = sigterm_received) -> None:
        self.store, self.draining_key, self._sigterm = store, draining_key, sigterm
        self._reason: str | None = None
        #: Whether the notice is its node's drain, and that drain's deadline (epoch seconds; None: it has none).
        self.drained = False
        self.deadline: float | None = None

    def reason(self) -> str | None:
        """``SIGTERM to this worker``, ``its node is draining, deadline in 25 s`` (``..., without a deadline``) or
        None (one store read a call until one is seen)."""
        if self._reason is None:
            if self._sigterm():
                self._reason = "SIGTERM to this worker"
            elif self.store.check([self.draining_key]):
                self.drained = True
                self.deadline = float(self.store.get(self.draining_key)) or None
                when = f"deadline in {max(0.0, self.deadline - time.time()):.0f} s" if self.deadline else None
                self._reason = f"its node is draining, {when or 'without a deadline'}"
        return self._reason

    def warn_if_held(self, member: str) -> bool:
        """After this replica left on its node's drain: one warning when that drain has no deadline (the run's slot
        holds the node until the run ends: the module's docstring). Returns whether it warned."""
        if not self.drained or self.deadline is not None:
            return False
        log.warning(
            "live recovery: %s's node is draining without a deadline; the run's placement-group slot there stays "
            "reserved (the replica that left holds it until the run ends), so the node stays busy. The other "
            "replicas train on. To free the node sooner: shut it down (its replica's replacement then waits for "
            "capacity elsewhere), or stop the run (raytrn stop; it resumes from its checkpoint)", member,
        )  # fmt: skip
        return True


__all__ = ["LiveNotice"]
