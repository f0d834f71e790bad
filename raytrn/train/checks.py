"""Pre-flight checks shared by ``raytrn validate`` and ``raytrn train``: fail before anything starts."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from raytrn import storage
from raytrn.backends import Backend, get_backend
from raytrn.config import JobSpec
from raytrn.config.layout import check_parallel as check_parallel  # re-exported: validate's callers import it here
from raytrn.config.layout import check_recovery
from raytrn.config.sizes import (
    check_global_batch,
    data_parallel_sizes,
    describe_batch,
    describe_sizes,
    global_batch,
)
from raytrn.data.manifest import Manifest, load_manifest
from raytrn.data.verify import verify_dataset
from raytrn.data.vocab import differences, same_encoding
from raytrn.errors import BackendUnavailableError, DataError, RaytrnError
from raytrn.models import model_stats
from raytrn.models.hf import check_config


def check_spec(job: JobSpec) -> list[str]:
    """The checks of the spec itself that ``raytrn validate``, ``train`` and ``precompile`` all run: the
    parallel layout at every world size (:func:`check_parallel`, or the backend's own rules where it has them: the
    frozen XLA path), then a global batch that is whole and constant at every size.
    Raises ConfigError; returns info lines."""
    notes = check_recovery(job)
    own = get_backend(job.scaling.accelerator).check_layout(job)
    lines = own if own is not None else check_parallel(job)
    check_global_batch(job)
    return lines + notes


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
    checkpoint has one): one that gives the same ids (:mod:`raytrn.data.vocab`: the vocabulary, merges, added
    tokens, normalizer and pre-tokenizer; not the file's bytes)."""
    theirs = storage.read_text(storage.join(str(job.model.init_from), "tokenizer.json"))
    if theirs is None:
        return  # a checkpoint without its tokenizer: only the vocabulary size is checked (above)
    ours = storage.read_text(manifest.tokenizer_path) or ""
    if not same_encoding(ours, theirs):
        raise DataError(
            f"{where}: the dataset was tokenized with another tokenizer than model.init_from's "
            f"({job.model.init_from}/tokenizer.json; they differ in {', '.join(differences(ours, theirs))}): its token "
            f"ids would mean other words to the model; prepare it with `raytrn data prepare --tokenizer "
            f"{job.model.init_from}`"
        )


# -- the parallel layout ---------------------------------------------------------------------------------------------


def validation_set(job: JobSpec, manifest: Manifest) -> Manifest | None:
    """The job's validation set (``data.validation``, else the split prepared with its dataset), checked against the
    training set and the batch: DataError for another seq_len or tokenizer, or fewer rows than one global batch."""
    where = f"{job.source}: data.validation"
    path = job.data.validation
    if path == "none":
        val = None
    else:
        path = path or manifest.validation_path()
        val = load_manifest(path) if path else None
    if val is None:
        if job.tracking.registers == "best":
            raise DataError(
                f"{job.source}: tracking.register: best registers the checkpoint of the lowest val_loss, but there is "
                "no validation set: prepare the data with --validation-fraction F, set data.validation, or use "
                "register: last"
            )
        if job.run.eval_every is not None:
            raise DataError(
                f"{job.source}: run.eval_every is set but there is no validation set: prepare the data with "
                "--validation-fraction F, or set data.validation to a prepared dataset"
            )
        return None
    if val.seq_len != manifest.seq_len:
        raise DataError(f"{where}: {val.manifest_path} has seq_len {val.seq_len}, the training set {manifest.seq_len}")
    if val.tokenizer.sha256 != manifest.tokenizer.sha256 and not same_encoding(
        storage.read_text(val.tokenizer_path) or "", storage.read_text(manifest.tokenizer_path) or ""
    ):
        raise DataError(
            f"{where}: {val.manifest_path} was made with another tokenizer than the training set; prepare both with the "
            "same --tokenizer"
        )
    if val.instruction != manifest.instruction:
        raise DataError(f"{where}: {val.manifest_path} is {val.kind} data, the training set {manifest.kind}")
    largest = max(global_batch(job, dp) for dp in set(data_parallel_sizes(job).values()))
    if val.num_rows < largest:
        raise DataError(
            f"{where}: the validation set has {val.num_rows:,} rows, fewer than one global batch ({largest:,} "
            "sequences): an evaluation needs at least one; prepare a larger validation split or lower "
            "data.global_batch_size"
        )
    return val


#: Resources a local Ray finds by itself (``ray.init`` counts the CPUs and GPUs, sizes the memory).
_DETECTED = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
#: Where Ray looks for ``neuron-ls``: without it a local Ray has no ``neuron_cores``
#: (ray/_private/accelerators/neuron.py, NeuronAcceleratorManager.get_current_node_num_accelerators).
NEURON_TOOLS = "/opt/aws/neuron/bin"


def embedded_ray_lacks(
    job: JobSpec, backend: Backend, *, environ: Mapping[str, str] = os.environ, neuron_tools: str = NEURON_TOOLS
) -> dict[str, float]:
    """The workers' resources that a local Ray started here would surely have none of, known before starting it
    (``{name: 0}``): ``neuron_cores`` without the Neuron tools Ray detects them with, any custom resource (raytrn
    starts a local Ray with none). Empty when ``RAY_OVERRIDE_RESOURCES`` says otherwise; the rest is checked once the
    Ray is up (:func:`check_local_resources` with ``ray.cluster_resources()``)."""
    if environ.get("RAY_OVERRIDE_RESOURCES"):
        return {}
    lacks = {}
    for name, amount in backend.worker_resources(job).items():
        if amount <= 0 or name in _DETECTED:
            continue
        if name == "neuron_cores" and sys.platform.startswith("linux") and os.path.isdir(neuron_tools):
            continue
        lacks[name] = 0.0
    return lacks


def check_local_resources(job: JobSpec, backend: Backend, have: Mapping[str, float], *, partial: bool = False) -> None:
    """On a local Ray nothing can scale up: refuse a job whose ``scaling.min_workers`` need more of a resource than
    ``have`` holds (a resource it does not name: none), rather than wait forever for it. ``partial``: ``have`` names
    only what is known (:func:`embedded_ray_lacks`); the resources it does not name are not checked."""
    for name, amount in backend.worker_resources(job).items():
        need = amount * job.scaling.min_workers
        if amount > 0 and (name in have or not partial) and have.get(name, 0) < need:
            raise RaytrnError(
                f"{job.source}: scaling needs {need:g} '{name}' ({job.scaling.min_workers} workers x {amount:g}) but "
                f"this local Ray has {have.get(name, 0):g}; lower scaling.min_workers or "
                f"scaling.resources_per_worker, or run on a cluster (set RAY_ADDRESS or use `ray job submit`)"
            )
