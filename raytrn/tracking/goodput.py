"""The goodput ledger: where a run's wall time went, split by cause, through every restart of the run.

Anchor: Google's ML Productivity Goodput, which splits a job's time into scheduling, runtime and program goodput.
raytrn's ledger is the runtime part, measured: from the ``raytrn train`` process's start to the end of its run, each
second is booked to exactly one cause:

============  ==============================================================================================
productive    training steps that moved the run forward, less their waits for data (:data:`PRODUCTIVE`)
startup       process start to the first group's first step (imports, Ray, the worker group, the model)
restart       a failed group's last step to the next group's first step (detection, teardown, a new group); under
              ``scaling.recovery: live``, inside the group: the step attempts a lost replica aborted, the group's
              re-formation and a newcomer's admission (``GroupTimes.recovery_s``)
resize        the same gap when the group was replaced to grow (capacity came back)
preemption    the same gap after a preemption notice (the group checkpointed, then restarted without its node)
restore       loading the state a group starts from (inside a start-up or restart gap, taken out of it)
retrained     steps trained again after a restore (an earlier group had trained them; their work was lost)
warmup        a group's first step beyond a steady step's time (lazy initialisation, graph compiles)
data_wait     a step's wait for its batch
checkpoint    blocking checkpoint and in-memory snapshot time
eval          blocking validation time
other         the loop between steps: metrics, logging, the per-step collectives
shutdown      the last step to the end of the run (the final export, flushing MLflow, the group's teardown)
============  ==============================================================================================

The workers measure their own time (rank 0 of each group posts a :class:`GroupTimes` to the job's board); the driver
records why each group ended (:class:`GroupEnd`) and closes the ledger (:func:`close`). ``unaccounted`` is what the
causes do not cover (clock skew between processes, a group's time its rank 0 never posted); it should stay near 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

#: The cause whose share is the run's goodput.
PRODUCTIVE = "productive"
#: Every cause of lost time, in the order the summary and ``runs compare --goodput`` show them.
BADPUT = (
    "startup", "restart", "resize", "preemption", "restore", "retrained", "warmup", "data_wait", "checkpoint",
    "eval", "other", "shutdown",
)  # fmt: skip


class EndCause(Enum):
    """Why a worker group ended before the run did (what the driver's controller decided)."""

    FAILURE = "restart"
    RESIZE = "resize"
    PREEMPTION = "preemption"


@dataclass(frozen=True)
class GroupEnd:
    """A worker group ended at ``at`` (wall clock, the driver's) because of ``cause``."""

    at: float
    cause: EndCause


@dataclass(frozen=True, kw_only=True)
class GroupTimes:
    """One worker group's own time, measured by its rank 0 (seconds; ``*_at`` are wall-clock times)."""

    #: The board's count of the job's groups when this one started (1 for the first).
    group: int
    world_size: int
    restore_s: float = 0.0
    #: When its first step began and its last iteration (the step and what followed it) ended; None: no step yet.
    first_step_at: float | None = None
    last_step_end_at: float | None = None
    steps: int = 0
    productive_s: float = 0.0
    retrained_s: float = 0.0
    warmup_s: float = 0.0
    data_wait_s: float = 0.0
    checkpoint_s: float = 0.0
    eval_s: float = 0.0
    other_s: float = 0.0
    #: Live recovery inside the group (``scaling.recovery: live``): aborted attempts, re-formations, admissions.
    recovery_s: float = 0.0


@dataclass(kw_only=True)
class Ledger:
    """A run's wall time by cause (seconds): :data:`PRODUCTIVE` and every cause of :data:`BADPUT`."""

    wall_s: float
    productive: float = 0.0
    startup: float = 0.0
    restart: float = 0.0
    resize: float = 0.0
    preemption: float = 0.0
    restore: float = 0.0
    retrained: float = 0.0
    warmup: float = 0.0
    data_wait: float = 0.0
    checkpoint: float = 0.0
    eval: float = 0.0
    other: float = 0.0
    shutdown: float = 0.0
    #: The restarts, resizes and preemptions that ended a group, in order (the causes above).
    events: list[str] = field(default_factory=list)

    @property
    def unaccounted(self) -> float:
        """``wall_s`` less every cause (negative when causes overlap): near 0 for a consistent ledger."""
        return self.wall_s - sum(self.seconds().values())

    @property
    def goodput(self) -> float:
        """The productive fraction of the wall time (0 for an empty run)."""
        return self.productive / self.wall_s if self.wall_s > 0 else 0.0

    def seconds(self) -> dict[str, float]:
        """Each cause's seconds, :data:`PRODUCTIVE` first."""
        return {name: getattr(self, name) for name in (PRODUCTIVE, *BADPUT)}

    def metrics(self) -> dict[str, float]:
        """What MLflow gets: ``goodput``, ``goodput_s``, ``badput_<cause>_s`` and ``wall_s`` (the run's, this
        invocation's)."""
        out = {"goodput": self.goodput, "goodput_s": self.productive, "wall_s": self.wall_s}
        out.update({f"badput_{name}_s": getattr(self, name) for name in BADPUT})
        return out

    def render(self) -> str:
        """``goodput 0.62 (41.0 of 66.1 s); startup 9.2 s, restart 6.1 s, ...``: the causes of 0.05 s and more."""
        lost = ", ".join(f"{name} {getattr(self, name):.1f} s" for name in BADPUT if getattr(self, name) >= 0.05)
        return f"{self.goodput:.2f} ({self.productive:.1f} of {self.wall_s:.1f} s productive)" + (
            f"; {lost}" if lost else ""
        )


def close(started_at: float, ended_at: float, groups: list[GroupTimes], ends: list[GroupEnd]) -> Ledger:
    """The ledger of a run from ``started_at`` to ``ended_at`` (the driver's process start and the end of its run),
    from its groups' own times (a group that never stepped is part of the gap around it) and the
    driver's record of why each group before the last ended (``ends``, in order)."""
    out = Ledger(wall_s=max(0.0, ended_at - started_at))
    # in the order they trained (by their first step's time: a group number the board could not give is 0)
    stepped = sorted((g for g in groups if g.first_step_at is not None), key=lambda g: g.first_step_at or 0.0)
    for g in stepped:
        for name in ("productive", "retrained", "warmup", "data_wait", "checkpoint", "eval", "other"):
            setattr(out, name, getattr(out, name) + getattr(g, f"{name}_s"))
        out.restart += g.recovery_s  # live recovery: a restart's cost paid inside the group
    if not stepped:  # nothing trained: all of it was start-up
        out.startup = out.wall_s
        return out
    previous_start, previous_end = started_at, started_at
    for i, g in enumerate(stepped):
        assert g.first_step_at is not None
        gap = max(0.0, g.first_step_at - previous_end)
        restore = min(max(0.0, g.restore_s), gap)
        out.restore += restore
        if i == 0:
            out.startup += gap - restore
        else:
            cause = _cause_between(ends, previous_start, g.first_step_at)
            setattr(out, cause.value, getattr(out, cause.value) + gap - restore)
            out.events.append(cause.value)
        previous_start = g.first_step_at
        previous_end = g.last_step_end_at if g.last_step_end_at is not None else g.first_step_at
    out.shutdown = max(0.0, ended_at - previous_end)
    return out


def _cause_between(ends: list[GroupEnd], since: float, before: float) -> EndCause:
    """Why the group that stepped first at ``since`` ended: the last decision the driver recorded after that and
    before the next group's first step at ``before`` (a resize is decided while the group still trains); a failure
    when none was recorded (a group that died is the only other way a gap opens)."""
    within = [e for e in ends if since < e.at <= before]
    return within[-1].cause if within else EndCause.FAILURE


def add(earlier: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """The run's totals over its invocations: ``earlier`` (what an earlier ``raytrn train`` of this run logged, by
    metric name) plus ``metrics`` (this invocation's :meth:`Ledger.metrics`); ``goodput`` recomputed over the sum."""
    out = {k: v for k, v in metrics.items() if k != "goodput"}
    for key in out:
        value = earlier.get(key)
        if value is not None and math.isfinite(value):
            out[key] += value
    out["goodput"] = out["goodput_s"] / out["wall_s"] if out.get("wall_s", 0) > 0 else 0.0
    return out


#: The MLflow metrics of a ledger (what :func:`add` sums over invocations).
METRICS = ("goodput", "goodput_s", "wall_s", *(f"badput_{name}_s" for name in BADPUT))
