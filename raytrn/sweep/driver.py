"""Running a planned sweep with Ray Tune: one trial per job, each a full ``run_training`` (checkpoints, elasticity,
tracking) inside a Tune function trainable; Ray Train's ``TuneReportCallback`` hands rank 0's metrics of every log
and eval step to Tune, whose ASHA scheduler stops the trials that fall behind.

MLflow: the driver creates one parent run for the sweep and one child run per trial (``mlflow.parentRunId``,
status SCHEDULED until it starts; the trial's own tracking attaches to it through ``tracking.run_id``). A trial the
scheduler stopped was killed with its Tune actor: the driver ends its run KILLED with ``raytrn.stopped_early``
saying why. The driver records every event in ``sweep.json`` (:mod:`raytrn.sweep.plan`), so ``--resume`` runs the
trials that did not end, replaying the ended ones' reports into a new ASHA so that it decides as the old one would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from raytrn import storage
from raytrn.backends import get_backend
from raytrn.cluster.capacity import load_capacity
from raytrn.config import JobSpec, apply_overrides, read_job_mapping, set_value
from raytrn.errors import ConfigError, RaytrnError
from raytrn.ray_output import mark_raytrn_logs
from raytrn.sweep.plan import BEST_FILE, DONE, TRAINING_METRICS, VALIDATION_METRICS, Scheduler, SweepState, TrialState
from raytrn.sweep.space import format_value, label
from raytrn.tracking.client import mlflow_client, redact_uri, unreachable
from raytrn.tracking.compare_sweeps import Ending, SweepComparison, TrialRow, compare_sweep
from raytrn.tracking.mlflow_run import ensure_experiment, param_text
from raytrn.train.trainer import run_storage, run_training

log = logging.getLogger(__name__)

#: Tags on the sweep's MLflow runs.
SWEEP_TAG = "raytrn.sweep"
KIND_TAG = "raytrn.kind"
TRIAL_TAG = "raytrn.trial"
STOPPED_TAG = "raytrn.stopped_early"
STATUS_TAG = "raytrn.sweep.status"
#: What a trial's Tune actor reserves (it runs ``run_training``'s driver side): bytes of Ray's ``memory`` resource.
TRIAL_MEMORY = 256 * 1024 * 1024
#: How often the driver writes sweep.json while trials report (it always writes at a trial's start and end).
SAVE_EVERY_S = 5.0


@dataclass
class Outcome:
    state: SweepState
    best: TrialState | None
    best_yaml: str | None


# -- capacity -------------------------------------------------------------------------------------------------


def trial_slots(jobs: list[JobSpec], *, cluster_file: str | None, resources: dict[str, float]) -> tuple[int, str]:
    """How many trials the cluster holds at once (each at its ``min_workers``), and what that is based on: the
    cluster file's largest size when given (an autoscaling cluster grows to it), else the resources it has now."""
    slots, why = None, ""
    for job in jobs:
        per_worker = get_backend(job.scaling.accelerator).worker_resources(job)
        need = job.scaling.min_workers
        if cluster_file:
            total, _ = load_capacity(cluster_file).workers(per_worker, job.scaling.workers_per_node)
            n, basis = total // need, f"{cluster_file} holds {total} worker(s) of {_shown(per_worker)}"
        else:
            fits = [math.floor(resources.get(r, 0) / (v * need)) for r, v in per_worker.items() if v > 0]
            n = min(fits, default=0)
            basis = f"the cluster has {_shown({r: resources.get(r, 0) for r in per_worker})} now"
        if slots is None or n < slots:
            slots = n
            why = f"a trial needs {need} worker(s) of {_shown(per_worker)}; {basis}"
    return int(slots or 0), why


def _shown(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


# -- MLflow -------------------------------------------------------------------------------------------------------


def create_runs(state: SweepState) -> None:
    """The sweep's parent run (the search space and the scheduler as params) and a child run per trial (its values as
    params, status SCHEDULED), once; a resumed sweep reuses them."""
    if state.tracking_uri is None:
        return
    from mlflow.entities import Param  # mlflow lazily: a sweep without tracking never needs it

    uri = state.tracking_uri
    problem = unreachable(uri)
    if problem:
        raise RaytrnError(
            f"tracking.mlflow_uri={redact_uri(uri)}: {problem}; a sweep records its trials in MLflow: start the "
            "server, fix the URI, or set tracking.enabled: false"
        )
    client = mlflow_client(uri)
    assert state.experiment is not None
    exp_id = ensure_experiment(client, state.experiment, uri)
    if state.parent_run_id is None:
        s = state.sched
        parent = client.create_run(exp_id, run_name=state.name, tags={SWEEP_TAG: state.name, KIND_TAG: "sweep"})
        params: dict[str, Any] = {
            **state.search_space.describe(),
            "sweep.job_file": state.job_file,
            "sweep.overrides": " ".join(state.overrides) or "-",
            "sweep.trials": len(state.trials),
            "sweep.samples": state.search_space.samples,
            "sweep.seed": state.search_space.seed,
            "sweep.scheduler": s.kind,
            "sweep.metric": s.metric,
            "sweep.mode": s.mode,
            "sweep.max_concurrent": state.max_concurrent,
        }
        if s.kind == "asha":
            params.update({"sweep.grace_steps": s.grace_steps, "sweep.reduction_factor": s.reduction_factor})
        client.log_batch(parent.info.run_id, params=[Param(k, param_text(k, v)) for k, v in params.items()])
        state.parent_run_id = parent.info.run_id
        state.save()
    for t in state.trials:
        if t.run_id is not None:
            continue
        tags = {
            "mlflow.parentRunId": state.parent_run_id,
            SWEEP_TAG: state.name,
            TRIAL_TAG: t.tag,
            "raytrn.trial.values": label(t.values),
        }
        run = client.create_run(exp_id, run_name=t.run_name, tags=tags)
        client.log_batch(run.info.run_id, params=[Param(k, param_text(k, v)) for k, v in t.values.items()])
        client.update_run(run.info.run_id, status="SCHEDULED")
        t.run_id = run.info.run_id
        state.save()


def _client(state: SweepState) -> Any:
    assert state.tracking_uri is not None
    return mlflow_client(state.tracking_uri)


def end_trial_run(state: SweepState, t: TrialState) -> None:
    """A trial's run as the sweep saw it end: KILLED with the reason when stopped early (its process was killed with
    the Tune trial: its own tracking never marked it), FAILED when its job failed; the last reported metrics it may
    not have delivered are logged (at their step, once)."""
    if state.tracking_uri is None or t.run_id is None:
        return
    try:
        client = _client(state)
        run = client.get_run(t.run_id)
        tags = {STATUS_TAG: t.status}
        if t.status == "stopped" and t.reason:
            tags[STOPPED_TAG] = t.reason
        if t.status == "failed" and t.reason:
            tags["raytrn.error"] = t.reason[:5000]
        for k, v in tags.items():
            client.set_tag(t.run_id, k, v)
        step = int(t.last.get("step", 0))
        value = t.last.get(state.sched.metric)
        if step and value is not None and not _logged_at(client, t.run_id, state.sched.metric, step):
            # the report that stopped it may not have reached MLflow before the trial's processes were killed
            client.log_metric(t.run_id, state.sched.metric, float(value), step=step)
        if t.status == "stopped":
            client.set_terminated(t.run_id, status="KILLED")
        elif t.status == "failed" and run.info.status in ("RUNNING", "SCHEDULED"):
            client.set_terminated(t.run_id, status="FAILED")
    except Exception as e:  # MLflow down: the sweep goes on (sweep.json has it all)
        log.warning("could not record trial %s in MLflow: %s", t.run_name, e)


def _logged_at(client: Any, run_id: str, metric: str, step: int) -> bool:
    return any(m.step == step for m in client.get_metric_history(run_id, metric))


# -- Tune ---------------------------------------------------------------------------------------------------------


def run_trial(config: dict[str, Any], jobs: dict[int, JobSpec] | None = None) -> None:
    """The Tune function trainable: trial ``config["trial"]``'s job, trained by ``run_training``."""
    assert jobs is not None
    mark_raytrn_logs()
    job = jobs[int(config["trial"])]
    meta, _ = get_backend(job.scaling.accelerator).resume_format().latest(job)
    if meta is not None and meta.progress.step >= job.run.max_steps:  # done before a driver died unaware of it
        from ray import tune

        tune.report({"step": meta.progress.step, "already_done": 1})
        return
    run_training(job, live_progress=False, trial=True)


def asha_scheduler(s: Scheduler, on_stop: Any) -> Any:
    """Ray Tune's ASHA on ``step``, which also says why it stopped a trial (``on_stop(trial_index, reason)``) and
    never stops one at its last step (it ends there anyway, and a stop would kill it mid-export)."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    rungs = s.rungs()

    class _Asha(ASHAScheduler):  # type: ignore[misc,valid-type]
        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
            if result.get("step", 0) >= s.max_steps:
                return str(TrialScheduler.CONTINUE)
            action = super().on_trial_result(tune_controller, trial, result)
            if action == TrialScheduler.STOP and s.metric in result:
                step = int(result["step"])
                rung = max((r for r in rungs if r <= step), default=step)
                on_stop(
                    int(trial.config["trial"]),
                    f"ASHA at step {step}: {s.metric} {result[s.metric]:.4g} was not in the best "
                    f"1/{s.reduction_factor:g} of the trials that reached step {rung}",
                )
            return str(action)

    return _Asha(
        time_attr="step", metric=s.metric, mode=s.mode, max_t=s.max_steps, grace_period=s.grace_steps,
        reduction_factor=s.reduction_factor, brackets=1, stop_last_trials=False,
    )  # fmt: skip


@dataclass
class _Replayed:
    """What ASHA needs of a trial to replay its reports: its id and config."""

    trial_id: str
    config: dict[str, Any]


def replay(scheduler: Any, state: SweepState) -> int:
    """Feed the reports of the trials that already ended into a new ASHA (public scheduler calls only), so that a
    resumed sweep's rungs hold them and it stops the others as the first driver would have. Returns how many."""
    s = state.sched
    count = 0
    for t in state.trials:
        if t.status not in DONE or not t.history:
            continue
        stub = _Replayed(trial_id=f"replayed-{t.index}", config={"trial": t.index})
        scheduler.on_trial_add(None, stub)
        for step, value in t.history:
            if step < s.max_steps:
                scheduler.on_trial_result(None, stub, {"step": step, s.metric: value})
        scheduler.on_trial_remove(None, stub)
        count += 1
    return count


class SweepCallback:
    """Tune driver callback: keeps ``sweep.json`` and MLflow in step with the trials, and prints one line per event."""

    def __init__(self, state: SweepState, stopped: dict[int, str], out: Any = None) -> None:
        self.state, self.stopped = state, stopped
        self.out = out
        self._saved = 0.0

    def __getstate__(self) -> dict[str, Any]:  # Tune pickles its callbacks with the experiment's state
        return {**self.__dict__, "out": None}

    def _trial(self, trial: Any) -> TrialState:
        return self.state.trials[int(trial.config["trial"])]

    def _say(self, t: TrialState, text: str) -> None:
        print(f"sweep {self.state.name}: {t.tag} [{label(t.values)}] {text}", file=self.out or sys.stdout, flush=True)

    def _save(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._saved >= SAVE_EVERY_S:
            self._saved = now
            try:
                self.state.save()
            except Exception as e:  # storage down: written at the next event
                log.warning("could not write %s: %s", self.state.path, e)

    def on_trial_start(self, trial: Any) -> None:
        t = self._trial(trial)
        t.status = "running"
        self._say(t, f"started (run {t.run_name})")
        self._save(force=True)

    def on_trial_result(self, trial: Any, result: dict[str, Any]) -> None:
        t = self._trial(trial)
        metric = self.state.sched.metric
        if "step" not in result:
            return
        step = int(result["step"])
        values = {k: float(v) for k, v in result.items() if _is_metric(k, v)}
        t.last = {**t.last, **values, "step": float(step)}
        if metric in result and not result.get("already_done"):
            if not t.history or t.history[-1][0] != step:
                t.history.append([step, float(result[metric])])
                self._say(t, f"step {step}: {metric} {float(result[metric]):.4g}")
        self._save()

    def on_trial_complete(self, trial: Any) -> None:
        t = self._trial(trial)
        reason = self.stopped.get(t.index)
        metric = self.state.sched.metric
        if reason is not None:
            t.status, t.reason = "stopped", reason
            self._say(t, f"stopped early: {reason}")
        else:
            t.status = "finished"
            self._say(t, f"finished: {metric} {_fmt(t.value(metric))} at step {int(t.last.get('step', 0))}")
        self._save(force=True)
        end_trial_run(self.state, t)

    def on_trial_error(self, trial: Any) -> None:
        t = self._trial(trial)
        t.status, t.reason = "failed", _error_of(trial)
        record = _error_path(trial)
        self._say(t, f"FAILED: {t.reason}" + (f" (the whole error: {record})" if record else ""))
        self._save(force=True)
        end_trial_run(self.state, t)


def _is_metric(key: str, value: Any) -> bool:
    return (
        key in (*TRAINING_METRICS, *VALIDATION_METRICS)
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _error_of(trial: Any) -> str:
    """The first line of what a failed trial raised (a RaytrnError's message; Ray wraps it)."""
    text = getattr(trial, "error_msg", None) or ""
    path = _error_path(trial)
    if not text and path:
        try:
            text = storage.read_text(path) or ""
        except Exception:  # the file is only a convenience
            text = ""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("raytrn.errors.", "RaytrnError", "ConfigError", "DataError", "BackendError")):
            return ln.split(": ", 1)[-1]
    return lines[-1] if lines else "failed (see the trial's log)"


def _error_path(trial: Any) -> str | None:
    """Where Tune wrote a failed trial's whole error (its error.txt), when it says."""
    path = getattr(trial, "error_file", None) or getattr(getattr(trial, "run_metadata", None), "error_filename", None)
    return str(path) if path else None


def _tune_callback(cb: SweepCallback) -> Any:
    """``cb`` as a ``ray.tune.Callback`` (its hooks get Tune's iteration/trials arguments)."""
    from ray import tune

    class _Callback(tune.Callback):  # type: ignore[misc]
        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            cb.on_trial_start(trial)

        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            cb.on_trial_result(trial, result)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            cb.on_trial_complete(trial)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            cb.on_trial_error(trial)

    return _Callback()


def run_sweep(state: SweepState, *, max_concurrent: int, out: Any = None) -> Outcome:
    """Run the trials of ``state`` that have not ended (``max_concurrent`` at a time) and finish the sweep."""
    from ray import tune

    out = out or sys.stdout
    # The sweep's metric comes with the reports of the steps that log it (val_loss: the eval steps), not with every
    # report (a checkpoint's): Tune's strict check would fail the trial on the others.
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    # Tune's own tables, boxes and per-trial tracebacks: the sweep prints one line per event instead (a failed
    # trial's line has its error; Tune's full record stays in the trial's error.txt).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    pending = [t for t in state.trials if t.status not in DONE]
    source = state.job_file
    jobs = {t.index: _with_run_id(t.job_spec(source), t.run_id) for t in pending}
    state.attempts += 1
    state.save()
    if pending:
        stopped: dict[int, str] = {}
        s = state.sched
        scheduler = None
        if s.kind == "asha":
            scheduler = asha_scheduler(s, lambda i, why: stopped.__setitem__(i, why))
            replayed = replay(scheduler, state)
            if replayed:
                print(f"sweep {state.name}: ASHA holds the reports of {replayed} trial(s) that already ended", file=out)
        callback = SweepCallback(state, stopped, out)
        # The trial only drives its job (its workers hold their own resources): no CPU, a little memory (Tune
        # refuses a trial that asks for nothing).
        trainable = tune.with_resources(tune.with_parameters(run_trial, jobs=jobs), {"CPU": 0, "memory": TRIAL_MEMORY})
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search([t.index for t in pending])},
            tune_config=tune.TuneConfig(
                max_concurrent_trials=max_concurrent,
                scheduler=scheduler,
                reuse_actors=False,
            ),
            run_config=tune.RunConfig(
                name=f"tune-{state.attempts}",
                **run_storage(state.root),
                callbacks=[_tune_callback(callback)],
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=0),  # a trial's own retries are its job's
            ),
        )
        with _quiet("ray.tune"), _away_from_cwd():
            tuner.fit()
        if any(t.status not in DONE for t in state.trials):
            # Tune catches Ctrl-C and SIGTERM itself: it stops the running trials and returns.
            raise KeyboardInterrupt
    return finish(state, out=out)


@contextlib.contextmanager
def _away_from_cwd() -> Iterator[None]:
    """Run the block in the temp directory, then return to the working directory by its path.

    Tune resolves paths against the working directory after its trials end. A submitted sweep's working directory
    is its Ray job's unpacked working dir, which Ray may replace while the sweep runs (on the local simulator every
    node shares one disk, and a node that joins unpacks the job's working dir again over the driver's): the path
    stays, the directory the process was in does not. Every path a sweep keeps is absolute, except its job file's,
    read again by path when the sweep ends."""
    import tempfile

    here = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        yield
    finally:
        os.chdir(here)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Only critical records from logger ``name`` (and its children) inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _with_run_id(job: JobSpec, run_id: str | None) -> JobSpec:
    if run_id is None:
        return job
    return job.model_copy(update={"tracking": job.tracking.model_copy(update={"run_id": run_id})})


def finish(state: SweepState, *, out: Any = None) -> Outcome:
    """The sweep's end: the best trial, its job file (``best.yaml``), the parent run's summary and status."""
    out = out or sys.stdout
    best = state.best()
    best_yaml = None
    if best is not None:
        best_yaml = write_best(state, best)
    state.save()
    if state.tracking_uri is not None and state.parent_run_id is not None:
        try:
            _finish_parent(state, best, best_yaml)
        except Exception as e:  # MLflow down: sweep.json and best.yaml have it
            log.warning("could not record the sweep's end in MLflow: %s", e)
    return Outcome(state=state, best=best, best_yaml=best_yaml)


def write_best(state: SweepState, best: TrialState) -> str:
    """``<sweep>/best.yaml``: the sweep's job file (its ``sweep:`` section dropped, the ``--set`` overrides and the best
    trial's values applied, no run name: running it is a new run), ready for ``raytrn train``."""
    try:
        raw = read_job_mapping(state.job_file)
        raw.pop("sweep", None)
        apply_overrides(raw, [o for o in state.overrides if not o.startswith("tracking.run_name=")])
    except ConfigError:  # the job file moved since: the trial's full spec instead
        raw = {k: v for k, v in best.job.items() if k != "source"}
    for key, value in best.values.items():
        set_value(raw, key, value, where=key)
    tracking = raw.get("tracking")
    if isinstance(tracking, dict):
        tracking.pop("run_name", None)
        tracking.pop("run_id", None)
    s = state.sched
    header = (
        f"# The best trial of sweep {state.name}: {best.tag} ({label(best.values)}), {s.metric} "
        f"{_fmt(best.value(s.metric))} at step {int(best.last.get('step', 0))}.\n"
        f"# Written by `raytrn sweep` from {state.job_file}; run it with: raytrn train <this file>\n"
    )
    path = storage.join(state.root, BEST_FILE)
    storage.write_text(path, header + yaml.safe_dump(raw, sort_keys=False))
    return path


def _finish_parent(state: SweepState, best: TrialState | None, best_yaml: str | None) -> None:
    client = _client(state)
    parent = state.parent_run_id
    assert parent is not None
    counts = {k: sum(t.status == k for t in state.trials) for k in ("finished", "stopped", "failed", "pending")}
    for k, v in counts.items():
        client.set_tag(parent, f"sweep.{k}", str(v))
    s = state.sched
    if best is not None:
        client.set_tag(parent, "best_trial", best.tag)
        client.set_tag(parent, "best_run_id", best.run_id or "-")
        client.set_tag(parent, "best_config", label(best.values))
        value = best.value(s.metric)
        if value is not None:
            client.log_metric(parent, f"best_{s.metric}", value)
    if best_yaml and not storage.is_remote(best_yaml):
        try:
            client.log_artifact(parent, best_yaml)
        except Exception as e:  # the artifact store (e.g. S3) refused: the file is where best_yaml says
            log.warning("could not log %s to the sweep's run: %s", best_yaml, e)
    unfinished = any(t.status not in DONE for t in state.trials)
    status = "KILLED" if unfinished else ("FAILED" if counts["finished"] + counts["stopped"] == 0 else "FINISHED")
    client.set_terminated(parent, status=status)


def mark_interrupted(state: SweepState) -> None:
    """Ctrl-C / SIGTERM of the driver: the parent run and the runs of the trials it cut off are KILLED, those trials
    pending again (``--resume`` runs them, from their checkpoints, into the same runs)."""
    cut = [t for t in state.trials if t.status == "running"]
    for t in cut:
        t.status = "pending"
    state.save()
    if state.tracking_uri is not None and state.parent_run_id is not None:
        try:
            client = _client(state)
            for t in cut:
                if t.run_id is not None and client.get_run(t.run_id).info.status == "RUNNING":
                    client.set_terminated(t.run_id, status="KILLED")
            client.set_terminated(state.parent_run_id, status="KILLED")
        except Exception as e:
            log.warning("could not mark the sweep's runs KILLED: %s", e)


def reopen(state: SweepState) -> None:
    """A resumed sweep's parent run is RUNNING again."""
    if state.tracking_uri is not None and state.parent_run_id is not None:
        _client(state).update_run(state.parent_run_id, status="RUNNING")


def table_of(state: SweepState) -> Any:
    """The trials ranked (:class:`raytrn.tracking.compare_sweeps.SweepComparison`): from MLflow, as ``raytrn runs compare
    --sweep`` shows them, else (no tracking, or MLflow down) from sweep.json."""
    if state.tracking_uri is not None and state.parent_run_id is not None:
        try:
            return compare_sweep(tracking_uri=state.tracking_uri, parent=state.parent_run_id)
        except RaytrnError as e:
            log.warning("could not read the sweep's runs from MLflow (%s): the table comes from sweep.json", e)
    s = state.sched
    fields = state.search_space.fields
    cmp = SweepComparison(
        name=state.name, parent_run_id=state.parent_run_id, metric=s.metric, mode=s.mode, fields=fields
    )
    for t in state.trials:
        cmp.histories[t.run_name] = [(int(a), float(b)) for a, b in t.history]
        ending = {"stopped": Ending.STOPPED_EARLY, "failed": Ending.FAILED}.get(t.status, Ending.RAN)
        detail = str(t.reason)[: 90 - len("failed: ")] if ending is Ending.FAILED else ""
        cmp.rows.append(
            TrialRow(
                tag=t.tag, run_id=t.run_id or t.run_name, status=t.status.upper(),
                steps=int(t.last["step"]) if "step" in t.last else None,
                values={f: format_value(t.values.get(f)) for f in fields}, metric=t.value(s.metric),
                ending=ending, detail=detail,
            )
        )  # fmt: skip
    return cmp
