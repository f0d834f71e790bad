"""Stragglers: which rank is slow, when every rank's step takes the same wall time.

Under synchronous data parallelism each step ends in a gradient all-reduce, so every rank's wall step time is the
slowest rank's; a rank on a slow node makes the others wait and the step time alone cannot say which. What can is
each rank's *own* time per step: its wait for data and its forward pass (no collective waits on another rank there
under DDP; under FSDP/TP the forward's all-gathers are included). At every log step the ranks gather their mean own
time over the log window (one small gloo all-gather at log steps only: never on a plain step), and the metrics
say the slowest and fastest (``step_time_max_s``, ``step_time_min_s``, ``step_time_max_rank``); when one rank
takes more than ``FACTOR`` x the median over a window, rank 0 warns, naming the rank and its node.
On an accelerator the forward's time is the host's (its launches), unless the backend synchronises.
"""

from __future__ import annotations

import logging
import socket
import statistics
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: A rank slower than this many times the median of the ranks' own times over a window is named in a warning.
FACTOR = 1.5


def node_name() -> str:
    """This worker's node: its Ray node IP inside Ray, else the host name."""
    import ray

    if ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return socket.gethostname()


class Stragglers:
    """Every rank builds one at the same point (a collective: the node names are gathered once)."""

    def __init__(self, world_size: int, rank: int, *, node: str | None = None) -> None:
        self.world_size, self.rank = world_size, rank
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self._group: Any = None
        if self.distributed and dist.get_backend() != "gloo":  # CPU floats need a CPU group (on nccl/neuron too)
            self._group = dist.new_group(backend="gloo")
        names: list[Any] = [node or node_name()]
        if self.distributed:
            names = [None] * world_size
            dist.all_gather_object(names, node or node_name(), group=self._group)
        self.nodes = [str(n) for n in names]
        #: The last warning (rank 0), for tests and the logs.
        self.warned: str | None = None

    def metrics(self, own_s: float, steps: tuple[int, int]) -> dict[str, float]:
        """Every rank, at a log step: the window's ``own_s`` (mean own time per step, this rank) gathered; the
        slowest and fastest rank's. ``steps``: the window's first and last step (for the warning)."""
        times = [own_s]
        if self.distributed:
            gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
            dist.all_gather(gathered, torch.tensor([own_s], dtype=torch.float64), group=self._group)
            times = [float(t[0]) for t in gathered]
        slow = max(range(len(times)), key=times.__getitem__)
        fast = min(range(len(times)), key=times.__getitem__)
        median = statistics.median(times)
        self.warned = None
        if len(times) > 1 and median > 0 and times[slow] > FACTOR * median:
            self.warned = (
                f"straggler: rank {slow} on node {self.nodes[slow]} took {times[slow]:.3f} s per step of its own work "
                f"(data wait + forward) over steps {steps[0]}-{steps[1]}, {times[slow] / median:.1f}x the median "
                f"{median:.3f} s of the {len(times)} ranks; every rank waits for it at the gradient all-reduce"
            )
            if self.rank == 0:
                log.warning("%s", self.warned)
        return {"step_time_max_s": times[slow], "step_time_min_s": times[fast], "step_time_max_rank": float(slow)}
