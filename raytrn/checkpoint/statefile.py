"""The single-file format: the whole training state in one ``state.pt``, written by rank 0.

The frozen XLA path writes it (:mod:`raytrn.xla.checkpoints`: replicas are identical there); the sharded
path reads it once to resume a checkpoint of an older raytrn into an unsharded model
(:mod:`raytrn.checkpoint.sharded`). Both read the format here, so neither depends on the other.
Beside it, ``meta.json`` (:mod:`raytrn.checkpoint.progress`) holds the counters, readable without torch.
"""

from __future__ import annotations

import os
import pickle
import random
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from raytrn.checkpoint.progress import Progress, write_meta
from raytrn.errors import CheckpointError

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
    # weights_only: tensors and plain containers, plus the numpy array of numpy's RNG state, nothing else (an
    # arbitrary pickle in checkpoint storage would run code on every worker).
    path = os.path.join(directory, STATE_FILE)
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refusing to load it: it holds objects other than tensors and plain values, which raytrn never "
            f"writes ({str(e).splitlines()[0]}). Checkpoint storage must be writable only by the people who may "
            "run code on the cluster (SECURITY.md)"
        ) from None
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return Progress.from_dict(state["progress"])


def _numpy_rng_globals() -> list[Any]:
    """What unpickling ``np.random.get_state()`` needs (its key is a uint32 array): the allow-list of
    :func:`load_state`'s ``torch.load(weights_only=True)``."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    allowed: list[Any] = [np.ndarray, np.dtype, core.multiarray._reconstruct]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles a dtype by its class
    if dtypes is not None:
        allowed.append(dtypes.UInt32DType)
    return allowed


def has_state(directory: str) -> bool:
    """Whether ``directory`` (a checkpoint Ray handed back) holds a ``state.pt``."""
    return os.path.exists(os.path.join(directory, STATE_FILE))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)
