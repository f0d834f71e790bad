"""A placement group of its own for each replica under ``scaling.recovery: live`` (private Ray Train APIs).

Ray Train 2.60 puts a worker group's workers in one placement group, a bundle each. When a node is lost, its
bundles are ``RESCHEDULING`` until capacity returns, and Ray 2.60's GCS retries that with no backoff, on the one
thread that also answers every RPC and health check: a whole core of the head node for as long as a lost replica's
slot waits (docs/elasticity.md, ``tools/pg_spin_probe.py``). A placement group asked for anew waits ``PENDING``
instead, at no cost. So each replica of a live run (one worker each) gets a single-bundle placement group of its
own (:class:`ReplicaSlots`, the worker group's placement-group handle): a slot whose node is dead, draining or gone
is given up and asked for anew when its replica waits for capacity (:meth:`ReplicaSlots.ready_on`), and the
replacement is created in the new one (:func:`create_workers`, Ray Train's ``_create_workers`` with a group per
slot). Not in a Ray Tune trial: there Ray Train's cleaner, which removes a killed trial's placement group, knows
one group, and the trial keeps Ray's.

Public alternative: none (Ray Train creates the worker group's placement group itself and has no per-replica
placement). Every name used here is in :data:`PRIVATE_NAMES`; ``tests/unit/test_compat.py`` checks that Ray
Train's worker creation still takes the steps :func:`create_workers` repeats.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Sequence
from typing import Any

#: The private names this module relies on (merged into :data:`raytrn.compat.PRIVATE_NAMES`).
PRIVATE_NAMES: dict[str, str] = {
    "Ray Train worker group's placement": "ray.train.v2._internal.execution.worker_group:WorkerGroup._create_placement_group",
    "Ray Train placement-group handle": "ray.train.v2._internal.execution.worker_group.placement_group_handle:PlacementGroupHandle",
    "Ray Train worker": "ray.train.v2._internal.execution.worker_group.worker:Worker",
    "Ray Train actor options of a bundle": "ray.train.v2._internal.util:bundle_to_remote_args",
    "Ray Train worker runtime env": "ray.train.v2._internal.execution.worker_group:WorkerGroup._get_worker_runtime_env",
    "Ray Train rank assignment": "ray.train.v2._internal.execution.worker_group:WorkerGroup._assign_worker_ranks",
}

log = logging.getLogger(__name__)


class ReplicaSlots:
    """Ray Train's placement-group handle (``PlacementGroupHandle``: ``placement_group``, ``ready``, ``wait``,
    ``shutdown``) over one single-bundle placement group per slot: slot ``i`` is ``groups[i]``, bundle 0."""

    def __init__(
        self, bundle: dict[str, float], count: int, strategy: str = "PACK", labels: Sequence[dict] | None = None
    ) -> None:
        self._bundle, self._strategy = dict(bundle), strategy
        self._labels = list(labels) if labels else None
        self.groups: list[Any] = []
        try:
            for i in range(count):
                self.groups.append(self._request(i))
        except BaseException:  # (a GCS timeout halfway: the groups made so far are nobody's to remove otherwise)
            self.shutdown()
            raise

    def _request(self, slot: int) -> Any:
        from ray.util.placement_group import placement_group

        labels = [self._labels[slot]] if self._labels else None
        return placement_group([self._bundle], strategy=self._strategy, bundle_label_selector=labels)

    @property
    def placement_group(self) -> Any:
        """Slot 0's group (Ray Train's ``PlacementGroupCleanerCallback`` would register it; a hosted controller
        leaves that callback out but in a Tune trial, where it makes Ray's one group instead)."""
        return self.groups[0]

    def ready(self) -> Any:
        """Not used by Ray Train 2.60 (``tests/unit/test_compat.py``); a group's ``ready()`` would start a task."""
        raise NotImplementedError("ReplicaSlots.ready: wait() instead")

    def wait(self, timeout_seconds: float = 30) -> bool:
        """Whether every slot's group is placed within ``timeout_seconds`` (all of them: one deadline)."""
        deadline = time.monotonic() + timeout_seconds
        try:  # (Ray takes whole seconds, and 0 is "not ready" even for a placed group)
            return all(g.wait(max(1, math.ceil(deadline - time.monotonic()))) for g in self.groups)
        except Exception:  # (as Ray Train's own handle: a failed wait is a group not ready)
            log.warning("placement group wait failed; treating as not ready", exc_info=True)
            return False

    def shutdown(self) -> None:
        for slot in range(len(self.groups)):
            self._remove(slot)

    def _remove(self, slot: int) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.groups[slot])
        except Exception as e:  # (removed already: a group is removed once)
            log.debug("placement group of slot %d not removed: %s", slot, e)

    def state(self, slot: int) -> tuple[str, str | None]:
        """Slot ``slot``'s group's state (``PENDING``, ``PREPARED``, ``CREATED``, ``RESCHEDULING``, ``REMOVED``) and
        its node id (None until ``CREATED``)."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.groups[slot])
        node = table.get("bundles_to_node_id", {}).get(0)
        return str(table.get("state")), (str(node) if node and table.get("state") == "CREATED" else None)

    def ready_on(self, slots: Sequence[int], usable: set[str]) -> bool:
        """Whether every slot of ``slots`` is placed on a node of ``usable`` (alive, not draining). A slot that is
        not, and is not being placed already (``PENDING`` or ``PREPARED``), is given up and asked for anew (its node
        dead and Ray rescheduling it, or placed on a node that is draining or dead): it waits ``PENDING``, without
        the GCS spin. A request that fails (the GCS busy) leaves the slot to the next call."""
        ready = True
        for slot in slots:
            state, node = self.state(slot)
            if node in usable:
                continue
            ready = False
            if state not in ("PENDING", "PREPARED"):
                self._remove(slot)
                try:
                    self.groups[slot] = self._request(slot)
                except Exception as e:  # (its removed group reads REMOVED: asked for again at the next call)
                    log.warning("replica slot %d: asking for a placement group failed: %s", slot, e)
                    continue
                log.info("replica slot %d (%s, node %s) asked for anew: it waits for capacity", slot, state, node)
        return ready


def create_workers(
    group: Any,
    slots: ReplicaSlots,
    num_workers: int,
    resources_per_worker: dict[str, float],
    placement_group_bundle_indices: list[int] | None = None,
    starting_world_rank: int = 0,
    world_size: int | None = None,
    replica_group_size: int | None = None,
) -> list[Any]:
    """Ray Train 2.60's ``WorkerGroup._create_workers`` (same arguments but its placement group, same result: the
    workers sorted by world rank) for a worker group ``group`` whose slots are ``slots``: the worker of slot ``i``
    (its "bundle index") is created in ``slots.groups[i]``."""
    import ray
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.worker import Worker
    from ray.train.v2._internal.util import bundle_to_remote_args
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    indices = placement_group_bundle_indices if placement_group_bundle_indices is not None else range(num_workers)
    runtime_env = group._get_worker_runtime_env(
        custom_runtime_env=group._train_run_context.run_config.worker_runtime_env
    )
    worker_actor_cls = ray.remote(runtime_env=runtime_env, **bundle_to_remote_args(resources_per_worker))(
        group._worker_cls
    )
    actors = [
        worker_actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slots.groups[i], placement_group_bundle_index=0
            )
        ).remote()
        for i in indices
    ]
    try:
        metadatas = ray.get([actor.get_metadata.remote() for actor in actors])
    except RayActorError as actor_error:
        for actor in actors:
            ray.kill(actor)
        message = f"One of the worker actors failed to initialize due to error:\n{traceback.format_exc()}"
        raise WorkerGroupStartupFailedError(message) from actor_error
    workers = [
        Worker(actor, meta, resources_per_worker, placement_group_bundle_index=i)
        for i, actor, meta in zip(indices, actors, metadatas, strict=True)
    ]
    return list(WorkerGroup._assign_worker_ranks(workers, starting_world_rank, world_size, replica_group_size))
