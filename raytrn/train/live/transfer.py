"""A live replica's training state, copied to newcomers over the live group's process group (no storage read).

The state is any nesting of dicts, lists and tuples of plain values and tensors: the model's and the optimizer's
``state_dict()``, the schedule's, the step and the data position. Rank 0 sends its *skeleton* first (the nesting,
the plain values and each tensor's dtype and shape, as JSON: nothing a peer sends is unpickled) and then every
tensor by a broadcast; every other rank builds the same structure from the skeleton and receives the tensors into
it, bit for bit. Dict keys keep their type (an optimizer's state is keyed by int parameter ids).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from raytrn.train.live.group import LiveGroup

_TENSOR, _DICT, _LIST, _TUPLE = "__tensor__", "__dict__", "__list__", "__tuple__"
_PLAIN = (str, int, float, bool, type(None))


def skeleton(state: Any, tensors: list[torch.Tensor]) -> Any:
    """``state`` as JSON-able values, each tensor replaced by its index into ``tensors`` (appended in order)."""
    if isinstance(state, torch.Tensor):
        tensors.append(state.detach())
        return {_TENSOR: [len(tensors) - 1, str(state.dtype).removeprefix("torch."), list(state.shape)]}
    if isinstance(state, dict):
        for key in state:
            if not isinstance(key, _PLAIN):
                raise TypeError(f"live state transfer: a dict key of type {type(key).__name__} ({key!r})")
        return {_DICT: [[key, skeleton(value, tensors)] for key, value in state.items()]}
    if isinstance(state, (list, tuple)):
        return {_TUPLE if isinstance(state, tuple) else _LIST: [skeleton(v, tensors) for v in state]}
    if isinstance(state, _PLAIN):
        return state
    raise TypeError(f"live state transfer: a value of type {type(state).__name__} (plain values and tensors only)")


def build(shape: Any, received: list[torch.Tensor]) -> Any:
    """The structure ``shape`` (a :func:`skeleton`) describes, with empty tensors appended to ``received``."""
    if isinstance(shape, dict):
        if _TENSOR in shape:
            _, dtype, dims = shape[_TENSOR]
            tensor = torch.empty(dims, dtype=getattr(torch, dtype))
            received.append(tensor)
            return tensor
        if _DICT in shape:
            return {key: build(value, received) for key, value in shape[_DICT]}
        if _TUPLE in shape:
            return tuple(build(v, received) for v in shape[_TUPLE])
        return [build(v, received) for v in shape[_LIST]]
    return shape


def share_state(group: LiveGroup, state: Any | None) -> Any:
    """Rank 0's ``state`` on every member (rank 0 passes its own and gets it back; the others may pass None).
    Two small broadcasts carry the skeleton, then one per tensor."""
    tensors: list[torch.Tensor] = []
    if group.rank == 0:
        text = json.dumps(skeleton(state, tensors)).encode()
        length = torch.tensor([len(text)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length])
    payload = (
        torch.frombuffer(bytearray(text), dtype=torch.uint8)
        if group.rank == 0
        else torch.empty(int(length.item()), dtype=torch.uint8)
    )
    group.broadcast([payload])
    if group.rank == 0:
        group.broadcast([t.contiguous() for t in tensors])
        return state
    received: list[torch.Tensor] = []
    result = build(json.loads(payload.numpy().tobytes()), received)
    group.broadcast(received)
    return result
