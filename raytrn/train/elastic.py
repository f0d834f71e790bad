"""How many workers an elastic job runs with, given the nodes it has: whole nodes, valid sizes only.

Ray Train V2's elastic policy adds up the workers every node could hold and starts that many (capped at the
maximum). On Trainium that is wrong twice: capacity comes in whole instances (a TP group must sit on one),
and a size that breaks the global batch or the TP layout must never be picked. :class:`SizeChooser` is the
rule raytrn's policy (:func:`raytrn.compat.elastic_scaling_policy`) applies instead: per node, whole
multiples of ``workers_per_node``; in total, the largest size of :func:`raytrn.config.sizes.world_sizes` that
fits.

Ray's own view of the cluster lags a lost node: its autoscaling coordinator refreshes every 20 s, and the GCS
marks a node dead only after its health checks fail (~15 s by default). Restarting at the old size then waits
out the worker-group start timeout (60 s) before trying smaller. :func:`reachable_nodes` is the live check
the policy adds when it picks a size for a (re)start: a TCP connect to each node's raylet, answered at once by
a live node and refused or timed out by a dead one.

Pure apart from :func:`reachable_nodes` (sockets): the unit tests run it as it is.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: How long a node's raylet has to accept a connection before the node counts as gone.
PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class SizeChooser:
    """The worker count to run at with the given per-node free resources (``{node id: {resource: amount}}``).

    ``resources``: what one worker takes; ``workers_per_node``: a node counts only in whole multiples of it
    (None: any number); ``sizes``: the sizes the job may take, ascending. Returns 0 when none fits.
    """

    resources: Mapping[str, float]
    sizes: tuple[int, ...]
    workers_per_node: int | None = None

    def workers_on(self, node: Mapping[str, float]) -> int:
        """Workers one node can hold (whole multiples of ``workers_per_node``)."""
        needs = [(name, amount) for name, amount in self.resources.items() if amount > 0]
        if not needs:
            return self.sizes[-1]
        fit = min(int(node.get(name, 0.0) // amount) for name, amount in needs)
        per = self.workers_per_node
        return fit // per * per if per else fit

    def __call__(self, nodes: Mapping[str, Mapping[str, float]]) -> int:
        capacity = sum(self.workers_on(resources) for resources in nodes.values())
        return max((n for n in self.sizes if n <= capacity), default=0)


def reachable_nodes(nodes: Iterable[Mapping[str, object]], timeout_s: float = PROBE_TIMEOUT_S) -> set[str]:
    """The ids of the nodes (``ray.nodes()`` entries) that Ray thinks alive and whose raylet accepts a TCP
    connection within ``timeout_s`` (probed in parallel: a lost node costs at most ``timeout_s`` in all)."""
    alive = [n for n in nodes if n.get("Alive")]

    def answers(node: Mapping[str, object]) -> bool:
        try:
            with socket.create_connection(
                (str(node["NodeManagerAddress"]), int(str(node["NodeManagerPort"]))), timeout_s
            ):
                return True
        except (OSError, KeyError, ValueError):
            return False

    if not alive:
        return set()
    with ThreadPoolExecutor(max_workers=min(32, len(alive)), thread_name_prefix="raytrn-probe") as pool:
        ok = list(pool.map(answers, alive))
    return {str(n["NodeID"]) for n, good in zip(alive, ok, strict=True) if good}


def lost_nodes_unconfirmed(node_ids: Iterable[str]) -> bool:
    """Whether a node of ``node_ids`` is gone but Ray does not know it yet (the GCS still calls it alive, its raylet
    refuses or ignores connections). A lost replica is replaced in its placement-group slot: placed there before the
    GCS marks the node dead (after its health checks fail: 13-40 s here), the replacement fails when it does, one
    more failure against ``scaling.max_failures`` for the same loss. A node whose raylet answers (a killed worker
    process on a live node) is not lost; one Ray marked dead is known."""
    import ray

    wanted = set(node_ids)
    suspects = [n for n in ray.nodes() if n.get("NodeID") in wanted and n.get("Alive")]
    return len(reachable_nodes(suspects)) != len(suspects)
