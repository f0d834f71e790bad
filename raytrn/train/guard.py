"""Training state that a diverging run cannot poison: steps whose loss or gradient norm is not finite.

Such a step's optimizer update is skipped where the gradients are clipped (:func:`raytrn.train.build.clip_and_step`),
so the weights and optimizer state stay those of the last finite step: a checkpoint, its retention and the exported
model never hold a NaN. This component counts the skipped steps (``nonfinite_steps``) and, after
``run.max_nonfinite_steps`` in a row, fails the worker group with an error naming the step: Ray Train restarts it
from the newest committed checkpoint (every one of them finite), up to ``scaling.max_failures`` times, and a run
that keeps diverging then ends with that error instead of training on as NaN.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from raytrn.errors import RaytrnError

if TYPE_CHECKING:
    from raytrn.config import JobSpec


class NonFiniteError(RaytrnError):
    """Too many steps in a row had a NaN or inf loss or gradient norm."""


class NonFiniteGuard:
    """Counts the steps whose gradient norm (the same on every rank: it is taken over the reduced gradients) or
    loss is not finite, on every rank alike."""

    def __init__(self, job: JobSpec, *, enabled: bool = True) -> None:
        self.limit = job.run.max_nonfinite_steps
        self.enabled = enabled
        self.total = 0  # this worker group's skipped steps: the nonfinite_steps metric
        self.in_a_row = 0

    def check(self, grad_norm: torch.Tensor, step: int) -> None:
        """After step ``step``: count it when its gradient norm is not finite; NonFiniteError at the limit."""
        if not self.enabled:
            return
        norm = float(grad_norm)  # the value clip_and_step read already: no further device sync
        if math.isfinite(norm):
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise NonFiniteError(
                f"steps {first}-{step}: the loss or gradient norm was {norm} for {self.in_a_row} steps in a row "
                f"(run.max_nonfinite_steps={self.limit}); their updates were skipped and nothing non-finite was "
                "saved. The worker group restarts from the newest committed checkpoint; if the run keeps diverging, "
                "lower optim.lr, raise optim.warmup_steps or set optim.grad_clip_norm"
            )
