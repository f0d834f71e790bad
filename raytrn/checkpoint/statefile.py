"""The single-file format: the whole training state in one ``state.pt``, written by rank 0.

The frozen XLA path writes it (:mod:`raytrn.backends.xla`: replicas are identical there); the sharded path reads
it once to resume a checkpoint of an older raytrn into an unsharded model (:mod:`raytrn.checkpoint.sharded`).
Beside it, ``meta.json`` (:mod:`raytrn.checkpoint.progress`) holds the counters, readable without torch.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch

from raytrn.checkpoint.progress import Progress, read_local_meta, write_meta
from raytrn.checkpoint.store import Checkpoints, PinnedSchedule, Saved, TrainState

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


class StateFileCheckpoints(Checkpoints):
    """Rank 0 writes the whole state as ``state.pt`` (the frozen XLA path: replicas are identical)."""

    def __init__(self, to_cpu: Callable[[Any], Any]) -> None:
        self.to_cpu = to_cpu

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        counters, pinned = replace(progress), schedule.to_dict()

        def write(d: str) -> None:
            save_state(
                d, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, progress=counters,
                schedule=pinned, to_cpu=self.to_cpu,
            )  # fmt: skip

        return [Saved(step=progress.step, report=report, write=write)]

    def load(self, directory: str, t: TrainState) -> Progress:
        return load_state(directory, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)


class NoCheckpoints(Checkpoints):
    """Nothing written, nothing recorded: ``neuron_parallel_compile``'s trial run (its outputs are invalid)."""

    def save(
        self, t: TrainState, progress: Progress, schedule: PinnedSchedule, report: dict[str, Any], *, final: bool
    ) -> list[Saved]:
        return [Saved(step=progress.step, report=report, write=None)]

    def load(self, directory: str, t: TrainState) -> Progress:
        return read_local_meta(directory).progress
