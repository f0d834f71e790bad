"""Ray Train V2's controller, run in the calling process instead of an actor of its own (private Ray Train APIs).

Stock ``DataParallelTrainer.fit()`` starts ``TrainController`` as an actor: a new Python process that imports
``ray.train`` (~2.2 CPU-seconds here) before it asks for a single worker, and, because that actor may die on its
own, a detached ``PlacementGroupCleaner`` actor to remove the workers' placement group if it does (~1.4
CPU-seconds). Its ``DatasetsCallback`` starts a ``DatasetManager`` actor per worker group even with no datasets
(~1.1), and its ``PreemptionCallback`` a ``PreemptionWatcher`` actor per worker group (~1.2): four processes, none
of which raytrn needs as a process. :func:`hosted_trainer` runs the same controller (its state machine, scaling and
failure policies, worker group, callbacks) on an event loop in the process that calls ``fit()``:

- the placement group and the worker actors are then owned by that process and go with it (Ray removes a job's
  placement groups when its driver exits), so the cleaner is left out; inside another actor (a Ray Tune trial,
  which its scheduler may kill while the sweep lives on) it is kept, and it watches that actor;
- the preemption watcher is the same class, polling in a thread of this process instead of an actor's;
- Ray Train's controller log lines go to ``console`` (a ``logging.Handler``) instead of stderr;
- under replica groups (``scaling.recovery: live``) a replacement first shuts down the other replica groups whose
  workers no longer answer (Ray 2.60 would fail the run on them: two nodes lost at once), and each replica has a
  placement group of its own (:mod:`raytrn.compat.replica_slots`: a lost slot waits without a GCS spin);
- ``listener`` (a :class:`raytrn.compat.listener.ControllerListener`) hears the controller's decisions as they are
  made: the typed seam raytrn's terminal lines and goodput ledger are built on (nothing is parsed back out of a log
  line).

Public alternative: none (``DataParallelTrainer.fit`` always starts the controller as an actor). Every name used
here is in :data:`raytrn.compat.PRIVATE_NAMES`, and ``tests/unit/test_compat.py`` runs a hosted controller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from raytrn.compat.listener import ControllerListener, WorkerPlace
from raytrn.compat.preemption import NOTICE_COMMITTED, is_preemption_failure, preemption_poll_s

#: The logger (its module's) of Ray Train's checkpoint manager, which the controller builds before raytrn routes Ray
#: Train's lines (:meth:`HostedController._start`); on every resume it logs a three-line notice that ends "please
#: configure a new, unique `RunConfig(name)` or delete the existing folder": raytrn's own line says where it resumes.
CHECKPOINT_MANAGER_LOGGER = "ray.train.v2._internal.execution.checkpoint.checkpoint_manager"


class ToHandler(logging.Filter):
    """A logger's filter that hands each record to ``handler`` alone (at ``handler``'s level), not to the logger's
    own handlers and its parents'."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.handler.level:
            self.handler.handle(record)
        return False


#: The private names this module relies on (merged into :data:`raytrn.compat.PRIVATE_NAMES`).
PRIVATE_NAMES: dict[str, str] = {
    "Ray Train controller": "ray.train.v2._internal.execution.controller:TrainController",
    "Ray Train controller run loop": "ray.train.v2._internal.execution.controller:TrainController.run",
    "Ray Train controller start hooks": "ray.train.v2._internal.execution.controller:TrainController._start",
    "Ray Train controller worker-group class": "ray.train.v2._internal.execution.controller:TrainController.worker_group_cls",
    "Ray Train worker actor class": "ray.train.v2._internal.execution.worker_group.worker:RayTrainWorker",
    "Ray Train worker group's worker class": "ray.train.v2._internal.execution.worker_group:WorkerGroup._worker_cls",
    "Ray Train controller state": "ray.train.v2._internal.execution.controller.state:AbortedState",
    "Ray Train resizing state": "ray.train.v2._internal.execution.controller.state:ResizingState",
    "Ray Train preempting state": "ray.train.v2._internal.execution.controller.state:PreemptingState",
    "Ray Train worker group": "ray.train.v2._internal.execution.worker_group:WorkerGroup._init_train_context_on_workers",
    "Ray Train worker-group log paths": "ray.train.v2._internal.execution.worker_group:WorkerGroup._decorate_worker_log_file_paths",
    "Ray Train worker-group shutdown": "ray.train.v2._internal.execution.worker_group:WorkerGroup.shutdown",
    "Ray Train worker-group poll status": "ray.train.v2._internal.execution.worker_group:WorkerGroup.get_latest_poll_status",
    "Ray Train worker-group polls": "ray.train.v2._internal.execution.worker_group:WorkerGroup._poll_workers_and_collect_errors",
    "Ray Train worker status": "ray.train.v2._internal.execution.worker_group.poll:WorkerStatus",
    "Ray Train worker health-check timeout": "ray.train.v2._internal.exceptions:WorkerHealthCheckTimeoutError",
    "Ray Train worker health-check timeout variable": "ray.train.v2._internal.constants:WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR",
    "Ray Train replica groups": "ray.train.v2._internal.execution.worker_group:WorkerGroup.get_replica_groups",
    "Ray Train replica-group replace": "ray.train.v2._internal.execution.worker_group:WorkerGroup.replace_replica_group",
    "Ray Train replica-group state": "ray.train.v2._internal.execution.worker_group.execution_group:ReplicaGroup.is_active",
    "Ray Train replica-group shutdown": "ray.train.v2._internal.execution.worker_group.execution_group:ReplicaGroup.shutdown",
    "Ray Train worker-group state": "ray.train.v2._internal.execution.worker_group.state:WorkerGroupState.shutdown",
    "Ray Train controller callback": "ray.train.v2._internal.execution.callback:ControllerCallback",
    "Ray Train report callback": "ray.train.v2._internal.execution.callback:ReportCallback.after_report",
    "Ray Train preemption deadline": "ray.train.v2._internal.execution.controller:TrainController._is_preemption_deadline_exceeded",
    "Ray Train worker-group callback": "ray.train.v2._internal.execution.callback:WorkerGroupCallback",
    "Ray Train preemption callback": "ray.train.v2._internal.callbacks.preemption_callback:PreemptionCallback",
    "Ray Train preemption watcher": "ray.train.v2._internal.execution.preemption:PreemptionWatcher",
    "Ray Train failure decisions": "ray.train.v2._internal.execution.failure_handling:FailureDecision",
    "Ray Train failure decision hook": "ray.train.v2._internal.execution.controller:TrainController._execute_failure_decision",
    "Ray Train failing replica groups' replacement": "ray.train.v2._internal.execution.controller:TrainController._replace_bad_workers",
    "Ray Train preemption error": "ray.train.v2.api.exceptions:PreemptionError",
    "Ray Train checkpoint manager's logger": f"{CHECKPOINT_MANAGER_LOGGER}:logger",
    "Ray Train controller console handler": "ray.train.v2._internal.logging.logging:PlainRayHandler",
    "Ray Train resource-request expiry": "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client:AUTOSCALING_REQUESTS_EXPIRE_TIME_S",
    "Ray Train resource-request renewal": "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client:AUTOSCALING_REQUESTS_INTERVAL_S",
}

#: How long a hosted controller's resource request to Ray's autoscaling coordinator outlives its last renewal (a live
#: controller renews it every 20 s; Ray's default 180 s). A controller that dies without cancelling it (its process
#: killed: a driver, a Ray Tune trial whose sweep driver died) leaves its reservation that long, and an elastic job
#: that starts meanwhile sees fewer workers' worth of resources than are free: it waited 131 s for them once here.
REQUEST_EXPIRY_S = 45

#: How long a replica group's workers have to answer before another group is replaced (a lost node's refuse at once).
REACH_TIMEOUT_S = 5.0

#: Ray Train's default callbacks a hosted controller leaves out: the placement-group cleaner (see the module's
#: docstring; kept inside another actor) and the datasets callback (raytrn's workers read their own rows: with no
#: ``datasets`` it only starts an idle ``DatasetManager`` actor).
HOSTED_SKIPPED_CALLBACKS = ("PlacementGroupCleanerCallback", "DatasetsCallback")


def hosted_trainer(
    base: type,
    *,
    listener: ControllerListener | None = None,
    console: logging.Handler | None = None,
    make_policy: Callable[[Any], Any] | None = None,
    health_check_s: float | None = None,
    worker_timeout_s: float | None = None,
    skipped: tuple[str, ...] = HOSTED_SKIPPED_CALLBACKS,
    lost_nodes_unconfirmed: Callable[[list[str]], bool] | None = None,
    draining: Callable[[], set[str]] = lambda: set(),
    import_ahead: bool = False,
) -> type:
    """``base`` (a ``DataParallelTrainer``) whose ``fit()`` runs the controller in this process.

    ``make_policy(scaling_config)``: the scaling policy instead of the one Ray picks; ``health_check_s``: how often
    the controller polls its workers (Ray's default 2 s; ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` set by the user
    wins); ``worker_timeout_s``: how long a worker may leave a poll unanswered before the controller counts it
    failed (a frozen process: SIGSTOP, a hung host; Ray's default 600 s; ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``
    set by the user wins); such a worker's actor is killed at once (Ray's shutdown would first wait 5 s for it to
    answer). A ``KeyboardInterrupt`` (Ctrl-C, SIGTERM turned into one) aborts the worker group, then propagates.
    ``lost_nodes_unconfirmed(node_ids)``: whether a node of a failed replica group's workers is lost but not yet
    marked dead by Ray (a replacement placed there would fail); with it, a failed replica group whose slots have no
    place yet is replaced by a later poll, not in the controller's loop; ``draining()``: the nodes being drained
    (no place for a replacement); ``import_ahead``: the workers are :class:`raytrn.compat.worker.RayTrainWorker`, which
    imports torch and raytrn's training modules as it is constructed (for raytrn's own backends only).
    """
    import asyncio
    import os

    import ray
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.constants import WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError
    from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.controller.state import AbortedState, PreemptingState, ResizingState
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
    from ray.train.v2._internal.logging.logging import PlainRayHandler

    from raytrn.compat.replica_slots import ReplicaSlots, create_workers
    from raytrn.compat.replicas import frozen_workers, replace_together

    def _answer(workers: list[Any], frozen_after_s: float | None) -> bool | None:
        """Whether ``workers``' actors answer: False when one is gone (a dead node's refuse at once), None when one
        has not answered within :data:`REACH_TIMEOUT_S` and, given ``frozen_after_s`` (the health check's bound),
        within that (frozen; Ray's own calls to it would wait without end), else True (a busy one that does not
        answer within the first bound counts as there without ``frozen_after_s``: Ray's own calls will tell)."""
        refs = [w.actor.__ray_ready__.remote() for w in workers]
        bounds = [REACH_TIMEOUT_S] + ([max(frozen_after_s - REACH_TIMEOUT_S, 1.0)] if frozen_after_s else [])
        for bound in bounds:
            try:
                ray.get(refs, timeout=bound)
                return True
            except ray.exceptions.RayActorError:
                return False
            except ray.exceptions.GetTimeoutError:
                if lost_nodes_unconfirmed is not None and lost_nodes_unconfirmed([w.metadata.node_id for w in workers]):
                    return False  # its node is gone, Ray not yet saying so
        return None if frozen_after_s else True

    def _places(workers: list[Any]) -> list[WorkerPlace]:
        return [
            WorkerPlace(w.distributed_context.world_rank, w.metadata.node_id, w.metadata.node_ip, w.metadata.pid)
            for w in workers
        ]

    def in_actor() -> bool:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None

    class KilledState(WorkerGroupState):  # type: ignore[misc]
        """A failed group's state: its actors are killed at once, not first asked to shut down and waited for (up to
        5 s, ~2 s for a worker whose node is gone: measured), before the next group can start."""

        def shutdown(self) -> None:
            for worker in self.workers:
                ray.kill(worker.actor)
            ray.kill(self.sync_actor)
            self.placement_group_handle.shutdown()

    from raytrn.compat import worker as raytrn_worker

    worker_cls: Any = raytrn_worker.RayTrainWorker if import_ahead else WorkerGroup._worker_cls

    class HostedWorkerGroup(WorkerGroup):  # type: ignore[misc]
        _worker_cls = worker_cls  # every worker it makes, replacements too

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._raytrn_slots: ReplicaSlots | None = None  # (a placement group per replica: replica groups only)
            if worker_timeout_s is not None and not os.environ.get(WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR):
                self._worker_health_check_timeout_s = float(worker_timeout_s)

        def _create_placement_group(self, scaling_config: Any, context: Any) -> Any:
            # replica groups: one placement group each (replica_slots.py), but in a Tune trial, whose actor its
            # scheduler may kill: Ray Train's cleaner then removes one group, the one Ray makes
            if not self._manages_replica_groups or in_actor():
                return super()._create_placement_group(scaling_config, context)
            self._raytrn_slots = ReplicaSlots(
                context.resources_per_worker, context.num_workers, context.placement_strategy, context.label_selector
            )
            return self._raytrn_slots

        def _create_workers(self, num_workers: int, placement_group: Any, *args: Any, **kwargs: Any) -> list[Any]:
            if self._raytrn_slots is None:
                return list(super()._create_workers(num_workers, placement_group, *args, **kwargs))
            return create_workers(self, self._raytrn_slots, num_workers, *args, **kwargs)

        def shutdown(self) -> None:
            state = self._worker_group_state
            status = self.get_latest_poll_status() if state is not None else None
            if state is not None and status is not None and status.errors:
                self._worker_group_state = KilledState(**{f.name: getattr(state, f.name) for f in fields(state)})
            super().shutdown()

        def replace_replica_group(self, replica_group_index: int) -> None:
            # Replica groups (scaling.recovery: live): Ray 2.60 first clears the result queue of every other active
            # replica group, and one that cannot be reached fails the whole run (a ControllerError, never retried):
            # two nodes lost at once, the second not yet noticed by a poll. Such a group's workers are gone: it is
            # shut down here and waits for its slot as the failed one does (below: no failure of its own counted;
            # until stop 58 the next poll found it failed, a second failure for one event). Ray's replacement then
            # waits, in this controller's loop, until its actors start: until capacity returns, with no poll (a
            # run whose survivors finished would not end). So a group whose slot has no place yet waits here
            # instead (its workers reported finished, not failed), and a poll replaces it once the slot is placed.
            # A frozen one (it has not answered for the health check's bound) is killed and waits the same way: Ray's
            # replacement would wait on it without end (stop 62's review: two replicas frozen apart hung the loop).
            self._waiting().pop(replica_group_index, None)  # (a group waiting, then failed again: replaced now)
            frozen_after_s = self._worker_health_check_timeout_s if worker_timeout_s is not None else None
            groups = self.get_replica_groups() or []
            live = 0  # other replica groups still training: what a replacement joins
            for i, group in enumerate(groups):
                if i == replica_group_index or not group.is_active():
                    continue
                answer = _answer(group.get_workers(), frozen_after_s)
                if answer is None:
                    self._kill([(i, w.actor) for w in group.get_workers()])  # (one worker a replica group)
                if not answer:
                    gone = group.get_workers()
                    group.shutdown()
                    if lost_nodes_unconfirmed is not None:
                        self._waiting()[i] = gone
                live += bool(answer)
            if lost_nodes_unconfirmed is not None and replica_group_index < len(groups):
                old = groups[replica_group_index].get_workers()
                # It waits: while no other replica answers (every one gone, killed together but seen by polls
                # apart: nothing to join; the next poll reports them all failed and Ray restarts the whole group; a
                # replacement would wait for members that are gone, as stop 62's second rehearsal hung), or until
                # its slot has a place.
                if not live or not self._slot_ready(old):
                    groups[replica_group_index].shutdown()
                    self._waiting()[replica_group_index] = old
                    if live:
                        logging.getLogger(__name__).info(
                            "replica group %d waits for capacity for its slot", replica_group_index
                        )
                    return
            collecting: list[int] | None = getattr(self, "_raytrn_collecting", None)
            if collecting is None:
                for error in self._replace_now([replica_group_index]).values():
                    raise error  # (as Ray's replacement raises: the controller decides)
            else:  # the controller's failing groups, replaced together once each is checked (_replace_bad_workers)
                groups[replica_group_index].shutdown()  # (not a live other to the next one's checks)
                collecting.append(replica_group_index)

        def _replace_now(self, indices: list[int]) -> dict[int, BaseException]:
            """The replica groups ``indices`` replaced together (replicas.py), the started ones' places to the listener;
            returns the errors of those whose workers failed to start."""
            failed = replace_together(self, indices)
            groups = self.get_replica_groups() or []
            for index in indices:
                if listener is not None and index not in failed:
                    listener.replicas_started(_places(groups[index].get_workers()))
            return failed

        def _waiting(self) -> dict[int, list[Any]]:
            """Replica groups waiting for their slots (index: the failed group's workers), of this worker group."""
            waiting: dict[int, list[Any]] | None = getattr(self, "_raytrn_waiting", None)
            if waiting is None:
                waiting = {}
                self._raytrn_waiting = waiting
            return waiting

        def _slot_ready(self, old: list[Any]) -> bool:
            """Whether the placement-group slots of ``old`` (a failed replica group's workers) can take a replacement
            now: no node of theirs is lost while Ray still calls it alive (a replacement placed there fails when Ray
            marks it dead: a second failure for one loss), and every slot is placed on a live node that is not
            being drained (a slot of its own per replica: one that is not is asked for anew, and waits for capacity
            without the GCS spin of Ray's rescheduling; replica_slots.py)."""
            state = self._worker_group_state
            if state is None or lost_nodes_unconfirmed is None:
                return True
            if lost_nodes_unconfirmed([w.metadata.node_id for w in old]):
                return False
            usable = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")} - draining()
            if self._raytrn_slots is not None:  # (a lost slot asked for anew: no GCS spin)
                return self._raytrn_slots.ready_on([w.placement_group_bundle_index for w in old], usable)
            pg = state.placement_group_handle.placement_group
            where = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
            return all(where.get(w.placement_group_bundle_index) in usable for w in old)

        def _poll_workers_and_collect_errors(self, timeout: float | None) -> list[Any]:
            statuses = list(super()._poll_workers_and_collect_errors(timeout))
            self._kill_frozen(statuses)
            waiting = self._waiting()
            if not waiting:
                return statuses
            ranks = {w.distributed_context.world_rank for old in waiting.values() for w in old}
            others = [status for rank, status in enumerate(statuses) if rank not in ranks]
            if all(status.error is not None for status in others):  # (none left, or every one failed)
                return statuses  # every live replica failed too: Ray restarts the whole group (nothing to join)
            for rank in ranks:
                statuses[rank] = WorkerStatus(running=False)  # (finished: the run ends with the others)
            ready = {index: old for index, old in waiting.items() if self._slot_ready(old)}
            for index in ready:
                del waiting[index]
            if ready:  # together: nodes back at once join at one step
                try:
                    failed: dict[int, BaseException] = self._replace_now(sorted(ready))
                except Exception as error:  # (a survivor gone since the poll: none started; the next poll decides)
                    failed = dict.fromkeys(ready, error)
                for index, why in failed.items():  # its actors failed to start: it waits again, the next poll retries
                    waiting[index] = ready[index]
                    logging.getLogger(__name__).warning("replacing replica group %d failed: %s", index, why)
            return statuses

        def _kill_frozen(self, statuses: list[Any]) -> None:
            """Kill, once, the actor of every worker whose poll has gone unanswered past the health check's timeout
            while its node answers (a frozen process): whatever the controller decides next (a replica group
            replaced, the group restarted), its slot is freed ~5 s sooner (Ray's kill of a stopped process), and the
            others' collectives with it fail at once instead of waiting out their timeout. One whose node does not
            answer (lost, Ray not yet saying so) is left running until Ray marks the node dead and its poll fails
            as a lost node's (a drained one's then a preemption, as Ray counts it)."""
            workers = self.get_workers()
            waiting = {w.distributed_context.world_rank for old in self._waiting().values() for w in old}
            polls = [
                (None if r in waiting else s.error, w.metadata.node_id)
                for r, (s, w) in enumerate(zip(statuses, workers, strict=False))
            ]
            if not any(isinstance(error, WorkerHealthCheckTimeoutError) for error, _ in polls):
                return
            dead = {str(n["NodeID"]) for n in ray.nodes() if not n.get("Alive")}  # (marked dead since the poll)
            frozen, lost = frozen_workers(
                polls, WorkerHealthCheckTimeoutError,
                lambda ids: bool(set(ids) & dead) or bool(lost_nodes_unconfirmed and lost_nodes_unconfirmed(ids)),
            )  # fmt: skip
            for rank in lost:
                statuses[rank] = WorkerStatus(running=True, error=None, training_report=None)
            self._kill([(rank, workers[rank].actor) for rank in frozen])

        def _kill(self, actors: list[tuple[int, Any]]) -> None:
            """``ray.kill`` each of ``actors`` (rank, actor) not killed before, saying so in the driver's log."""
            killed: set[Any] = getattr(self, "_raytrn_killed", set())
            self._raytrn_killed = killed
            for rank, actor in actors:
                if actor not in killed:
                    killed.add(actor)
                    logging.getLogger(__name__).warning(
                        "rank %d stopped answering for %.0f s (frozen): killing its actor", rank,
                        self._worker_health_check_timeout_s,
                    )  # fmt: skip
                    ray.kill(actor)

        def _init_train_context_on_workers(
            self, workers: list[Any], sync_actor: Any, train_context_args: dict[str, list[Any]]
        ) -> None:
            # Stock passes ``ray.get_runtime_context().current_actor`` (the controller actor) for
            # ``ray.train.get_all_reported_checkpoints``, which raytrn does not use; here there is no such actor.
            current = ray.get_runtime_context().current_actor if in_actor() else None
            ray.get(
                [
                    worker.actor.init_train_context.remote(
                        train_run_context=self._train_run_context,
                        distributed_context=worker.distributed_context,
                        synchronization_actor=sync_actor,
                        storage_context=self._storage_context,
                        worker_callbacks=self._worker_callbacks_to_propagate,
                        controller_actor=current,
                        **{arg: values[i] for arg, values in train_context_args.items()},
                    )
                    for i, worker in enumerate(workers)
                ]
            )
            self._decorate_worker_log_file_paths(workers)

    class HostedPreemptionCallback(PreemptionCallback):  # type: ignore[misc]
        """Ray's preemption watcher, polling in a thread of this process (stock: an actor per worker group), every
        :func:`raytrn.compat.preemption.preemption_poll_s` seconds."""

        def after_worker_group_start(self, worker_group: Any) -> None:
            self._stop_watcher()
            node_to_ranks: dict[str, list[int]] = {}
            actors: dict[int, Any] = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                actors[rank] = w.actor
            watcher: Any = PreemptionWatcher(
                node_to_ranks=node_to_ranks, poll_interval_s=preemption_poll_s(), worker_actors_by_rank=actors
            )
            self._watcher = watcher

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()

    class Events(ControllerCallback, WorkerGroupCallback, ReportCallback):  # type: ignore[misc]
        """The controller's decisions, to ``listener``; ``committed``: the step of the running group's committed
        notice checkpoint (None: none)."""

        committed: int | None = None

        def before_worker_group_start(self, worker_group_context: Any) -> None:
            self.committed = None
            if listener is not None:
                listener.group_starting(int(worker_group_context.num_workers))

        def after_report(self, training_report: Any, metrics: list[dict[str, Any]]) -> None:
            steps = [m[NOTICE_COMMITTED] for m in metrics if NOTICE_COMMITTED in m]
            if steps and self.committed is None:
                self.committed = int(steps[0])
                if listener is not None:
                    listener.notice_committed(self.committed)

        def after_worker_group_training_start(self, worker_group: Any) -> None:
            if listener is not None:
                listener.group_started(_places(worker_group.get_workers()))

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            if listener is None or type(previous_state) is type(current_state):
                return
            if isinstance(current_state, ResizingState):
                decision: Any = current_state.scaling_decision
                listener.resizing(int(decision.num_workers))
            elif isinstance(current_state, PreemptingState):
                info = current_state.preemption_info
                listener.preempting(sorted(info.preempted_ranks), info.deadline_ms)

    class HostedController(TrainController):  # type: ignore[misc]
        worker_group_cls = HostedWorkerGroup

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Ray Train's lines reach ``console`` from _start on; its checkpoint manager's, built before, too
            manager = logging.getLogger(CHECKPOINT_MANAGER_LOGGER)
            routed = ToHandler(console) if console is not None else None
            if routed is not None:
                manager.addFilter(routed)
            try:
                super().__init__(*args, **kwargs)
            finally:
                if routed is not None:
                    manager.removeFilter(routed)

        def _start(self) -> None:
            # The end of TrainController.__init__, which configured Ray Train's logging and picked the callbacks:
            # adjusted before its first hook runs (the scaling policy's, which logs its resource request).
            self._worker_group_callbacks_to_propagate = [
                HostedPreemptionCallback() if isinstance(c, PreemptionCallback) else c
                for c in self._worker_group_callbacks_to_propagate
            ]
            if health_check_s is not None and not os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"):
                self._health_check_interval_s = health_check_s
            if console is not None:  # Ray Train's lines to raytrn's handler, not stderr
                train_logger = logging.getLogger("ray.train")
                for handler in list(train_logger.handlers):
                    if isinstance(handler, PlainRayHandler):
                        train_logger.removeHandler(handler)
                        for f in handler.filters:  # Ray's level filter (RunConfig's logging level)
                            console.addFilter(f)
                        train_logger.addHandler(console)
            super()._start()

        def _execute_failure_decision(
            self, failure_decision: Any, training_failed_error: Any, invoke_failure_decision_callbacks: bool = True
        ) -> Any:
            if listener is not None and failure_decision != FailureDecision.NOOP:
                errors = dict(getattr(training_failed_error, "worker_failures", None) or {})
                preemption = is_preemption_failure(training_failed_error)  # Ray's own budget: as it counts
                listener.failure_decided(
                    failure_decision == FailureDecision.RETRY, errors, training_failed_error, preemption
                )
            return super()._execute_failure_decision(
                failure_decision, training_failed_error, invoke_failure_decision_callbacks
            )

        def _is_preemption_deadline_exceeded(  # type: ignore[override]  # (a static method in Ray, called on self)
            self, preemption_info: Any, detected_at_s: float, extra_grace_s: float = 0.0
        ) -> bool:
            # The group stopped at its notice's committed checkpoint: restarting it without the draining node now
            # loses nothing (stock waits for the deadline, its workers perhaps still training)
            if any(isinstance(c, Events) and c.committed is not None for c in self._callbacks):
                return True
            return bool(TrainController._is_preemption_deadline_exceeded(preemption_info, detected_at_s, extra_grace_s))

        def _replace_bad_workers(self, poll_status: Any) -> None:
            # Ray's loop replaces the failing replica groups one after another (its "TODO: parallelize this"): each
            # is checked as before (replace_replica_group above), then those ready are replaced together
            group: Any = self._worker_group
            group._raytrn_collecting = []
            try:
                super()._replace_bad_workers(poll_status)
            finally:
                ready, group._raytrn_collecting = group._raytrn_collecting, None
            if ready:
                for error in group._replace_now(ready).values():
                    raise error

        def abort_here(self) -> None:
            """Stock ``abort`` (callbacks, worker group, state), without exiting the process it runs in."""
            if self.get_state().is_terminal():
                return
            self._controller_callback_manager.invoke_best_effort("before_controller_abort")
            try:
                if self._worker_group:
                    self._worker_group.abort()
                self._set_state(AbortedState())
            except Exception as e:  # as stock: logged, the abort goes on
                logging.getLogger(__name__).warning("aborting the worker group: %s", e)

    class Trainer(base):  # type: ignore[misc,valid-type]
        def _create_default_callbacks(self) -> list[Any]:
            keep_cleaner = in_actor()  # a Tune trial: its actor may be killed while the sweep's Ray lives on
            dropped = {n for n in skipped if not (keep_cleaner and n == "PlacementGroupCleanerCallback")}
            callbacks = [c for c in super()._create_default_callbacks() if type(c).__name__ not in dropped]
            return [*callbacks, Events()]

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            expire_resource_requests_after(REQUEST_EXPIRY_S)
            if make_policy is not None and "scaling_policy" in kwargs:
                kwargs["scaling_policy"] = make_policy(self.scaling_config)
            controller = HostedController(**kwargs)
            try:
                asyncio.run(controller.run())
            except BaseException:  # Ctrl-C, SIGTERM, an error in the loop itself: the workers go first
                controller.abort_here()
                raise
            return controller.get_result()

    Trainer.controller_cls = HostedController  # what its fit() runs
    Trainer.__name__ = Trainer.__qualname__ = f"Hosted{base.__name__}"
    return Trainer


def expire_resource_requests_after(seconds: float) -> int:
    """Ray Train's resource requests from this process expire ``seconds`` after their last renewal (at least two
    renewals' time and 5 s more: a live controller's never lapses), instead of Ray's 180 s; returns the expiry set.

    ``ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client.AUTOSCALING_REQUESTS_EXPIRE_TIME_S``,
    a module constant Ray's coordinator client reads at each request; public alternative: none.
    """
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client

    expiry = max(int(seconds), 2 * int(client.AUTOSCALING_REQUESTS_INTERVAL_S) + 5)
    client.AUTOSCALING_REQUESTS_EXPIRE_TIME_S = expiry
    return expiry
