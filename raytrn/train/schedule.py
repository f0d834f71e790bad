"""The learning-rate schedule: linear warmup, then cosine decay or warmup-stable-decay (WSD) to a floor.

A :class:`Schedule` is pinned when a run starts and stored with every checkpoint. Raising
``run.max_steps`` to continue a run must not move the learning rate: with the horizon derived from
``max_steps`` again, a cosine run trained to its end (lr at 0.1x peak) would resume at ~0.7x peak.
:func:`resolve_schedule` therefore keeps the stored horizon on resume, unless the new one leaves the lr at
the resume step unchanged (during warmup, or in WSD's stable phase, which is why WSD makes continuing a
run natural) or the user sets ``optim.decay_steps`` explicitly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from raytrn.config import JobSpec

#: Two factors closer than this are the same learning rate (for deciding whether a horizon may move).
_SAME_LR = 1e-12


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Multiplier of the peak lr per optimizer step: warmup, then ``kind`` over ``decay_steps`` to the floor.

    ``horizon = warmup_steps + decay_steps`` is the step count at which the lr reaches ``min_lr_ratio``;
    it stays there after. ``wsd`` holds the peak until the last ``decay_fraction`` of the horizon, then
    decays (``decay_shape``).
    """

    kind: Literal["cosine", "wsd"] = "cosine"
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    decay_fraction: float = 0.2
    decay_shape: Literal["linear", "cosine"] = "linear"

    @classmethod
    def from_job(cls, job: JobSpec) -> Schedule:
        """The schedule the job's ``optim`` section asks for, with its horizon at ``run.max_steps``."""
        o = job.optim
        return cls(
            kind=o.schedule,
            warmup_steps=o.warmup_steps,
            decay_steps=o.decay_steps or max(1, job.run.max_steps - o.warmup_steps),
            min_lr_ratio=o.min_lr_ratio,
            decay_fraction=o.decay_fraction,
            decay_shape=o.decay_shape,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        fields = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in fields})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def horizon(self) -> int:
        return self.warmup_steps + self.decay_steps

    def with_horizon(self, horizon: int) -> Schedule:
        """The same schedule reaching its floor at step ``horizon`` (at least one decay step)."""
        return Schedule(**{**asdict(self), "decay_steps": max(1, horizon - self.warmup_steps)})

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr after ``step`` optimizer steps (the lr of step ``step + 1``)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps))
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        decay = min(self.decay_steps, max(1, round(self.decay_fraction * self.horizon)))
        progress = min(1.0, max(0.0, (step - (self.horizon - decay)) / decay))
        if self.decay_shape == "cosine":
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress

    def describe(self) -> str:
        floor = f"{self.min_lr_ratio:g}x peak"
        if self.kind == "cosine":
            return f"cosine to {floor} at step {self.horizon:,}"
        decay = min(self.decay_steps, max(1, round(self.decay_fraction * self.horizon)))
        return f"wsd: peak until step {self.horizon - decay:,}, {self.decay_shape} decay to {floor} at step {self.horizon:,}"


def resolve_schedule(job: JobSpec, saved: dict[str, Any] | None, step: int) -> tuple[Schedule, str | None]:
    """The schedule a run resumed at ``step`` trains with, and a one-line note when it differs from the job's.

    ``saved`` is the schedule stored in the checkpoint (None: a new run, or a checkpoint from before
    schedules were stored). The stored horizon is kept unless ``optim.decay_steps`` is set explicitly, or
    the job's horizon gives the same lr at ``step`` (warmup, WSD's stable phase): then it moves, silently
    for the lr. Other ``optim`` settings (warmup, floor, kind) always follow the job: changing them is asking
    for another schedule.
    """
    asked = Schedule.from_job(job)
    if saved is None or step == 0:
        return asked, None
    stored = Schedule.from_dict(saved)
    if asked.horizon == stored.horizon:
        return asked, None
    if job.optim.decay_steps is not None:
        return asked, (
            f"optim.decay_steps={job.optim.decay_steps}: the learning-rate schedule's horizon moves from step "
            f"{stored.horizon:,} to {asked.horizon:,} as set (lr at step {step:,}: {stored.factor(step):.4g}x -> "
            f"{asked.factor(step):.4g}x peak)"
        )
    kept = asked.with_horizon(stored.horizon)
    if abs(asked.factor(step) - kept.factor(step)) <= _SAME_LR:
        return asked, (
            f"run.max_steps={job.run.max_steps:,}: the learning-rate schedule now ends at step {asked.horizon:,} "
            f"(was {stored.horizon:,}); the lr at step {step:,} is unchanged ({asked.describe()})"
        )
    return kept, (
        f"run.max_steps={job.run.max_steps:,} differs from the run's schedule horizon (step {stored.horizon:,}): "
        f"kept it so the learning rate does not jump at step {step:,} ({kept.describe()}; after it the lr stays at "
        f"its floor). Set optim.decay_steps to choose a new horizon, or optim.schedule: wsd for runs you extend"
    )
