"""Several of Ray Train's replica groups replaced at once (private Ray Train APIs).

Ray 2.60's ``WorkerGroup.replace_replica_group`` replaces one replica group: it creates the group's worker actors and
waits for them (a new process each, started and imported), initializes their train context, then starts training;
replacing two groups that way puts one worker start after the other (Ray's controller loops over its failing groups:
"TODO: parallelize this"; raytrn's poll replaced the groups waiting for their slots the same way). Two nodes back at
once then joined the live group a worker start apart: in the live chaos test (2026-12-01), admitted at steps 46 and
53. :func:`replace_together` does what Ray's replacement does (its ``_replace_replica_group_impl``) for every group
named, creating their actors together, so that the newcomers start side by side.

:func:`frozen_workers` tells, of a poll's workers, the frozen ones from those whose node is lost.

Public alternative: none (``replace_replica_group`` takes one index). Every name used here is in
:data:`PRIVATE_NAMES`; ``tests/unit/test_compat.py`` checks that Ray's replacement still takes these steps, and
``tests/unit/test_replicas.py`` runs this one on a stand-in worker group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: The private names this module relies on (merged into :data:`raytrn.compat.PRIVATE_NAMES`).
PRIVATE_NAMES: dict[str, str] = {
    "Ray Train replica-group replacement steps": "ray.train.v2._internal.execution.worker_group:WorkerGroup._replace_replica_group_impl",
    "Ray Train worker creation": "ray.train.v2._internal.execution.worker_group:WorkerGroup._create_workers",
    "Ray Train train-context start": "ray.train.v2._internal.execution.worker_group:WorkerGroup._init_train_context",
    "Ray Train replica group": "ray.train.v2._internal.execution.worker_group.execution_group:ReplicaGroup.start_training",
    "Ray Train worker-group state's replacement": "ray.train.v2._internal.execution.worker_group.state:WorkerGroupState.replace_workers",
    "Ray Train start-up failure": "ray.train.v2._internal.exceptions:WorkerGroupStartupFailedError",
}

log = logging.getLogger(__name__)


def replace_together(group: Any, indices: Sequence[int]) -> dict[int, BaseException]:
    """Replace the replica groups ``indices`` of the worker group ``group`` (a Ray Train ``WorkerGroup``) as Ray's
    ``replace_replica_group`` replaces one, their actors created together; returns, by index, the error of each
    group whose workers failed to start (a ``WorkerGroupStartupFailedError``, which Ray's failure policy retries, as
    Ray raises it; the group is left shut down, for the caller to retry). A failure before any worker is created (a
    surviving group's actor gone since the poll) is raised, every group named left shut down."""
    import ray
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.worker_group import execution_group

    group._assert_active()
    groups = group._replica_groups
    olds = {i: groups[i].get_workers() for i in indices}
    for i, old in olds.items():  # (a group that failed to start before is inactive already)
        groups[i].shutdown()
        for w in old:
            if w.distributed_context is not None:
                group._world_rank_to_ongoing_poll.pop(w.distributed_context.world_rank, None)
    # Ray's order: the others' result queues cleared (no mixed generations of reports), the barrier reset (a
    # survivor waiting in it is released), then the new workers in the old ones' placement-group slots.
    others = [w for i, g in enumerate(groups) if i not in olds and g.is_active() for w in g.get_workers()]
    if others:
        ray.get([w.actor.clear_result_queue.remote() for w in others])
    ray.get(group._worker_group_state.sync_actor.reset.remote())
    placement_group = group._worker_group_state.placement_group_handle.placement_group
    resources = group._worker_group_context.resources_per_worker

    def create(i: int) -> list[Any]:
        return list(
            group._create_workers(
                num_workers=len(olds[i]),
                placement_group=placement_group,
                resources_per_worker=resources,
                placement_group_bundle_indices=[w.placement_group_bundle_index for w in olds[i]],
                starting_world_rank=i,  # (Ray 2.60: replica groups of one worker; a group's index is its rank)
                world_size=len(groups),
                replica_group_size=len(olds[i]),
            )
        )

    failed: dict[int, BaseException] = {}
    created: dict[int, list[Any]] = {}
    pool = ThreadPoolExecutor(max_workers=len(olds), thread_name_prefix="raytrn-replace")
    try:
        futures = {i: pool.submit(create, i) for i in olds}
        for i, future in futures.items():
            try:
                created[i] = future.result()
            except Exception as e:  # (Ray's creation killed its actors: a WorkerGroupStartupFailedError)
                failed[i] = e
    except BaseException:  # Ctrl-C: the controller aborts; a creation waiting on its actors is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=False)
    for i, new in created.items():
        group._worker_group_state = group._worker_group_state.replace_workers(olds[i], new)
        groups[i] = execution_group.ReplicaGroup(new, resources, group._replica_group_callbacks)
    for n, (i, new) in enumerate(created.items()):
        try:  # each group on its own, as Ray's: one whose worker died does not fail the others
            group._init_train_context(new, group._worker_group_state.sync_actor)
            groups[i].start_training(group._worker_group_context)
        except RayActorError as e:
            groups[i].shutdown()
            failed[i] = WorkerGroupStartupFailedError(f"a replacement worker of replica group {i} failed to start")
            failed[i].__cause__ = e
        except BaseException:  # (Ray's: the group shut down, the error raised; the rest not started either)
            for j in list(created)[n:]:
                groups[j].shutdown()
            raise
        else:
            places = ", ".join(
                f"(ip={w.metadata.node_ip}, pid={w.metadata.pid}) rank {w.distributed_context.world_rank}" for w in new
            )
            log.info("started replica group %d: %s", i, places)
    return failed


def frozen_workers(
    polls: list[tuple[BaseException | None, str]], timed_out: type, node_lost: Callable[[list[str]], bool] | None
) -> tuple[list[int], list[int]]:
    """Of a poll's ``(error, node id)`` per rank, the ranks whose poll went unanswered past the health check's bound
    (``timed_out``: Ray Train's ``WorkerHealthCheckTimeoutError``): ``(frozen, lost)``, where ``lost`` are those
    whose node ``node_lost`` says is gone (dead, or not answering while Ray still calls it alive: Ray's node death
    fails them as a lost node's) and ``frozen`` the others; ``node_lost`` is asked once per node."""
    frozen: list[int] = []
    lost: list[int] = []
    seen: dict[str, bool] = {}  # one probe per node and poll
    for rank, (error, node) in enumerate(polls):
        if isinstance(error, timed_out):
            if node not in seen:
                seen[node] = node_lost is not None and node_lost([node])
            (lost if seen[node] else frozen).append(rank)
    return frozen, lost
