"""A run's counters and what ``meta.json`` says: readable without torch (the driver reads it, never the state).

:class:`Progress` holds the counters that survive restarts (step, tokens, the data position, cost, the best
validation loss); ``meta.json`` holds them with the pinned learning-rate schedule and where the state is (a
sharded checkpoint's location, ``dcp``; NxD's directory, ``sharded``). Ray Train's record of every checkpoint
(``checkpoint_<N>``, :class:`raytrn.checkpoint.rundir.RunDir`) is a directory with this one file.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrn import jsonfile, storage
from raytrn.errors import CheckpointError

META_FILE = "meta.json"


@dataclass(kw_only=True)
class Progress:
    """Counters that survive restarts (and new invocations of the same run)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # tokens trained on, over all workers
    epoch: int = 0  # the pass over the dataset in progress (0-based; raytrn.data.order)
    epoch_samples: int = 0  # rows of it trained on (whole global batches)
    last_logged_step: int = 0  # last step whose metrics were logged (never log a step twice)
    #: The training metrics logged at ``last_logged_step``: a restored group sends them again (the tracking actor
    #: drops a step it has), since a group killed right after that step's save may never have sent them.
    logged_metrics: dict[str, float] = field(default_factory=dict)
    cost_usd: float = 0.0  # what the run has cost so far (with a known price), over every worker group
    best_val_loss: float | None = None  # the lowest validation loss so far (raytrn.train.evaluate)
    last_logged_val_step: int = 0  # last step whose validation metrics were logged
    logged_val_metrics: dict[str, float] = field(default_factory=dict)  # those metrics, sent again as the others

    def logged(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step``'s training metrics were logged (or were a step before this group's newest: nothing)."""
        if step > self.last_logged_step:
            self.last_logged_step, self.logged_metrics = step, numeric_metrics(metrics)

    def logged_val(self, step: int, scores: dict[str, Any]) -> None:
        """Step ``step``'s validation metrics were logged (or were a step before this group's newest: nothing)."""
        if step > self.last_logged_val_step:
            self.last_logged_val_step, self.logged_val_metrics = step, numeric_metrics(scores)

    def restored(self, other: Progress) -> None:
        """The newer of this progress's and ``other``'s last logged steps, with their metrics (a checkpoint's two
        records of the counters: its ``meta.json`` and the saved state; a rollback's restored counters and the
        steps the run has logged)."""
        if other.last_logged_step > self.last_logged_step:
            self.last_logged_step, self.logged_metrics = other.last_logged_step, dict(other.logged_metrics)
        if other.last_logged_val_step > self.last_logged_val_step:
            self.last_logged_val_step = other.last_logged_val_step
            self.logged_val_metrics = dict(other.logged_val_metrics)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        """The counters in ``data``; other keys (a layout, where shards are) are ignored."""
        fields = set(cls.__dataclass_fields__)
        metrics = ("logged_metrics", "logged_val_metrics")
        progress = cls(**{k: v for k, v in data.items() if k in fields and k not in metrics})
        progress.logged_metrics = numeric_metrics(data.get("logged_metrics"))
        progress.logged_val_metrics = numeric_metrics(data.get("logged_val_metrics"))
        return progress


def numeric_metrics(metrics: Any) -> dict[str, float]:
    """The entries of ``metrics`` with a name and a numeric value, as floats; anything else (or not a mapping) is
    left out: they are only ever sent again, never needed."""
    if not isinstance(metrics, dict):
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(k, str) and _number(v)}


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(kw_only=True)
class Meta:
    """What ``meta.json`` says: the counters, the learning-rate schedule (None in older checkpoints), the rest."""

    progress: Progress
    schedule: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def write_meta(directory: str, progress: Progress, *, schedule: dict[str, Any] | None = None, **extra: Any) -> None:
    """``meta.json``: the counters, the schedule (and, for sharded checkpoints, where the shards are), readable
    without torch."""
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({**asdict(progress), "schedule": schedule, **extra}, f)


def read_meta(location: str) -> Meta | None:
    """What a checkpoint's ``meta.json`` says (local path or s3:// URI), or None if it has none."""
    text = storage.read_text(storage.join(location, META_FILE))
    return parse_meta(text) if text else None


def read_local_meta(directory: str) -> Meta:
    """The ``meta.json`` of a checkpoint Ray handed back (a local directory); CheckpointError when unreadable."""
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            return parse_meta(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {META_FILE} ({e})") from None


def parse_meta(text: str) -> Meta:
    """The counters, schedule and other keys (such as where shards are) of a ``meta.json`` text."""
    data = jsonfile.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{META_FILE} holds {type(data).__name__}, not an object")
    fields = set(Progress.__dataclass_fields__)
    schedule = data.get("schedule")
    return Meta(
        progress=Progress.from_dict(data),
        schedule=schedule if isinstance(schedule, dict) else None,
        extra={k: v for k, v in data.items() if k not in fields and k != "schedule"},
    )
