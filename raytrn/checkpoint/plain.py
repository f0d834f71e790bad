"""What a written checkpoint can make a reader do: build plain data and DCP's own records, never run code.

A DCP checkpoint holds two kinds of pickles besides its tensors: ``.metadata`` (DCP's index: which item is where,
of which shape) and the non-tensor items of the state (the schedule's counters, the optimizer's hyperparameters:
``torch.save`` of a plain value each). PyTorch reads the first with ``pickle.load`` and the second with
``torch.load(weights_only=False)``: a checkpoint whose ``scheduler`` item pickles a ``__reduce__`` would run
``os.system`` when it is restored. raytrn reads both here instead:

- ``.metadata`` with :class:`MetadataUnpickler`, which builds only DCP's metadata records, ``torch.Size``, dtypes,
  layouts and paths (:data:`METADATA_GLOBALS`);
- a non-tensor item with ``torch.load(weights_only=True)`` (:class:`PlainLoadPlanner`): tensors and plain values
  (numbers, strings, ``None``, lists, tuples, dicts), what raytrn writes.

Anything else is refused with one :class:`~raytrn.errors.CheckpointError` naming the item and the file, before any
of it is built. Every raytrn reader (:class:`raytrn.checkpoint.inplace.InPlaceReader`: local, S3, the memory tier)
reads ``.metadata`` this way and hands non-tensor items only to a :class:`PlainLoadPlanner`; every DCP load in
raytrn goes through :func:`load` (the resume from storage or memory, the evaluator's export; ``model.init_from`` reads safetensors, no pickle).
"""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from raytrn.errors import CheckpointError

#: The globals a DCP ``.metadata`` may name (torch 2.9-2.14): DCP's records, torch's shape, dtype and layout, paths.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),  # fmt: skip
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeItem(pickle.UnpicklingError):
    """A pickle in a checkpoint holds something besides plain data: ``what`` says what (``it names posix.system``)."""

    def __init__(self, item: str, what: str) -> None:
        super().__init__(f"{item}: {what}")
        self.item, self.what = item, what


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: the globals of :data:`METADATA_GLOBALS` and torch's dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeItem(".metadata", f"it names {module}.{name}")


def read_metadata_pickle(stream: IO[bytes] | io.IOBase, where: str) -> Any:
    """DCP's metadata from ``stream`` (the ``.metadata`` of the checkpoint at ``where``); CheckpointError when it
    names anything but DCP's records."""
    try:
        return MetadataUnpickler(stream).load()
    except UnsafeItem as e:
        raise refused(e, where, ".metadata") from None


#: torch's weights-only refusal names the global it met ("unsupported GLOBAL posix.system") or what else it could not
#: read, on the line after "WeightsUnpickler error:" ("Unsupported operand 139": a pickle opcode it does not take).
_GLOBAL = re.compile(r"GLOBAL ([\w.<>]+)")
_OTHER = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def _why(e: pickle.UnpicklingError) -> str:
    text = str(e)
    if found := _GLOBAL.search(text):
        return f"it names {found.group(1)}"
    found = _OTHER.search(text)
    return f"torch's weights-only reader refused it: {found.group(1) if found else text.splitlines()[0][:160]}"


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor items are read with ``torch.load(weights_only=True)``: plain
    values load as before; anything else is an :class:`UnsafeItem` naming the item, and nothing of it runs."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeItem(fqn, _why(e)) from None
        # Handed on as DCP's planner takes it (its own torch.load, now of bytes that hold plain values only): where
        # an item goes in the state dict stays DCP's business.
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def refused(e: UnsafeItem, where: str, file: str) -> CheckpointError:
    """The one error for a checkpoint pickle that names more than plain data."""
    return CheckpointError(
        f"checkpoint {where}: item {e.item!r} in {file} is not plain data ({e.what}); refused, nothing of it "
        "was run. A checkpoint raytrn wrote holds tensors and plain values only: this one was written by other code "
        "or altered. Resume from a checkpoint you trust (or delete this one), and restrict who can write "
        "checkpoint.storage (SECURITY.md)"
    )


def load(state: dict[str, Any], reader: Any, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` through ``reader``, non-tensor items read as plain data
    (:class:`PlainLoadPlanner`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=PlainLoadPlanner(), no_dist=no_dist)
    except CheckpointException:  # DCP gathers every rank's failure: a refusal is one error, not a rank's stack
        refusal = getattr(reader, "refusal", None)
        if refusal is None:
            raise
        raise CheckpointError(refusal.message) from None
