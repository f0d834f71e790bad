"""Committed checkpoints exported and evaluated off the training loop: the job's :class:`CheckpointEvaluator`.

The driver starts it (a Ray actor, no CPU, on the driver's node) when the job evaluates (``eval.tasks``) or registers
its best checkpoint (``tracking.register: best``); the tracking actor tells it of each committed checkpoint once its
LoggedModel exists. Work for a checkpoint runs as a Ray task of its own (:func:`process_checkpoint`, ``eval.num_cpus``
CPUs or a GPU): the checkpoint exported as a Hugging Face model (:mod:`raytrn.evals.export`), uploaded to its
LoggedModel's artifacts when it is to be registered, and scored by lm-eval (:mod:`raytrn.evals.harness`).

Training never waits for it. One task runs at a time and at most one checkpoint waits for each purpose (the newest
to evaluate, the newest best to register): a checkpoint superseded while waiting is skipped and counted
(``eval_skipped``). A task that fails, is killed (out of memory) or runs past ``eval.timeout_s`` (then cancelled) is
logged once with its reason (``eval_failures``, the LoggedModel's ``raytrn.eval_error`` tag) and the next one runs.
Results go back to the tracking actor: scores as the checkpoint's LoggedModel metrics and the run's metrics at its
step; an exported best is registered (alias ``candidate``). At the end the driver drains it (bounded): the last
checkpoint's evaluation and the best's registration are waited for.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from raytrn.checkpoint.manifest import RetentionSkipped, prune
from raytrn.checkpoint.pins import unpin
from raytrn.checkpoint.rundir import RunDir
from raytrn.config import JobSpec
from raytrn.tracking.tracker_client import TrackerClient

log = logging.getLogger(__name__)


@dataclass
class Work:
    """What to do for one committed checkpoint."""

    step: int
    pointer: str
    model_id: str
    export: bool = False  # upload the export to its LoggedModel (to register it)
    evaluate: bool = False
    started: float = field(default=0.0)


def process_checkpoint(job: JobSpec, work: Work, uri: str) -> dict[str, Any]:
    """A Ray task's body: export the checkpoint, upload it (``work.export``), score it (``work.evaluate``); returns
    ``{"scores": {...}, "exported": bool}``."""
    from raytrn.evals.export import export_checkpoint
    from raytrn.evals.harness import run_lm_eval
    from raytrn.tracking.client import mlflow_client

    out: dict[str, Any] = {"scores": {}, "exported": False}
    with tempfile.TemporaryDirectory(prefix=f"raytrn-eval-{work.step}-") as d:
        model_dir = os.path.join(d, "model")
        export_checkpoint(job, work.step, model_dir)
        if work.export:
            mlflow_client(uri).log_model_artifacts(work.model_id, model_dir)
            out["exported"] = True
        if work.evaluate:
            e, tasks, before = job.eval, task_dir(job, os.path.join(d, "tasks")), os.getcwd()
            os.chdir(tasks)  # a task's relative data_files name files beside it (this process is the task's own)
            try:
                out["scores"] = run_lm_eval(model_dir, list(e.tasks), include_path=tasks, limit=e.limit,
                                            batch_size=e.batch_size, device=e.device)  # fmt: skip
            finally:
                os.chdir(before)
    return out


def task_dir(job: JobSpec, out_dir: str) -> str:
    """One directory of lm-eval task YAML files for ``eval.tasks``: ``eval.include_path``'s files (copied; from S3
    too) and raytrn's shipped tasks among the names, written there."""
    from raytrn import storage
    from raytrn.evals.harness import SHIPPED_TASKS, build_task

    os.makedirs(out_dir, exist_ok=True)
    include = job.eval.include_path
    if include:
        fs, root = storage.filesystem(include)
        from pyarrow import fs as pafs

        for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
            if info.type == pafs.FileType.File:
                target = os.path.join(out_dir, os.path.relpath(info.path, root))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with fs.open_input_stream(info.path) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    for name in job.eval.tasks:
        if name in SHIPPED_TASKS:
            build_task(name, out_dir)
    return out_dir


class CheckpointEvaluator:
    """The job's evaluator (a Ray actor; see the module). ``tracker``: the tracking actor's handle."""

    def __init__(self, job: JobSpec, tracker: Any, uri: str) -> None:
        import ray

        self.job, self.tracker, self.uri = job, TrackerClient(tracker), uri
        self.run = RunDir.of(job)
        resources: dict[str, Any] = {"num_cpus": job.eval.num_cpus, "max_retries": 0}
        if job.eval.device == "cuda":
            resources["num_gpus"] = 1
        self._task = ray.remote(process_checkpoint).options(**resources)
        self.committed_count = 0
        self.best: tuple[float, int] | None = None  # (val_loss, step) of the best checkpoint seen
        self.registered_steps: set[int] = set()
        self.skipped = self.failures = self.done = 0
        self._waiting: dict[str, Work] = {}  # "register" / "evaluate" -> the newest waiting
        self._cond = threading.Condition()
        self._running: Work | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="raytrn-evals", daemon=True)
        self._thread.start()

    def committed(self, step: int, pointer: str, model_id: str, val_loss: float | None) -> None:
        """A checkpoint committed (its LoggedModel ``model_id``): queue what it needs (rank 0 pinned it as it
        committed it: retention keeps it until its work is done or skipped)."""
        self.committed_count += 1
        e, register = self.job.eval, self.job.tracking.registers == "best"
        evaluate = bool(e.tasks) and self.committed_count % e.every_n_checkpoints == 0
        best = val_loss is not None and (self.best is None or val_loss < self.best[0])
        if best:
            self.best = (float(val_loss), step)  # type: ignore[arg-type]
        with self._cond:
            if register and best:
                self._put("register", Work(step, pointer, model_id, export=True, evaluate=evaluate))
                if self._waiting.get("evaluate") and self._waiting["evaluate"].step <= step:
                    self._drop("evaluate")  # (this one evaluates too, when due)
            elif evaluate:
                self._put("evaluate", Work(step, pointer, model_id, evaluate=True))
            else:  # nothing to do with it: rank 0's pin goes
                self._release(step)
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> dict[str, int]:
        """Wait for the running and waiting work (at most ``timeout_s`` each: ``eval.timeout_s``); then stop. What
        was done."""
        with self._cond:
            deadline = time.monotonic() + timeout_s * (len(self._waiting) + (1 if self._running else 0)) + 30
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            left = len(self._waiting) + (1 if self._running else 0)
            self._stop = True
            self._cond.notify_all()
        if left:
            log.warning("evaluations: %d not finished by the end of the run (eval.timeout_s)", left)
        return {"done": self.done, "failed": self.failures, "skipped": self.skipped + left}

    # -- its thread ---------------------------------------------------------------------------------
    def _put(self, slot: str, work: Work) -> None:
        if slot in self._waiting:
            self._drop(slot)
        self._waiting[slot] = work

    def _drop(self, slot: str) -> None:
        dropped = self._waiting.pop(slot)
        self._release(dropped.step)
        self.skipped += 1
        log.info("evaluation of step %d skipped: a newer checkpoint came first", dropped.step)
        self.tracker.log_metrics({"eval_skipped": float(self.skipped)}, dropped.step, training=False)

    def _work(self) -> None:
        import ray

        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                slot = "register" if "register" in self._waiting else "evaluate"
                work = self._running = self._waiting.pop(slot)
            ref = self._task.remote(self.job, work, self.uri)
            ready, _ = ray.wait([ref], timeout=self.job.eval.timeout_s)
            try:
                if not ready:
                    ray.cancel(ref, force=True)
                    raise TimeoutError(f"still running after eval.timeout_s={self.job.eval.timeout_s:g} s: stopped")
                result = ray.get(ref)
                self.done += 1
                told = self.tracker.checkpoint_evaluated(work.step, result["scores"], result["exported"])
            except Exception as e:  # its own failure, never training's
                self.failures += 1
                reason = _reason(e)
                log.warning("evaluation of the checkpoint of step %d failed: %s", work.step, reason)
                log.debug("%s", e)
                told = self.tracker.checkpoint_eval_failed(work.step, reason, self.failures)
            try:  # received before the work counts as done (the driver ends the run after a drain)
                told.result(timeout_s=60)
            except Exception as e:
                log.warning("tracking actor: %s", e)
            self._release(work.step)
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _release(self, step: int) -> None:
        """Unpin ``step`` unless other work still needs it; retention then deletes what it kept for us."""
        if any(w.step == step for w in self._waiting.values()):
            return
        unpin(self.run, step)
        c = self.job.checkpoint
        try:
            prune(self.run, keep_last=c.keep_last, keep_best=c.keep_best)
        except RetentionSkipped as e:  # retention never fails anything; rank 0's next save prunes again
            log.warning("after an evaluation: %s", e)
        except Exception as e:
            log.debug("retention after an evaluation: %s", e)


def _reason(e: BaseException) -> str:
    """One line: what went wrong in the task (Ray's wrapper and the task's traceback left out)."""
    cause = getattr(e, "cause", None) or e
    name = type(cause).__name__
    if "OutOfMemory" in name or "WorkerCrashed" in name or "ActorDied" in name:
        return f"{name}: the evaluation's process died (out of memory, or killed)"
    text = str(cause).strip().splitlines()
    return f"{name}: {text[-1] if text else ''}"[:500]


def start_evaluator(job: JobSpec, tracker: Any, uri: str) -> Any:
    """The job's evaluator actor (on this node, no CPU), or None when the job neither evaluates nor registers its
    best checkpoint; the tracking actor is given its handle."""
    import ray

    from raytrn.runtime import on_this_node

    if not job.reads_checkpoints_off_loop:
        return None
    actor = ray.remote(num_cpus=0)(CheckpointEvaluator).options(**on_this_node()).remote(job, tracker, uri)
    TrackerClient(tracker).set_evaluator(actor)
    return actor


def drain_evaluator(evaluator: Any, tracker: Any, timeout_s: float) -> None:
    """The end of a run: every checkpoint handed to the evaluator (the tracking actor's LoggedModels created), its
    work waited for (at most ``timeout_s``), what it did said; then it stops."""
    import ray

    try:
        TrackerClient(tracker).flush_models(60.0)
        done = ray.get(evaluator.drain.remote(timeout_s), timeout=3 * timeout_s + 120)
        if done["done"] or done["failed"] or done["skipped"]:
            print(f"raytrn: checkpoint evaluations: {done['done']} done, {done['failed']} failed, "
                  f"{done['skipped']} skipped", flush=True)  # fmt: skip
    except Exception as e:  # the evaluator's trouble is never the run's
        log.warning("checkpoint evaluator: %s", e)
    finally:
        ray.kill(evaluator, no_restart=True)
