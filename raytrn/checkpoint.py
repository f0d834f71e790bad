"""Training state on disk: everything needed to continue a run exactly where it stopped.

A checkpoint directory holds ``state.pt`` (model, optimizer, scheduler, counters, RNG states, the pinned
learning-rate schedule) and ``meta.json`` (the counters and the schedule, readable without torch). Ray
Train uploads the directory to ``checkpoint.storage`` (local or s3://) and hands it back through
``ray.train.get_checkpoint()``.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where state is saved or loaded: the driver reads meta.json only
    import torch

STATE_FILE = "state.pt"
META_FILE = "meta.json"


@dataclass(kw_only=True)
class Progress:
    """Counters that survive restarts (and new invocations of the same run)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # tokens trained on, over all workers
    epoch: int = 0  # the pass over the dataset in progress (0-based; raytrn.data.order)
    epoch_samples: int = 0  # rows of it trained on (whole global batches)
    last_logged_step: int = 0  # last step whose metrics were logged (never log a step twice)
    cost_usd: float = 0.0  # what the run has cost so far (with a known price), over every worker group
    best_val_loss: float | None = None  # the lowest validation loss so far (raytrn.train.evaluate)
    last_logged_val_step: int = 0  # last step whose validation metrics were logged

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        """The counters in ``data``; other keys (a layout, where shards are) are ignored."""
        fields = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in fields})


@dataclass(kw_only=True)
class Meta:
    """What ``meta.json`` says: the counters, the learning-rate schedule (None in older checkpoints), the rest."""

    progress: Progress
    schedule: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def save_state(
    directory: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: Progress,
    schedule: dict[str, Any] | None = None,
    to_cpu: Any = None,
) -> None:
    """Write the full training state into ``directory`` (rank 0 only; DDP replicas are identical).

    ``to_cpu`` moves device tensors (XLA) to the CPU first; eager CPU/CUDA tensors save as they are.
    """
    import numpy as np
    import torch

    os.makedirs(directory, exist_ok=True)
    convert = to_cpu or (lambda x: x)
    state = {
        "model": convert(_unwrap(model).state_dict()),
        "optimizer": convert(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "progress": asdict(progress),
        "schedule": schedule,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
    }
    torch.save(state, os.path.join(directory, STATE_FILE))
    write_meta(directory, progress, schedule=schedule)


def write_meta(directory: str, progress: Progress, *, schedule: dict[str, Any] | None = None, **extra: Any) -> None:
    """``meta.json``: the counters, the schedule (and, for sharded checkpoints, where the shards are), readable
    without torch."""
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({**asdict(progress), "schedule": schedule, **extra}, f)


def load_state(
    directory: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> Progress:
    """Restore what :func:`save_state` wrote; returns the saved progress counters."""
    import numpy as np
    import torch

    state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return Progress.from_dict(state["progress"])


def read_meta(location: str) -> Meta | None:
    """What a checkpoint's ``meta.json`` says (local path or s3:// URI), or None if it has none."""
    from raytrn import storage

    text = storage.read_text(storage.join(location, META_FILE))
    return parse_meta(text) if text else None


def parse_meta(text: str) -> Meta:
    """The counters, schedule and other keys (such as where shards are) of a ``meta.json`` text."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{META_FILE} holds {type(data).__name__}, not an object")
    fields = set(Progress.__dataclass_fields__)
    schedule = data.get("schedule")
    return Meta(
        progress=Progress.from_dict(data),
        schedule=schedule if isinstance(schedule, dict) else None,
        extra={k: v for k, v in data.items() if k not in fields and k != "schedule"},
    )


#: Ray Train's checkpoint directories of a run: ``checkpoint_<N>`` (raytrn names them by step).
_RECORDED = re.compile(r"^checkpoint_(\d{8})$")


def recorded_steps(run_dir: str) -> list[int]:
    """The steps of the checkpoints Ray Train records for the run at ``run_dir`` (its ``checkpoint_<N>``
    directories), ascending; empty when the directory is missing or cannot be listed."""
    import pyarrow.fs as pafs

    from raytrn import storage

    fs, path = storage.filesystem(run_dir)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    matches = (_RECORDED.match(i.base_name) for i in infos if i.type == pafs.FileType.Directory)
    return sorted(int(m.group(1)) for m in matches if m)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)
