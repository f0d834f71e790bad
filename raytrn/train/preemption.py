"""A preemption notice (a spot interruption: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) ends a
worker group's training at a checkpoint, so the restart loses no step.

Ray Train V2 hands every worker of the group a copy of the notice (its preemption watcher) and tears the group
down at the notice's deadline, then restarts it on the remaining capacity (``FailureConfig``'s
``max_preemption_failures``, unlimited by default). Workers see their copy at different steps, so they agree
first: every step, one all-reduce (MAX) of a one-element CPU tensor over a gloo group. Agreed, every rank saves
a checkpoint at the same step (synchronously), it is reported, and the workers stop training and wait for the
teardown: the steps trained between the save and the deadline would be trained again anyway, so waiting costs
the same time and loses nothing. The restart is sized without the draining node
(:func:`raytrn.compat.draining_nodes`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from raytrn.compat import preemption_notice
from raytrn.sigterm import sigterm_received

log = logging.getLogger(__name__)

#: What a worker's copy of the notice is when it got a SIGTERM (no ``PreemptionInfo`` comes with one).
SIGTERM_NOTICE = "SIGTERM"


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

    def notice(self) -> Any:
        """The notice (this worker's copy: Ray Train's ``PreemptionInfo``, or :data:`SIGTERM_NOTICE`; True when only
        another rank has one), or None: a collective, every rank calls it once per step."""
        return self.agree(0)[0]

    def agree(self, stop_at: int, abort: bool = False) -> tuple[Any, int, bool]:
        """:meth:`notice`, the step a stop request asks the run to end at (rank 0's ``stop_at``: 0 for none;
        :mod:`raytrn.train.stopping`), and whether the run must stop at once (rank 0's ``abort``: its lease was taken
        over), agreed in the same collective."""
        info = _local_notice()
        if info is None and sigterm_received():
            info = SIGTERM_NOTICE
        if self._world_size == 1:
            return info, stop_at, abort
        import torch
        import torch.distributed as dist

        flags = torch.tensor([int(info is not None), stop_at, int(abort)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        notice = info if info is not None else (True if flags[0].item() else None)
        return notice, int(flags[1].item()), bool(flags[2].item())


def _local_notice() -> Any:
    try:
        return preemption_notice()
    except (ImportError, AttributeError, RuntimeError):  # not inside a Ray Train V2 worker
        return None


def describe(info: Any) -> str:
    """``node n1 (ranks [1]), deadline in 25 s`` from a ``ray.train.PreemptionInfo`` (or what is known)."""
    if info is True or info is None:
        return "another rank's node"
    if info == SIGTERM_NOTICE:
        return "SIGTERM to this worker"
    parts = []
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


def wait_for_teardown(max_wait_s: float = 24 * 3600) -> None:
    """Idle until Ray Train tears the group down at the notice's deadline (the process ends there)."""
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
