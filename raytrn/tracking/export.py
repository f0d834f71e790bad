"""The trained model at the end of a run: a Hugging Face checkpoint (with the dataset's tokenizer) logged as the
run's ``model`` artifact. Under LoRA the adapters are merged (``tracking.export: merged``) or written as a peft
adapter directory (``adapter``). A sharded model's tensors are gathered one at a time, so every rank takes part and
rank 0, which writes, never holds the whole model.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raytrn import storage
from raytrn.ahead import import_ahead, wait_for
from raytrn.config import JobSpec
from raytrn.data.manifest import load_manifest
from raytrn.models.export import save_hf
from raytrn.models.lora import adapted_weights, export_specs, merged_items, save_adapter

log = logging.getLogger(__name__)

#: What saving the final model's tokenizer imports (transformers' tokenizer class and its hub client: 0.4-0.7 s in a
#: training worker, none of it a module training imports): imported ahead by :class:`ExportAhead`.
TOKENIZER_IMPORTS = ("transformers.tokenization_utils_fast",)


class ExportAhead:
    """Rank 0 (which saves the final model's tokenizer), after each step: once the steps left to ``run.max_steps``
    look like at most :attr:`HORIZON_S` seconds at this group's pace (measured from its first step done: a short run's
    second step), :data:`TOKENIZER_IMPORTS` are imported in a thread beside the steps (:mod:`raytrn.ahead`), so that
    the run's end does not wait for them (measured: 0.7 of the 1.2 s from a tiny run's last step to its end). Not
    earlier: a group restarted, preempted or stopped early (``raytrn stop``) would have spent that CPU for nothing.
    Nothing when the job does not log its final model."""

    HORIZON_S = 30.0

    def __init__(self, job: JobSpec) -> None:
        self.max_steps = job.run.max_steps
        self.done = not job.tracking.log_model
        self._since: tuple[int, float] | None = None  # (step, time) of this group's first step done

    def step_done(self, step: int) -> None:
        if self.done:
            return
        now = time.monotonic()
        if self._since is None:
            self._since = (step, now)
            return
        first, since = self._since
        if step > first and (self.max_steps - step) * (now - since) / (step - first) <= self.HORIZON_S:
            self.done = True
            import_ahead(TOKENIZER_IMPORTS)


def log_final_model(
    job: JobSpec, model: torch.nn.Module, export: Callable[[], Iterator[tuple[str, torch.Tensor]]], logger: Any
) -> None:
    """Every rank calls it: ``export`` yields the full tensors (gathered: collectives); rank 0 (``logger``, None
    elsewhere) streams them into the safetensors file and uploads the directory. Never fails the finished training."""
    writing = logger is not None and logger.run_id is not None
    if logger is not None and not writing:
        log.warning("final model not logged: the MLflow run was never created (server unreachable)")
    specs = getattr(model, "export_specs", None) or {  # a pipeline's rank holds its stages: the whole's, given
        name: (v.dtype, tuple(v.shape)) for name, v in getattr(model, "module", model).state_dict().items()
    }
    # transformers' lazy module fails a `from transformers import X` here ("cannot import name") while ExportAhead's
    # thread is still importing transformers: a short run lost its final model so. Wait for that import first.
    for module in TOKENIZER_IMPORTS:
        wait_for(module)
    with tempfile.TemporaryDirectory(prefix="raytrn-model-") as d:
        try:
            export_hf(job, export(), d if writing else None, specs)
            if writing:
                save_tokenizer(load_manifest(job.data.manifest, check_files=False), d)
                logger.log_artifacts(d, "model")  # by the tracking actor when it is on this node
        except Exception as e:  # tracking never fails a finished training
            log.warning("could not log the final model to MLflow: %s", e)


def export_hf(job: JobSpec, items: Any, out_dir: str | None, specs: dict[str, Any]) -> None:
    """The model's full tensors (gathered one at a time) as a Hugging Face checkpoint in ``out_dir`` (None: this
    rank only takes part in the gathers); under LoRA with the adapters merged or as a peft adapter directory."""
    lora = job.model.lora
    if lora is None:
        save_hf(job.model, items, out_dir, specs=specs)
        return
    if job.tracking.export == "adapter":
        save_adapter(lora, items, out_dir, base=job.model.init_from)
        return
    scaling = lora.alpha / lora.rank
    save_hf(job.model, merged_items(items, scaling, adapted_weights(specs)), out_dir, specs=export_specs(specs))


def save_tokenizer(manifest: Any, out_dir: str) -> None:
    """The dataset's ``tokenizer.json`` (local or S3) saved as a transformers tokenizer beside the model, its
    end-of-text token named (what generation stops at and what lm-eval prefixes a context with)."""
    from transformers import PreTrainedTokenizerFast  # (imported ahead near the run's end: ExportAhead)

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(storage.read_text(manifest.tokenizer_path) or "")
    try:
        eos = manifest.tokenizer.eos_token
        PreTrainedTokenizerFast(tokenizer_file=f.name, eos_token=eos, bos_token=eos).save_pretrained(out_dir)
    finally:
        os.unlink(f.name)
