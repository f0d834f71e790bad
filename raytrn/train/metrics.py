"""The loop's metrics component: throughput, loss, cost and MFU every ``run.log_every`` steps, to where they go.

Every rank keeps the throughput window and reads the loss at log steps (an all-reduce: a host-device sync, after the
step's graph); rank 0 sends the metrics to the job's tracking actor (MLflow, never waited on) and progress board,
and in a sweep's trial every rank reports them to Ray Tune through Ray Train. The first step's time (launch or
restart to first step) goes to the board once per worker group. The first worker of each node samples its node's
system metrics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import ray
import ray.train
import torch

from raytrn.checkpoint.progress import Progress
from raytrn.config import JobSpec
from raytrn.estimate.job import estimate_errors
from raytrn.models import model_stats
from raytrn.runtime import process_started_at
from raytrn.tracking.actor import RemoteLogger, resolve
from raytrn.tracking.cost import CostTracker, mfu, peak_flops_per_worker, usd_per_hour
from raytrn.tracking.export import ExportAhead
from raytrn.tracking.roles import ProgressPosts
from raytrn.train.memory_probe import MemoryProbe
from raytrn.train.plan import WorkerPlan
from raytrn.train.protocol import MetricSource, StepEnd
from raytrn.train.step import StepResult, Training, read_metrics
from raytrn.train.stragglers import Stragglers

#: Between log steps, rank 0 tells the board the step it reached at most this often (a restart's steps trained again
#: are counted from it; a step posts nothing when the last post is more recent).
REACHED_EVERY_S = 1.0


def tracking_logger(plan: WorkerPlan) -> RemoteLogger | None:
    """This worker's handle on the job's tracking actor (None when tracking is off)."""
    if plan.tracker is None or plan.mlflow_uri is None:
        return None
    return RemoteLogger(plan.tracker, plan.mlflow_uri)


class MetricsReporter:
    """Decides the log steps and sends each one's metrics; ``progress`` is the loop's (its step and tokens). The
    ``metrics`` phase of the step protocol (:mod:`raytrn.train.protocol`).

    Built by :func:`raytrn.train.components.build_components`, which starts its collaborators: ``logger`` and
    ``posts`` (rank 0's MLflow handle and the board's progress posts; None elsewhere), ``efficiency`` (rank 0's cost
    and MFU), ``probe`` (a worker's memory, measured once per group: a collective at its second step), ``sources``
    (other components' metrics of a log step: the checkpoints', the guard's, the in-memory snapshots')."""

    phase: ClassVar[str] = "metrics"
    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(
        self,
        plan: WorkerPlan,
        t: Training,
        progress: Progress,
        *,
        rank: int,
        world_size: int,
        logger: RemoteLogger | None,
        posts: ProgressPosts | None,
        efficiency: Efficiency | None,
        probe: MemoryProbe,
        sources: Sequence[MetricSource] = (),
    ) -> None:
        job = self.job = plan.job
        self.t, self.progress, self.world_size = t, progress, world_size
        self.started_at = plan.started_at
        self.logger, self.board, self.efficiency, self.probe = logger, posts, efficiency, probe
        self.sources = tuple(sources)
        self.group_started_at = process_started_at()
        # Tokens per optimizer step over the job: one batch per model replica (data-parallel rank).
        self.tokens_per_step = t.grad_accum * job.data.micro_batch_size * job.data.seq_len * t.data_parallel_size
        self._reached_at = time.monotonic()
        # Each rank's own time per step (data wait + forward), gathered at log steps: who is slow
        self.stragglers = Stragglers(world_size, rank)
        self._first_step = True
        #: Rank 0: the final model's export imports, once the run's end is near (raytrn.tracking.export).
        self.export_ahead = ExportAhead(job) if logger is not None else None
        #: Tokens and seconds of the group's log windows after its first (compiles, warm-up), and of the first
        self._steady_tokens, self._steady_s = 0, 0.0
        self._first_window: tuple[int, float] | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start, self._tokens, self._steps, self._data_wait = time.perf_counter(), 0, 0, 0.0
        self._own, self._window_first = 0.0, self.progress.step + 1

    def should_log(self, step: int, *, last: bool) -> bool:
        return last or step % self.job.run.log_every == 0

    def measuring(self, step: int) -> AbstractContextManager[None]:
        """Around the train step ``step`` (every rank): the memory probe's, at its step."""
        return self.probe.stepping(step)

    def step_ended(self, end: StepEnd) -> None:
        """The ``metrics`` phase: count the step; at a log step, its metrics (``end.logged``)."""
        end.logged = self.step_done(end.result, last=end.last)

    def step_done(self, result: StepResult, *, last: bool) -> dict[str, Any]:
        """Count the step just trained (``progress.step`` already moved); on a log step, its metrics (else {})."""
        progress = self.progress
        measured = self.probe.measure(progress.step, self.t.model, self.t.optimizer, self.t.grad_accum)  # collective
        if measured is not None and self.logger is not None:
            self.logger.log_metrics({"memory_measured_bytes": float(measured.bytes)}, progress.step, training=False)
        if self._first_step:  # start-up cost: launch (or restart) to the first step done, once per worker group
            self._first_step = False
            if self.board is not None:  # the board names it: time_to_first_step_s, or restart_to_first_step_s
                now = time.time()
                since_launch = now - (self.started_at or now)
                self.board.first_step_done(progress.step, since_launch, now - self.group_started_at)
        trained = result.trained_tokens if result.trained_tokens is not None else self.tokens_per_step  # masked
        progress.tokens_seen += trained
        self._tokens += trained
        self._steps += 1
        self._data_wait += result.data_wait_s
        self._own += result.data_wait_s + result.forward_s
        step = progress.step
        if self.export_ahead is not None:
            self.export_ahead.step_done(step)
        if not self.should_log(step, last=last):
            if self.board is not None and time.monotonic() - self._reached_at >= REACHED_EVERY_S:
                self.board.reached(step)
                self._reached_at = time.monotonic()
            return {}
        # Loss all-reduced over workers, then read: a host-device sync, after the step's graph.
        elapsed = time.perf_counter() - self._window_start
        if self._first_window is None:
            self._first_window = (self._tokens, elapsed)
        else:
            self._steady_tokens += self._tokens
            self._steady_s += elapsed
        metrics: dict[str, Any] = {
            **read_metrics(result, self.world_size),
            "lr": self.t.scheduler.get_last_lr()[0],
            "tokens_per_s": self._tokens / elapsed,
            "step_time_s": elapsed / self._steps,
            "data_wait_s": self._data_wait / self._steps,
            "tokens_seen": float(progress.tokens_seen),
            "world_size": float(self.world_size),
            "epoch": float(progress.epoch),
            # the slowest and fastest rank's own time per step (data wait + forward), and the slowest's rank
            **self.stragglers.metrics(self._own / self._steps, (self._window_first, step)),
        }
        if self.efficiency is not None:
            metrics.update(self.efficiency.metrics(metrics["tokens_per_s"], progress.tokens_seen))
        for source in self.sources:  # other components' (raytrn.train.protocol.MetricSource)
            metrics.update(source.metrics())
        if self.logger is not None and step > progress.last_logged_step:
            self.logger.log_metrics(metrics, step)
        if self.board is not None:
            self.board.update(step, self.job.run.max_steps, metrics)
        progress.logged(step, metrics)
        self._reset_window()
        return metrics

    def finish(self) -> None:
        """The run's last step (rank 0 logs): how far ``raytrn estimate``'s tokens/s and memory a worker were from
        this group's (its log windows after the first; the probe's measurement), as metrics."""
        if self.logger is None:
            return
        tokens, seconds = (self._steady_tokens, self._steady_s) if self._steady_s else (self._first_window or (0, 0.0))
        measured = self.probe.result
        errors = estimate_errors(
            self.job, self.world_size, tokens_per_s=tokens / seconds if seconds else None,
            memory_bytes=measured.bytes if measured else None, memory_how=measured.how if measured else "probe",
        )  # fmt: skip
        if errors:
            self.logger.log_metrics(errors, self.progress.step, training=False)

    def cost_usd(self) -> float | None:
        """The run's cost up to now (rank 0; None elsewhere): what a checkpoint stores."""
        return self.efficiency.cost_usd() if self.efficiency is not None else None


class TuneReport:
    """The ``report`` phase of a sweep's trial: Ray Tune judges it on the log and eval steps' metrics (every rank
    reports, through Ray Train)."""

    phase: ClassVar[str] = "report"
    long: ClassVar[bool] = True
    blocking: ClassVar[str | None] = None

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def step_ended(self, end: StepEnd) -> None:
        if end.logged or end.scores:
            ray.train.report({**end.logged, **end.scores, "step": self.progress.step}, checkpoint=None)


class Efficiency:
    """Running cost (USD, over the whole run), USD per 1M tokens, tokens per USD and MFU, for rank 0's metrics.

    ``spent_usd``: what the run cost before this worker group (the checkpoint's), raised to ``logged_usd`` (a
    future of the last value logged: a restart repeats steps whose time was paid for) when it is first needed;
    ``started_at``: when the group started (wall clock), from which its own cost runs.
    """

    def __init__(
        self,
        job: JobSpec,
        world_size: int,
        *,
        spent_usd: float = 0.0,
        logged_usd: Any = None,
        started_at: float | None = None,
    ) -> None:
        s = job.scaling
        nodes = -(-world_size // s.workers_per_node) if s.workers_per_node else 1
        price = usd_per_hour(
            s.instance_type, override=job.tracking.usd_per_hour, spot_price=job.tracking.spot_usd_per_hour
        )
        self.cost = CostTracker(price, nodes, base_usd=spent_usd)
        gpu = None
        if s.accelerator == "cuda" and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
        self.peak = peak_flops_per_worker(s.accelerator, s.instance_type, lnc=job.neuron.lnc, gpu=gpu)
        self.flops_per_token = model_stats(job.model, job.data.seq_len).flops_per_token
        self.world_size = world_size
        self.start = time.time() if started_at is None else started_at
        self._logged_usd = logged_usd

    def _spent(self) -> None:
        if self._logged_usd is not None:  # read once, at the first log step (never while the group starts)
            self.cost.base_usd = max(self.cost.base_usd, resolve(self._logged_usd, 0.0))
            self._logged_usd = None

    def metrics(self, tokens_per_s: float, tokens_total: int) -> dict[str, float]:
        """Cost metrics with ``tokens_total`` tokens trained over the run, MFU at ``tokens_per_s``."""
        self._spent()
        out = self.cost.update(time.time() - self.start, tokens_total)
        value = mfu(tokens_per_s, self.flops_per_token, self.world_size, self.peak)
        if value is not None:
            out["mfu"] = value
        return out

    def cost_usd(self) -> float:
        """The run's cost up to now (what a checkpoint stores)."""
        self._spent()
        self.cost.update(time.time() - self.start, 0)
        return self.cost.cost_usd
