"""The ``parallel`` section's rules for the torch.distributed layouts (DDP, FSDP2, HSDP, tensor, expert, context and
pipeline parallelism, activation checkpointing) at every world size a job can take: pure (no torch), so ``raytrn
validate`` and ``raytrn estimate`` check a job on a laptop. The frozen XLA path has its own (:mod:`raytrn.xla.nxd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrn.config.sizes import data_parallel_size, hsdp_shard_size, padded_length, world_sizes
from raytrn.config.stages import SCHEDULES, ZERO_BUBBLE
from raytrn.errors import ConfigError

if TYPE_CHECKING:
    from raytrn.config import JobSpec


def check_parallel(job: JobSpec) -> list[str]:
    """Validate the ``parallel`` section for the torch.distributed layouts (cpu, cuda, neuron: DDP or FSDP2, tensor
    parallel over DTensor, activation checkpointing) at every world size; ConfigError (field, values, fix), else
    info lines for ``raytrn validate``."""
    p, where = job.parallel, job.source
    tp = p.tensor_parallel_size
    _check_features(job)
    _check_model_dims(job)
    sizes = world_sizes(job)
    _check_context(job, sizes)
    _check_pipeline(job, sizes)
    bad = [n for n in sizes if n % tp]
    if bad:
        step = job.scaling.workers_per_node
        raise ConfigError(
            f"{where}: parallel.tensor_parallel_size ({tp}) does not divide "
            f"{', '.join(map(str, bad))} worker(s), a world size the job can take "
            f"(scaling.min_workers={job.scaling.min_workers}, max_workers={job.scaling.max_workers}"
            f"{f', workers_per_node={step}' if step else ''}); every world size must hold whole tensor-parallel "
            f"groups: make min_workers, max_workers{' and workers_per_node' if step else ''} multiples of {tp}"
        )
    _check_hsdp(job, sizes)
    _check_expert_parallel(job, sizes)
    _check_live(job, sizes)
    return _describe_layout(job, sizes)


def _check_context(job: JobSpec, sizes: list[int]) -> None:
    """Context parallelism (:mod:`raytrn.models.context_parallel`): dense models, at least one token a chunk
    (``2 x CP`` chunks a row), whole ``CP x TP`` groups at every world size (inside one hsdp shard group), and what
    this version does not run with it refused with the fix."""
    p, m, where = job.parallel, job.model, job.source
    cp, tp = p.context_parallel_size, p.tensor_parallel_size
    if cp == 1:
        return
    off = "set parallel.context_parallel_size: 1"
    refusals = [
        (m.is_moe, f"a MoE model ({m.family}): its load-balancing loss sums the routing over every token of a "
                   f"micro-batch, which no rank of a context-parallel group sees whole (not yet); {off}"),
        (p.pipeline_parallel_size > 1, f"with parallel.pipeline_parallel_size {p.pipeline_parallel_size}: a "
                                       "pipeline's stages passing sequence shards is not built yet; "
                                       f"{off} or pipeline_parallel_size: 1"),
        (job.scaling.recovery == "live", f"with scaling.recovery: live (its replicas are one worker each); {off} "
                                         "or scaling.recovery: restart"),
        (job.data.seq_len < 2 * cp, f"data.seq_len {job.data.seq_len}: a row is cut into 2 x CP = {2 * cp} chunks "
                                    f"of one token at least; lower context_parallel_size to {job.data.seq_len // 2} "
                                    "at most"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where}: parallel.context_parallel_size {cp} cannot train {why}")
    _whole_blocks(job, sizes, cp * tp, f"parallel.context_parallel_size {cp} x TP {tp} = {cp * tp}",
                  "every world size holds whole context-parallel groups of whole tensor-parallel groups")  # fmt: skip
    shard = hsdp_shard_size(job)
    if shard and shard % (cp * tp):
        named = f"parallel.hsdp_shard_size {shard}" if p.hsdp_shard_size else f"scaling.workers_per_node {shard}"
        raise ConfigError(
            f"{where}: {named} (hsdp's shard group) is not a multiple of parallel.context_parallel_size {cp} x TP "
            f"{tp}: a context-parallel group lies inside one shard group (FSDP shards over its data and context "
            f"ranks); use a multiple of {cp * tp}"
        )


def refuse_on_xla(job: JobSpec) -> None:
    """ConfigError when ``job`` asks the frozen XLA path (neuron-xla, xla-cpu) for what only the torch.distributed
    backends run: context parallelism."""
    cp = job.parallel.context_parallel_size
    if cp > 1:
        raise ConfigError(
            f"{job.source}: parallel.context_parallel_size {cp} is not available on scaling.accelerator "
            f"{job.scaling.accelerator} (the XLA path, frozen): context parallelism runs on cpu, cuda and neuron "
            "(TorchNeuron); set context_parallel_size: 1 or use one of those"
        )


def _whole_blocks(job: JobSpec, sizes: list[int], block: int, named: str, why: str, fix: str = "") -> None:
    """ConfigError naming the world sizes the job can take that are not a multiple of ``block`` (``named``: the
    settings it is the product of; ``why`` it must divide them)."""
    bad = [n for n in sizes if n % block]
    if bad:
        raise ConfigError(
            f"{job.source}: {', '.join(map(str, bad))} worker(s) (a world size the job can take) is not a multiple of "
            f"{named}: {why}; make scaling.min_workers and max_workers multiples of {block}{fix}"
        )


def _check_pipeline(job: JobSpec, sizes: list[int]) -> None:
    """Pipeline parallelism (:mod:`raytrn.models.pipeline`): models with untied embeddings, enough decoder
    layers for the stages, whole pipelines at every world size, enough micro-batches to fill the pipeline, and what
    this version's pipelined loop does not run yet refused with the fix."""
    p, m, where = job.parallel, job.model, job.source
    pp = p.pipeline_parallel_size
    if pp == 1:
        if "pipeline_schedule" in p.model_fields_set and p.pipeline_schedule != "1f1b":
            raise ConfigError(
                f"{where}: parallel.pipeline_schedule {p.pipeline_schedule} with pipeline_parallel_size 1: it "
                "schedules a pipeline's stages; set parallel.pipeline_parallel_size, or remove it"
            )
        return
    per_rank = SCHEDULES[p.pipeline_schedule][1]
    stages = pp * per_rank
    fix = "set parallel.pipeline_parallel_size: 1, or"
    refusals = [
        (m.tie_word_embeddings, "tied input and output embeddings (model.tie_word_embeddings): the embedding is on "
                                "the first stage and the head on the last; set model.tie_word_embeddings: false"),
        (m.num_layers < stages, f"{m.num_layers} decoder layers for {stages} stages ({pp} ranks x {per_rank} of "
                                f"{p.pipeline_schedule}): a stage holds one layer at least; lower the stages"),
        (job.scaling.recovery == "live", "scaling.recovery: live (whole replicas of one worker)"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where}: parallel.pipeline_parallel_size {pp} cannot train {why}; {fix.rstrip(', or')}")
    tp, ep = p.tensor_parallel_size, p.expert_parallel_size
    _whole_blocks(job, sizes, pp * tp * ep,
                  f"parallel.pipeline_parallel_size {pp} x TP {tp}" + (f" x EP {ep}" if ep > 1 else ""),
                  "every world size holds whole pipelines" + (" (a stage's experts over EP of its data-parallel "
                                                              "ranks)" if ep > 1 else ""))  # fmt: skip
    for n in sizes:
        dp = n // (pp * tp)
        if p.data_parallel == "ddp" and dp > 1:
            raise ConfigError(
                f"{where}: parallel.pipeline_parallel_size {pp} with data_parallel: ddp at {n} workers ({dp} "
                "replicas): pipeline stages replicate with FSDP2; set parallel.data_parallel: fsdp (or hsdp)"
            )
        micro = job.data.grad_accum_for(dp)
        if micro < stages or micro % pp:
            raise ConfigError(
                f"{where}: {micro} micro-batch(es) a step at {n} workers (data.grad_accum per data-parallel rank: "
                f"the pipeline's micro-batches) cannot fill {stages} pipeline stages ({p.pipeline_schedule}): "
                f"they must be at least {stages} and a multiple of {pp}; raise data.grad_accum (or "
                "data.global_batch_size)"
            )


def _check_hsdp(job: JobSpec, sizes: list[int]) -> None:
    """hsdp's shard groups: a size (``parallel.hsdp_shard_size``, else one node), whole tensor-parallel groups, a
    divisor of every world size (the groups replicate), and with expert parallelism whole EP groups (the experts'
    all-to-all stays inside a shard group)."""
    p, where = job.parallel, job.source
    if p.data_parallel != "hsdp":
        return
    tp, ep = p.tensor_parallel_size, p.expert_parallel_size
    shard = hsdp_shard_size(job)
    if shard is None:
        raise ConfigError(
            f"{where}: parallel.data_parallel: hsdp needs the size of its shard groups: set parallel.hsdp_shard_size "
            "(workers FSDP shards over; the groups replicate), or scaling.workers_per_node (the default: one node)"
        )
    named = f"parallel.hsdp_shard_size {shard}" if p.hsdp_shard_size else f"scaling.workers_per_node {shard}"
    if shard % tp:
        raise ConfigError(
            f"{where}: {named} (hsdp's shard group) is not a multiple of parallel.tensor_parallel_size {tp}: a shard "
            f"group holds whole tensor-parallel groups; use a multiple of {tp}"
        )
    pp = p.pipeline_parallel_size  # a pipeline's stages each shard over their own groups
    _whole_blocks(job, sizes, pp * shard,
                  f"{named} (hsdp's shard group)" + (f" x parallel.pipeline_parallel_size {pp}" if pp > 1 else ""),
                  "the workers form whole shard groups that replicate" + (", in each stage" if pp > 1 else ""),
                  ", or change the shard size")  # fmt: skip
    if ep > 1 and (shard // tp) % ep:
        raise ConfigError(
            f"{where}: parallel.expert_parallel_size {ep} does not divide the {shard // tp} data-parallel ranks of "
            f"hsdp's shard group ({named} / TP {tp}): under hsdp an expert-parallel group lies inside one shard "
            f"group; make the shard size a multiple of TP x EP = {tp * ep}"
        )


def check_recovery(job: JobSpec) -> list[str]:
    """``scaling.recovery: live`` on any accelerator (the frozen XLA path's own layout rules never reach
    :func:`_check_live`): on cpu only in this version; the step-end phases the live loop does not run, as notes."""
    s, where = job.scaling, job.source
    if s.recovery != "live":
        return []
    if s.accelerator != "cpu":
        raise ConfigError(
            f"{where}: scaling.recovery: live runs on accelerator cpu (gloo process groups) in this version, not "
            f"{s.accelerator}: set scaling.recovery: restart, or train on cpu"
        )
    return [
        "note: scaling.recovery: live: a lost replica's survivors train on and a returning node joins them; its loop "
        "runs the hang watchdog, and its rank 0 alone takes the in-memory snapshots (a restart after every replica "
        "was lost resumes from them); a replica with a preemption notice leaves at a step "
        "boundary and the others train on; a non-finite rollback loads the checkpoint into the live replicas in "
        "place (docs/elasticity.md 'Live recovery')"
    ]


def _check_live(job: JobSpec, sizes: list[int]) -> None:
    """``scaling.recovery: live`` keeps whole model replicas training when one is lost: today one worker a replica
    (hsdp with shard groups of one worker: every worker holds the whole model), on gloo, at one size (a lost
    replica's place waits for capacity while the others train; docs/elasticity.md)."""
    p, s, where = job.parallel, job.scaling, job.source
    if s.recovery != "live":
        return
    fix = "set scaling.recovery: restart, or"
    shard = hsdp_shard_size(job)
    if p.data_parallel != "hsdp" or shard != 1:
        raise ConfigError(
            f"{where}: scaling.recovery: live needs whole model replicas of one worker each: {fix} set "
            "parallel.data_parallel: hsdp with parallel.hsdp_shard_size: 1 "
            f"(now data_parallel: {p.data_parallel}{f', shard groups of {shard}' if shard else ''})"
        )
    if p.tensor_parallel_size > 1 or p.expert_parallel_size > 1:
        raise ConfigError(
            f"{where}: scaling.recovery: live trains replicas of one worker: tensor_parallel_size "
            f"({p.tensor_parallel_size}) and expert_parallel_size ({p.expert_parallel_size}) must be 1; {fix} drop them"
        )
    if len(sizes) > 1:
        raise ConfigError(
            f"{where}: scaling.recovery: live trains at one size (min_workers {s.min_workers}, max_workers "
            f"{s.max_workers}): a lost replica's place waits for capacity while the others train and a returning "
            f"node takes it; {fix} set min_workers = max_workers"
        )


def _check_expert_parallel(job: JobSpec, sizes: list[int]) -> None:
    """Expert parallelism takes its EP ranks from the data-parallel ones: ``workers / TP`` must be a multiple of EP
    at every size; an elastic job resizes by whole nodes (``scaling.workers_per_node``), so that a lost node takes
    whole EP groups with it, never half of every one."""
    p, s, where = job.parallel, job.scaling, job.source
    ep, tp = p.expert_parallel_size, p.tensor_parallel_size
    if ep == 1:
        return
    if s.elastic and not s.workers_per_node:
        raise ConfigError(
            f"{where}: parallel.expert_parallel_size {ep} in an elastic job (scaling.min_workers {s.min_workers}, "
            f"max_workers {s.max_workers}) needs scaling.workers_per_node: it resizes by whole nodes; set it to the "
            "workers one node holds (a multiple of TP x EP keeps every all-to-all inside a node)"
        )
    _whole_blocks(job, sizes, tp * ep, f"TP {tp} x parallel.expert_parallel_size {ep} = {tp * ep}",
                  "the experts are spread over EP data-parallel ranks (workers / TP = EP x the rest)",
                  ", or lower expert_parallel_size")  # fmt: skip


def refuse_nxd_only(job: JobSpec) -> None:
    """ConfigError when ``job`` asks for ZeRO-1 or sequence parallelism, neuronx-distributed's (neuron-xla) alone,
    on another accelerator."""
    acc, p, where = job.scaling.accelerator, job.parallel, job.source
    nxd_only = [
        name
        for name, on in (("parallel.zero1=true", p.zero1), ("parallel.sequence_parallel=true", p.sequence_parallel))
        if on
    ]
    if nxd_only:
        fix = "use parallel.data_parallel: fsdp, which shards parameters, gradients and optimizer state"
        raise ConfigError(
            f"{where}: {' and '.join(nxd_only)} {'is' if len(nxd_only) == 1 else 'are'} neuronx-distributed's "
            f"(scaling.accelerator: neuron-xla, the XLA path); on {acc} {fix if p.zero1 else 'remove it'}"
            + ("" if not p.sequence_parallel else " (sequence parallelism is not supported on torch.distributed yet)")
        )


def _check_features(job: JobSpec) -> None:
    """torch.distributed does DDP/FSDP, tensor parallel and activation checkpointing; ZeRO-1 and sequence parallel
    are neuronx-distributed's (the frozen XLA path)."""
    p, where = job.parallel, job.source
    refuse_nxd_only(job)
    if p.tensor_parallel_size > 1 and p.data_parallel == "ddp":
        raise ConfigError(
            f"{where}: parallel.tensor_parallel_size={p.tensor_parallel_size} needs parallel.data_parallel: fsdp "
            "(DDP cannot hold tensor-parallel (DTensor) parameters); set data_parallel: fsdp, which also shards "
            "the rest of the state over the data-parallel ranks"
        )


#: Why each model dimension must divide by the tensor-parallel size (DTensor's plan: q/k/v and o by heads, the MLP
#: by intermediate, embedding and head by vocabulary).
_SPLIT_ALONG = {
    "num_attention_heads": "each rank computes num_attention_heads / TP query heads",
    "num_key_value_heads": "each rank computes num_key_value_heads / TP kv heads (GQA groups stay whole)",
    "intermediate_size": "the MLP gate/up/down projections are split along it",
    "vocab_size": "the embedding and the output head are split by vocabulary rows",
}


def _check_model_dims(job: JobSpec) -> None:
    m, tp = job.model, job.parallel.tensor_parallel_size
    if tp == 1:
        return
    dims = {
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
    }
    problems = []
    for field, value in dims.items():
        if value % tp == 0:
            continue
        why = _SPLIT_ALONG[field]
        if field == "vocab_size":
            why += f"; pad it to {-(-value // tp) * tp} (rows past the tokenizer's vocabulary are never used)"
        problems.append(f"model.{field} ({value}) % {tp} = {value % tp}: {why}")
    if problems:
        valid = [d for d in range(1, m.num_attention_heads + 1) if all(v % d == 0 for v in dims.values())]
        raise ConfigError(
            f"{job.source}: parallel.tensor_parallel_size ({tp}) must divide the model's sharded dimensions:\n  "
            + "\n  ".join(problems)
            + f"\n  tensor_parallel_size values this model allows: {', '.join(map(str, valid))}."
        )


def _describe_layout(job: JobSpec, sizes: list[int]) -> list[str]:
    """One line on the torch.distributed layout (nothing for plain DDP)."""
    p = job.parallel
    if p.data_parallel == "ddp" and p.tensor_parallel_size == 1 and p.activation_checkpointing == "none":
        if p.pipeline_parallel_size == 1 and p.context_parallel_size == 1:
            return []
    tp, shard = p.tensor_parallel_size, hsdp_shard_size(job)
    parts = [f"{p.data_parallel} over {'/'.join(str(data_parallel_size(job, n)) for n in sizes)} data-parallel rank(s)"]
    if shard:
        replicas = "/".join(str(n // (shard * p.pipeline_parallel_size)) for n in sizes)  # a stage's
        parts[0] += f" (sharded over {shard // tp} in each of {replicas} replicated group(s) of {shard} workers)"
    if p.context_parallel_size > 1:
        parts.append(_describe_context(job, sizes))
    if tp > 1:
        parts.append(f"tensor parallel {tp} (DTensor)")
    if p.expert_parallel_size > 1:
        per = (job.model.num_experts or 0) // p.expert_parallel_size
        parts.append(f"expert parallel {p.expert_parallel_size} ({per} experts a rank, all-to-all)")
    if p.pipeline_parallel_size > 1:
        from raytrn.config.stages import stage_layers

        pp, per_rank = p.pipeline_parallel_size, SCHEDULES[p.pipeline_schedule][1]
        layers = "/".join(str(len(r)) for r in stage_layers(job.model.num_layers, pp * per_rank))
        sharded = p.data_parallel != "ddp" and any(data_parallel_size(job, n) > 1 for n in sizes)
        # a zero-bubble schedule's split weight-gradient pass needs the stages gathered (raytrn.train.pipelined)
        kept = sharded and p.reshard_after_forward and p.pipeline_schedule in ZERO_BUBBLE
        note = "; parameters gathered from forward to backward: reshard_after_forward ignored" if kept else ""
        parts.append(f"pipeline parallel {pp} ({p.pipeline_schedule}, {pp * per_rank} stages of {layers} layers{note})")
    if p.activation_checkpointing != "none":
        parts.append(f"{p.activation_checkpointing} activation checkpointing")
    return [f"parallel: {', '.join(parts)}"]


def _describe_context(job: JobSpec, sizes: list[int]) -> str:
    """``context parallel 2 (ring attention, 4 chunks of 10 tokens a row, 3 of them padding)``, and the ranks FSDP
    shards over (data x context)."""
    p, seq = job.parallel, job.data.seq_len
    cp = p.context_parallel_size
    padded = padded_length(seq, cp)
    pad = f", {padded - seq} of them padding" if padded > seq else ""
    line = f"context parallel {cp} (ring attention, {2 * cp} chunks of {padded // (2 * cp)} tokens a row{pad}"
    shard = hsdp_shard_size(job)
    if shard:
        line += f"; FSDP shards over the {shard // p.tensor_parallel_size} data x context ranks of a shard group"
    elif p.data_parallel == "fsdp":
        line += f"; FSDP shards over {'/'.join(str(n // p.tensor_parallel_size) for n in sizes)} data x context ranks"
    return line + ")"
