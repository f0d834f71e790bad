"""Validation: the loss over a fixed part of the validation set, the same rows every time and at any world size.

The validation set is read in manifest order (never shuffled) and cut into global batches as the training data is
(``data.global_batch_size`` rows; rank r of D takes its slice of each); an evaluation covers the first
``run.eval_batches`` of them. Each rank reads its rows once, in this process, and keeps them (a validation slice is
small). The loss is summed over the trained tokens of every row of every rank and divided by their count: the
mean over the tokens, as training's. An evaluation runs the model forward only, without gradients; it draws no
random numbers and does not touch the training data's position, so it never changes the training trajectory. A
pipelined model's micro-batches go through its stages one at a time (:mod:`raytrn.train.pipelined_eval`): the same
sums, taken on the last stage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.config.sizes import global_batch
from raytrn.data.batch import attention, to_torch
from raytrn.data.manifest import Manifest, rows_per_group
from raytrn.data.order import RankSlice, SampleOrder, iter_rows, plan_epoch
from raytrn.data.source import block_arrays, slices
from raytrn.errors import DataError
from raytrn.train.loss import summed_losses
from raytrn.train.pipelined_eval import pipeline_loss_sums
from raytrn.train.step import Training, forward

if TYPE_CHECKING:
    from raytrn.backends.base import Backend
    from raytrn.config import JobSpec
    from raytrn.train.protocol import StepEnd


class Evaluator:
    """This rank's validation micro-batches and the validation loss over every rank's."""

    def __init__(self, job: JobSpec, manifest: Manifest, *, dp: int, dp_rank: int) -> None:
        b = global_batch(job, dp)
        self.num_batches = min(job.run.eval_batches, manifest.num_rows // b)
        if self.num_batches < 1:
            raise DataError(
                f"{job.source}: the validation set {manifest.manifest_path} has {manifest.num_rows:,} rows, fewer than "
                f"one global batch ({b:,}); use a larger validation set or a smaller data.global_batch_size"
            )
        order = SampleOrder(shard_rows=[s.rows for s in manifest.shards], block_rows=rows_per_group(manifest.row_len),
                            shuffle=False)  # fmt: skip
        part = RankSlice(rank=dp_rank, size=dp, global_batch=b)
        wanted = self.num_batches * part.rows_per_step
        columns = (manifest.column, *manifest.extra_columns)

        def blocks() -> Any:
            got = 0
            for table in iter_rows(manifest.shard_paths(), columns, plan_epoch(order, part, 0)):
                block = block_arrays(table, manifest.column, manifest.row_len, manifest.extra_columns)
                yield block.rows(0, min(len(block), wanted - got))
                got += len(block)
                if got >= wanted:
                    return

        document = attention(job, manifest) == "document"
        self.batches = [
            to_torch(mb, document=document, eos_id=manifest.tokenizer.eos_id)
            for mb in slices(blocks(), job.data.micro_batch_size)
        ]

    @torch.no_grad()
    def evaluate(self, t: Training, backend: Backend) -> dict[str, float]:
        """``val_loss`` (mean over the trained tokens of the evaluated rows of every rank) and ``val_perplexity``. A
        collective: every rank calls it at the same step."""
        device = backend.device()
        was_training = t.model.training
        t.model.eval()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        count = torch.zeros((), device=device, dtype=torch.float64)
        try:
            if t.pipeline is not None:  # through the stages: the sums on the last stage's ranks, zeros elsewhere
                loss_sum, count = pipeline_loss_sums(t, self.batches, device)
            else:
                for batch in self.batches:
                    logits, targets, mask, _ = forward(t, batch.to(device))
                    summed, tokens = summed_losses(logits, targets, mask)  # (in chunks, as the training step's)
                    loss_sum += summed
                    count += tokens
        finally:
            t.model.train(was_training)
        totals = torch.stack([loss_sum, count])
        if torch.distributed.is_available() and torch.distributed.is_initialized() and t.world_size > 1:
            # every TP copy counts alike: the ratio is unchanged (a pipeline's sums: its last stage's ranks')
            torch.distributed.all_reduce(totals)
        loss = float(totals[0] / totals[1].clamp(min=1))
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 80.0))}


class Evaluation:
    """The loop's evaluation component: every ``run.eval_every`` steps and at the last, the validation loss (every
    rank: a collective; forward only, no random numbers, no data moved), the run's best so far, and rank 0's MLflow
    metrics and best-checkpoint tags. Without a validation set it never evaluates. The ``eval`` phase of the step
    protocol (:mod:`raytrn.train.protocol`) when built with the training it evaluates (``t``, ``backend``)."""

    phase: ClassVar[str] = "eval"
    long: ClassVar[bool] = True
    blocking: ClassVar[str | None] = "eval"

    def __init__(
        self, job: JobSpec, validation: Manifest | None, progress: Progress, *, dp: int, dp_rank: int, logger: Any,
        t: Training | None = None, backend: Backend | None = None,
    ) -> None:  # fmt: skip
        self.job, self.progress, self.logger, self.t, self.backend = job, progress, logger, t, backend
        self.evaluator = Evaluator(job, validation, dp=dp, dp_rank=dp_rank) if validation is not None else None

    def step_ended(self, end: StepEnd) -> None:
        """The ``eval`` phase: the scores of an eval step (``end.scores``); the best-checkpoint tag names the
        checkpoint this step writes, if it writes one."""
        assert self.t is not None and self.backend is not None, "built without the training it evaluates"
        checkpoint = RunDir.of(self.job).pointer(end.step) if end.saving else None
        end.scores = self.maybe_evaluate(self.t, self.backend, last=end.last, checkpoint=checkpoint)

    def should_evaluate(self, step: int, *, last: bool) -> bool:
        every = self.job.run.eval_every
        return self.evaluator is not None and (last or bool(every and step % every == 0))

    def maybe_evaluate(
        self, t: Training, backend: Backend, *, last: bool, checkpoint: str | None = None
    ) -> dict[str, float]:
        """The scores at this step when it is an evaluation step (else {}); ``checkpoint``: the location of the
        checkpoint written at this step, if one is (the best-checkpoint tag names it)."""
        progress, step = self.progress, self.progress.step
        if self.evaluator is None or not self.should_evaluate(step, last=last):
            return {}
        scores = self.evaluator.evaluate(t, backend)
        best = progress.best_val_loss is None or scores["val_loss"] < progress.best_val_loss
        if best:
            progress.best_val_loss = scores["val_loss"]
        if self.logger is not None and step > progress.last_logged_val_step:  # (the step's training metrics first)
            self.logger.log_missing(scores, step)  # (a step evaluated again after a restart: logged once)
            if best:
                self.logger.set_tags(best_tags(step, scores["val_loss"], checkpoint))
        progress.logged_val(step, scores)
        return scores


def best_tags(step: int, val_loss: float, checkpoint: str | None) -> dict[str, str]:
    """The run's tags for a new best validation loss: the step, the loss, and the checkpoint of that step (when one
    is written there: evaluate at checkpoint steps to keep every candidate)."""
    location = checkpoint or "none (no checkpoint)"
    return {"best_val_loss": f"{val_loss:.6f}", "best_val_step": str(step), "best_checkpoint": location}
