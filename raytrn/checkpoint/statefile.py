"""The single-file format: the whole training state in one ``state.pt``, written by rank 0.

The frozen XLA path writes it (:mod:`raytrn.xla.checkpoints`: replicas are identical there); the sharded
path reads it once to resume a checkpoint of an older raytrn into an unsharded model
(:mod:`raytrn.checkpoint.sharded`). Both read the format here, so neither depends on the other.
Beside it, ``meta.json`` (:mod:`raytrn.checkpoint.progress`) holds the counters, readable without torch.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from raytrn.checkpoint.progress import Progress, write_meta

STATE_FILE = "state.pt"


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


def load_state(
    directory: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> Progress:
    """Restore what :func:`save_state` wrote; returns the saved progress counters."""
    state = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return Progress.from_dict(state["progress"])


def has_state(directory: str) -> bool:
    """Whether ``directory`` (a checkpoint Ray handed back) holds a ``state.pt``."""
    return os.path.exists(os.path.join(directory, STATE_FILE))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)
