"""The driver: checks the job, fixes the MLflow run, builds the Ray Train trainer and runs it (its controller in this
process: :func:`raytrn.compat.hosted_trainer`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raytrn import storage
from raytrn.backends import Backend, get_backend
from raytrn.backends.worker_setup import worker_setup
from raytrn.checkpoint.lease import Lease, acquire
from raytrn.checkpoint.memory_clients import KeeperClient
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.compat import (
    NOTICE_COMMITTED,
    create_data_stats_actor,
    draining_nodes,
    elastic_scaling_policy,
    hosted_trainer,
    local_fixed_scaling_policy,
)
from raytrn.config import JobSpec
from raytrn.config.sizes import world_sizes
from raytrn.data.manifest import Manifest
from raytrn.data.order import pace_s
from raytrn.errors import RaytrnError
from raytrn.estimate.job import estimate_params, resolve_auto_interval
from raytrn.evals.runner import drain_evaluator, start_evaluator
from raytrn.models import model_stats
from raytrn.ray_output import ray_train_console
from raytrn.runtime import (
    ensure_ray,
    on_this_node,
    ray_job_submission_id,
    run_started_at,
    starts_local_ray,
    trial_id,
)
from raytrn.tracking.actor import driver_env, start_tracking_actor
from raytrn.tracking.board import BOARD_NAMESPACE, ProgressBoard, ProgressPrinter, Summary, board_name
from raytrn.tracking.mlflow_run import end_run, plan_run
from raytrn.tracking.roles import BoardClients
from raytrn.tracking.tracker_client import TrackerClient
from raytrn.train.checks import (
    check_data,
    check_init_from,
    check_local_resources,
    check_spec,
    embedded_ray_lacks,
    validation_set,
)
from raytrn.train.elastic import SizeChooser, lost_nodes_unconfirmed, reachable_nodes
from raytrn.train.entry import loop_module, train_fn
from raytrn.train.events import RunEvents, close_ledger
from raytrn.train.plan import WorkerPlan
from raytrn.train.refused import RunRefusedWatch
from raytrn.train.run_meta import git_commit_param, run_tags, versions
from raytrn.train.schedule import Schedule, resolve_schedule

log = logging.getLogger(__name__)


def run_training(job: JobSpec, *, live_progress: bool = True, trial: bool = False, take_over: bool = False) -> Summary:
    """Run ``job`` to ``run.max_steps`` (resuming when a checkpoint exists) and summarise it.

    ``trial``: as a sweep's trial (:mod:`raytrn.sweep`), inside a Ray Tune trial: the metrics of every log and eval
    step go to Tune (``TuneReportCallback``), no progress lines (the sweep prints its own). The run is this job's
    alone while it trains (:mod:`raytrn.checkpoint.lease`; ``take_over``: replace a stale lease)."""
    backend = get_backend(job.scaling.accelerator)
    check_spec(job)
    pace_s(os.environ)  # (RAYTRN_PACE_S, the tests' pace: a bad one is one error before anything is written)
    job, auto_params, auto_line = resolve_auto_interval(job)  # checkpoint.every_n_steps: auto, chosen once here
    if auto_line:
        print(f"raytrn: {auto_line}", flush=True)
    backend.check(job)
    with storage.quick_checks():  # the checks' reads: an unreachable S3 endpoint is one line in seconds
        check_init_from(job)
        manifest = check_data(job)
        validation = validation_set(job, manifest)
    # A sweep's trial has a run of its own (named by the sweep); an earlier attempt of the same trial is over.
    holder = f"trial {trial_id()}" if trial else (ray_job_submission_id() or "")
    lease = acquire(RunDir.of(job), take_over=take_over, job=holder, replaces_job=trial)
    try:
        return _train(job, backend, manifest, validation, live_progress=live_progress, trial=trial,
                      params=auto_params, lease=lease)  # fmt: skip
    finally:
        lease.release()


def _train(
    job: JobSpec,
    backend: Backend,
    manifest: Manifest,
    validation: Any,
    *,
    live_progress: bool,
    trial: bool,
    params: dict[str, Any],
    lease: Lease | None = None,
) -> Summary:
    started_at = run_started_at()  # time_to_first_step_s and the goodput ledger count from here
    resume = backend.resume_format()  # how this backend's checkpoints resume (raytrn.checkpoint.resume)
    meta, latest = resume.latest(job)
    resumed = meta.progress if meta else Progress()
    start_step = resumed.step
    if start_step >= job.run.max_steps:
        raise RaytrnError(
            f"run '{job.run_name}' already reached step {start_step} (checkpoint {latest}), which is >= "
            f"run.max_steps={job.run.max_steps}; raise run.max_steps to continue it, or set tracking.run_name "
            "to start a new run"
        )
    if latest:
        print(f"raytrn: resuming run '{job.run_name}' from step {start_step} ({latest})", flush=True)
    if meta is not None and isinstance(meta.extra.get("dcp"), str):  # refused here, not on every worker
        from raytrn.checkpoint.dcp import check_resumable  # torch's DCP (~1.5 s): only a resumed run reads it

        check_resumable(job, RunDir.of(job).own_dcp(meta.extra["dcp"]))
    # The learning-rate schedule is pinned by the run's first invocation; said once, here, when it moves or stays.
    schedule, note = resolve_schedule(job, meta.schedule if meta else None, start_step)
    if note:
        print(f"raytrn: {note}", flush=True)

    stats = model_stats(job.model, job.data.seq_len)
    params = {
        **params,  # the driver's own choices (checkpoint.every_n_steps: auto)
        "model.num_params": stats.num_params,
        "model.flops_per_token": stats.flops_per_token,
        **versions(),
        **git_commit_param(),
        **estimate_params(job),
    }
    # Only whether MLflow answers (tracking.required: fail now); the run is created by the tracking actor.
    tracked = plan_run(job, tags={**run_tags(job), "lr_schedule": schedule.describe()}, extra_params=params)

    if starts_local_ray():  # what the local Ray about to start will surely lack: refused before it starts
        check_local_resources(job, backend, embedded_ray_lacks(job, backend), partial=True)
    # Ray Train's import (ray.train: pandas and ray.air, ~1.3 s; the trainer, its controller: ~0.5 s; no torch) needs
    # no Ray: it runs while Ray starts or this process connects to it, and the ScalingConfig is built after it.
    with ThreadPoolExecutor(1, thread_name_prefix="raytrn-prepare") as pool:
        pool.submit(importlib.import_module, "ray.train.v2.api.data_parallel_trainer")
        # As many logical CPUs as the workers take (Ray Data's read tasks reserve none: raytrn.data.source).
        started_locally = ensure_ray(min_cpus=_cpus_needed(job, backend))
    scaling = _scaling(job, backend)
    import ray

    if started_locally:  # on an embedded local Ray nothing can scale up: fail now rather than wait forever
        check_local_resources(job, backend, ray.cluster_resources())
    else:  # on one machine (a Ray this process started) it lands on the workers' node anyway
        _pin_data_stats_actor(manifest)

    if not trial:
        print(f"raytrn: {job.run_name}: {job.model.family} {stats.describe()}", flush=True)
    # The tracking actor creates or reattaches the MLflow run while the workers start (no run exists before
    # the resource check passed); it is also the progress board. Without tracking, a board of its own.
    # A Ray this process did not start has another environment: give the actor the driver's MLflow/AWS settings.
    env = None if started_locally else driver_env(os.environ)
    tracker = start_tracking_actor(tracked, job, manifest=manifest, validation=validation, env=env) if tracked else None
    board = BoardClients.of(tracker if tracker is not None else _progress_board(job))
    if lease is not None:  # taken over by another job: the workers stop at their next step, FAILED, saving nothing
        lease.watch(board.stops.lease_lost)
    # eval.tasks, tracking.register: best: committed checkpoints exported and evaluated off the loop (raytrn.evals)
    evaluator = start_evaluator(job, tracker, tracked.uri) if tracker is not None and tracked is not None else None
    keeper = _memory_keeper(job) if resume.memory_tier else None  # (not the frozen XLA path's formats)
    watch = RunRefusedWatch(TrackerClient(tracker).ready() if tracker is not None else None)
    events = RunEvents(
        job.scaling.max_failures, quiet=trial, live=job.scaling.recovery == "live"
    )  # the controller's decisions: lines, the ledger
    status = "FAILED"

    ended: dict[str, str | None] = {}

    def finish(status: str, flush_timeout_s: float) -> str | None:
        """Deliver what the tracking actor holds (bounded), then mark the run; once (SIGTERM, then finally)."""
        if "run_id" in ended:
            return ended["run_id"]
        if tracker is not None and tracked is not None:
            try:  # the actor marks the run: it has the store open (see TrackingActor.finish)
                ids = TrackerClient(tracker).finish(status, flush_timeout_s)
                tracked.run_id, tracked.experiment_id = ids.run_id, ids.experiment_id
                ended["run_id"] = ids.run_id
                return ended["run_id"]
            except RaytrnError:  # MLflow refused the run: there is none to mark
                ended["run_id"] = None
                return None
            except Exception as e:  # the actor is gone: mark the run from here
                log.warning("MLflow tracking actor: %s", e)
        ended["run_id"] = end_run(tracked, status, job=job)
        return ended["run_id"]

    try:
        with _stop_on_sigterm(lambda: finish("KILLED", 3.0)):  # Ray SIGKILLs soon after SIGTERM
            trainer = _trainer(
                job, backend, scaling, manifest, tracked, tracker, board, schedule=schedule,
                validation=validation, report_metrics=trial, memory=keeper, events=events, local=started_locally,
                started_at=started_at,
            )  # fmt: skip
            printer = ProgressPrinter(board.reader.since, live=live_progress) if not trial else contextlib.nullcontext()
            with printer, watch:
                result = trainer.fit()
        resume.tidy(job)  # what Ray Train left that the format no longer needs
        watch.raise_if_refused()  # fit was aborted because MLflow refused the run
        board.reader.snapshot().raise_if_stopped()  # the workers' RunStopped (its own subclass): FAILED with it
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM; Ray turns an interrupted wait into SystemExit
        if watch.error is not None:
            raise watch.error from None
        status = "KILLED"
        raise
    except Exception as e:
        user_error = watch.error or _user_error(e)
        if user_error is not None:
            raise user_error from None
        raise
    finally:
        if keeper is not None:  # its stores (it owns them) go with it: the snapshots' memory is freed
            with contextlib.suppress(Exception):  # their slabs first (a store that does not answer: its node's next
                keeper.shutdown(timeout_s=60)  # store removes them, raytrn.checkpoint.slabs.sweep)
            keeper.kill()
        if evaluator is not None:  # the last checkpoint's evaluation and the best's registration, bounded
            drain_evaluator(evaluator, tracker, job.eval.timeout_s if status == "FINISHED" else 0.0)
        # where this invocation's time went (raytrn.tracking.goodput), to MLflow before the run is marked
        ledger = close_ledger(board.reader, events.ends, started_at=started_at, tracker=tracker)
        run_id = finish(status, job.tracking.flush_timeout_s)
    if run_id and tracker is not None and job.tracking.registers != "none":
        registered = TrackerClient(tracker).registered()
        name = job.tracking.registered_model
        print(f"raytrn: registered as {name!r}: version(s) {', '.join(registered.values()) or 'none'}", flush=True)

    snap = board.reader.snapshot()
    first, last = snap.first or {}, snap.last or {}
    final_step = last.get("step", start_step)
    tokens = int(last.get("tokens_seen", resumed.tokens_seen)) - resumed.tokens_seen
    return Summary(
        run_name=job.run_name,
        start_step=start_step,
        final_step=final_step,
        tokens=max(0, tokens),
        tokens_per_s=_mean_rate(first, last),
        first_loss=first.get("loss"),
        final_loss=last.get("loss"),
        checkpoint=result.checkpoint.path if result.checkpoint else None,
        mlflow_run_id=run_id,
        mlflow_ui=tracked.ui_command() if tracked and run_id else None,
        first_step_s=snap.first_step_s,
        restores=list(snap.restores),
        goodput=ledger,
        max_steps=job.run.max_steps,
    )


def _progress_board(job: JobSpec) -> Any:
    """The job's progress board when tracking is off (with tracking on, the tracking actor is it), on this node,
    named so that ``raytrn stop`` finds it (:mod:`raytrn.train.stopping`)."""
    import ray

    named = {"name": board_name(job.run_name), "namespace": BOARD_NAMESPACE}
    return ray.remote(num_cpus=0)(ProgressBoard).options(**on_this_node(), **named).remote()


def memory_tier_may_run(job: JobSpec, *, alive_nodes: int) -> bool:
    """Whether the run needs an in-memory snapshot keeper: ``checkpoint.memory_every_n_steps`` > 0, or null (auto,
    the default) on a cluster of more than one node now (each worker group then takes snapshots only while it spans
    more than one node). Auto leaves the frozen ``neuron-xla`` path (trn1) as it was: durable checkpoints only. Under
    ``scaling.recovery: live`` the same: the live rank 0 snapshots for the fallback, a restart after every replica
    was lost (:mod:`raytrn.train.live_snapshots`)."""
    every = job.checkpoint.memory_every_n_steps
    if every is None:
        return job.scaling.accelerator != "neuron-xla" and alive_nodes > 1
    return every > 0


def _memory_keeper(job: JobSpec) -> KeeperClient | None:
    """The run's in-memory snapshot keeper when the tier may be on (:func:`memory_tier_may_run`); else None."""
    import ray

    spec = job.checkpoint
    alive = sum(1 for n in ray.nodes() if n.get("Alive")) if spec.memory_every_n_steps is None else 0
    if not memory_tier_may_run(job, alive_nodes=alive):
        return None
    from raytrn.checkpoint.memory import start_keeper

    capacity = None if spec.memory_store_gib is None else int(spec.memory_store_gib * 2**30)
    try:
        return start_keeper(job.run_name, capacity)
    except Exception as e:  # the tier is an optimisation: the durable checkpoints are there
        log.warning("in-memory snapshots: no keeper (%s); restarts resume from checkpoints only", e)
        return None


def _trainer(
    job: JobSpec,
    backend: Backend,
    scaling: Any,
    manifest: Any,
    tracked: Any,
    tracker: Any,
    board: BoardClients,
    *,
    schedule: Schedule,
    validation: Any = None,
    report_metrics: bool = False,
    memory: KeeperClient | None = None,
    events: RunEvents | None = None,
    local: bool = False,
    started_at: float = 0.0,
) -> Any:
    """The Ray Train trainer for ``job``, whose controller runs in this process (:func:`raytrn.compat.hosted_trainer`:
    no controller actor, placement-group cleaner, dataset manager or preemption-watcher process to start). Every
    worker streams its own rows of the job's global order with Ray Data (:mod:`raytrn.data.order`): no Ray Train
    datasets, whose split hands blocks to whichever worker asks first. ``local``: on a Ray this process started (no
    autoscaler: a fixed-size group asks for no resources)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    policy: Any = None
    if scaling.elasticity_enabled:
        policy = _ElasticPolicy(job, backend)
    elif local:
        policy = local_fixed_scaling_policy
    # (the driver's variables and run.tune_malloc go in raytrn's backend config: no runtime env of raytrn's own)
    backend_config, worker_env = worker_setup(job, backend, backend.ray_backend_config(job), ahead=(loop_module(job),))
    trainer_class = hosted_trainer(
        DataParallelTrainer, listener=events, console=ray_train_console(), make_policy=policy,
        health_check_s=HEALTH_CHECK_S, lost_nodes_unconfirmed=lost_nodes_unconfirmed, draining=draining_nodes,
        worker_timeout_s=getattr(backend_config, "worker_timeout_s", None),  # (the XLA path's configs: none)
        import_ahead=getattr(backend_config, "import_at_construction", False),  # raytrn's cpu/cuda (compat.worker)
    )  # fmt: skip
    return trainer_class(
        train_fn,
        train_loop_config=WorkerPlan(
            job=job,
            manifest=manifest,
            schedule=schedule,
            validation=validation,  # raytrn.train.evaluate: the same rows every evaluation, at any size
            board=board,
            tracker=tracker,
            mlflow_uri=tracked.uri if tracked else None,
            started_at=started_at,
            report_metrics=report_metrics,
            memory=memory,
        ).as_config(),  # Ray Train takes a dict: the plan travels inside one
        scaling_config=scaling,
        backend_config=backend_config,
        # Train V2's RunConfig (mypy sees the V1 class that ray.train names statically; V2 is Ray 2.60's default).
        run_config=RunConfig(  # type: ignore[call-arg]
            name=job.run_name,
            **_run_storage(job),
            failure_config=FailureConfig(max_failures=job.scaling.max_failures),
            # keep_best: Ray keeps every pointer (small meta.json files; tidied after the run: resume.tidy)
            checkpoint_config=CheckpointConfig(
                num_to_keep=None if job.checkpoint.keep_best else job.checkpoint.keep_last
            ),
            worker_runtime_env=worker_env,
            callbacks=_tune_callbacks() if report_metrics else None,
        ),
    )


#: How often the controller (in this process) polls its workers: a dead worker is noticed this much later at most,
#: and a finished group's end (Ray's default: 2 s). A poll is one small actor call per worker.
HEALTH_CHECK_S = 0.5


def _tune_callbacks() -> list[Any]:
    """Ray Tune's bridge from Ray Train's reports (rank 0's metrics) to the trial it runs in; a group's report that
    its notice's checkpoint is committed (``NOTICE_COMMITTED``, no metrics) is not a result of the trial."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class TrialReports(TuneReportCallback):  # type: ignore[misc]
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            if not any(NOTICE_COMMITTED in m for m in metrics):
                super().after_report(run_context, metrics, checkpoint)

    return [TrialReports()]


def _pin_data_stats_actor(manifest: Manifest) -> None:
    """Create Ray Data's stats actor on the driver's node (the head under ``ray job submit``), in a thread: the worker
    group's start does not wait for it (nor for Ray Data's import, ~0.6 s).

    It is detached and pinned to the node of whoever runs a dataset first: a training worker (each reads its
    own rows) would put it on a worker node and keep that node from ever scaling down. (A private Ray Data
    function; without it the actor is created as before.) Not for a dataset whose every epoch the workers read
    themselves (:func:`raytrn.data.source.streams_through_ray_data`): no dataset runs, no actor is needed.
    """

    def create() -> None:
        from raytrn.data.source import streams_through_ray_data  # (imports Ray Data: ~0.7 s, here off the start)

        if not streams_through_ray_data(manifest):
            return
        try:
            create_data_stats_actor()
        except Exception as e:  # another Ray version: not worth failing a job over
            log.warning("Ray Data stats actor not created on the driver's node: %s", e)

    threading.Thread(target=create, name="raytrn-data-stats", daemon=True).start()


def _cpus_needed(job: JobSpec, backend: Backend) -> float:
    """The logical CPUs the largest worker group takes: :func:`_scaling`'s ``total_resources["CPU"]``, without
    importing Ray Train."""
    return backend.worker_resources(job).get("CPU", 0) * world_sizes(job)[-1]


def _scaling(job: JobSpec, backend: Backend) -> Any:
    from ray.train import ScalingConfig

    s = job.scaling
    sizes = world_sizes(job)
    # Train V2 takes (min, max) for an elastic worker group; raytrn's policy picks only the sizes in between
    # that are whole nodes and whole TP groups (_ElasticPolicy).
    elastic = len(sizes) > 1
    num_workers: Any = (sizes[0], sizes[-1]) if elastic else sizes[0]
    extra: dict[str, Any] = {"elastic_resize_monitor_interval_s": s.resize_interval_s} if elastic else {}
    return ScalingConfig(
        num_workers=num_workers, use_gpu=backend.use_gpu, resources_per_worker=backend.worker_resources(job), **extra
    )


class _ElasticPolicy:
    """``make_policy`` for :func:`raytrn.compat.hosted_trainer`: Ray's elastic policy choosing
    sizes by :class:`raytrn.train.elastic.SizeChooser` (picklable: it travels to the controller actor)."""

    def __init__(self, job: JobSpec, backend: Backend) -> None:
        self.chooser = SizeChooser(
            resources=dict(backend.worker_resources(job) or {}),
            sizes=tuple(world_sizes(job)),
            workers_per_node=job.scaling.workers_per_node,
        )

    def __call__(self, scaling_config: Any) -> Any:
        return elastic_scaling_policy(scaling_config, self.chooser, reachable_nodes)


def _run_storage(job: JobSpec) -> dict[str, Any]:
    return run_storage(job.checkpoint.storage)


def run_storage(uri: str) -> dict[str, Any]:
    """RunConfig's storage_path / storage_filesystem (Ray Train's and Ray Tune's) for a local path or an S3 URI:
    S3 through raytrn's filesystem (endpoint override, retries)."""
    if not uri.startswith("s3://"):
        return {"storage_path": uri, "storage_filesystem": None}
    fs, path = storage.portable_filesystem(uri)  # the controller and workers keep raytrn's S3 retries
    return {"storage_path": path, "storage_filesystem": fs}


@contextlib.contextmanager
def _stop_on_sigterm(on_stop: Any) -> Any:
    """SIGTERM (``ray job stop``, a scheduler's preemption of the driver) becomes KeyboardInterrupt, after
    ``on_stop`` (marking the run KILLED first: Ray SIGKILLs the driver 3 s after SIGTERM by default)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        on_stop()
        raise KeyboardInterrupt("stopped (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mean_rate(first: dict[str, Any], last: dict[str, Any]) -> float | None:
    if not last:
        return None
    if first and last["time"] > first["time"]:
        return (last["tokens_seen"] - first["tokens_seen"]) / (last["time"] - first["time"])
    return last.get("tokens_per_s")


def _user_error(exc: BaseException) -> RaytrnError | None:
    """The RaytrnError a worker raised, if that is what failed the run."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RaytrnError):
            return e
        todo.extend(getattr(e, "worker_failures", {}).values())
        todo.extend([getattr(e, "controller_failure", None), getattr(e, "cause", None), e.__cause__, e.__context__])
    return None
