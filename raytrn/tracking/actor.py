"""The job's MLflow writer as a Ray actor: the driver starts it, workers send it metrics without waiting.

Why an actor rather than a thread in rank 0: the MLflow client's work (serialising, SQL or HTTP) then
runs in another process, not competing with the training loop for its GIL and CPU; and the buffer
outlives the workers, so metrics queued before a worker dies (or while the server is down) are still
delivered after the worker group restarts. The actor also knows the highest step it was given, so a
restarted worker group never logs a step twice, even while MLflow is unreachable.

It also creates (or reattaches) the job's run, in its own process while the workers start (then it yields the
CPU to them: a lower priority for the rest of the run); the driver only checked that the server answers. A run
MLflow refuses (a deleted experiment or run, a bad ``tracking.run_id``) is reported by
:meth:`TrackingActor.ready`; the driver then stops the training with that error. And it is the job's progress
board (one process, not two).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from raytrn.checkpoint.messages import PassedOver, render
from raytrn.compat import metric_objects
from raytrn.errors import RaytrnError
from raytrn.ray_output import mark_raytrn_logs
from raytrn.runtime import NOT_FORWARDED, forwarded_env, on_this_node
from raytrn.tracking import goodput
from raytrn.tracking.board import BOARD_NAMESPACE, ProgressBoard, RestoreRecord, board_name
from raytrn.tracking.client import mlflow_client, unreachable
from raytrn.tracking.logger import AsyncLogger, logged_step_of
from raytrn.tracking.mlflow_run import TrackedRun, attach, end_run
from raytrn.tracking.models import CheckpointModels, DatasetRef
from raytrn.tracking.sender import sender

log = logging.getLogger(__name__)

#: Where the newest worker-group restart restored from: ``memory:step_<N>`` (an in-memory snapshot), ``storage:step_<N>``
#: (a committed checkpoint), ``none:step_0`` (neither yet).
RESTORE_SOURCE_TAG = "raytrn.restore_source"
#: Why the newest restart passed over newer in-memory snapshots ("; "-joined reasons; absent when it did not).
RESTORE_PASSED_OVER_TAG = "raytrn.restore_passed_over"


class TrackingActor(ProgressBoard):
    """Holds the job's :class:`~raytrn.tracking.logger.AsyncLogger` (started with ``num_cpus=0``).

    ``run_id`` None with a ``job``: the run is created here (``attach``), now when the server answers, else
    once it does. ``background``: lower this process's CPU priority first (the actor's own process). ``environ``:
    variables set in this process first (:func:`driver_env`'s).
    """

    def __init__(
        self,
        uri: str,
        run_id: str | None,
        job: Any = None,
        tags: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        *,
        manifest: Any = None,
        validation: Any = None,
        background: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        os.environ.update(environ or {})  # the driver's MLflow and AWS settings, before any client reads them
        super().__init__()
        mark_raytrn_logs()  # its warnings (MLflow unreachable, refused metrics) stay on the driver's terminal
        self.error: RaytrnError | None = None
        self.experiment_id: str | None = None
        self.job = job

        def create() -> str | None:
            run = attach(job, tags or {}, params or {}, manifest=manifest, validation=validation)
            self.experiment_id = run.experiment_id
            return run.run_id

        def create_when_reachable() -> str | None:  # MLflow was unreachable at start
            return None if unreachable(uri) else create()

        if run_id is None and job is not None and not unreachable(uri):
            try:
                run_id = create()
            except RaytrnError as e:  # MLflow refused the run: the driver stops the job with this
                self.error = e
            except Exception as e:  # anything else: keep trying, as for a server that is down
                log.warning("MLflow run not created yet (%s): metrics are buffered meanwhile", e)
        pending = run_id is None and job is not None and self.error is None
        self.logger = AsyncLogger(uri, run_id, resolve_run=create_when_reachable if pending else None)
        sets = (("train", manifest), ("validation", validation))
        datasets = {k: DatasetRef.of(m, k) for k, m in sets if m is not None}
        #: The run's committed checkpoints as LoggedModels, and what is registered (raytrn.tracking.models)
        self.models = (
            CheckpointModels(
                self.logger,
                job,
                lambda: (self.logger.run_id, self.experiment_id),
                datasets=datasets,
                created=self._created,
            )  # fmt: skip
            if job is not None
            else None
        )
        #: The job's checkpoint evaluator (raytrn.evals.runner), when it has one: told of each LoggedModel
        self.evaluator: Any = None
        # What an earlier invocation of this job delivered (one read of the run), then what is queued here:
        # the highest training step (the run's tag), each metric's last step, the last value of
        # the running totals, the world-size history and the checkpoints that still exist.
        self.max_step = 0
        self.world_sizes = WorldSizeHistory()
        self.last_steps: dict[str, int] = {}
        self.last_values: dict[str, float] = {}
        self.checkpoints: dict[int, str] = {}
        if run_id:
            try:
                run = self.logger.client.get_run(run_id)
                self.experiment_id = run.info.experiment_id
                self.max_step = logged_step_of(run)
                self.world_sizes = WorldSizeHistory.parse(run.data.tags.get(WORLD_SIZE_TAG, ""))
                self.last_steps = {m.key: m.step for m in metric_objects(run)}
                self.last_values = {k: v for k, v in run.data.metrics.items() if k in RUNNING_TOTALS}
                self.checkpoints = live_checkpoints(run.data.tags)
            except Exception as e:  # unreachable: start from zero (steps are then only ordered within this job)
                log.warning("MLflow run %s not read: %s", run_id, e)
        # Only now at a lower priority: the run's creation (or MLflow's refusal, which stops the job) at nice 10
        # waited for CPU behind the run's own training; on 2 busy cores a refused run trained on for minutes.
        if background:
            _lower_priority()

    def ready(self) -> dict[str, str | None]:
        """The run's ids once this actor is constructed (``run_id`` None while pending); raises the error
        when MLflow refused the run."""
        if self.error is not None:
            raise self.error
        return {"run_id": self.logger.run_id, "experiment_id": self.experiment_id}

    def log_metrics(self, metrics: dict[str, float], step: int, training: bool = True) -> None:
        """Queue ``metrics``; training steps at or below the highest one logged are dropped (a worker group
        restarted from an older checkpoint repeats them; the run has them already)."""
        if training and step <= self.max_step:
            return
        self.logger.log_metrics(metrics, step, training=training)
        for key in RUNNING_TOTALS.intersection(metrics):
            self.last_values[key] = float(metrics[key])
        if training:
            self.max_step = step
            self.reached(step)  # a logged step was reached (its board update may die with a killed rank 0)
        else:
            for key in metrics:
                self.last_steps[key] = max(self.last_steps.get(key, -1), step)

    def log_missing(self, metrics: dict[str, float], step: int) -> None:
        """Queue the non-training ``metrics`` this run has not logged at ``step`` yet (the others dropped): the
        evaluation's scores, once per step however often it runs (a group restarted from an older checkpoint
        evaluates some steps again; a replica that became the live group's rank 0 re-sends what the lost rank 0
        may not have logged)."""
        missing = {k: v for k, v in metrics.items() if self.last_steps.get(k, -1) < step}
        if missing:
            self.log_metrics(missing, step, training=False)

    def next_step(self, prefix: str) -> int:
        """The step after the last one of the non-training metrics named ``prefix...`` (0 when none): a
        restarted system-metrics sampler continues its node's series instead of repeating steps."""
        steps = [s for k, s in self.last_steps.items() if k.startswith(prefix)]
        return max(steps) + 1 if steps else 0

    def last_value(self, key: str) -> float:
        """The last value logged for a running total (``cost_usd``) in this run, by any invocation (0.0: none)."""
        return self.last_values.get(key, 0.0)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.logger.set_tags(tags)

    def log_goodput(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """This invocation's goodput ledger (:meth:`raytrn.tracking.goodput.Ledger.metrics`) added to what earlier
        invocations of the run logged, logged at ``step``: the run's ledger, returned."""
        earlier = {k: self.last_values[k] for k in goodput.METRICS if k in self.last_values}
        total = goodput.add(earlier, metrics)
        self.log_metrics(total, step, training=False)
        return total

    def group_started(self, step: int, world_size: int) -> int:
        """A worker group started: append ``step:world_size`` to the run's ``world_size_history`` tag."""
        number = super().group_started(step, world_size)
        self.world_sizes.append(step, world_size)
        self.logger.set_tags({WORLD_SIZE_TAG: self.world_sizes.tag()})
        return number

    def restored(
        self, source: str | None, step: int, restore_s: float, passed_over: Sequence[PassedOver] = ()
    ) -> RestoreRecord | None:
        """A restart's restore, in MLflow: ``restore_s`` and ``steps_retrained`` at the restored step, and the tag
        ``raytrn.restore_source`` (``storage:step_20``: the newest restart's), with ``raytrn.restore_passed_over``:
        why it passed over newer in-memory snapshots, if it did."""
        record = super().restored(source, step, restore_s, passed_over)
        if record is not None:
            metrics = {"restore_s": restore_s, "steps_retrained": float(record.steps_retrained)}
            self.log_metrics(metrics, step, training=False)
            tags = {RESTORE_SOURCE_TAG: f"{record.source}:step_{step}"}
            tags[RESTORE_PASSED_OVER_TAG] = ("; ".join(render(p) for p in record.passed_over) or "none")[:4000]
            self.logger.set_tags(tags)
        return record

    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None:
        """Log the start-up cost at ``step``: ``time_to_first_step_s`` (from the ``raytrn train`` process start)
        for the job's first worker group, ``restart_to_first_step_s`` (from the group's own start) for a
        restarted one."""
        super().first_step_done(step, since_launch_s, since_group_start_s)
        if self.groups <= 1:
            self.log_metrics({"time_to_first_step_s": since_launch_s}, step, training=False)
        else:
            self.log_metrics({"restart_to_first_step_s": since_group_start_s}, step, training=False)

    def checkpoint_saved(
        self,
        step: int,
        location: str,
        keep_last: int | None,
        deleted: set[int] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Tag the new checkpoint (``checkpoint.latest``, ``checkpoint.step_<N>``) and mark the tags of those that
        ``checkpoint.keep_last`` made Ray Train delete (it keeps the newest ``keep_last`` reported), or, with
        ``checkpoint.keep_best``, the ``deleted`` steps raytrn's retention reports; each committed checkpoint is a
        LoggedModel with ``metrics`` of its step linked to it, the deleted ones' marked so."""
        if self.models is not None:
            self.models.committed(step, location, metrics)
        self.checkpoints[step] = location
        tags = {"checkpoint.latest": location, "checkpoint.latest_step": str(step), checkpoint_tag(step): location}
        gone = sorted(self.checkpoints)[:-keep_last] if keep_last is not None else []
        gone += sorted(s for s in (deleted or ()) if s in self.checkpoints and s not in gone)
        reason = f"checkpoint.keep_last={keep_last}" if keep_last is not None else "checkpoint.keep_last (keep_best)"
        for old in gone:
            tags[checkpoint_tag(old)] = f"{DELETED} by {reason}: {self.checkpoints.pop(old)}"
            if self.models is not None:
                self.models.deleted(old, f"{DELETED} by {reason}")
        self.logger.set_tags(tags)

    def run_id(self) -> str | None:
        return self.logger.run_id

    def upload_here(self, local_dir: str, artifact_path: str, node_id: str) -> bool:
        """Log ``local_dir`` as the run's ``artifact_path`` from this process when it runs on ``node_id`` (the
        caller's node: the directory is readable here). This process has the store open; a worker's first call
        opens it anew (a local sqlite store: ~1.4 s at the end of every run). False, nothing done, on another node or
        before the run exists: the caller uploads it itself."""
        import ray

        if self.logger.run_id is None or node_id != ray.get_runtime_context().get_node_id():
            return False
        self.logger.client.log_artifacts(self.logger.run_id, local_dir, artifact_path)
        return True

    def flush(self, timeout_s: float) -> bool:
        return self.logger.flush(timeout_s)

    def close(self, timeout_s: float) -> int:
        """Flush (bounded) and stop; returns how many metrics could not be delivered."""
        if self.models is not None:  # first: its links are metrics the logger then delivers
            self.models.close(timeout_s)
        return self.logger.close(timeout_s)

    def finish(self, status: str, timeout_s: float) -> dict[str, str | None]:
        """Deliver what is queued (bounded by ``timeout_s``), then mark the run ``status``; the run's ids
        (``run_id`` None when it was never created). Raises the error when MLflow refused the run.

        Here rather than in the driver: this process has the store open already (under ``ray job submit``
        the driver's working directory can be gone by the end, and a new local MLflow store needs it)."""
        self.ready()  # MLflow refused the run: raise that
        if status == "FINISHED":
            self.final_model()
        if self.logger.run_id is None and not unreachable(self.logger.target) and not self.logger.resolve_now():
            # The server answers but the run could not be made (its checkpoint storage, say): waiting delivers nothing
            timeout_s = 0.0
        self.close(timeout_s)
        ids = self.ready()  # (a pending run may have been created while flushing)
        # the URI itself, not the logger's redacted one (a client of it would send "***" as the password)
        run = TrackedRun(
            uri=self.logger.target, run_id=ids["run_id"], experiment_id=ids["experiment_id"], resumed=False
        )
        ids["run_id"] = end_run(run, status, job=self.job)
        return ids

    # -- the evaluator's (raytrn.evals.runner) -----------------------------------------------------------------
    def set_evaluator(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    def _created(self, step: int, location: str, model_id: str, val_loss: float | None) -> None:
        if self.evaluator is not None:  # (its models thread) received before this checkpoint counts as recorded
            import ray

            ray.get(self.evaluator.committed.remote(step, location, model_id, val_loss), timeout=60)

    def flush_models(self, timeout_s: float) -> bool:
        """Wait (bounded) until every committed checkpoint's LoggedModel exists and the evaluator was told."""
        return self.models.flush(timeout_s) if self.models is not None else True

    def checkpoint_evaluated(self, step: int, scores: dict[str, float], exported: bool) -> None:
        """The evaluator's results for the checkpoint of ``step``: its scores as the run's metrics at ``step`` and
        its LoggedModel's; an export better (``val_loss``) than what the run registered so far is registered and
        becomes the candidate (``tracking.register: best``)."""
        if self.models is None:
            return
        if scores:
            self.log_metrics(scores, step, training=False)
            self.models.link(step, scores)
        tracking = self.job.tracking
        if exported and tracking.registers == "best" and self.models.improves(step):
            self.models.register(step, tracking.registered_model)

    def checkpoint_eval_failed(self, step: int, reason: str, failures: int) -> None:
        """An evaluation failed (or timed out): counted (``eval_failures``) and its reason on the LoggedModel."""
        self.log_metrics({"eval_failures": float(failures)}, step, training=False)
        if self.models is not None:
            self.models.tag(step, {"raytrn.eval_error": reason})

    def final_model(self) -> None:
        """A finished run: its last checkpoint's LoggedModel is the run's output model (its export the run's
        ``model`` artifact, with ``tracking.log_model``), registered with ``tracking.register: last``."""
        if self.models is None or not self.checkpoints or self.logger.run_id is None:
            return
        step, tracking = max(self.checkpoints), self.job.tracking
        export = f"runs:/{self.logger.run_id}/model" if tracking.log_model else None
        self.models.output(step, export)
        if tracking.registers == "last":
            self.models.register(step, tracking.registered_model, source=export)

    def registered(self) -> dict[str, str]:
        """What this run registered: ``{model id: version}``."""
        return dict(self.models.registered) if self.models is not None else {}


def resolve(future: Any, default: float, timeout_s: float = 60) -> float:
    """The value of a :meth:`RemoteLogger.last_value` future, or ``default`` when the actor cannot say."""
    import ray

    try:
        return float(ray.get(future, timeout=timeout_s))
    except Exception as e:  # tracking never stops training
        log.warning("tracking actor: value unknown (%s)", e)
        return default


#: Tag of the worker groups' start steps and sizes, ``step:world_size,...``; older entries are folded into a
#: count in front (``+N earlier,...``) so the tag stays far below MLflow's length limit.
WORLD_SIZE_TAG = "world_size_history"
_MAX_HISTORY_CHARS = 4000
#: Metrics that run over the whole run, so a restarted worker group continues from their last value.
RUNNING_TOTALS = frozenset({"cost_usd", *goodput.METRICS})
#: The value a checkpoint tag starts with once its checkpoint was deleted.
DELETED = "deleted"


def checkpoint_tag(step: int) -> str:
    return f"checkpoint.step_{step:08d}"


def live_checkpoints(tags: Mapping[str, str]) -> dict[int, str]:
    """``{step: location}`` of the checkpoints a run's tags name and do not mark deleted."""
    out = {}
    for key, value in tags.items():
        if key.startswith("checkpoint.step_") and key[len("checkpoint.step_") :].isdigit():
            if not value.startswith(DELETED):
                out[int(key[len("checkpoint.step_") :])] = value
    return out


class WorldSizeHistory:
    """``world_size_history``: each worker group's ``start step:world size``, bounded in length."""

    def __init__(self, entries: list[str] | None = None, earlier: int = 0) -> None:
        self.entries = entries or []
        self.earlier = earlier

    @classmethod
    def parse(cls, tag: str) -> WorldSizeHistory:
        parts = [p for p in tag.split(",") if p]
        earlier = 0
        if parts and parts[0].startswith("+") and parts[0].endswith(" earlier"):
            head = parts.pop(0)[1 : -len(" earlier")]
            earlier = int(head) if head.isdigit() else 0
        return cls(parts, earlier)

    def append(self, step: int, world_size: int) -> None:
        self.entries.append(f"{step}:{world_size}")

    def tag(self, limit: int = _MAX_HISTORY_CHARS) -> str:
        """The tag value: the newest entries that fit in ``limit`` characters, after a count of the others."""
        while self.entries and len(self._text()) > limit:
            self.entries.pop(0)
            self.earlier += 1
        return self._text()

    def _text(self) -> str:
        head = [f"+{self.earlier} earlier"] if self.earlier else []
        return ",".join(head + self.entries)


#: The bound on the tracking actor's upload of a worker's directory (a model's export: gigabytes to S3 at worst).
UPLOAD_TIMEOUT_S = 3600.0


class RemoteLogger:
    """A worker's handle on the :class:`TrackingActor`: sends are fire-and-forget (no waiting on MLflow), submitted
    off the calling thread (:mod:`raytrn.tracking.sender`); a call that waits for its answer comes after them."""

    def __init__(self, actor: Any, uri: str) -> None:
        self.actor = actor
        self.uri = uri
        self._client: Any = None

    def log_metrics(self, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
        sender().post(self.actor.log_metrics, dict(metrics), step, training)

    def log_missing(self, metrics: dict[str, float], step: int) -> None:
        sender().post(self.actor.log_missing, dict(metrics), step)

    def set_tags(self, tags: dict[str, str]) -> None:
        sender().post(self.actor.set_tags, dict(tags))

    def checkpoint_saved(
        self,
        step: int,
        location: str,
        keep_last: int | None,
        *,
        deleted: set[int] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        copied = None if metrics is None else dict(metrics)
        sender().post(
            self.actor.checkpoint_saved, step, location, keep_last, None if deleted is None else set(deleted), copied
        )

    def last_value(self, key: str) -> Any:
        """A future (Ray ObjectRef) of the run's last value of a running total: asked now, read when needed, so
        a worker never waits for the actor while it starts (see :func:`resolve`)."""
        return sender().ask(self.actor.last_value, key)

    def next_step(self, prefix: str) -> int:
        import ray

        return int(ray.get(sender().ask(self.actor.next_step, prefix), timeout=60))

    @property
    def run_id(self) -> str | None:
        import ray

        return ray.get(sender().ask(self.actor.run_id), timeout=60)  # type: ignore[no-any-return]

    @property
    def client(self) -> Any:
        """A direct MLflow client (artifact uploads, reads): the actor only queues metrics and tags."""
        if self._client is None:
            self._client = mlflow_client(self.uri)
        return self._client

    def flush(self, timeout_s: float) -> bool:
        import ray

        return bool(ray.get(sender().ask(self.actor.flush, timeout_s), timeout=timeout_s + 60))

    def handed_over(self, timeout_s: float = 60.0) -> None:
        """Wait until every call made before this one is in the tracking actor's hands (an answer from the actor
        comes after them): the actor outlives this process and delivers them to MLflow, however long that takes."""
        import ray

        ray.get(sender().ask(self.actor.run_id), timeout=timeout_s)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        """Upload ``local_dir`` as the run's ``artifact_path``: by the tracking actor when it is on this node (its
        store is open: :meth:`TrackingActor.upload_here`), else with this process's own client."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        if not ray.get(sender().ask(self.actor.upload_here, local_dir, artifact_path, node), timeout=UPLOAD_TIMEOUT_S):
            self.client.log_artifacts(self.run_id, local_dir, artifact_path)


def start_tracking_actor(
    tracked: Any, job: Any, *, manifest: Any = None, validation: Any = None, env: dict[str, str] | None = None
) -> Any:
    """The job's TrackingActor, on the driver's node (0 CPUs, a lower CPU priority once its run exists): it creates
    or reattaches ``tracked``'s run (from :func:`~raytrn.tracking.mlflow_run.plan_run`) unless it has an id already.

    ``env``: variables the actor's process needs and may lack (see :func:`driver_env`), set by the actor itself as it
    starts: as a Ray runtime environment they would start its process through Ray's runtime env agent and
    ``setup_worker.py`` (~1 CPU-second more; :mod:`raytrn.backends.worker_setup`)."""
    import ray

    options: dict[str, Any] = {**on_this_node(), "name": board_name(job.run_name), "namespace": BOARD_NAMESPACE}
    return (
        ray.remote(num_cpus=0)(TrackingActor)  # one call at a time: metrics stay in order
        .options(**options)
        .remote(
            tracked.uri,
            tracked.run_id,
            job,
            tracked.tags,
            tracked.params,
            manifest=manifest,
            validation=validation,
            background=True,
            environ=env,
        )  # fmt: skip
    )


def driver_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's MLflow and AWS settings (credentials, S3 endpoint, profile), for the tracking actor: it
    reads and writes the run's ``raytrn-mlflow.json`` next to the checkpoints and talks to MLflow for the
    driver. A Ray the driver did not start was started with another environment (a shell's ``ray start``, a
    test's session cluster), so its processes do not have the driver's. The actor runs on the driver's
    node, so file-naming settings (``AWS_PROFILE``, paths of this machine) are kept, unlike what
    :func:`raytrn.runtime.forwarded_env` gives a submitted job."""
    return forwarded_env(environ, {k: environ[k] for k in NOT_FORWARDED if k in environ}, same_machine=True)


BACKGROUND_NICENESS = 10


def _lower_priority() -> None:
    """Make this process yield the CPU to training (it writes to MLflow in the background): on a small
    head node the job's steps come first. Not before the run exists: MLflow's answer is on the start's path."""
    try:
        os.nice(BACKGROUND_NICENESS)
    except OSError as e:  # not permitted here: run at normal priority
        log.debug("tracking actor keeps its priority: %s", e)
