"""Pre-flight checks shared by ``raytrn validate`` and ``raytrn train``: fail before anything starts."""

from __future__ import annotations

from raytrn.backends import get_backend
from raytrn.backends.nxd import check_parallel, require_nxd
from raytrn.config import JobSpec
from raytrn.data.manifest import Manifest, load_manifest
from raytrn.errors import BackendUnavailableError, DataError
from raytrn.models import model_stats
from raytrn.train.sizes import check_global_batch, data_parallel_sizes, describe_batch, describe_sizes, global_batch


def check_spec(job: JobSpec) -> list[str]:
    """The checks of the spec itself that ``raytrn validate``, ``train`` and ``precompile`` all run: the
    parallel layout at every world size, then a global batch that is whole and constant at every size.
    Raises ConfigError; returns info lines."""
    lines = check_parallel(job, require_installed=False)
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
        require_nxd(job)
    except BackendUnavailableError as e:  # a trn job validated on a laptop: fine, noted
        lines.append(f"note: {e} (checked again when the job starts)")
    lines.append(f"model: llama, {model_stats(job.model, job.data.seq_len).describe()}")
    lines.append(describe_sizes(job))
    # One batch per model replica: data-parallel size = workers / tensor-parallel size.
    lines.append(describe_batch(job))
    if not data:
        lines.append(f"data: not checked (--no-data): {job.data.manifest}")
        return lines
    manifest = check_data(job)
    lines.append(
        f"data: {manifest.num_rows:,} rows x {manifest.row_len} tokens in {len(manifest.shards)} shard(s), "
        f"tokenizer vocab {manifest.tokenizer.vocab_size:,} (model vocab {job.model.vocab_size:,})"
    )
    return lines


def check_data(job: JobSpec) -> Manifest:
    """Load the job's manifest and check it fits the model and the batch shape."""
    where = f"{job.source}: data.manifest"
    manifest = load_manifest(job.data.manifest)
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
    largest = max(global_batch(job, dp) for dp in set(data_parallel_sizes(job).values()))
    if manifest.num_rows < largest:
        raise DataError(
            f"{where}: the dataset has {manifest.num_rows:,} rows, fewer than one global batch ({largest:,} sequences "
            f"per step at {job.scaling.max_size} workers): prepare more data, or lower data.global_batch_size / "
            "data.micro_batch_size"
        )
    return manifest
