"""Training state on disk: everything needed to continue a run exactly where it stopped.

A checkpoint directory holds ``state.pt`` (model, optimizer, scheduler, counters, RNG states) and
``meta.json`` (step and tokens, readable without torch). Ray Train uploads the directory to
``checkpoint.storage`` (local or s3://) and hands it back through ``ray.train.get_checkpoint()``.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where state is saved or loaded: the driver reads meta.json only
    import torch

STATE_FILE = "state.pt"
META_FILE = "meta.json"


@dataclass(kw_only=True)
class Progress:
    """Counters that survive restarts."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # tokens trained on, over all workers
    epoch: int = 0  # passes over the dataset started
    last_logged_step: int = 0  # last step whose metrics were logged (never log a step twice)


def save_state(
    directory: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: Progress,
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
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
    }
    torch.save(state, os.path.join(directory, STATE_FILE))
    write_meta(directory, progress)


def write_meta(directory: str, progress: Progress, **extra: Any) -> None:
    """``meta.json``: the counters (and, for sharded checkpoints, where the shards are), readable without torch."""
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({**asdict(progress), **extra}, f)


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
    return Progress(**state["progress"])


def read_meta(location: str) -> Progress | None:
    """The progress counters of a checkpoint (local path or s3:// URI), or None if it has none."""
    from raytrn import storage

    text = storage.read_text(storage.join(location, META_FILE))
    return parse_meta(text) if text else None


def parse_meta(text: str) -> Progress:
    """The counters in a ``meta.json`` text (other keys, such as where shards are, are ignored)."""
    fields = set(Progress.__dataclass_fields__)
    return Progress(**{k: v for k, v in json.loads(text).items() if k in fields})


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)
