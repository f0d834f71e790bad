"""A run's committed checkpoints as MLflow LoggedModels, and the registry's ``candidate``.

Held by the tracking actor (:mod:`raytrn.tracking.actor`), which tells it of every committed checkpoint:

- **one LoggedModel per committed checkpoint**, named ``<run name>-step-<step>``, its params the job's model and
  layout, its tags the checkpoint's location and step; the training ``loss`` and ``val_loss`` / ``val_perplexity``
  logged at that step are linked to it (with the training or validation dataset), sharing the run metric's row. A
  checkpoint that retention deletes is tagged ``raytrn.deleted`` (with why); the model stays, as a record.
- **registration** (``tracking.register``): ``best`` registers a checkpoint's exported model (Hugging Face files in
  the LoggedModel's artifacts, written off the training loop: :mod:`raytrn.evals`) when its ``val_loss`` is the
  run's best so far, and points the alias ``candidate`` at it: a later, better checkpoint moves the alias to its own
  new version; a model is registered once. Each version is tagged with its ``val_loss`` and the validation set's
  digest, so runs sharing a registered model (a sweep's trials) move ``candidate`` only to a better version: one
  whose ``val_loss`` on the same validation set is lower than the candidate's (another validation set: the newest
  wins, as the losses do not compare). ``last``: the run's final model, at the end.
- **the run's output model**: the final step's LoggedModel (the run's ``model`` artifact is its export).

Its MLflow calls run on its own thread in order, retried with backoff while the server is unreachable (training
never waits for them); the linked metrics go through the run's :class:`~raytrn.tracking.logger.AsyncLogger`. After
a restart it finds the run's LoggedModels again (by their source run) instead of creating them twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrn.tracking.logger import AsyncLogger, is_permanent

log = logging.getLogger(__name__)

STEP_TAG = "raytrn.step"
CHECKPOINT_TAG = "raytrn.checkpoint"
DELETED_TAG = "raytrn.deleted"
REGISTERED_TAG = "raytrn.registered_version"
REGISTERED_NAME_TAG = "raytrn.registered_model"
#: A registered version's validation loss and the digest of the validation set it was measured on.
VAL_LOSS_TAG = "raytrn.val_loss"
VAL_SET_TAG = "raytrn.validation_set"
MODEL_TYPE = "raytrn-checkpoint"
#: The alias ``tracking.register`` moves; ``raytrn models promote`` sets others (``champion``).
CANDIDATE = "candidate"
#: Metrics of a checkpoint's step linked to its LoggedModel, and the dataset each was measured on.
LINKED = {"loss": "train", "val_loss": "validation", "val_perplexity": "validation"}
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)


@dataclass(frozen=True)
class DatasetRef:
    """A dataset as MLflow names it: the run's input of that name and digest."""

    name: str
    digest: str

    @classmethod
    def of(cls, manifest: Any, context: str = "train") -> DatasetRef:
        """The training set's digest is its source's fingerprint; another split of the same source (the
        validation set) gets one of its own, from the fingerprint and its manifest's location."""
        import hashlib
        import os

        digest = manifest.source.fingerprint[:32]
        if context != "train":
            digest = hashlib.sha256(f"{manifest.source.fingerprint}:{manifest.manifest_path}".encode()).hexdigest()[:32]
        return cls(os.path.basename(manifest.root.rstrip("/")) or "dataset", digest)


def model_params(job: Any) -> dict[str, str]:
    """A checkpoint's LoggedModel params: the job's model and layout (what tells checkpoints of runs apart)."""
    out: dict[str, str] = {}
    for section in ("model", "parallel"):
        for key, value in getattr(job, section).model_dump(mode="json").items():
            if value is not None and not isinstance(value, dict | list):
                out[f"{section}.{key}"] = str(value)
    if job.model.lora is not None:
        out["model.lora.rank"] = str(job.model.lora.rank)
    out.update({"data.seq_len": str(job.data.seq_len), "scaling.accelerator": job.scaling.accelerator})
    return {k: v[:6000] for k, v in out.items()}


class CheckpointModels:
    """The run's LoggedModels by step (see the module). ``run``: the run's ids once known (``(run_id,
    experiment_id)``, either None while MLflow was unreachable at start)."""

    def __init__(
        self,
        logger: AsyncLogger,
        job: Any,
        run: Callable[[], tuple[str | None, str | None]],
        *,
        datasets: dict[str, DatasetRef] | None = None,
        created: Callable[[int, str, str, float | None], None] | None = None,
    ) -> None:
        """``created(step, location, model id, val_loss)``: called (on its thread) once a checkpoint's LoggedModel
        exists (the evaluator's cue)."""
        self.logger, self.client, self.job, self.run = logger, logger.client, job, run
        self.created = created
        self.datasets = datasets or {}
        self.params = model_params(job)
        #: step -> LoggedModel id, and the val_loss of each (registration's "best")
        self.ids: dict[int, str] = {}
        self.val_loss: dict[int, float] = {}
        self.registered: dict[str, str] = {}  # model id -> version
        self.candidate: int | None = None  # the step this run last registered (points the alias at)
        self._history: dict[str, dict[int, tuple[int, float]]] = {}  # key -> step -> an earlier invocation's row
        self.failed = 0
        self._recovered = False
        self._ops: deque[tuple[str, Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="raytrn-mlflow-models", daemon=True)
        self._thread.start()

    # -- what the tracking actor says -----------------------------------------------------------
    def committed(self, step: int, location: str, metrics: dict[str, float] | None = None) -> None:
        """A checkpoint of ``step`` at ``location`` is committed; ``metrics``: what was logged at that step."""
        metrics = {k: float(v) for k, v in (metrics or {}).items() if k in LINKED}
        if "val_loss" in metrics:
            self.val_loss[step] = metrics["val_loss"]
        self._submit(f"LoggedModel of step {step}", lambda: self._create(step, location, metrics))

    def deleted(self, step: int, why: str) -> None:
        """Retention deleted the checkpoint of ``step``: its LoggedModel says so."""
        self.tag(step, {DELETED_TAG: why})

    def link(self, step: int, scores: dict[str, float], *, dataset: str | None = None) -> None:
        """``scores`` measured on the checkpoint of ``step`` (an evaluation off the loop): linked to its model and
        logged as the run's metrics at ``step``."""
        self._submit(f"scores of step {step}", lambda: self._link(step, scores, dataset))

    def tag(self, step: int, tags: dict[str, str]) -> None:
        self._submit(f"tags of step {step}", lambda: self._tag(step, tags))

    def register(self, step: int, name: str, source: str | None = None) -> None:
        """Register the model of ``step`` as ``name`` (``source``: where its files are; default its LoggedModel's
        artifacts) and move the alias ``candidate`` to the new version; once per model."""
        self.candidate = step  # decided here (the next one must improve on it), done on its thread
        self._submit(f"registration of step {step}", lambda: self._register(step, name, source))

    def improves(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` has a lower ``val_loss`` than the one registered as candidate by this
        run (any, when none is yet)."""
        if step not in self.val_loss:
            return False
        return self.candidate is None or self.val_loss[step] < self.val_loss.get(self.candidate, float("inf"))

    def output(self, step: int, export: str | None) -> None:
        """The run's final model: the LoggedModel of ``step`` is the run's output (``export``: its files)."""

        def do() -> None:
            from mlflow.entities import LoggedModelOutput

            model_id, run_id = self._id(step), self.run()[0]
            assert run_id is not None
            if export:
                self.client.set_logged_model_tags(model_id, {"raytrn.export": export})
            self.client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])

        self._submit(f"output model of step {step}", do)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for what was submitted; True when done."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ops or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    def close(self, timeout_s: float) -> None:
        done = self.flush(timeout_s)
        with self._cond:
            left = len(self._ops)
            self._closing = True
            self._cond.notify_all()
        if not done:
            log.warning("MLflow: %d checkpoint-model updates not delivered (server unreachable)", left)

    # -- the MLflow calls (its thread) ------------------------------------------------------------
    def _create(self, step: int, location: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import LoggedModelStatus

        run_id, experiment_id = self._ids_or_wait()
        if step not in self.ids:
            model = self.client.create_logged_model(
                experiment_id, name=f"{self.job.run_name}-step-{step}", source_run_id=run_id, params=self.params,
                tags={STEP_TAG: str(step), CHECKPOINT_TAG: location}, model_type=MODEL_TYPE,
            )  # fmt: skip
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
            self.ids[step] = model.model_id
            if self.created is not None:
                self.created(step, location, model.model_id, metrics.get("val_loss"))
        self._link(step, metrics, None)

    def _link(self, step: int, scores: dict[str, float], dataset: str | None) -> None:
        from mlflow.entities import Metric

        model_id = self._id(step)
        out = []
        for key, value in scores.items():
            ref = self.datasets.get(dataset or LINKED.get(key, ""))
            # The run's own row of this metric at this step, when it has one, is linked (MLflow keeps one row): logged
            # by this invocation, or by an earlier one (a restarted group or a resumed run drops the steps it repeats,
            # and its value of a retrained step differs in the last bits: the run's row is the one kept).
            stamp, value = (
                self.logger.row_of(key, step) or self._earlier_row(key, step) or (int(time.time() * 1000), value)
            )
            out.append(Metric(key, value, stamp, step, model_id=model_id, dataset_name=ref.name if ref else None,
                              dataset_digest=ref.digest if ref else None))  # fmt: skip
        if out:
            self.logger.log_metric_objects(out)

    def _earlier_row(self, key: str, step: int) -> tuple[int, float] | None:
        """The run's row of ``key`` at ``step`` (timestamp, value) on the server: an earlier invocation's, or this
        one's that the logger no longer remembers; else None. The metric's history is read again only when it lacks
        the step (a resumed run, linking a step it did not log itself, or a link after a long outage)."""
        known = self._history.get(key)
        if known is None or step not in known:
            run_id = self.run()[0]
            assert run_id is not None
            known = self._history[key] = {
                m.step: (m.timestamp, m.value) for m in self.client.get_metric_history(run_id, key)
            }
        return known.get(step)

    def _tag(self, step: int, tags: dict[str, str]) -> None:
        self.client.set_logged_model_tags(self._id(step), tags)

    def _register(self, step: int, name: str, source: str | None) -> None:
        from mlflow.exceptions import MlflowException

        model_id = self._id(step)
        if source and source.startswith("runs:/"):  # the run's artifact, as the registry stores it
            run_id, _, path = source[len("runs:/") :].partition("/")
            if not self.client.list_artifacts(run_id, path):
                raise LookupError(f"run {run_id} has no {path!r} artifact (its export failed?): nothing registered")
            source = self.client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + path
        if model_id in self.registered:
            version = self.registered[model_id]
        else:
            model = self.client.get_logged_model(model_id)
            if REGISTERED_TAG in model.tags:
                version = model.tags[REGISTERED_TAG]
            else:
                try:
                    self.client.get_registered_model(name)
                except MlflowException:
                    self.client.create_registered_model(name)
                # MLflow links a version to a LoggedModel (model_id) only when its files are that model's own; the
                # run's final export is the run's artifact: the link is then the tag
                own = source is None
                tags = {STEP_TAG: str(step), "raytrn.model_id": model_id, **self._validation_tags(step)}
                created = self.client.create_model_version(
                    name, source=source or model.artifact_location, run_id=self.run()[0],
                    model_id=model_id if own else None, tags=tags,
                )  # fmt: skip
                version = str(created.version)
                self.client.set_logged_model_tags(model_id, {REGISTERED_TAG: version, REGISTERED_NAME_TAG: name})
            self.registered[model_id] = version
        better = self._better_candidate(name, version, step)
        if better is not None:
            log.info("registered step %d as %s version %s; %s stays: %s", step, name, version, CANDIDATE, better)
            return
        self.client.set_registered_model_alias(name, CANDIDATE, version)
        log.info("registered step %d as %s version %s (alias %s)", step, name, version, CANDIDATE)

    def _validation_tags(self, step: int) -> dict[str, str]:
        """A version's ``val_loss`` and the digest of the validation set it was measured on (when known)."""
        validation = self.datasets.get("validation")
        if step not in self.val_loss or validation is None:
            return {}
        return {VAL_LOSS_TAG: repr(self.val_loss[step]), VAL_SET_TAG: validation.digest}

    def _better_candidate(self, name: str, version: str, step: int) -> str | None:
        """Why ``candidate`` stays where it is under ``register: best``: the version it names (another run's) has a
        ``val_loss`` on the same validation set at most this one's. None: move it (no candidate yet, ``last``, no
        loss to compare, or another validation set)."""
        from mlflow.exceptions import MlflowException

        ours = self._validation_tags(step)
        if self.job.tracking.registers != "best" or not ours:
            return None
        try:
            holder = self.client.get_model_version_by_alias(name, CANDIDATE)
        except MlflowException as e:
            if is_permanent(e):  # no candidate yet
                return None
            raise  # the server unreachable: this registration is tried again, later
        theirs = holder.tags or {}
        if str(holder.version) == version or theirs.get(VAL_SET_TAG) != ours[VAL_SET_TAG]:
            return None
        try:
            loss = float(theirs[VAL_LOSS_TAG])
        except (KeyError, ValueError):
            return None
        if loss > self.val_loss[step]:
            return None
        return (
            f"version {holder.version} (run {holder.run_id}) has val_loss {loss:.4f} on the same validation set, "
            f"this one {self.val_loss[step]:.4f}"
        )

    def _id(self, step: int) -> str:
        if step not in self.ids:
            self._recover()
        if step not in self.ids:
            raise LookupError(f"no LoggedModel for the checkpoint of step {step}")
        return self.ids[step]

    def _ids_or_wait(self) -> tuple[str, str]:
        run_id, experiment_id = self.run()
        if run_id is None or experiment_id is None:
            raise ConnectionError("the MLflow run is not created yet")
        self._recover()
        return run_id, experiment_id

    def _recover(self) -> bool:
        """The run's LoggedModels from an earlier invocation (once): their steps and ids."""
        if self._recovered:
            return False
        run_id, experiment_id = self.run()
        if run_id is None or experiment_id is None:
            return False
        token = None
        while True:
            page = self.client.search_logged_models(
                [experiment_id], filter_string=f"source_run_id = '{run_id}'", max_results=100, page_token=token
            )
            for model in page:
                step = model.tags.get(STEP_TAG, "")
                if step.isdigit():
                    self.ids.setdefault(int(step), model.model_id)
                    if REGISTERED_TAG in model.tags:
                        self.registered[model.model_id] = model.tags[REGISTERED_TAG]
            token = page.token
            if not token:
                break
        self._recovered = True
        return True

    def _submit(self, what: str, op: Callable[[], None]) -> None:
        with self._cond:
            if self._closing:
                return
            self._ops.append((what, op))
            self._cond.notify_all()

    def _work(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                while not self._ops and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                what, op = self._ops[0]
                self._busy = True
            try:
                op()
            except Exception as e:
                if not (is_permanent(e) or isinstance(e, LookupError | AssertionError)):
                    with self._cond:  # unreachable (or the run not created yet): the same op again, later
                        self._busy = False
                        self._cond.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
                    attempt += 1
                    continue
                self.failed += 1
                log.warning("MLflow: %s not recorded: %s", what, str(getattr(e, "message", e))[:300])
            attempt = 0
            with self._cond:
                self._ops.popleft()
                self._busy = False
                self._cond.notify_all()
