"""A sweep planned before anything runs: options (flags, or a ``sweep:`` section), every trial's job validated, the
scheduler's settings checked against what the jobs log, and the state a sweep keeps (``sweep.json``).

The state lives at ``<checkpoint.storage>/sweeps/<name>/sweep.json`` (local or S3, next to the trials'
checkpoints): the options, every trial's values and full job spec, its MLflow run, its status and what it reported.
``raytrn sweep --resume NAME`` reads it back; nothing else is needed (the job file may have changed since).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from raytrn import jsonfile, storage
from raytrn.config import RUN_NAME, JobSpec, check_field_value, load_job, read_job_file
from raytrn.data.manifest import load_manifest
from raytrn.errors import ConfigError, RaytrnError
from raytrn.sweep.space import KINDS, Dimension, SearchSpace, dimensions_from_section, label
from raytrn.train.checks import check_job

#: The metrics a trial reports at its log steps (rank 0's; mfu only where the accelerator's peak is known).
TRAINING_METRICS = (
    "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "data_wait_s", "tokens_seen", "epoch", "cost_usd",
    "usd_per_1m_tokens", "tokens_per_usd", "mfu",
)  # fmt: skip
#: ... and at its eval steps (``run.eval_every`` and the last step), when the job has a validation set.
VALIDATION_METRICS = ("val_loss", "val_perplexity")
HIGHER_IS_BETTER = frozenset({"tokens_per_s", "tokens_per_usd", "mfu", "tokens_seen"})
SCHEDULERS = ("none", "asha")
#: Keys of a ``sweep:`` section besides the dimensions.
SECTION_KEYS = (
    "samples", "seed", "scheduler", "metric", "mode", "grace_steps", "reduction_factor", "max_concurrent", "name",
)  # fmt: skip
STATE_FILE = "sweep.json"
BEST_FILE = "best.yaml"
#: Trial statuses: pending (not started), running, finished (to max_steps), stopped (early, by the scheduler),
#: failed (its job failed past its retries).
DONE = ("finished", "stopped", "failed")


@dataclass
class SweepOptions:
    """What ``raytrn sweep`` was asked (flags; None: the ``sweep:`` section's value, else the default)."""

    job_path: str
    overrides: list[str] = field(default_factory=list)
    dimensions: list[Dimension] = field(default_factory=list)
    samples: int | None = None
    seed: int | None = None
    scheduler: str | None = None
    metric: str | None = None
    mode: str | None = None
    grace_steps: int | None = None
    reduction_factor: float | None = None
    max_concurrent: int | None = None
    name: str | None = None


@dataclass
class Scheduler:
    """How trials are judged and stopped early: ``asha`` (Ray Tune's asynchronous successive halving, on ``step``)
    or ``none`` (every trial runs to its max_steps)."""

    kind: str
    metric: str
    mode: str
    grace_steps: int
    reduction_factor: float
    max_steps: int

    def rungs(self) -> list[int]:
        """The steps at which ASHA compares trials: grace, grace x rf, ... below max_steps."""
        out, step = [], float(self.grace_steps)
        while step < self.max_steps:
            out.append(int(step))
            step *= self.reduction_factor
        return out

    def describe(self) -> str:
        if self.kind == "none":
            return f"no early stopping; ranked by {self.metric} ({self.mode})"
        rungs = ", ".join(str(r) for r in self.rungs())
        return (
            f"ASHA on {self.metric} ({self.mode}): at steps {rungs}, trials outside the best 1/{self.reduction_factor:g} "
            "of those that got there stop"
        )


@dataclass
class TrialState:
    index: int
    run_name: str
    values: dict[str, Any]
    job: dict[str, Any]  # the full job spec (JobSpec.model_dump), paths resolved
    run_id: str | None = None
    status: str = "pending"
    reason: str | None = None  # why it stopped early, or why it failed
    history: list[list[float]] = field(default_factory=list)  # [step, metric] as reported to the scheduler
    last: dict[str, float] = field(default_factory=dict)  # the last reported metrics

    @property
    def tag(self) -> str:
        return self.run_name.rsplit("-", 1)[-1]

    def job_spec(self, source: str) -> JobSpec:
        return JobSpec.model_validate({**self.job, "source": source})

    def value(self, metric: str) -> float | None:
        v = self.last.get(metric)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


@dataclass
class SweepState:
    """Everything a sweep is and has done; ``sweep.json``."""

    name: str
    root: str  # <checkpoint.storage>/sweeps/<name>
    job_file: str
    overrides: list[str]
    space: dict[str, Any]
    scheduler: dict[str, Any]
    max_concurrent: int | None
    tracking_uri: str | None
    experiment: str | None
    parent_run_id: str | None = None
    created: float = field(default_factory=time.time)
    attempts: int = 0
    trials: list[TrialState] = field(default_factory=list)

    @property
    def sched(self) -> Scheduler:
        return Scheduler(**self.scheduler)

    @property
    def search_space(self) -> SearchSpace:
        return SearchSpace.from_dict(self.space)

    @property
    def path(self) -> str:
        return storage.join(self.root, STATE_FILE)

    def save(self) -> None:
        storage.write_text(self.path, json.dumps(asdict(self), indent=1, default=str))

    @classmethod
    def load(cls, root: str) -> SweepState | None:
        text = storage.read_text(storage.join(root, STATE_FILE))
        if text is None:
            return None
        try:
            raw = jsonfile.loads(text)
            trials = [TrialState(**t) for t in raw.pop("trials")]
            return cls(**raw, trials=trials)
        except (ValueError, TypeError, KeyError) as e:
            raise RaytrnError(
                f"{storage.join(root, STATE_FILE)}: not a sweep state raytrn can read ({e}); it was written by another "
                "raytrn version or damaged: start a new sweep with another --name"
            ) from None

    def best(self) -> TrialState | None:
        """The best trial by its last reported metric: among those that finished, else among all that reported it."""
        s = self.sched
        for pool in ([t for t in self.trials if t.status == "finished"], self.trials):
            scored = [t for t in pool if t.value(s.metric) is not None]
            if scored:
                key = (lambda t: t.value(s.metric)) if s.mode == "min" else (lambda t: -t.value(s.metric))  # type: ignore[operator]
                return min(scored, key=key)
        return None


def sweeps_root(job: JobSpec) -> str:
    return storage.join(job.checkpoint.storage, "sweeps")


def default_name(job_path: str) -> str:
    stem = os.path.splitext(os.path.basename(job_path))[0]
    stem = stem if "sweep" in stem else f"{stem}-sweep"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"[:180]


def read_section(job_path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job file's mapping without its ``sweep:`` section, and the section (empty when there is none)."""
    raw, section = read_job_file(job_path)
    if section is None:
        return raw, {}
    if not isinstance(section, dict):
        raise ConfigError(f"{job_path}: sweep: must be a mapping (grid, choice, loguniform, uniform, samples, ...)")
    known = (*KINDS, *SECTION_KEYS)
    for key in section:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"Did you mean '{near[0]}'?" if near else f"Known keys: {', '.join(known)}."
            raise ConfigError(f"{job_path}: sweep.{key}: unknown key. {hint}")
    return raw, section


def merge_options(opts: SweepOptions, section: dict[str, Any]) -> SweepOptions:
    """Flags over the section: a dimension given by a flag replaces the section's on the same field."""
    where = opts.job_path
    dims = {d.field: d for d in dimensions_from_section(section, where)}
    for d in opts.dimensions:
        dims.pop(d.field, None)
    merged = [*dims.values(), *opts.dimensions]

    def pick(flag: Any, key: str, kind: type) -> Any:
        if flag is not None:
            return flag
        value = section.get(key)
        if value is None:
            return None
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: sweep.{key}: expected {kind.__name__}, got {value!r}")
        return value

    return replace(
        opts,
        dimensions=merged,
        samples=pick(opts.samples, "samples", int),
        seed=pick(opts.seed, "seed", int),
        scheduler=pick(opts.scheduler, "scheduler", str),
        metric=pick(opts.metric, "metric", str),
        mode=pick(opts.mode, "mode", str),
        grace_steps=pick(opts.grace_steps, "grace_steps", int),
        reduction_factor=pick(opts.reduction_factor, "reduction_factor", float),
        max_concurrent=pick(opts.max_concurrent, "max_concurrent", int),
        name=pick(opts.name, "name", str),
    )


@dataclass
class Plan:
    """A new sweep, checked: its state (trials pending) and the base job."""

    state: SweepState
    base: JobSpec
    notes: list[str]


def plan_sweep(opts: SweepOptions, *, check_data: bool = True, base_dir: str | None = None) -> Plan:
    """Validate everything a sweep will run, before anything starts: every trial's job spec (one error listing the
    trials that are invalid), the data once per distinct dataset, the metric against what the jobs log, and the
    scheduler's settings. ConfigError on any problem; nothing is written."""
    raw, section = read_section(opts.job_path)
    opts = merge_options(opts, section)
    base_dir = base_dir or os.getcwd()
    base = load_job(opts.job_path, opts.overrides, raw=raw, base_dir=base_dir)
    space = SearchSpace(tuple(opts.dimensions), samples=opts.samples or 1, seed=opts.seed or 0)
    labels = {d.field: d.flag for d in space.dimensions}
    # Each value alone first: a wrong type or range is named by its flag, not by every trial that has it.
    for d in space.dimensions:
        for v in d.values if d.kind in ("grid", "choice") else (d.low, d.high):
            check_field_value(d.field, v, where=f"{opts.job_path}: {d.flag}")

    name = opts.name or default_name(opts.job_path)
    if not RUN_NAME.match(name) or len(name) > 190:
        raise ConfigError(
            f"--name {name!r}: a sweep's name becomes a directory and its trials' run names (<name>-t00): use 1-190 "
            "letters, digits and . _ = + - (starting with a letter or digit)"
        )
    values = space.trials()
    width = max(2, len(str(len(values) - 1)))
    jobs: list[tuple[int, str, dict[str, Any], JobSpec]] = []
    problems: list[str] = []
    notes: list[str] = []
    for i, v in enumerate(values):
        run_name = f"{name}-t{i:0{width}d}"
        try:
            job = load_job(
                opts.job_path, [*opts.overrides, f"tracking.run_name={run_name}"], raw=raw, base_dir=base_dir,
                values=v, labels=labels,
            )  # fmt: skip
            lines = check_job(job, data=check_data)  # the batch, the layout and the data, as `raytrn validate`
            notes = notes or lines
        except RaytrnError as e:
            problems.append(f"trial t{i:0{width}d} ({label(v)}): {e}")
            continue
        jobs.append((i, run_name, v, job))
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise ConfigError(
            f"{len(problems)} of {len(values)} trials are invalid; no trial was started:\n  " + "\n  ".join(shown)
        )
    scheduler = plan_scheduler(opts, base, [j for _, _, _, j in jobs], check_data=check_data)
    trials = [
        TrialState(index=i, run_name=rn, values=v, job=job.model_dump(mode="json", by_alias=True))
        for i, rn, v, job in jobs
    ]
    state = SweepState(
        name=name,
        root=storage.join(sweeps_root(base), name),
        job_file=opts.job_path,
        overrides=list(opts.overrides),
        space=space.to_dict(),
        scheduler=asdict(scheduler),
        max_concurrent=opts.max_concurrent,
        tracking_uri=base.tracking.mlflow_uri if base.tracking.enabled else None,
        experiment=base.tracking.experiment if base.tracking.enabled else None,
        trials=trials,
    )
    if opts.max_concurrent is not None and opts.max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {opts.max_concurrent}: must be at least 1")
    return Plan(state=state, base=base, notes=notes)


def has_validation(job: JobSpec, *, check_data: bool) -> bool | None:
    """Whether the job evaluates a validation set (None: unknown, its data is not readable here)."""
    if job.data.validation == "none":
        return False
    if job.data.validation:
        return True
    if not check_data:
        return None

    return load_manifest(job.data.manifest).validation_path() is not None


def plan_scheduler(opts: SweepOptions, base: JobSpec, jobs: list[JobSpec], *, check_data: bool) -> Scheduler:
    """The scheduler's settings, defaulted and checked against what every trial's job logs and when."""
    kind = opts.scheduler or "none"
    if kind not in SCHEDULERS:
        raise ConfigError(f"--scheduler {kind!r}: choose one of {', '.join(SCHEDULERS)}")
    validation = [has_validation(j, check_data=check_data) for j in jobs]
    metric = opts.metric or ("val_loss" if all(v is not False for v in validation) else "loss")
    known = [*TRAINING_METRICS, *VALIDATION_METRICS]
    if metric not in known:
        near = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ConfigError(
            f"--metric {metric!r}: the trials never log it.{hint} A trial logs {', '.join(TRAINING_METRICS)} every "
            f"run.log_every steps and, with a validation set, {', '.join(VALIDATION_METRICS)} every run.eval_every steps"
        )
    if metric == "mfu" and any(j.scaling.accelerator in ("cpu", "xla-cpu") for j in jobs):
        raise ConfigError("--metric mfu: a CPU trial logs no MFU (no peak FLOPs to compare with); use tokens_per_s")
    if metric in VALIDATION_METRICS and False in validation:
        raise ConfigError(
            f"--metric {metric}: the job has no validation set, so it never logs {metric}; prepare the data with "
            "--validation-fraction, set data.validation, or use --metric loss"
        )
    mode = opts.mode or ("max" if metric in HIGHER_IS_BETTER else "min")
    if mode not in ("min", "max"):
        raise ConfigError(f"--mode {mode!r}: min or max")
    max_steps = max(j.run.max_steps for j in jobs)
    validating = metric in VALIDATION_METRICS
    intervals = {(j.run.eval_every if validating else j.run.log_every) for j in jobs}
    every = max((i or 0) for i in intervals)
    rf = opts.reduction_factor if opts.reduction_factor is not None else 2.0
    grace = opts.grace_steps
    if kind == "asha":
        if validating and any(not j.run.eval_every for j in jobs):
            raise ConfigError(
                f"--scheduler asha judges trials on {metric}, which a trial evaluates only at its last step "
                "(run.eval_every is unset): set --set run.eval_every=N with N at most --grace-steps"
            )
        if grace is None:  # a quarter of the run, on a step the metric is reported at
            grace = max(every, -(-(max_steps // 4) // every) * every)
        if not 1 <= grace < max_steps:
            raise ConfigError(f"--grace-steps {grace}: must be at least 1 and below run.max_steps ({max_steps})")
        if grace < every:
            raise ConfigError(
                f"--grace-steps {grace}: {metric} is first reported at step {every} "
                f"({'run.eval_every' if validating else 'run.log_every'}); use --grace-steps {every} or more"
            )
        if not rf > 1 or not math.isfinite(rf):
            raise ConfigError(f"--reduction-factor {rf:g}: must be above 1 (2 keeps the best half at each rung)")
    else:
        for flag, value in (("--grace-steps", opts.grace_steps), ("--reduction-factor", opts.reduction_factor)):
            if value is not None:
                raise ConfigError(f"{flag} applies to --scheduler asha; add --scheduler asha or drop {flag}")
    return Scheduler(
        kind=kind,
        metric=metric,
        mode=mode,
        grace_steps=int(grace or 0),
        reduction_factor=float(rf),
        max_steps=max_steps,
    )
