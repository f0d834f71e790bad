"""A preemption notice (a spot interruption: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) ends a
worker group's training at a checkpoint, so the restart loses no step.

Ray Train V2 hands every worker of the group a copy of the notice (its preemption watcher) and tears the group
down at the notice's deadline, then restarts it on the remaining capacity (``FailureConfig``'s
``max_preemption_failures``, unlimited by default). Workers see their copy at different steps, so they agree
first: every step, one all-reduce (MAX) of a one-element CPU tensor over a gloo group. Agreed, every rank saves
a checkpoint at the same step (synchronously), it is reported, and the workers stop training (the steps trained
between the save and the deadline would be trained again anyway). Each then reports the checkpoint committed
(:data:`raytrn.compat.NOTICE_COMMITTED`), and raytrn's controller restarts the group at once instead of at the
deadline (:mod:`raytrn.compat.preemption`): no node idles until then. The restart is sized without the draining
node (:func:`raytrn.compat.draining_nodes`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from raytrn.compat import preemption_notice
from raytrn.sigterm import sigterm_received

log = logging.getLogger(__name__)


class NoticeFrom(Enum):
    """Where a worker's preemption notice came from."""

    RAY = "ray"  # this worker's copy of Ray Train's notice (a ``ray.train.PreemptionInfo``)
    SIGTERM = "sigterm"  # a SIGTERM to this worker (no details come with one)
    PEER = "peer"  # another rank had one: agreed in the step's collective


@dataclass(frozen=True)
class Notice:
    """A preemption notice as a rank knows it: where from, and Ray Train's details (``info``) when it has them."""

    source: NoticeFrom
    info: Any = None

    def describe(self) -> str:
        """``node n1, ranks [1], deadline in 25 s`` (what is known), ``SIGTERM to this worker`` or ``another rank's
        node``."""
        if self.source is NoticeFrom.SIGTERM:
            return "SIGTERM to this worker"
        if self.source is NoticeFrom.PEER:
            return "another rank's node"
        info, parts = self.info, []
        nodes = getattr(info, "preempted_node_ids", None)
        ranks = getattr(info, "preempted_ranks", None)
        if nodes:
            parts.append(f"node {', '.join(sorted(map(str, nodes)))}")
        if ranks:
            parts.append(f"ranks {sorted(ranks)}")
        deadline_ms = getattr(info, "deadline_ms", None)
        if deadline_ms:
            parts.append(f"deadline in {max(0.0, deadline_ms / 1000 - time.time()):.0f} s")
        return ", ".join(parts) or "no details"


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed at a step (one collective): the preemption notice (None: none), the step a stop
    request ends the run at (0: none; :mod:`raytrn.train.stopping`), and whether the run stops at once (its lease
    was taken over)."""

    notice: Notice | None = None
    stop_at: int = 0
    abort: bool = False


class PreemptionWatch:
    """Whether the group got a preemption notice, agreed by every rank at the same step."""

    def __init__(self, world_size: int) -> None:
        self._group: Any = None
        self._world_size = world_size
        if world_size > 1:
            import torch.distributed as dist

            # The default group may be nccl or neuron: the agreement runs on the host (created by every rank,
            # at the same point: the start of the loop).
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def notice(self) -> Notice | None:
        """The notice every rank agrees on (a collective, every rank calls it once per step), or None."""
        return self.agree(0).notice

    def agree(self, stop_at: int, abort: bool = False) -> Agreement:
        """:meth:`notice`, the step a stop request asks the run to end at (rank 0's ``stop_at``: 0 for none), and
        whether the run must stop at once (rank 0's ``abort``), agreed in the same collective."""
        mine = own_notice()
        if self._world_size == 1:
            return Agreement(mine, stop_at, abort)
        import torch
        import torch.distributed as dist

        flags = torch.tensor([int(mine is not None), stop_at, int(abort)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        notice = mine if mine is not None else (Notice(NoticeFrom.PEER) if flags[0].item() else None)
        return Agreement(notice, int(flags[1].item()), bool(flags[2].item()))


def own_notice() -> Notice | None:
    """This worker's own notice: Ray Train's copy, else a SIGTERM it received, else None."""
    info = _local_notice()
    if info is not None:
        return Notice(NoticeFrom.RAY, info)
    return Notice(NoticeFrom.SIGTERM) if sigterm_received() else None


def _local_notice() -> Any:
    try:
        return preemption_notice()
    except (ImportError, AttributeError, RuntimeError):  # not inside a Ray Train V2 worker
        return None


def wait_for_teardown(max_wait_s: float = 24 * 3600) -> None:
    """Idle until Ray Train tears the group down (the process ends there)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)


def exit_after_sigterm(logger: Any, flush_timeout_s: float, step: int) -> None:
    """End this worker after its SIGTERM's checkpoint: rank 0 first delivers what it logged (bounded), so the
    restarted group (resumed from that checkpoint, by Ray Train's failure handling) logs no step twice or never."""
    log.warning("SIGTERM: step %d is committed; this worker exits and the group restarts from it", step)
    if logger is not None:
        try:
            logger.flush(flush_timeout_s)
        except Exception as e:  # exiting regardless: the signal asked for it
            log.warning("SIGTERM: metrics not flushed: %s", e)
    logging.shutdown()
    os._exit(128 + signal.SIGTERM)
