"""A committed checkpoint as a Hugging Face model directory, in one process, off the training loop.

The job's model is built on the CPU as training built it (``model.init_from``'s weights first, LoRA's adapters on
top), the checkpoint's model state is read into it through DCP (resharded from whatever layout wrote it: only the
model's tensors are read, not the optimizer's), and it is written as the final export is (:mod:`raytrn.tracking.export`:
safetensors, config, the dataset's tokenizer; LoRA merged or as an adapter, ``tracking.export``).
"""

from __future__ import annotations

import os
from typing import Any

from raytrn.checkpoint.rundir import RunDir
from raytrn.config import JobSpec
from raytrn.data.manifest import load_manifest
from raytrn.one_process import no_dist


def export_checkpoint(job: JobSpec, step: int, out_dir: str) -> None:
    """Write the model of the committed checkpoint of ``step`` into ``out_dir`` (created) as a Hugging Face model;
    CheckpointError when that checkpoint is not (or no longer) complete."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from raytrn.checkpoint import plain
    from raytrn.checkpoint.dcp import check_complete, state_dict_options, storage_reader
    from raytrn.models import build_model
    from raytrn.models.hf import load_weights
    from raytrn.models.lora import apply_lora
    from raytrn.tracking.export import export_hf, save_tokenizer

    model: Any = build_model(job.model, seed=job.run.seed)
    if job.model.init_from:  # the frozen base under LoRA (checkpoints hold the adapters only)
        load_weights(model, str(job.model.init_from), tied=job.model.tie_word_embeddings, source=job.source)
    if job.model.lora is not None:
        apply_lora(model, job.model.lora, seed=job.run.seed)
    options = state_dict_options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    location = RunDir.of(job).dcp_step(step)
    check_complete(location)  # one clear error for a checkpoint retention deleted or a save never finished
    plain.load(state, storage_reader(location), no_dist=no_dist(alone=True))
    set_model_state_dict(model, state["model"], options=options)
    os.makedirs(out_dir, exist_ok=True)
    specs = {name: (v.dtype, tuple(v.shape)) for name, v in model.state_dict().items()}
    export_hf(job, ((k, v.detach()) for k, v in model.state_dict().items()), out_dir, specs)
    save_tokenizer(load_manifest(job.data.manifest, check_files=False), out_dir)
