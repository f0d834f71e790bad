"""A job's estimate: memory a worker against its device (and the smallest changes that make it fit), tokens/s,
time and cost to ``run.max_steps`` with the expected interruptions, and the checkpoint interval that loses least.

Offline and pure (no torch, no Ray): the inputs are the job spec, the tables in :mod:`raytrn.estimate.devices`,
:mod:`raytrn.tracking.cost` and :mod:`raytrn.estimate.reference`, and what the caller passes (a node MTBF, an MFU,
a spot price, a measured save time).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrn.config.sizes import data_parallel_size, global_batch, world_sizes
from raytrn.config.stages import SCHEDULES
from raytrn.estimate.devices import GIB, Device, worker_device
from raytrn.estimate.failures import DEFAULT_RATE, FailureRate, lost_fraction, young_daly_interval_s
from raytrn.estimate.history import History
from raytrn.estimate.memory import USABLE, ContextSplit, MemoryEstimate, estimate_memory
from raytrn.estimate.reference import ASSUMED_MFU, MFU, RESTART_S, Measured, carried_over_to_moe
from raytrn.models import model_stats
from raytrn.tracking.cost import usd_per_hour

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: A blocking checkpoint save, when nothing measured is given: the state a worker holds copied to host memory
#: (async checkpoints block only for that) at this rate. An assumption, shown as one.
ASSUMED_STAGING_BYTES_PER_S = 2e9


@dataclass(frozen=True, kw_only=True)
class Fix:
    """A change to the job (``--set`` overrides) and the memory it leaves."""

    overrides: tuple[str, ...]
    memory: MemoryEstimate

    def describe(self) -> str:
        return f"{' '.join('--set ' + o for o in self.overrides)}: {self.memory.total / GIB:,.2f} GiB"


def pipeline_bubble(schedule: str, ranks: int, micro_batches: int) -> tuple[float, str]:
    """The idle share of a pipelined step in theory, and the formula with whose claim it is: ``P`` ranks, ``m``
    micro-batches, ``v`` stages a rank. The zero-bubble schedules' figures take a forward, an input-gradient and a
    weight-gradient pass to cost the same (``F = B = W``; a full backward ``2F``) and communication to be free, as
    their papers do."""
    p, m = ranks, micro_batches
    v = SCHEDULES[schedule][1]
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1), "theory (P-1)/(m+P-1)"
    if schedule == "interleaved_1f1b":  # Narayanan et al. 2021: the warm-up and cool-down shrink v-fold
        return (p - 1) / (v * m + p - 1), f"theory (P-1)/(v*m+P-1), v = {v} stages a rank"
    if schedule == "interleaved_zero_bubble":  # ZB1P: the weight passes fill two thirds of the idle time
        return (p - 1) / (3 * v * m + p - 1), (
            f"theory (P-1)/(3*v*m+P-1), v = {v}: ZB-H1/ZB1P (Qi et al. 2024), a third of interleaved 1F1B's idle "
            "time when F = B = W"
        )
    if schedule == "zbv_zero_bubble":
        return 0.0, "theory: zero, ZB-V's claim (Qi et al. 2024) when F = B = W"
    # dualpipev: DeepSeek-V3's (PP/2-1)(F&B+B-3W) over PP = 2P stages, F&B = F + B (no overlap credited)
    return (p - 1) / (3 * m + p - 1), "theory (P-1)/(3*m+P-1): DeepSeek-V3's DualPipe bubble when F = B = W"


@dataclass(frozen=True, kw_only=True)
class Bubble:
    """A pipeline's idle share of the step (:func:`pipeline_bubble`): the theory's, not a measurement."""

    schedule: str
    ranks: int
    stages_per_rank: int
    micro_batches: int
    fraction: float
    theory: str

    def describe(self) -> str:
        """``pipeline: 1f1b over 4 stages, 8 micro-batches: bubble 27% (theory (P-1)/(m+P-1))``."""
        over = (
            f"{self.ranks} stages"
            if self.stages_per_rank == 1
            else f"{self.ranks} ranks x {self.stages_per_rank} stages"
        )
        return (
            f"pipeline: {self.schedule} over {over}, {self.micro_batches} micro-batches: bubble {self.fraction:.0%} "
            f"({self.theory})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "ranks": self.ranks, "stages_per_rank": self.stages_per_rank,
                "micro_batches": self.micro_batches, "bubble": self.fraction, "theory": self.theory}  # fmt: skip


def bubble(job: JobSpec, world_size: int) -> Bubble | None:
    """The pipeline bubble of ``job`` at ``world_size`` workers: its schedule over its micro-batches (a
    data-parallel rank's, ``data.grad_accum`` at that size); None without a pipeline."""
    p = job.parallel
    if p.pipeline_parallel_size == 1:
        return None
    micro = job.data.grad_accum_for(data_parallel_size(job, world_size))
    fraction, theory = pipeline_bubble(p.pipeline_schedule, p.pipeline_parallel_size, micro)
    per_rank = SCHEDULES[p.pipeline_schedule][1]
    return Bubble(schedule=p.pipeline_schedule, ranks=p.pipeline_parallel_size, stages_per_rank=per_rank,
                  micro_batches=micro, fraction=fraction, theory=theory)  # fmt: skip


@dataclass(kw_only=True)
class JobEstimate:
    job: str
    world_size: int
    nodes: int
    device: Device
    memory: MemoryEstimate
    fits: bool | None  # None: the device's memory is unknown
    fixes: list[Fix] = field(default_factory=list)
    flops_per_token: float = 0.0
    mfu: Measured | None = None
    tokens_per_s_per_node: float | None = None
    hours: float | None = None
    usd_per_hour: float | None = None
    spot_usd_per_hour: float | None = None
    failures: FailureRate = DEFAULT_RATE
    expected_interruptions: float | None = None
    lost_hours: float | None = None
    save_s: Measured | None = None
    interval_s: float | None = None
    interval_steps: int | None = None
    step_s: float | None = None
    restart_s: Measured | None = None
    #: The pipeline's bubble (tokens/s and time are after it); None without a pipeline.
    pipeline: Bubble | None = None
    #: Context parallelism's rows a worker (tokens/s are after the padding's share); None without it.
    context_parallel: ContextSplit | None = None

    def fix_kinds(self) -> str:
        """What :func:`fixes` changes besides checkpointing and the micro-batch, for the lines that list none."""
        return "TP, " + "PP, " * bool(self.pipeline) + "CP, " * bool(self.context_parallel) + "FSDP"

    @property
    def margin_bytes(self) -> int | None:
        if self.device.memory_bytes is None:
            return None
        return int(self.device.memory_bytes * USABLE) - self.memory.total

    @property
    def memory_verdict(self) -> str | None:
        """``fits``: at most the :data:`USABLE` share of the device planned for; ``tight``: above it but not above
        the device (``raytrn submit`` takes it and says so); ``does not fit``: above the device (refused). None: the
        device's memory is unknown."""
        device = self.device.memory_bytes
        if device is None:
            return None
        if self.memory.total <= device * USABLE:
            return "fits"
        return "tight" if self.memory.total <= device else "does not fit"

    def describe_verdict(self) -> str:
        """The verdict with its arithmetic, one line."""
        device, total = self.device.memory_bytes, self.memory.total / GIB
        if device is None:
            return "memory: not checked (the device's memory is unknown)"
        usable = f"the {USABLE:.0%} of {device / GIB:,.1f} GiB planned for ({device * USABLE / GIB:,.1f} GiB)"
        return {
            "fits": f"memory: fits ({total:,.2f} GiB a worker, within {usable})",
            "tight": f"memory: tight ({total:,.2f} GiB a worker: over {usable}, within the device: try it)",
            "does not fit": f"memory: does not fit ({total:,.2f} GiB a worker, the device has {device / GIB:,.1f} GiB)",
        }[self.memory_verdict or ""]

    def cost(self, price: float | None) -> float | None:
        if price is None or self.hours is None:
            return None
        return price * self.nodes * (self.hours + (self.lost_hours or 0.0))

    def summary(self) -> str:
        """One line: fits or not, $/hour, ETA."""
        fit = self.memory_verdict or "memory not checked"
        if fit == "tight":
            fit = f"tight: {-(self.margin_bytes or 0) / GIB:,.2f} GiB over the {USABLE:.0%} planned for"
        parts = [f"estimate: {fit} ({self.memory.total / GIB:,.1f} GiB a worker"]
        if self.device.memory_bytes:
            parts[0] += f" of {self.device.memory_bytes / GIB:,.1f}"
        parts[0] += ")"
        if self.usd_per_hour is not None:
            parts.append(f"${self.usd_per_hour * self.nodes:,.2f}/hour on {self.nodes} node(s)")
        if self.hours is not None:
            total = self.hours + (self.lost_hours or 0.0)
            parts.append(f"ETA {total:,.1f} h to step {self.job_steps:,}")
        return ", ".join(parts)

    job_steps: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "device": {
                "name": self.device.name,
                "memory_bytes": self.device.memory_bytes,
                "peak_flops": self.device.peak_flops,
                "source": self.device.source,
                "confirmed": self.device.confirmed,
            },  # fmt: skip
            "memory": {**self.memory.as_dict(), "notes": self.memory.notes},
            "fits": self.fits,
            "memory_verdict": self.memory_verdict,
            "margin_bytes": self.margin_bytes,
            "fixes": [{"set": list(f.overrides), "total_bytes": f.memory.total} for f in self.fixes],
            "flops_per_token": self.flops_per_token,
            "mfu": None if self.mfu is None else {"value": self.mfu.value, "source": self.mfu.source},
            "tokens_per_s_per_node": self.tokens_per_s_per_node,
            "hours": self.hours,
            "lost_hours": self.lost_hours,
            "usd_per_hour": self.usd_per_hour,
            "cost_usd": self.cost(self.usd_per_hour),
            "spot_usd_per_hour": self.spot_usd_per_hour,
            "spot_cost_usd": self.cost(self.spot_usd_per_hour),
            "node_mtbf_hours": self.failures.node_mtbf_hours,
            "failure_source": self.failures.source,
            "expected_interruptions": self.expected_interruptions,
            "restart_s": None
            if self.restart_s is None
            else {"value": self.restart_s.value, "source": self.restart_s.source},  # fmt: skip
            "save_s": None if self.save_s is None else {"value": self.save_s.value, "source": self.save_s.source},
            "checkpoint_interval_s": self.interval_s,
            "checkpoint_interval_steps": self.interval_steps,
            "pipeline": None if self.pipeline is None else self.pipeline.as_dict(),
            "context_parallel": None if self.context_parallel is None else self.context_parallel.as_dict(),
        }

    def render(self) -> str:
        m, gib = self.memory, GIB
        lines = [f"{self.job}: {self.world_size} workers on {self.nodes} node(s)", f"device: {self.device.describe()}"]
        lines.append(
            f"memory a worker: {m.describe()}; layout: {', '.join(m.notes)}"
            + (
                ""
                if self.margin_bytes is None
                else f"; margin {self.margin_bytes / gib:,.2f} GiB of {USABLE:.0%} usable"
            )  # fmt: skip
        )
        lines.append(self.describe_verdict())
        if self.fits is False:  # tight or does not fit: the changes that bring it within the share planned for
            within = f"within {USABLE:.0%}"
            what = "changes that make it fit" if self.memory_verdict == "does not fit" else "changes that bring it"
            lines.append(f"{what} {within} (smallest first):" if self.fixes else
                         f"no change of {self.fix_kinds()}, checkpointing or micro-batch brings it {within}")  # fmt: skip
            lines += [f"  {f.describe()}" for f in self.fixes]
        if self.pipeline is not None:
            lines.append(self.pipeline.describe() + ("; the speed and time below are after it" if self.hours else ""))
        if self.context_parallel is not None and self.hours is not None:
            c = self.context_parallel
            pad = c.padded_length - c.seq_len
            trained = f"the trained tokens' (the padding's {pad:,} of {c.padded_length:,} a row computed too)"
            lines.append(
                f"context parallel {c.size}: the speed below is {trained if pad else 'the rows split without padding'}; "
                "the ring's transfers are not modelled (assumed hidden behind its blocks' compute)"
            )
        if self.tokens_per_s_per_node is not None and self.mfu is not None:
            lines.append(
                f"speed: {self.tokens_per_s_per_node:,.0f} tokens/s a node at MFU {self.mfu.value:.1%} ({self.mfu.source}); "
                f"{self.flops_per_token / 1e9:,.1f} GFLOPs/token"
            )
        else:
            lines.append("speed: no peak FLOP/s for this device (cpu): run it and read tokens_per_s in MLflow")
        if self.hours is not None:
            lines.append(
                f"time to step {self.job_steps:,}: {self.hours:,.1f} h of training + {self.lost_hours or 0:,.2f} h lost to "
                f"{self.expected_interruptions or 0:,.2f} expected interruption(s) (node MTBF "
                f"{self.failures.node_mtbf_hours:,.0f} h: {self.failures.source}; a restart "
                f"{self.restart_s.value if self.restart_s else 0:,.0f} s: "
                f"{self.restart_s.source if self.restart_s else '-'})"
            )
        for label, price in (("on-demand", self.usd_per_hour), ("spot", self.spot_usd_per_hour)):
            cost = self.cost(price)
            if cost is not None and price is not None:
                lines.append(f"cost {label}: ${cost:,.0f} (${price:,.2f} a node-hour)")
            elif label == "spot":
                lines.append("cost spot: pass --spot-usd-per-hour (or tracking.spot_usd_per_hour)")
        if self.interval_s is not None and self.save_s is not None:
            steps = f" = every {self.interval_steps:,} steps" if self.interval_steps else ""
            lines.append(
                f"checkpoint interval that loses least (Young/Daly): {self.interval_s / 60:,.1f} min{steps} "
                f"(blocking save {self.save_s.value:,.1f} s: {self.save_s.source})"
            )
        return "\n".join(lines)


def device_family(device: Device, instance_type: str | None) -> str:
    family = (instance_type or "").split(".", 1)[0]
    if family.startswith("trn"):
        return family.rstrip("nu") if family in ("trn1n", "trn2u") else family
    return device.name.split()[0]


def estimate_job(
    job: JobSpec,
    *,
    instance_type: str | None = None,
    world_size: int | None = None,
    failures: FailureRate = DEFAULT_RATE,
    mfu: Measured | None = None,
    spot_usd_per_hour: float | None = None,
    save_s: Measured | None = None,
    restart_s: Measured | None = None,
    history: History | None = None,
) -> JobEstimate:
    """The estimate of ``job`` at ``world_size`` workers (default: the most it can take). The MFU and the restart
    time: as given, else from ``history`` (:func:`raytrn.estimate.history.read_history`), else the shipped ones."""
    history = history or History()
    restart = restart_s or history.restart_s or RESTART_S
    s = job.scaling
    world = world_size or max(world_sizes(job))
    itype = instance_type or s.instance_type
    nodes = max(1, -(-world // (s.workers_per_node or world)))
    device = worker_device(job, instance_type=itype)
    memory = estimate_memory(job, world)
    fits = None if device.memory_bytes is None else memory.total <= device.memory_bytes * USABLE
    out = JobEstimate(job=job.source, world_size=world, nodes=nodes, device=device, memory=memory, fits=fits,
                      failures=failures, job_steps=job.run.max_steps, pipeline=bubble(job, world),
                      context_parallel=ContextSplit.of(job))  # fmt: skip
    if fits is False:
        out.fixes = fixes(job, world, device)
    out.flops_per_token = model_stats(job.model, job.data.seq_len).flops_per_token
    out.usd_per_hour = usd_per_hour(itype, override=job.tracking.usd_per_hour)
    out.spot_usd_per_hour = spot_usd_per_hour or job.tracking.spot_usd_per_hour
    if device.peak_flops:
        shipped = MFU.get(device_family(device, itype))  # measured on dense models: labelled for a MoE one
        if shipped is not None and job.model.is_moe:
            shipped = carried_over_to_moe(shipped, job.model.family)
        out.mfu = mfu or history.mfu or shipped or ASSUMED_MFU
        per_worker = device.peak_flops * out.mfu.value / out.flops_per_token
        out.tokens_per_s_per_node = per_worker * (world // nodes)
        if out.pipeline is not None:  # the stages idle for this share of the step
            out.tokens_per_s_per_node *= 1 - out.pipeline.fraction
        if out.context_parallel is not None:  # the padding's tokens are computed, not trained
            out.tokens_per_s_per_node *= out.context_parallel.seq_len / out.context_parallel.padded_length
        tokens = job.run.max_steps * global_batch(job, data_parallel_size(job, world)) * job.data.seq_len
        out.hours = tokens / (out.tokens_per_s_per_node * nodes) / 3600
        out.step_s = out.hours * 3600 / job.run.max_steps
        out.save_s = (
            save_s
            or history.save_s
            or Measured(
                memory.state / ASSUMED_STAGING_BYTES_PER_S,
                f"assumed: the state a worker holds ({memory.state / GIB:,.1f} GiB) copied to host at "
                f"{ASSUMED_STAGING_BYTES_PER_S / 1e9:.0f} GB/s (async save; pass --save-s with a measured one)",
            )
        )
        job_mtbf_s = failures.job_mtbf_hours(nodes) * 3600
        out.interval_s = young_daly_interval_s(max(out.save_s.value, 1e-3), job_mtbf_s)
        out.interval_steps = max(1, round(out.interval_s / out.step_s))
        out.expected_interruptions = failures.expected(nodes, out.hours)
        every = job.checkpoint.every_n_steps
        interval = every * out.step_s if isinstance(every, int) else out.interval_s
        out.restart_s = restart
        out.lost_hours = out.hours * lost_fraction(interval, out.save_s.value, restart.value, job_mtbf_s)
    return out


def fixes(job: JobSpec, world: int, device: Device, *, limit: int = 3) -> list[Fix]:
    """The smallest changes (one, else two, of: FSDP (from DDP or HSDP), full activation checkpointing, a larger TP, a
    larger pipeline (a pipelined job's), a larger context-parallel group (a CP job's), a smaller micro-batch) after
    which a worker's memory fits ``device``, each a job that validates; fewest changes first, then least memory."""
    p, d = job.parallel, job.data
    single: list[tuple[str, ...]] = []
    if p.data_parallel != "fsdp":  # from hsdp: shard over every data-parallel rank, not a group's
        single.append(("parallel.data_parallel=fsdp", *(("parallel.hsdp_shard_size=null",) * bool(p.hsdp_shard_size))))
    if p.activation_checkpointing != "full":
        single.append(("parallel.activation_checkpointing=full",))
    tp = p.tensor_parallel_size
    for bigger in (tp * 2, tp * 4, tp * 8):
        if world % bigger == 0 and (not job.scaling.workers_per_node or job.scaling.workers_per_node % bigger == 0):
            fsdp = () if p.data_parallel != "ddp" else ("parallel.data_parallel=fsdp",)  # TP needs it (or hsdp)
            single.append((f"parallel.tensor_parallel_size={bigger}", *fsdp))
    pp = p.pipeline_parallel_size
    if pp > 1:  # fewer layers a rank (validation refuses what the layers or micro-batches cannot fill)
        single += [
            (f"parallel.pipeline_parallel_size={bigger}",) for bigger in (pp * 2, pp * 4) if world % (bigger * tp) == 0
        ]
    cp = p.context_parallel_size
    if cp > 1:  # fewer tokens a worker (validation refuses what the world or the rows cannot split)
        single += [
            (f"parallel.context_parallel_size={bigger}",) for bigger in (cp * 2, cp * 4) if world % (bigger * tp) == 0
        ]
    mb = d.micro_batch_size
    while mb > 1:
        mb //= 2
        single.append((f"data.micro_batch_size={mb}",))
    limit_bytes = (device.memory_bytes or 0) * USABLE
    found: list[Fix] = []
    for size in (1, 2):
        for combo in itertools.combinations(single, size):
            overrides = tuple(dict.fromkeys(o for change in combo for o in change))
            changed = _apply(job, overrides)
            if changed is None:
                continue
            memory = estimate_memory(changed, world)
            if memory.total <= limit_bytes:
                found.append(Fix(overrides=overrides, memory=memory))
        if found:
            break
    found.sort(key=lambda f: (len(f.overrides), f.memory.total))
    return found[:limit]


def _apply(job: JobSpec, overrides: tuple[str, ...]) -> JobSpec | None:
    """``job`` with ``overrides`` (``--set`` syntax), or None when the result is not a valid job."""
    from raytrn.config import apply_overrides, parse_job
    from raytrn.errors import RaytrnError

    raw = job.model_dump(mode="json", by_alias=True)
    try:
        apply_overrides(raw, list(overrides))
        changed = parse_job(raw, source=job.source)
        from raytrn.config.layout import check_parallel

        check_parallel(changed)
    except (RaytrnError, ValueError):
        return None
    return changed


def check_fits(job: JobSpec, *, instance_type: str | None = None) -> str:
    """The estimate's one-line summary for ``raytrn submit`` and ``raytrn validate --cluster``; ConfigError, with
    the arithmetic and the changes that fit, when a worker needs more than its device has (a device from the
    instance tables: a cpu worker's memory is the cluster's, unknown here). Between the usable share and the whole
    device the job is tight, not refused: the summary says so."""
    from raytrn.errors import ConfigError

    est = estimate_job(job, instance_type=instance_type)
    device = est.device.memory_bytes
    if job.scaling.accelerator != "cpu" and device is not None and est.memory_verdict == "does not fit":
        fixes = "; ".join(f.describe() for f in est.fixes) or f"none of {est.fix_kinds()}, checkpointing or micro-batch"
        raise ConfigError(
            f"{job.source}: a worker needs {est.memory.describe()} but its device ({est.device.name}) has "
            f"{device / GIB:,.1f} GiB; changes that fit: {fixes} (`raytrn estimate` for the whole estimate)"
        )
    return est.summary()


#: ``checkpoint.every_n_steps: auto`` where the estimate has no step time (cpu workers: no peak FLOP/s).
AUTO_FALLBACK_STEPS = 100


def resolve_auto_interval(job: JobSpec) -> tuple[JobSpec, dict[str, Any], str | None]:
    """``job`` with ``checkpoint.every_n_steps: auto`` replaced by the Young/Daly interval in steps (at the job's
    largest size, the MLflow history's figures where it has them), the params that record the choice and its
    inputs, and a line saying it; ``job`` unchanged (no params, no line) when the interval is a number."""
    if job.checkpoint.every_n_steps != "auto":
        return job, {}, None
    from raytrn.estimate.history import read_history

    est = estimate_job(job, history=read_history(job))
    if est.interval_steps is None or est.save_s is None or est.step_s is None:
        steps, why = AUTO_FALLBACK_STEPS, f"no step-time estimate for {est.device.name}: the default"
        params: dict[str, Any] = {"checkpoint.auto.every_n_steps": steps, "checkpoint.auto.reason": why}
    else:
        steps = est.interval_steps
        mtbf = est.failures.job_mtbf_hours(est.nodes)
        why = (
            f"Young/Daly: sqrt(2 x {est.save_s.value:.1f} s save x {mtbf:,.0f} h MTBF of {est.nodes} node(s)) = "
            f"{(est.interval_s or 0) / 60:,.1f} min at {est.step_s:.2f} s a step"
        )
        params = {
            "checkpoint.auto.every_n_steps": steps,
            "checkpoint.auto.save_s": round(est.save_s.value, 3),
            "checkpoint.auto.save_s_source": est.save_s.source,
            "checkpoint.auto.job_mtbf_hours": round(mtbf, 1),
            "checkpoint.auto.mtbf_source": est.failures.source,
            "checkpoint.auto.step_s": round(est.step_s, 4),
        }
    resolved = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"every_n_steps": steps})})
    return resolved, params, f"checkpoint.every_n_steps auto: every {steps:,} steps ({why})"


def estimate_params(job: JobSpec) -> dict[str, Any]:
    """``raytrn estimate``'s figures for this job at its largest size, logged as the run's params (``estimate.*``)
    so that a run's actuals can be set against them. An estimate that fails is a warning, never a failed job."""
    try:
        est = estimate_job(job)
    except Exception as e:  # the estimate is advice: a job it cannot describe still trains
        log.warning("no estimate for this job (%s: %s)", type(e).__name__, e)
        return {}
    out: dict[str, Any] = {
        "estimate.world_size": est.world_size,
        "estimate.memory_bytes": est.memory.total,
        "estimate.device_memory_bytes": est.device.memory_bytes,
        "estimate.fits": est.fits,
        "estimate.memory_verdict": est.memory_verdict,
    }
    if est.tokens_per_s_per_node is not None and est.mfu is not None:
        out.update({
            "estimate.tokens_per_s": round(est.tokens_per_s_per_node * est.nodes, 1),
            "estimate.mfu": est.mfu.value,
            "estimate.mfu_source": est.mfu.source,
            "estimate.hours": round(est.hours or 0.0, 3),
            "estimate.checkpoint_interval_steps": est.interval_steps,
        })  # fmt: skip
    if est.pipeline is not None:
        out["estimate.pipeline_bubble"] = round(est.pipeline.fraction, 4)
    return out


def estimate_errors(
    job: JobSpec, world_size: int, *, tokens_per_s: float | None, memory_bytes: int | None, memory_how: str = "probe"
) -> dict[str, float]:
    """How far the estimate of ``job`` at ``world_size`` workers was from a run's actuals, as signed fractions of
    the estimate (``+0.1``: the run measured 10% more): ``estimate_error_tokens_per_s`` (the run's tokens/s, the
    estimate's at the shipped MFU; none for a device without a peak FLOP/s: cpu) and ``estimate_error_memory`` (a
    worker's measured memory, :mod:`raytrn.train.memory_probe`: a device allocator's peak against the estimate's
    total less the runtime's share, ``memory_how="allocator"``; else the state held and the tensors saved for
    backward against :attr:`MemoryEstimate.probed`)."""
    est = estimate_job(job, world_size=world_size)
    out: dict[str, float] = {}
    if tokens_per_s and est.tokens_per_s_per_node:
        out["estimate_error_tokens_per_s"] = tokens_per_s / (est.tokens_per_s_per_node * est.nodes) - 1
    if memory_bytes:
        m = est.memory
        expected = m.total - m.runtime if memory_how == "allocator" else m.probed
        out["estimate_error_memory"] = memory_bytes / expected - 1
    return out
