"""The job's MLflow writer as a Ray actor: the driver starts it, workers send it metrics without waiting.

Why an actor rather than a thread in rank 0: the MLflow client's work (serialising, SQL or HTTP) then
runs in another process, not competing with the training loop for its GIL and CPU; and the buffer
outlives the workers, so metrics queued before a worker dies (or while the server is down) are still
delivered after the worker group restarts. The actor also knows the highest step it was given, so a
restarted worker group never logs a step twice, even while MLflow is unreachable.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TrackingActor:
    """Holds the job's :class:`~raytrn.tracking.logger.AsyncLogger` (started with ``num_cpus=0``)."""

    def __init__(
        self,
        uri: str,
        run_id: str | None,
        job: Any = None,
        tags: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        from raytrn.tracking.logger import AsyncLogger, logged_step_of
        from raytrn.tracking.mlflow_run import attach, unreachable
        from raytrn.tracking.neuron_monitor import PREFIX as SYSTEM_PREFIX

        def create_when_reachable() -> str | None:  # the driver could not reach MLflow at start
            if unreachable(uri):
                return None
            return attach(job, tags or {}, params or {}).run_id

        self.logger = AsyncLogger(uri, run_id, resolve_run=create_when_reachable if run_id is None else None)
        # What an earlier invocation of this job delivered (one read of the run), then what is queued here:
        # the highest training step (the run's tag) and each non-training metric's last step.
        self.max_step = 0
        self.world_sizes = ""
        self.last_steps: dict[str, int] = {}
        if run_id:
            try:
                run = self.logger.client.get_run(run_id)
                self.max_step = logged_step_of(run)
                self.world_sizes = run.data.tags.get("world_size_history", "")
                self.last_steps = {m.key: m.step for m in run.data._metric_objs if m.key.startswith(SYSTEM_PREFIX)}
            except Exception as e:  # unreachable: start from zero (steps are then only ordered within this job)
                log.warning("MLflow run %s not read: %s", run_id, e)

    def log_metrics(self, metrics: dict[str, float], step: int, training: bool = True) -> None:
        self.logger.log_metrics(metrics, step, training=training)
        if training:
            self.max_step = max(self.max_step, step)
        else:
            for key in metrics:
                self.last_steps[key] = max(self.last_steps.get(key, -1), step)

    def next_step(self, prefix: str) -> int:
        """The step after the last one of the non-training metrics named ``prefix...`` (0 when none): a
        restarted system-metrics sampler continues its node's series instead of repeating steps."""
        steps = [s for k, s in self.last_steps.items() if k.startswith(prefix)]
        return max(steps) + 1 if steps else 0

    def set_tags(self, tags: dict[str, str]) -> None:
        self.logger.set_tags(tags)

    def logged_step(self) -> int:
        """The highest training step already logged (queued or delivered): a restarted group skips up to it."""
        return self.max_step

    def worker_group_started(self, step: int, world_size: int) -> None:
        """Append ``step:world_size`` to the run's ``world_size_history`` tag."""
        self.world_sizes = f"{self.world_sizes},{step}:{world_size}".lstrip(",")
        self.logger.set_tags({"world_size_history": self.world_sizes})

    def run_id(self) -> str | None:
        return self.logger.run_id

    def flush(self, timeout_s: float) -> bool:
        return self.logger.flush(timeout_s)

    def close(self, timeout_s: float) -> int:
        """Flush (bounded) and stop; returns how many metrics could not be delivered."""
        return self.logger.close(timeout_s)


class RemoteLogger:
    """A worker's handle on the :class:`TrackingActor`: sends are fire-and-forget (no waiting on MLflow)."""

    def __init__(self, actor: Any, uri: str) -> None:
        self.actor = actor
        self.uri = uri
        self._client: Any = None

    def log_metrics(self, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
        self.actor.log_metrics.remote(metrics, step, training)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.actor.set_tags.remote(tags)

    def worker_group_started(self, step: int, world_size: int) -> None:
        self.actor.worker_group_started.remote(step, world_size)

    def logged_step(self) -> int:
        import ray

        return int(ray.get(self.actor.logged_step.remote(), timeout=60))

    def next_step(self, prefix: str) -> int:
        import ray

        return int(ray.get(self.actor.next_step.remote(prefix), timeout=60))

    @property
    def run_id(self) -> str | None:
        import ray

        return ray.get(self.actor.run_id.remote(), timeout=60)  # type: ignore[no-any-return]

    @property
    def client(self) -> Any:
        """A direct MLflow client (artifact uploads, reads): the actor only queues metrics and tags."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.uri)
        return self._client

    def flush(self, timeout_s: float) -> bool:
        import ray

        return bool(ray.get(self.actor.flush.remote(timeout_s), timeout=timeout_s + 60))


def start_tracking_actor(tracked: Any, job: Any) -> Any:
    """The job's TrackingActor, on the driver's node (0 CPUs), for a tracked run (pending or not)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    return (
        ray.remote(num_cpus=0)(TrackingActor)  # one call at a time: metrics stay in order
        .options(scheduling_strategy=here)
        .remote(tracked.uri, tracked.run_id, job, tracked.tags, tracked.params)
    )
