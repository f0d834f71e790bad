"""Small host-side agreements between the ranks of a worker group: gather, all-true, broadcast (over gloo).

Used by the sharded checkpoints (every rank's files into one manifest) and by the workers' choice of the
checkpoint to resume (rank 0 lists, every rank checks a share). Without a process group (one process) each is
the value itself.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_HOST_GROUP: list[Any] = []


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(value: Any, *, group: Any = None) -> list[Any]:
    """``value`` of every rank, in rank order (one element without a process group)."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group or host_group())
    return out


def all_true(value: bool, *, group: Any = None) -> bool:
    return all(gather(bool(value), group=group))


def broadcast(value: list[Any], *, group: Any = None) -> list[Any]:
    """Rank 0's ``value`` on every rank (``group``: one over every rank, else the host group)."""
    if not _distributed():
        return value
    box = list(value)
    dist.broadcast_object_list(box, src=0, group=group or host_group())
    return box


def host_group() -> Any:
    """A gloo group over every rank for small host-side agreements (None: the default group is gloo already).
    Created once per process, at the first agreement, which every rank reaches at the same point."""
    if not _HOST_GROUP:
        _HOST_GROUP.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]
