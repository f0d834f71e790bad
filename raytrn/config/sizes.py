"""World sizes and batch arithmetic: the worker counts a job can run at, its model replicas at each, and
the global batch they train with (and how many logits the loss takes at once). Pure (no torch, no Ray): ``raytrn validate`` runs it on a laptop.

An elastic job (``scaling.min_workers != max_workers``) is restarted at another size on every resize. Its
*global* batch (sequences per optimizer step) must not change when that happens, or the training trajectory
silently changes with the cluster: :func:`check_global_batch` insists on ``data.global_batch_size``
divisible at every data-parallel size the job can take (or an explicit
``data.allow_variable_global_batch: true``).

Every enumeration here is bounded: the job spec caps worker counts at :data:`MAX_WORKERS`, and the
least common multiple used in suggestions stops growing at :data:`MAX_SUGGESTED_BATCH`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from raytrn.errors import ConfigError

if TYPE_CHECKING:
    from raytrn.config import JobSpec

#: The most workers a job may ask for (the largest Trainium clusters are a few thousand NeuronCores).
MAX_WORKERS = 100_000
#: Above this a "use a multiple of N" suggestion is not a batch size anyone trains with.
MAX_SUGGESTED_BATCH = 1 << 24
_SHOWN = 8  # sizes listed in a message before "... and N more"
#: Logits a micro-batch's loss takes in one piece (256 MiB of float32); above it, chunks of about this many
#: (:mod:`raytrn.train.loss`; :mod:`raytrn.estimate.memory` counts it).
LOSS_CHUNK_LOGITS = 1 << 26


def loss_chunk_rows(tokens: int, vocab: int) -> int | None:
    """Rows (tokens) a chunk of the loss takes, or None when a micro-batch's ``tokens x vocab`` logits are taken in
    one piece (:data:`LOSS_CHUNK_LOGITS`)."""
    if tokens * vocab <= LOSS_CHUNK_LOGITS:
        return None
    return max(1, LOSS_CHUNK_LOGITS // vocab)


def padded_length(seq: int, context_parallel_size: int) -> int:
    """``seq`` rounded up to a multiple of ``2 x CP``: context parallelism's zigzag cuts a row into ``2 x CP``
    equal chunks (:mod:`raytrn.models.context_parallel`), the rest of the last one padding."""
    chunks = 2 * context_parallel_size
    return -(-seq // chunks) * chunks


def elastic_world_sizes(min_workers: int, max_workers: int, step: int) -> list[int]:
    """Every worker count of the elastic range at ``step`` granularity (whole nodes), both ends included."""
    if not 1 <= min_workers <= max_workers <= MAX_WORKERS or step < 1:
        raise ConfigError(
            f"worker range {min_workers}..{max_workers} (step {step}): need 1 <= min_workers <= max_workers <= "
            f"{MAX_WORKERS:,} and a positive step"
        )
    return sorted(set(range(min_workers, max_workers + 1, step)) | {min_workers, max_workers})


def world_sizes(job: JobSpec) -> list[int]:
    """Every worker count the job can run at: its fixed size, or, for an elastic job, the sizes in
    ``min_workers..max_workers`` that are whole nodes (multiples of ``scaling.workers_per_node``) holding whole
    tensor-parallel groups. The elastic scaling policy (:mod:`raytrn.train.elastic`) never picks another.

    ConfigError, with why, when an elastic range holds no such size."""
    s = job.scaling
    if not s.elastic:
        return [s.min_workers]
    unit = size_unit(job)
    sizes = list(range(-(-s.min_workers // unit) * unit, s.max_size + 1, unit))
    if not sizes:
        raise ConfigError(
            f"{job.source}: scaling: no worker count in min_workers..max_workers ({s.min_workers}..{s.max_size}) is "
            f"{_unit_reason(job)}: widen the range to include a multiple of {unit}"
        )
    return sizes


def size_unit(job: JobSpec) -> int:
    """What every elastic size is a multiple of: whole nodes (``workers_per_node``, which whole TP groups, and with
    expert parallelism whole ``TP x EP`` blocks, must divide: checked by ``raytrn.config.layout``), else whole
    tensor-parallel groups (with expert parallelism whole blocks of ``TP x EP`` consecutive ranks, with context
    parallelism whole ``CP x TP`` groups, with pipelines whole pipelines); under hsdp also whole shard groups."""
    p = job.parallel
    pp, cp, wpn = p.pipeline_parallel_size, p.context_parallel_size, job.scaling.workers_per_node
    block = pp * cp * p.tensor_parallel_size * p.expert_parallel_size
    plain = pp == 1 and cp == 1  # then layout checks TP x EP | wpn
    unit = (wpn if plain else math.lcm(wpn, block)) if wpn else block
    shard = hsdp_shard_size(job)
    return math.lcm(unit, pp * shard) if shard else unit


def hsdp_shard_size(job: JobSpec) -> int | None:
    """Workers in one HSDP shard group (``parallel.hsdp_shard_size``, else one node: ``scaling.workers_per_node``);
    None unless ``data_parallel`` is hsdp, or when neither is set (refused by :mod:`raytrn.config.layout`)."""
    p = job.parallel
    if p.data_parallel != "hsdp":
        return None
    return p.hsdp_shard_size or job.scaling.workers_per_node


def shard_size(job: JobSpec, world_size: int) -> int:
    """The data-parallel ranks a parameter (and its gradient and optimizer state) is sharded over at ``world_size``
    workers: every one under fsdp, a shard group's (``hsdp_shard_size / TP``) under hsdp, 1 under ddp or on one
    worker. With context parallelism FSDP shards over the context-parallel ranks too (DP x CP of them)."""
    p = job.parallel
    if world_size <= 1 or p.data_parallel == "ddp":
        return 1
    group = hsdp_shard_size(job) or world_size
    return max(1, min(group, world_size) // p.tensor_parallel_size)


def _unit_reason(job: JobSpec) -> str:
    wpn, tp, ep = job.scaling.workers_per_node, job.parallel.tensor_parallel_size, job.parallel.expert_parallel_size
    shard = hsdp_shard_size(job)
    pp, cp = job.parallel.pipeline_parallel_size, job.parallel.context_parallel_size
    if cp > 1 or pp > 1:
        factors = [f"parallel.pipeline_parallel_size {pp}"] * (pp > 1) + [f"parallel.context_parallel_size {cp}"] * (
            cp > 1
        )
        factors += [f"TP {tp}"] * (tp > 1) + [f"EP {ep}"] * (ep > 1)
        within = f", hsdp shard groups of {shard}{' in each stage' if pp > 1 else ''}" if shard else ""
        return (
            f"a multiple of {size_unit(job)}: whole {'pipelines' if pp > 1 else 'context-parallel groups'} "
            f"({' x '.join(factors)}{within}{f', on whole nodes of {wpn}' if wpn else ''})"
        )
    if shard and shard != wpn:
        return f"a multiple of {size_unit(job)}: whole hsdp shard groups of {shard} workers" + (
            f" on whole nodes (scaling.workers_per_node={wpn})" if wpn else ""
        )
    if wpn:
        return f"a multiple of {wpn}: whole nodes (scaling.workers_per_node={wpn})"
    if ep > 1:
        return f"a multiple of {tp * ep}: whole expert-parallel blocks (TP {tp} x parallel.expert_parallel_size {ep})"
    return f"a multiple of {tp}: whole tensor-parallel groups (parallel.tensor_parallel_size={tp})"


def describe_sizes(job: JobSpec) -> str:
    """``raytrn validate``'s line on the sizes an elastic job can take, and why only those."""
    sizes, s = world_sizes(job), job.scaling
    if not s.elastic:
        return f"size: fixed at {s.min_workers} worker{'s' * (s.min_workers > 1)}"
    shown = _listing([str(n) for n in sizes])
    unit = size_unit(job)
    why = f" ({_unit_reason(job)})" if unit > 1 else ""
    return f"elastic sizes: {shown} workers{why}"


def data_parallel_size(job: JobSpec, world_size: int) -> int:
    """Model replicas at ``world_size`` workers: ``world_size / (PP x CP x TP)`` (pipeline, context and tensor
    parallel sizes).

    The ranks of one TP group (and of one context-parallel group, and of one pipeline's stages) hold one replica
    and read the same batch, so this, not the world size, multiplies the micro-batch (``global batch = micro_batch
    x grad_accum x DP``).
    """
    tp, pp, cp = (
        job.parallel.tensor_parallel_size,
        job.parallel.pipeline_parallel_size,
        job.parallel.context_parallel_size,
    )
    if world_size % (tp * pp * cp):
        what = f"parallel.pipeline_parallel_size ({pp}) x " if pp > 1 else ""
        what += f"parallel.context_parallel_size ({cp}) x " if cp > 1 else ""
        whole = ("pipelines of whole " if pp > 1 else "") + ("context-parallel groups of whole " if cp > 1 else "")
        raise ConfigError(
            f"{job.source}: {world_size} workers is not divisible by {what}parallel.tensor_parallel_size ({tp}); "
            f"every world size must hold whole {whole}tensor-parallel groups"
        )
    return world_size // (tp * pp * cp)


def data_parallel_rank(job: JobSpec, rank: int, world_size: int | None = None) -> int:
    """This worker's replica index, i.e. which data slice it reads. The mesh is torchtitan's ``(pp, dp, cp, tp)``:
    tensor-parallel ranks are consecutive, a context-parallel group's ``CP x TP`` ranks consecutive around them
    (they read the same rows), and under pipeline parallelism (the outermost mesh dimension: ``world_size``
    needed) the ranks of a stage are a contiguous block of ``world_size / PP``, replica ``i`` of each block a stage
    of the same pipeline."""
    p = job.parallel
    if p.pipeline_parallel_size > 1:
        if world_size is None:
            raise ValueError("data_parallel_rank under pipeline parallelism needs the world size")
        rank %= world_size // p.pipeline_parallel_size
    return rank // (p.context_parallel_size * p.tensor_parallel_size)


def data_parallel_sizes(job: JobSpec) -> dict[int, int]:
    """``{world size: data-parallel size}`` for every world size of the elastic range."""
    return {n: data_parallel_size(job, n) for n in world_sizes(job)}


def global_batch(job: JobSpec, dp: int) -> int:
    """Sequences per optimizer step at data-parallel size ``dp`` (with ``grad_accum`` when no global batch)."""
    d = job.data
    return d.global_batch_size if d.global_batch_size is not None else d.micro_batch_size * (d.grad_accum or 1) * dp


def check_global_batch(job: JobSpec) -> None:
    """ConfigError unless every size of the elastic range trains with the same, whole global batch.

    ``data.global_batch_size`` must be divisible by ``micro_batch_size x DP`` at every data-parallel size
    DP the job can take (all failing sizes are listed). An elastic job with ``data.grad_accum`` instead
    would change its global batch at every resize: refused unless ``data.allow_variable_global_batch``.
    """
    d, where = job.data, job.source
    sizes = data_parallel_sizes(job)
    dps = sorted(set(sizes.values()))
    units = [d.micro_batch_size * dp for dp in dps]
    tp, cp = job.parallel.tensor_parallel_size, job.parallel.context_parallel_size
    tp_note = (
        f"; with tensor_parallel_size {tp} the ranks of a TP group share each batch, so DP = workers / TP"
        if tp > 1 and cp == 1
        else ""
    )
    if cp > 1:
        tp_note = (
            f"; with context_parallel_size {cp} the {cp * tp} ranks of a context-parallel group share each batch, "
            f"so DP = workers / (CP {cp}" + (f" x TP {tp}" if tp > 1 else "") + ")"
        )
    if d.global_batch_size is not None:
        bad = [(n, dp) for n, dp in sizes.items() if d.global_batch_size % (d.micro_batch_size * dp)]
        if not bad:
            return
        listed = _listing(
            [
                f"{n} worker{'s' * (n > 1)} (DP {dp}: {d.micro_batch_size} x {dp} = {d.micro_batch_size * dp})"
                for n, dp in bad
            ]
        )
        raise ConfigError(
            f"{where}: data.global_batch_size ({d.global_batch_size}) is not divisible by micro_batch_size x "
            f"data-parallel size at {listed}{tp_note}. {_fix(units, d.global_batch_size, job)}"
        )
    if len(dps) == 1 or d.allow_variable_global_batch:
        return
    accum = d.grad_accum or 1
    low, high = global_batch(job, dps[0]), global_batch(job, dps[-1])
    raise ConfigError(
        f"{where}: an elastic job (scaling.min_workers={job.scaling.min_workers}, "
        f"max_workers={job.scaling.max_size}) with data.grad_accum ({accum}) changes its global batch on every "
        f"resize: micro_batch_size x grad_accum x DP = {d.micro_batch_size} x {accum} x {dps[0]} = {low} sequences "
        f"at DP {dps[0]} but {high} at DP {dps[-1]}{tp_note}. Set data.global_batch_size instead (grad_accum is then "
        f"picked per size). {_fix(units, high, job)} Or set data.allow_variable_global_batch: true to accept a "
        "global batch that follows the cluster"
    )


def _fix(units: list[int], near: int, job: JobSpec) -> str:
    """``use a multiple of L (e.g. a or b)``, or why no practical global batch fits every size."""
    unit = 1
    for u in units:
        unit = math.lcm(unit, u)
        if unit > MAX_SUGGESTED_BATCH:
            step = job.scaling.workers_per_node
            return (
                f"No global batch up to {MAX_SUGGESTED_BATCH:,} sequences divides at every size of this elastic range: "
                f"narrow it (scaling.min_workers..max_workers){'' if step else ' or set scaling.workers_per_node so it moves in whole nodes'}."
            )
    below = near // unit * unit
    near_values = [x for x in (below, below + unit) if x > 0 and x != near] or [unit]
    return (
        f"Every size of the elastic range needs a multiple of {unit:,} "
        f"(the least common multiple of {_listing([str(u) for u in units])}): use {' or '.join(map(str, near_values))}."
    )


def _listing(items: list[str]) -> str:
    """``a, b and c`` with at most :data:`_SHOWN` items, then ``... and N more``."""
    if len(items) > _SHOWN:
        return ", ".join(items[:_SHOWN]) + f" and {len(items) - _SHOWN:,} more"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def describe_batch(job: JobSpec) -> str:
    """``raytrn validate``'s batch line: micro x grad_accum x DP at each size (a range when there are many)."""
    d = job.data
    sizes = data_parallel_sizes(job)
    parts = []
    for n, dp in sizes.items():
        total = global_batch(job, dp)
        accum = total // (d.micro_batch_size * dp)
        parts.append(f"{n} worker{'s' * (n > 1)}: {d.micro_batch_size} x {accum} x {dp} (DP) = {total} sequences/step")
    if len(parts) > _SHOWN:
        parts = [*parts[: _SHOWN // 2], f"... {len(parts) - _SHOWN} more sizes ...", *parts[-_SHOWN // 2 :]]
    return f"batch: {', '.join(parts)} of {d.seq_len} tokens"
