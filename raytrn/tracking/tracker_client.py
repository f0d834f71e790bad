"""The driver's and the evaluator's typed client of the job's tracking actor (:class:`TrackingActor`): the calls that
are not the progress board's (those: :mod:`raytrn.tracking.roles`). Each blocks or not as before: the run's end and
its registrations wait (bounded); the ledger's and the evaluator's posts do not, or are answers looked at later."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrn.pending import Pending, RayPending


@dataclass(frozen=True)
class RunIds:
    """The MLflow run the tracking actor wrote (``run_id`` None: it was never created)."""

    run_id: str | None
    experiment_id: str | None


class TrackerClient:
    """Typed calls on the tracking actor's Ray handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def ready(self) -> Pending[dict[str, str | None]]:
        """The run created (its ids), or the error MLflow refused it with (raised by ``result``)."""
        return RayPending(self.handle.ready.remote())

    def finish(self, status: str, flush_timeout_s: float) -> RunIds:
        """Deliver what the actor holds (bounded by ``flush_timeout_s``), then mark the run ``status``."""
        import ray

        ids = ray.get(self.handle.finish.remote(status, flush_timeout_s), timeout=flush_timeout_s + 30)
        return RunIds(run_id=ids.get("run_id"), experiment_id=ids.get("experiment_id"))

    def registered(self, timeout_s: float = 60) -> dict[str, str]:
        """The registered model versions of the run, by the step each was made from."""
        import ray

        return dict(ray.get(self.handle.registered.remote(), timeout=timeout_s))

    def log_goodput(self, metrics: dict[str, float], step: int) -> None:
        """The run's goodput ledger (fire-and-forget)."""
        self.handle.log_goodput.remote(metrics, step)

    def log_metrics(self, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
        """Metrics at ``step`` (fire-and-forget)."""
        self.handle.log_metrics.remote(metrics, step, training)

    def checkpoint_evaluated(self, step: int, scores: dict[str, float], exported: bool) -> Pending[None]:
        return RayPending(self.handle.checkpoint_evaluated.remote(step, scores, exported))

    def checkpoint_eval_failed(self, step: int, reason: str, failures: int) -> Pending[None]:
        return RayPending(self.handle.checkpoint_eval_failed.remote(step, reason, failures))

    def set_evaluator(self, evaluator: Any, timeout_s: float = 60) -> None:
        import ray

        ray.get(self.handle.set_evaluator.remote(evaluator), timeout=timeout_s)

    def flush_models(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) for the LoggedModels and registrations still being written."""
        import ray

        return bool(ray.get(self.handle.flush_models.remote(timeout_s), timeout=timeout_s + 60))
