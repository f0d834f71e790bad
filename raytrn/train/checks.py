"""Pre-flight checks shared by ``raytrn validate`` and ``raytrn train``: fail before anything starts."""

from __future__ import annotations

from raytrn import storage
from raytrn.backends import get_backend
from raytrn.config import JobSpec
from raytrn.config.sizes import (
    check_global_batch,
    data_parallel_sizes,
    describe_batch,
    describe_sizes,
    global_batch,
    world_sizes,
)
from raytrn.data.manifest import Manifest, load_manifest
from raytrn.data.verify import verify_dataset
from raytrn.errors import BackendUnavailableError, ConfigError, DataError
from raytrn.models import model_stats
from raytrn.models.hf import check_config


def check_spec(job: JobSpec) -> list[str]:
    """The checks of the spec itself that ``raytrn validate``, ``train`` and ``precompile`` all run: the
    parallel layout at every world size (:func:`check_parallel`, or the backend's own rules where it has them: the
    frozen XLA path), then a global batch that is whole and constant at every size.
    Raises ConfigError; returns info lines."""
    own = get_backend(job.scaling.accelerator).check_layout(job)
    lines = own if own is not None else check_parallel(job)
    check_global_batch(job)
    return lines


def check_job(job: JobSpec, *, data: bool = True) -> list[str]:
    """Check everything that can be checked without Ray; return human-readable findings.

    A backend that cannot run on this machine is a note, not an error: a trn job is validated on a
    laptop before it is submitted. ``data=False`` skips the dataset (its path may exist only on the
    cluster).
    """
    lines = check_spec(job)
    try:
        backend = get_backend(job.scaling.accelerator)
        lines += [f"warning: {w}" for w in backend.ignored_settings(job)]
        lines += [f"note: {n}" for n in backend.check(job)]
        backend.check_installed(job)
    except BackendUnavailableError as e:  # a trn job validated on a laptop: fine, noted
        lines.append(f"note: {e} (checked again when the job starts)")
    lines.append(f"model: {job.model.family}, {model_stats(job.model, job.data.seq_len).describe()}")
    lines.append(describe_sizes(job))
    # One batch per model replica: data-parallel size = workers / tensor-parallel size.
    lines.append(describe_batch(job))
    if not data:
        lines.append(f"data: not checked (--no-data): {job.data.manifest}")
        return lines
    check_init_from(job)
    manifest = check_data(job)
    lines.append(
        f"data: {manifest.num_rows:,} rows x {manifest.row_len} tokens in {len(manifest.shards)} shard(s) "
        f"({manifest.kind}{', loss on completions only' if manifest.instruction else ''}), "
        f"tokenizer vocab {manifest.tokenizer.vocab_size:,} (model vocab {job.model.vocab_size:,})"
    )
    from raytrn.train.evaluate import validation_set  # torch + Ray Data (~3.6 s, measured): validate needs neither

    val = validation_set(job, manifest)
    if val is not None:
        lines.append(
            f"validation: {val.num_rows:,} rows ({val.manifest_path}), val_loss every "
            f"{job.run.eval_every or job.run.max_steps} steps over up to {job.run.eval_batches} global batches"
        )
    return lines


def check_init_from(job: JobSpec) -> None:
    """A remote ``model.init_from``'s config.json against the job's model (local ones were read when the job loaded)."""
    if job.model.init_from and storage.is_remote(job.model.init_from):
        check_config(job.model, job.model.init_from, where=job.source)


def check_data(job: JobSpec) -> Manifest:
    """Load the job's manifest and check it fits the model and the batch shape."""
    where = f"{job.source}: data.manifest"
    manifest = load_manifest(job.data.manifest)
    verify_dataset(manifest)  # the files are what the manifest recorded (sizes, footers, tokenizer hash)
    if (val := manifest.validation_path()) is not None:
        verify_dataset(load_manifest(val))
    if manifest.seq_len != job.data.seq_len:
        raise DataError(
            f"{where}: the dataset was packed with seq_len={manifest.seq_len} but data.seq_len={job.data.seq_len}; "
            f"set data.seq_len: {manifest.seq_len}, or re-run `raytrn data prepare --seq-len {job.data.seq_len}`"
        )
    vocab = manifest.tokenizer.vocab_size
    if vocab > job.model.vocab_size:
        raise DataError(
            f"{where}: the dataset's tokenizer has {vocab:,} tokens but model.vocab_size={job.model.vocab_size:,}; "
            f"token ids would fall outside the embedding: set model.vocab_size >= {vocab}, or prepare the data "
            f"with --vocab-size {job.model.vocab_size}"
        )
    if job.data.packing is not None:
        if not manifest.instruction:
            raise DataError(
                f"{where}: data.packing applies to instruction data (prompt-completion, chat); {job.data.manifest} is "
                "text, which is always packed: drop data.packing"
            )
        if job.data.packing != manifest.packing:
            raise DataError(
                f"{where}: data.packing is {job.data.packing} but the dataset was prepared "
                f"{'with' if manifest.packing else 'without'} packing; prepare it again "
                f"{'without --no-packing' if job.data.packing else 'with --no-packing'}, or drop data.packing"
            )
    if job.model.init_from:
        _check_tokenizer_of(job, manifest, where)
    largest = max(global_batch(job, dp) for dp in set(data_parallel_sizes(job).values()))
    if manifest.num_rows < largest:
        raise DataError(
            f"{where}: the dataset has {manifest.num_rows:,} rows, fewer than one global batch ({largest:,} sequences "
            f"per step at {job.scaling.max_size} workers): prepare more data, or lower data.global_batch_size / "
            "data.micro_batch_size"
        )
    return manifest


def _check_tokenizer_of(job: JobSpec, manifest: Manifest, where: str) -> None:
    """A dataset for a model from ``model.init_from`` must be tokenized with that model's tokenizer (when the
    checkpoint has one): the same ``tokenizer.json``."""
    import hashlib

    theirs = storage.read_text(storage.join(str(job.model.init_from), "tokenizer.json"))
    if theirs is None:
        return  # a checkpoint without its tokenizer: only the vocabulary size is checked (above)
    if hashlib.sha256(theirs.encode()).hexdigest() != manifest.tokenizer.sha256:
        raise DataError(
            f"{where}: the dataset was tokenized with another tokenizer than model.init_from's "
            f"({job.model.init_from}/tokenizer.json): its token ids would mean other words to the model; prepare it "
            f"with `raytrn data prepare --tokenizer {job.model.init_from}`"
        )


# -- the parallel layout ---------------------------------------------------------------------------------------------


def check_parallel(job: JobSpec) -> list[str]:
    """Validate the ``parallel`` section for the torch.distributed layouts (cpu, cuda, neuron: DDP or FSDP2, tensor
    parallel over DTensor, activation checkpointing) at every world size; ConfigError (field, values, fix), else
    info lines for ``raytrn validate``."""
    p, where = job.parallel, job.source
    tp = p.tensor_parallel_size
    _check_features(job)
    _check_model_dims(job)
    sizes = world_sizes(job)
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
    _check_expert_parallel(job, sizes)
    return _describe_layout(job, sizes)


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
    bad = [n for n in sizes if n % (tp * ep)]
    if bad:
        raise ConfigError(
            f"{where}: {', '.join(map(str, bad))} worker(s) (a world size the job can take) is not a multiple of "
            f"TP {tp} x parallel.expert_parallel_size {ep} = {tp * ep}: the experts are spread over EP "
            f"data-parallel ranks (workers / TP = EP x the rest); make scaling.min_workers and max_workers "
            f"multiples of {tp * ep}, or lower expert_parallel_size"
        )


def _check_features(job: JobSpec) -> None:
    """torch.distributed does DDP/FSDP, tensor parallel and activation checkpointing; ZeRO-1 and sequence parallel
    are neuronx-distributed's (the frozen XLA path)."""
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
        return []
    tp = p.tensor_parallel_size
    parts = [f"{p.data_parallel} over {'/'.join(str(n // tp) for n in sizes)} data-parallel rank(s)"]
    if tp > 1:
        parts.append(f"tensor parallel {tp} (DTensor)")
    if p.expert_parallel_size > 1:
        per = (job.model.num_experts or 0) // p.expert_parallel_size
        parts.append(f"expert parallel {p.expert_parallel_size} ({per} experts a rank, all-to-all)")
    if p.activation_checkpointing != "none":
        parts.append(f"{p.activation_checkpointing} activation checkpointing")
    return [f"parallel: {', '.join(parts)}"]
