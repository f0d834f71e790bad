"""Interruptions and the checkpoint interval that minimises the time they cost (Young/Daly).

A job on ``n`` nodes, each failing on average once every ``node_mtbf`` hours, is interrupted every
``node_mtbf / n`` hours. Each interruption costs the restart (new workers, the restore) plus the work since the
last checkpoint: on average half an interval. Checkpointing every ``tau`` seconds with a blocking save of ``C``
seconds costs ``C / tau`` of the time; the sum is smallest at ``tau = sqrt(2 x C x M)`` (Young 1974; Daly 2006's
first-order form), ``M`` the job's mean time between failures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Llama 3 report (Meta, 2024, section 3.3.4): 419 unexpected interruptions in 54 days of pre-training on 16,384
#: H100s (8 a server: 2,048 servers). One server fails about every 54 x 24 x 2,048 / 419 hours.
LLAMA3_NODE_MTBF_HOURS = 54 * 24 * 2048 / 419
LLAMA3_SOURCE = "Llama 3 report: 419 unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes of 8)"


@dataclass(frozen=True)
class FailureRate:
    """Mean hours between failures of one node, and where the figure comes from."""

    node_mtbf_hours: float
    source: str

    def job_mtbf_hours(self, nodes: int) -> float:
        return self.node_mtbf_hours / max(1, nodes)

    def expected(self, nodes: int, hours: float) -> float:
        """Expected interruptions of ``nodes`` nodes over ``hours``."""
        return nodes * hours / self.node_mtbf_hours


DEFAULT_RATE = FailureRate(LLAMA3_NODE_MTBF_HOURS, LLAMA3_SOURCE)


def young_daly_interval_s(save_s: float, job_mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that minimises save time plus lost work: ``sqrt(2 x save x MTBF)``."""
    if save_s <= 0 or job_mtbf_s <= 0:
        raise ValueError(f"save time and MTBF must be positive (got {save_s}, {job_mtbf_s})")
    return math.sqrt(2 * save_s * job_mtbf_s)


def lost_fraction(interval_s: float, save_s: float, restart_s: float, job_mtbf_s: float) -> float:
    """The share of wall time checkpoints and interruptions cost at ``interval_s`` (first order): saving
    ``save / interval``, and per failure the restart plus half an interval of work again."""
    return save_s / interval_s + (restart_s + interval_s / 2) / job_mtbf_s
