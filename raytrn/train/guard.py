"""Training state that a diverging run cannot poison: steps whose loss or gradient norm is not finite.

Such a step's optimizer update is skipped where the gradients are clipped (:func:`raytrn.train.build.clip_and_step`),
so the weights and optimizer state stay those of the last finite step: a checkpoint, its retention and the exported
model never hold a NaN. This component counts the skipped steps (``nonfinite_steps``) and, after
``run.max_nonfinite_steps`` in a row, acts on ``run.on_nonfinite``:

- ``rollback`` (the default), once per job: the steps are recorded on the job's progress board (it outlives the
  worker group) and the group fails; Ray Train restarts it from the newest committed checkpoint (finite, as every
  one is), and the restarted group skips the global batches of the recorded steps (drawn, not trained: the data
  position and the learning-rate schedule move on as if they were). If the run diverges again, it stops.
- ``fail``: the run stops at once.

Stopping is :class:`~raytrn.errors.RunStopped`: the run ends FAILED with a message naming the steps, not retried.

Where the skip itself stays on the device (the fused AdamW kernel: ``deferred``), a step has no host sync at all:
the guard reads the steps' gradient norms where the loop syncs with the device anyway (its log and checkpoint
steps), one read for the steps since the last one, and a run of non-finite steps is acted on there, naming the
exact steps. Elsewhere the step read its flag already, and the guard counts each step at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raytrn.errors import RaytrnError, RunStopped

if TYPE_CHECKING:
    from raytrn.config import JobSpec
    from raytrn.tracking.roles import RollbackRegistry
    from raytrn.train.protocol import StepEnd


class NonFiniteError(RaytrnError):
    """Too many steps in a row had a NaN or inf loss or gradient norm: the group fails for its rollback."""


class NonFiniteGuard:
    """Counts the steps whose gradient norm (the same on every rank: it is taken over the reduced gradients) or
    loss is not finite, on every rank alike, and says which steps a rollback skips.

    ``rollbacks``: this job's earlier rollbacks (``(first, last)`` steps each); ``record_rollback(first, last)``
    records a new one where the next worker group finds it (returns once it is recorded). The ``guard`` phase of
    the step protocol (:mod:`raytrn.train.protocol`), and a source of the log steps' metrics."""

    phase: ClassVar[str] = "guard"
    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(
        self,
        job: JobSpec,
        *,
        enabled: bool = True,
        deferred: bool = False,
        rollbacks: Sequence[Sequence[int]] = (),
        record_rollback: Callable[[int, int], Any] | None = None,
    ) -> None:
        self.limit = job.run.max_nonfinite_steps
        self.deferred = deferred  # the norms are read only when the loop syncs anyway (``check``'s ``settle``)
        self.policy = job.run.on_nonfinite
        self.enabled = enabled
        self.rollbacks = [(int(a), int(b)) for a, b in rollbacks]
        self._record = record_rollback
        self.total = 0  # this worker group's skipped steps: the nonfinite_steps metric
        self.in_a_row = 0
        self.skipped_batches = 0  # this worker group's global batches drawn and not trained (a rollback's)
        self._unread: list[tuple[int, torch.Tensor]] = []  # (step, grad norm) not read on the host yet

    @classmethod
    def on_board(
        cls, job: JobSpec, registry: RollbackRegistry | None, *, enabled: bool, deferred: bool = False
    ) -> NonFiniteGuard:
        """The guard of a worker: the job's earlier rollbacks from its progress board's registry, new ones recorded
        there (each waited for)."""
        if registry is None or not enabled:
            return cls(job, enabled=enabled, deferred=deferred)
        return cls(
            job,
            enabled=enabled,
            deferred=deferred,
            rollbacks=registry.rollbacks(),
            record_rollback=registry.rolled_back,
        )

    def skips(self, step: int) -> bool:
        """Whether step ``step``'s global batch is skipped: a rollback recorded it as one that diverged the run."""
        return any(first <= step <= last for first, last in self.rollbacks)

    def step_ended(self, end: StepEnd) -> None:
        """The step's gradient norm counted; read where the loop syncs anyway (a checkpoint or log step)."""
        self.check(end.result.grad_norm, end.step, settle=end.saving or end.logging)

    def metrics(self) -> dict[str, float]:
        """A log step's: steps whose loss or grad norm was NaN/inf (their updates skipped) and global batches drawn
        and not trained (a rollback's), this worker group."""
        return {"nonfinite_steps": float(self.total), "skipped_batches": float(self.skipped_batches)}

    def check(self, grad_norm: torch.Tensor, step: int, *, settle: bool = True) -> None:
        """After step ``step``: count it (``deferred``: its gradient norm joins the unread ones, read and counted in
        step order with ``settle``, a step where the loop syncs anyway). At the limit, NonFiniteError (the group
        fails for its rollback) or RunStopped (the run ends)."""
        if not self.enabled:
            return
        self._unread.append((step, grad_norm.detach().reshape(())))
        if settle or not self.deferred:
            self.settle()

    def settle(self) -> None:
        """Read and count the gradient norms not read yet (one host read), in step order."""
        if not self._unread:
            return
        steps = [s for s, _ in self._unread]
        norms = torch.stack([n.float() for _, n in self._unread]).tolist()
        self._unread.clear()
        for step, norm in zip(steps, norms, strict=True):
            self._count(norm, step)

    def _count(self, norm: float, step: int) -> None:
        if math.isfinite(norm):
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row < self.limit:
            return
        first = step - self.in_a_row + 1
        what = (
            f"steps {first}-{step}: the loss or gradient norm was {norm} for {self.in_a_row} steps in a row "
            f"(run.max_nonfinite_steps={self.limit}); their updates were skipped and nothing non-finite was saved"
        )
        if self.policy == "rollback" and not self.rollbacks:
            if self._record is not None:
                self._record(first, step)
            raise NonFiniteError(
                f"{what}. Rolling back once (run.on_nonfinite=rollback): the worker group restarts from the newest "
                f"committed checkpoint and skips the global batches of steps {first}-{step}"
            )
        after = ""
        if self.rollbacks:
            a, b = self.rollbacks[-1]
            after = f", again after the rollback that skipped steps {a}-{b}"
        raise RunStopped(
            f"the run diverged at {what}{after}. The run stops (run.on_nonfinite={self.policy}); its newest committed "
            "checkpoint holds the last finite state. Lower optim.lr, raise optim.warmup_steps or set "
            "optim.grad_clip_norm, then run the job again to resume from it"
        )
