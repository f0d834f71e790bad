"""Every use of a private or undocumented Ray, MLflow (or torch DCP) API, in one place: this package.

Each function says what it stands in for and the public alternative, if there is one. Ray Train's controller,
run in the driver's process, is :mod:`raytrn.compat.controller` (re-exported here).
:data:`PRIVATE_NAMES` lists what each relies on; ``tests/unit/test_compat.py`` resolves every entry
against the installed Ray and MLflow and fails, naming it, when one has moved, so an upgrade that breaks
raytrn is caught by the unit tests rather than by a job. Nothing else in raytrn (or its tests and
benchmarks) imports a private Ray or MLflow name. Importing it imports neither Ray nor MLflow.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any, NoReturn

from raytrn.compat import controller, local_ray, preemption, replica_slots, replicas
from raytrn.compat.controller import (
    HOSTED_SKIPPED_CALLBACKS,
    ControllerListener,
    WorkerPlace,
    hosted_trainer,
)
from raytrn.compat.local_ray import agent_on_any_port
from raytrn.compat.preemption import NOTICE_COMMITTED, is_preemption_failure

#: Ray Train's modules a worker's main thread imports while Ray Train sets it up (its train context, Ray Tune's with
#: it), beside the thread of :mod:`raytrn.compat.worker` that imports torch: none may import torch (a torch submodule
#: imported beside ``import torch`` is an import-lock cycle). Audited on Ray 2.60 with an import hook in every worker
#: (docs/performance.md, 2026-12-02); ``tests/unit/test_import_ahead.py`` imports them and checks.
WORKER_SET_UP_MODULES = (
    "ray.train.v2._internal.execution.context",
    "ray.train.v2._internal.execution.storage",
    "ray.train.v2._internal.execution.train_fn_utils",
    "ray.train.v2._internal.execution.worker_group.thread_runner",
    "ray.tune.impl.tuner_internal",
)

#: The private names this package relies on: ``module`` or ``module:attribute.path``.
PRIVATE_NAMES: dict[str, str] = {
    **controller.PRIVATE_NAMES,
    **preemption.PRIVATE_NAMES,
    **replicas.PRIVATE_NAMES,
    **replica_slots.PRIVATE_NAMES,
    **local_ray.PRIVATE_NAMES,
    "Ray Data stats actor": "ray.data._internal.stats:get_or_create_stats_actor",
    "Ray Train replica-group flag": "ray.train.backend:Backend.has_replica_groups",
    "Ray Train replica-group replacement": "ray.train.v2._internal.execution.worker_group:WorkerGroup.replace_replica_group",
    "Ray Train context logger": "ray.train.v2._internal.execution.context",
    **{f"Ray Train worker set-up module {name}": name for name in WORKER_SET_UP_MODULES},
    "Ray Train storage logger": "ray.train.v2._internal.execution.storage",
    "Ray Data progress logger": "ray.data._internal.progress",
    "Ray Data executor logger": "ray.data._internal.execution.streaming_executor",
    "Ray Train controller start": "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._initialize_and_run_controller",
    "Ray Train default callbacks": "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._create_default_callbacks",
    "Ray Train elastic policy": "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy",
    "Ray Train fixed policy": "ray.train.v2._internal.execution.scaling_policy:FixedScalingPolicy._maybe_send_resource_request",
    "Ray Train policy start hook": "ray.train.v2._internal.execution.scaling_policy:ScalingPolicy.after_controller_start",
    "Ray Train scaling decisions": "ray.train.v2._internal.execution.scaling_policy:ResizeDecision",
    "Ray Train no-op decision": "ray.train.v2._internal.execution.scaling_policy:NoopDecision",
    "Ray Train elastic policy counting": "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy._count_possible_workers",
    "Ray Train elastic policy reservations": "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy._get_reserved_resources",
    "Ray autoscaling coordinator reservations": "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator:_AutoscalingCoordinatorActor.get_reserved_resources",
    "Ray Train worker preemption notice": "ray.train.v2._internal.execution.context:TrainContext",  # .preemption_context
    "Ray Train worker context": "ray.train.v2._internal.execution.context:get_train_context",
    "Ray Train preemption context": "ray.train.v2._internal.execution.preemption:PreemptionContext",
    "Ray draining nodes": "ray._private.state:GlobalState.get_draining_nodes",
    "Ray Train preemption watcher switch": "ray.train.v2._internal.constants:ENABLE_PREEMPTION_WATCHER_ENV_VAR",
    "Ray's raylet executable": "ray._private.services:RAYLET_EXECUTABLE",  # holds PRESTART_WORKERS_ENV's setting
    "Ray driver's printer of worker output": "ray._private.worker:print_to_stdstream",
    "Ray driver's worker-line formatter": "ray._private.worker:print_worker_logs",
    "Ray's node of this process": "ray._private.worker:_global_node",
    "Ray's log directory of a node": "ray._private.node:Node.get_logs_dir_path",
    "Ray node's autoscaler monitor stop": "ray._private.node:Node.kill_monitor",
    "Ray driver's error listener": "ray._private.worker:listen_error_messages",
    "Ray cluster-config validation": "ray.autoscaler._private.util:validate_config",
    "Ray cluster-config defaults": "ray.autoscaler._private.util:prepare_config",
    "Ray AWS network interfaces": "ray.autoscaler._private.aws.config:_configure_from_network_interfaces",
    "Ray fake multinode provider": "ray.autoscaler._private.fake_multi_node.node_provider:FakeMultiNodeProvider",
    "Ray node parameters": "ray._private.parameter:RayParams",
    "Ray job SDK error hook": "ray.dashboard.modules.dashboard_sdk:SubmissionClient._raise_error",
    "MLflow run metrics with steps": "mlflow.entities.run_data:RunData",  # ._metric_objs, set per instance
    "MLflow dataset entity": "mlflow.data.dataset:Dataset._to_mlflow_entity",
    "MLflow dataset context tag": "mlflow.utils.mlflow_tags:MLFLOW_DATASET_CONTEXT",
    "MLflow GPU monitor": "mlflow.system_metrics.metrics.gpu_monitor:GPUMonitor",
    "torch DCP file item record": "torch.distributed.checkpoint.filesystem:_StorageInfo",
    "torch DCP staging buffers": "torch.distributed._state_dict_utils:_create_cpu_state_dict",
    "torch DCP staging copy": "torch.distributed._state_dict_utils:_copy_state_dict",
    "torch traceable all-to-all": "torch.distributed._functional_collectives:all_to_all_single_autograd",
}

# -- Ray Train -----------------------------------------------------------------------------------------

#: Ray Train V2's switch for its preemption watcher (an actor polling the nodes). Undocumented environment
#: variable; no public alternative. An embedded local Ray (one machine, never preempted) turns it off.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

#: The raylet's setting (``RayConfig::prestart_worker_first_driver``, read from the environment as ``RAY_<name>``)
#: that starts as many idle Python workers as the node has CPUs when the first driver connects. Undocumented; no
#: public alternative. Ray Train's actors never run in them (an actor gets a new process), so on 2 cores they only
#: compete with a run's start: an embedded local Ray turns it off. ``tests/unit/test_compat.py`` finds the name in
#: the raylet's executable (``PRIVATE_NAMES``: "Ray's raylet executable").
PRESTART_WORKERS_ENV = "RAY_prestart_worker_first_driver"


def elastic_scaling_policy(scaling_config: Any, choose: Any, reachable: Callable[[Any], set[str]]) -> Any:
    """Ray Train V2's elastic scaling policy with raytrn's choice of size (``choose``) and live check of the
    nodes (``reachable``): :mod:`raytrn.train.elastic` gives both (this module imports nothing of raytrn's).

    Extends the private ``ElasticScalingPolicy`` (public alternative: none; Ray rounds sizes only for TPU
    slices) in four places:

    - ``_count_possible_workers(reserved)`` -> ``choose(reserved)``: whole nodes, valid sizes only;
    - ``_get_reserved_resources()`` asks the autoscaling coordinator to recompute against a fresh view of the
      cluster (``get_reserved_resources(..., recompute=True)``; its own view refreshes every 20 s) and drops
      the nodes whose raylet does not answer (``reachable(ray.nodes())``: the ids that do) or that are being
      drained (:func:`draining_nodes`): a (re)start is sized from the live cluster, not from before a node was
      lost, and never lands on a node about to be preempted;
    - ``make_decision_for_running_worker_group`` never shrinks a running group (failures and preemption
      deadlines do, after their checkpoints);
    - ``make_decision_for_non_running_worker_group`` never sizes a (re)start from a view taken while the last group
      still ran (Ray reuses a view for a second: a node lost right after a resize check was still counted).

    Everything else (when to decide, the resource requests to the autoscaler, ``min_workers``) is Ray's.
    """
    import time

    import ray
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
    )

    class RaytrnElasticPolicy(ElasticScalingPolicy):  # type: ignore[misc]
        def make_decision_for_running_worker_group(self, worker_group_state: Any, worker_group_status: Any) -> Any:
            # A running group only grows. It shrinks when a worker fails, or when a preemption notice's deadline
            # passes after the group checkpointed (raytrn.train.preemption); shrinking it here, on seeing a
            # draining node, would restart it before that checkpoint.
            decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
            self._raytrn_running_view_at = self._latest_reserved_resources_query_time  # (a view the group ran with)
            if isinstance(decision, ResizeDecision) and decision.num_workers < worker_group_state.num_workers:
                return NoopDecision()
            return decision

        def make_decision_for_non_running_worker_group(self) -> Any:
            # A (re)start is sized from a view of the cluster taken after the last group stopped running: Ray keeps
            # a view for a second, and one a resize check took while the group still ran predates whatever stopped
            # it (a node lost 0.35 s after such a check: restarted at the old size, Ray's 60 s start timeout, then
            # the right size; the chaos suite, 2026-12-04).
            if self._latest_reserved_resources_query_time <= getattr(self, "_raytrn_running_view_at", float("-inf")):
                self._latest_reserved_resources_query_time = float("-inf")
            return super().make_decision_for_non_running_worker_group()

        def _count_possible_workers(self, reserved_resources: dict[str, dict[str, float]]) -> int:
            return int(choose(reserved_resources))

        def _get_reserved_resources(self) -> dict[str, dict[str, float]] | None:
            now = time.monotonic()
            if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
                return self._latest_reserved_resources  # type: ignore[no-any-return]
            reserved = None
            try:
                reserved = ray.get(
                    self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                    timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
                )
                live = set(reachable(ray.nodes())) - draining_nodes()
                reserved = {node: res for node, res in reserved.items() if node in live}
            except Exception as e:  # as Ray's: no decision this time, try again shortly
                logging.getLogger(__name__).warning("raytrn elastic policy: no view of the cluster this time: %s", e)
            finally:
                self._latest_reserved_resources_query_time = time.monotonic()
                self._latest_reserved_resources = reserved
            return reserved

    return RaytrnElasticPolicy(scaling_config)


def with_replica_groups(backend_cls: type) -> type:
    """``backend_cls`` (a ``ray.train.backend.Backend``) marked as having replica groups of one worker: Ray Train V2's
    controller then replaces only a failed worker, in its placement-group slot, instead of restarting the group, when
    its scaling policy keeps the size (``TrainController._execute_resize_decision``). The flag is an undocumented
    class attribute of Ray's public ``Backend`` (Ray's own user: ``TorchftConfig``'s backend). Raises AttributeError
    naming it when Ray no longer has it."""
    from ray.train.backend import Backend

    if not hasattr(Backend, "has_replica_groups"):
        raise AttributeError(
            "ray.train.backend.Backend.has_replica_groups: gone from this Ray (live recovery needs it)"
        )
    backend_cls.has_replica_groups = True  # type: ignore[attr-defined]
    return backend_cls


def local_fixed_scaling_policy(scaling_config: Any) -> Any:
    """Ray Train V2's fixed-size scaling policy without its resource requests to the autoscaling coordinator, for a
    Ray that ``raytrn train`` started on this machine: no autoscaler reads them, and the coordinator is a detached
    actor (a process, ~1 CPU-second) the first request starts, on the path to the first step.

    Extends the private ``FixedScalingPolicy`` (public alternative: none; every policy sends them).
    """
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    class LocalFixedScalingPolicy(FixedScalingPolicy):  # type: ignore[misc]
        def after_controller_start(self, train_run_context: Any) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

        async def before_controller_shutdown(self) -> None:
            pass

        def before_controller_abort(self) -> None:
            pass

    return LocalFixedScalingPolicy(scaling_config)


def preemption_notice() -> Any:
    """This worker's copy of a preemption notice for its group (a ``ray.train.PreemptionInfo``), or None.

    ``ray.train.v2._internal.execution.context.get_train_context().preemption_context.preemption_info``, set on
    every worker by Ray Train's preemption watcher; public alternative: ``ray.train.get_preemption_info()``,
    the same value agreed through Ray (a barrier over every worker through Ray's actors, milliseconds): raytrn
    reads the local copy every step and agrees on it with one small all-reduce
    (:mod:`raytrn.train.preemption`).
    """
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


class JobRequestError(RuntimeError):
    """A request of Ray's job SDK that the dashboard answered with an error: its HTTP ``status_code`` and body
    (``text``); its message is the SDK's own."""

    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"Request failed with status code {status_code}: {text}.")
        self.status_code, self.text = status_code, text

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status_code, self.text))


@functools.cache
def job_client_class() -> type:
    """``ray.job_submission.JobSubmissionClient`` whose failed requests raise :class:`JobRequestError`, the status
    code kept. The SDK's ``SubmissionClient._raise_error`` raises a RuntimeError that carries the code only in its
    message; public alternative: none (the Jobs REST API itself, by hand)."""
    from ray.job_submission import JobSubmissionClient

    class Client(JobSubmissionClient):
        def _raise_error(self, r: Any) -> NoReturn:
            raise JobRequestError(int(r.status_code), str(r.text))

    return Client


def job_client(address: str, headers: dict[str, str]) -> Any:
    """A job-submission client of the dashboard at ``address`` (:func:`job_client_class`)."""
    return job_client_class()(address, headers=headers)


def draining_nodes() -> set[str]:
    """The ids of the nodes being drained (``ray drain-node``, a spot notice): no new work is placed there."""
    return set(drain_deadlines())


def drain_deadlines() -> dict[str, float | None]:
    """Each node being drained, with its drain's deadline (epoch seconds; None: the drain has none, the node goes
    once idle).

    ``ray._private.state.state.get_draining_nodes()`` (node id -> deadline in epoch ms, 0 for none); public
    alternative: none (``ray.nodes()`` shows a draining node as alive).
    """
    from ray._private.state import state

    return {node: (ms / 1000 if ms else None) for node, ms in state.get_draining_nodes().items()}


def create_data_stats_actor() -> None:
    """Create Ray Data's (detached) stats actor from this process, i.e. on this node.

    ``ray.data._internal.stats.get_or_create_stats_actor``; public alternative: none (Ray Data creates it
    wherever the first dataset runs).
    """
    from ray.data._internal.stats import get_or_create_stats_actor

    get_or_create_stats_actor()


#: Loggers of Ray Train V2's execution internals that log every report and checkpoint at INFO.
RAY_TRAIN_CHATTY_MODULES = ("ray.train.v2._internal.execution.context", "ray.train.v2._internal.execution.storage")
#: Ray Data's loggers (internal module names) and the level each is raised to: its progress module warns once
#: per process "Progress bars disabled ..." -- raytrn's own setting in each training worker (five such lines
#: around the summary of a plain ``ray job submit``) -- and the executor logs "execution finished" at INFO.
RAY_DATA_CHATTY_LOGGERS = {
    "ray.data._internal.progress": logging.ERROR,
    "ray.data._internal.execution.streaming_executor": logging.WARNING,
}


def quiet_ray_train_logs() -> None:
    """Set Ray Train's per-report and Ray Data's per-execution INFO loggers to WARNING (they drown the driver's
    progress line), Ray Data's progress-bar notices to ERROR.

    Those modules name their loggers by ``__name__`` or ``__file__``; public alternative: none short of
    raising the level of all of ``ray.train``. A Ray without the modules has nothing to quiet.
    """
    for name, level in RAY_DATA_CHATTY_LOGGERS.items():  # every worker streams its own data: per-epoch lines
        logging.getLogger(name).setLevel(level)
    for name in RAY_TRAIN_CHATTY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for logger_name in (module.__name__, getattr(module, "__file__", None)):
            if logger_name:
                logging.getLogger(logger_name).setLevel(logging.WARNING)


# -- Ray core --------------------------------------------------------------------------------------------

#: What :func:`route_worker_output` hands its handler: Ray's own printer of a batch of forwarded lines
#: (``data`` with ``lines``, ``pid``, ``actor_name``/``task_name``, ``ip``, ``is_err``; prints to the terminal).
RayPrint = Callable[[dict[str, Any], bool], None]


def route_worker_output(handler: Callable[[dict[str, Any], bool, RayPrint], None]) -> None:
    """Send what Ray forwards to this driver (every worker's and actor's stdout/stderr, the raylet's warnings
    such as "N PYTHON worker processes have been started") to ``handler(data, ignore_prefix, ray_print)``
    instead of the terminal; ``ray_print`` is Ray's own printer, for the lines the handler keeps on it.

    Call before ``ray.init``: ``ray._private.worker.print_to_stdstream`` is what ``connect`` binds as the
    log-forwarding handler and what ``listen_error_messages`` calls for the raylet's messages. Public
    alternative: ``ray.init(log_to_driver=False)``, which drops the workers' lines instead of keeping them
    (and not the raylet's), and keeps none of them for the user.
    """
    import ray._private.worker as ray_worker

    ray_print = ray_worker.print_to_stdstream
    if getattr(ray_print, "raytrn_routed", False):  # routed already (a second run in this process)
        ray_print = ray_print.ray_print  # type: ignore[attr-defined]

    def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
        handler(data, ignore_prefix, ray_print)

    print_to_stdstream.raytrn_routed = True  # type: ignore[attr-defined]
    print_to_stdstream.ray_print = ray_print  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def node_logs_dir() -> str | None:
    """Ray's log directory on this process's node (``<session>/logs``: what ``ray logs`` and the dashboard's Logs
    view list), once this process is connected; None before.

    ``ray._private.worker._global_node.get_logs_dir_path()``, as Ray's job supervisor finds it; public
    alternative: none (the session's directory is not in the runtime context).
    """
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    return None if node is None else str(node.get_logs_dir_path())


def stop_local_monitor() -> bool:
    """Stop the autoscaler monitor of the local Ray this process started, at once (SIGKILL, reaped); whether there
    was one running. Call just before Ray's own shutdown of it (at exit).

    Ray's shutdown stops its node's processes one after another, each with SIGTERM and up to 1 s to exit before a
    SIGKILL; the monitor exits only at its next update (every 5 s), so every embedded local Ray's end waited that
    second (measured: 1.02 of ray.shutdown's 1.12 s). A local Ray has nothing for it to scale: Ray SIGKILLs it anyway.
    ``ray._private.worker._global_node.kill_monitor(check_alive=False)`` (what Ray's tests use to stop it); public
    alternative: none (``ray.shutdown`` stops every process of the node, in turn).
    """
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not node.head or "monitor" not in node.all_processes:
        return False
    node.kill_monitor(check_alive=False)
    return True


def write_worker_lines(data: dict[str, Any], file: Any, ignore_prefix: bool = False) -> None:
    """Write a batch of forwarded lines to ``file`` as Ray prints them (``(TrainController pid=N) line``; the
    autoscaler's raw lines filtered to its events), without de-duplication.

    ``ray._private.worker.print_worker_logs``; public alternative: none (formatting them anew, and the
    autoscaler's filter, would copy Ray's).
    """
    from ray._private.worker import print_worker_logs

    print_worker_logs(data, file, ignore_prefix)


def ray_validate_cluster_config(config: dict[str, Any]) -> None:
    """Ray's own checks of a cluster-launcher config (what ``ray up`` runs before it launches): defaults
    filled, the schema, and AWS's NetworkInterfaces folded into the launch config. Raises on a bad one.

    ``ray.autoscaler._private.util.{prepare_config,validate_config}`` and
    ``ray.autoscaler._private.aws.config._configure_from_network_interfaces``; public alternative: ``ray up``
    itself, which needs cloud credentials. raytrn applies Ray's shipped JSON schema on its own; tests use this
    to check the shipped cluster files pass Ray's full check too.
    """
    from ray.autoscaler._private.aws.config import _configure_from_network_interfaces
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    _configure_from_network_interfaces(prepared)


#: The environment variable Ray's fake multinode provider gives each node it starts: the node's id.
FAKE_NODE_ID_ENV = "RAY_OVERRIDE_NODE_ID_FOR_TESTING"


def simulator_node_provider() -> type:
    """Ray's ``fake_multinode`` node provider, except that each node it starts unpacks runtime environments
    (a job's ``working_dir``) into a directory of its own, as a real node does on its own disk.

    Stock, every fake node shares the head's session directory, and a node that joins while a job runs
    unpacks the job's ``working_dir`` again with ``overwrite=True``: it deletes and recreates the directory
    that the job's driver and actors on the head have as their working directory, and their next
    ``os.getcwd()`` fails (``FileNotFoundError``; MLflow's sqlite store calls it). Each node here gets
    ``runtime_resources_<node id>`` instead.

    ``ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider`` builds each node's
    ``ray._private.parameter.RayParams`` with :data:`FAKE_NODE_ID_ENV` among its ``env_vars`` and no
    ``runtime_env_dir_name``; this class gives ``RayParams`` one, in the process that runs the provider (the
    simulator's autoscaler monitor, which starts nothing else). Public alternative: none (the fake provider is
    Ray's testing tool). Loaded by the autoscaler as ``raytrn.cluster.simprovider.SimulatorNodeProvider``.
    """
    from ray._private import parameter
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

    stock = parameter.RayParams

    class NodeParams(stock):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            node_id = (kwargs.get("env_vars") or {}).get(FAKE_NODE_ID_ENV)
            if node_id and not kwargs.get("runtime_env_dir_name"):
                kwargs["runtime_env_dir_name"] = f"runtime_resources_{node_id}"
            super().__init__(*args, **kwargs)

    class SimulatorNodeProvider(FakeMultiNodeProvider):  # type: ignore[misc, valid-type]
        def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
            super().__init__(provider_config, cluster_name)
            parameter.RayParams = NodeParams  # type: ignore[misc]

    return SimulatorNodeProvider


# -- MLflow ------------------------------------------------------------------------------------------


def metric_objects(run: Any) -> list[Any]:
    """The latest ``Metric`` (key, value, timestamp, *step*) of each metric of an MLflow ``Run``.

    ``RunData._metric_objs``; public alternative: ``MlflowClient.get_metric_history`` per key (one request
    per metric; ``run.data.metrics`` has values but not steps).
    """
    return list(run.data._metric_objs)


def dataset_input(dataset: Any, context: str) -> Any:
    """An ``mlflow.entities.DatasetInput`` for an ``mlflow.data`` dataset, tagged with its ``context``.

    ``Dataset._to_mlflow_entity`` and ``mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT``; public
    alternative: ``mlflow.log_input(dataset, context)``, which needs an active fluent run in this process.
    """
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])


def gpu_monitor() -> Any:
    """MLflow's pynvml GPU monitor (``system/gpu_*`` metrics under MLflow's names), or raise ImportError.

    ``mlflow.system_metrics.metrics.gpu_monitor.GPUMonitor``; public alternative: MLflow's system metrics
    logging for a fluent run (``mlflow.enable_system_metrics_logging``), which samples in the logging process.
    """
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    return GPUMonitor()


# -- torch DCP ---------------------------------------------------------------------------------------


def dcp_storage_info(name: str, offset: int, length: int) -> Any:
    """Where a DCP item is in a file (``relative_path``, ``offset``, ``length``): the record DCP's own file writer
    makes and its file reader reads (``_StorageInfo``), for a writer of raytrn's own layout
    (:mod:`raytrn.checkpoint.memory`). No public alternative: a storage writer that keeps DCP's file reader must
    record its items this way."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(name, offset, length)


def dcp_stage(state: dict[str, Any], host: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` copied to host memory as DCP's own staging does (its tensors and DTensors' shards into CPU tensors,
    plain values as they are), into ``host``'s buffers when it has the same keys, else into new ones (not pinned:
    CPU-only machines have no pinned memory). The caller passes ``host`` only for a state of the same structure:
    a tensor of the same shape wherever ``host`` has one, and none where it has a plain value (a tensor of another
    shape could broadcast into a kept buffer; a value that became a tensor is passed through, the live tensor, not
    copied: :class:`raytrn.checkpoint.dcp.LiveState` builds its state again for either). Returns the copy and the
    buffers to pass next time. DCP's
    ``BlockingAsyncStager`` uses these functions but pins its cached buffers; no public function stages into kept
    buffers."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    if host is not None:
        try:
            return _copy_state_dict(state, host, type_check=False), host
        except Exception:  # another structure (CompanionMismatch, a shape): new buffers (a real error raises again)
            pass
    host = _create_cpu_state_dict(state)
    return _copy_state_dict(state, host, type_check=False), host


# -- torch functional collectives -----------------------------------------------------------------------


def all_to_all_rows(rows: Any, send: list[int], receive: list[int], group: Any) -> Any:
    """``send[r]`` rows of ``rows`` to rank ``r`` of ``group``, ``receive[r]`` from it, differentiably (the gradient
    goes back the same way), and traceable by ``torch.compile`` (TorchNeuron compiles each block with
    ``fullgraph=True``): torch's functional ``all_to_all_single_autograd``, what torchtitan's expert parallelism
    uses. The public ``torch.distributed.all_to_all_single`` has no autograd and breaks the graph;
    ``torch.distributed.nn.functional.all_to_all_single`` is deprecated in its favour."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(rows.contiguous(), receive, send, group)


def resolve(spec: str) -> Any:
    """The object a :data:`PRIVATE_NAMES` entry names (``module`` or ``module:attr.path``); raises ImportError
    or AttributeError naming it when it has moved."""
    module_name, _, path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, path.split(".")):
        if not hasattr(obj, part):
            raise AttributeError(f"{spec}: {getattr(obj, '__qualname__', obj)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


__all__ = [
    "HOSTED_SKIPPED_CALLBACKS",
    "NOTICE_COMMITTED",
    "ControllerListener",
    "WorkerPlace",
    "agent_on_any_port",
    "hosted_trainer",
    "is_preemption_failure",
]
