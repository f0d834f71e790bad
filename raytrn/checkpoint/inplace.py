"""Tensors read in place from a DCP shard file's bytes, without copying them out first.

DCP's reader loads every stored item with ``torch.load``, which copies the item's bytes into a freshly allocated
tensor before DCP copies that into the model's or optimizer's own: for a snapshot read from Ray's object store
(:mod:`raytrn.checkpoint.memory`) the first copy, into new pages, was most of a restore (0.4 s of 0.75 s for a
696 MB state). :class:`InPlaceReader` reads a tensor item as a view over the file's bytes instead (``torch.frombuffer``
on the item's storage record) and copies it once, into its destination. Every raytrn reader is one: the memory
tier's (files in the object store), and the durable ones of :mod:`raytrn.checkpoint.dcp` (a local file mapped, an
S3 file read whole).

An item is one ``torch.save`` of one tensor: a zip archive whose records are stored, not compressed: ``data.pkl``
(the tensor's dtype, size, stride and storage offset, as a pickle of ``torch._utils._rebuild_tensor_v2`` over a
storage record) and ``data/<key>`` (the storage's bytes). The pickle is read by an unpickler that knows those
names only; an item that is anything else (another layout, byte order, a transform) goes through DCP's own reader.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from raytrn.checkpoint.plain import PlainLoadPlanner, UnsafeItem, read_metadata_pickle, refused
from raytrn.errors import CheckpointError

#: A zip local file header: signature, versions, flags, method, times, crc, sizes, then name and extra lengths.
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


class ViewStream(io.RawIOBase):
    """A read-only, seekable stream over a buffer (a file read in place, e.g. from Ray's object store): its reader
    reads the slices it needs, nothing copies the whole file first."""

    def __init__(self, data: memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = bytes(self._view[self._pos : end])
        self._pos = max(self._pos, end)
        return out

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class _Storage:
    """What the pickle's persistent id names: a storage record ``key`` of ``numel`` elements of ``dtype``."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Rebuilt:
    """What the pickle rebuilds: a tensor of ``size`` and ``stride`` at ``offset`` (elements) in ``storage``;
    ``extra``: anything more (``requires_grad``, hooks, and the metadata torch.save records for a tensor with its
    conjugate or negative bit set, which the raw bytes do not show)."""

    def __init__(
        self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *extra: Any
    ) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)
        self.plain = len(extra) < 3 or not extra[2]  # (requires_grad, backward_hooks, metadata)


class _Unpickler(pickle.Unpickler):
    """Knows the three names a tensor's ``data.pkl`` uses; anything else is refused (the item then goes to DCP)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            with warnings.catch_warnings():  # the legacy typed storage classes name the dtype, and warn
                warnings.simplefilter("ignore", UserWarning)
                dtype = getattr(getattr(torch, name, None), "dtype", None)
            if isinstance(dtype, torch.dtype):
                return dtype
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"not a plain tensor storage: {pid!r}")
        return _Storage(dtype, str(key), int(numel))


def _record(blob: memoryview, info: zipfile.ZipInfo) -> memoryview:
    """The bytes of one stored (uncompressed) record, as a view into ``blob``."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"record {info.filename} is compressed")
    header = _LOCAL_HEADER.unpack_from(blob, info.header_offset)
    if header[0] != 0x04034B50:  # a local file header's signature
        raise ValueError(f"record {info.filename}: no local header at {info.header_offset}")
    start = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
    return blob[start : start + info.file_size]


def tensor_in_place(blob: memoryview) -> torch.Tensor | None:
    """The tensor one ``torch.save`` wrote into ``blob``, as a read-only view over ``blob``'s bytes (nothing copied),
    or None where ``blob`` is not one plain CPU tensor in this machine's byte order (read it with ``torch.load``)."""
    try:
        with zipfile.ZipFile(ViewStream(blob)) as archive:  # reads the directory only
            infos = {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
            if "byteorder" in infos and bytes(_record(blob, infos["byteorder"])).decode() != sys.byteorder:
                return None
            rebuilt = _Unpickler(io.BytesIO(_record(blob, infos["data.pkl"]))).load()
            if not isinstance(rebuilt, _Rebuilt) or not rebuilt.plain:
                return None
            storage = rebuilt.storage
            data = _record(blob, infos[f"data/{storage.key}"])
    except (KeyError, ValueError, struct.error, zipfile.BadZipFile, pickle.UnpicklingError, TypeError):
        return None
    if storage.numel == 0 or len(data) != storage.numel * storage.dtype.itemsize:
        return None
    with warnings.catch_warnings():  # the view is read-only: it is only ever copied from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(data, dtype=storage.dtype, count=storage.numel)
    return flat.as_strided(rebuilt.size, rebuilt.stride, rebuilt.offset)


#: The suffix of a file whose tensor items are raw bytes (:func:`raw_tensor`), not ``torch.save`` archives: the memory
#: tier's (:mod:`raytrn.checkpoint.memfiles`). Their dtype and size are the checkpoint metadata's.
RAW_SUFFIX = ".raw"


def raw_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's elements as bytes, in row-major order, as a flat uint8 tensor (a view where it is contiguous
    already): copied into a file by torch, without Python's lock."""
    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


class InPlaceReader(FileSystemReader):
    """DCP's file reader whose tensor items are read in place (:func:`tensor_in_place`) from each file's bytes
    (:meth:`buffer`), file by file; every other item of a file (the schedule, the RNG, a transformed item) goes through
    DCP's own reader while the file is still at hand, and :meth:`release` lets the file go before the next."""

    def buffer(self, name: str) -> memoryview | None:
        """The bytes of the checkpoint's file ``name``, or None to read all of its items through DCP (this base's
        answer: its subclasses give the bytes)."""
        return None

    #: The error that refused a pickle of this checkpoint (:mod:`raytrn.checkpoint.plain`): DCP's load reports it as
    #: one rank's failure among its own; :func:`raytrn.checkpoint.plain.load` raises it alone.
    refusal: CheckpointError | None = None

    @property
    def where(self) -> str:
        """The checkpoint, as its errors name it."""
        return str(self.path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, read as DCP's records only (:func:`raytrn.checkpoint.plain.read_metadata_pickle`)."""
        if self.refusal is not None:  # (DCP falls back to a rank's own metadata when the global one fails: not here)
            raise self.refusal
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
            try:
                metadata = read_metadata_pickle(stream, self.where)
            except CheckpointError as e:
                self.refusal = e
                raise
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {self.where}: {name} holds a {type(metadata).__name__}, not DCP's "
                                  "metadata; resume from another checkpoint (or delete this one)")  # fmt: skip
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def release(self, name: str) -> None:
        """Done with file ``name``: what :meth:`buffer` holds for it can go."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        #: Each stored chunk's dtype and size, by (fqn, offsets): what a raw item's bytes are.
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, torch.Size]] = {
            (fqn, tuple(chunk.offsets)): (md.properties.dtype, chunk.sizes)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if not isinstance(planner, PlainLoadPlanner) and any(r.type == LoadItemType.BYTE_IO for r in plan.items):
            raise TypeError("raytrn's checkpoint readers hand non-tensor items only to a PlainLoadPlanner: load "
                            "through raytrn.checkpoint.plain.load")  # fmt: skip
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, reqs in per_file.items():
            try:
                view = self.buffer(name)
                rest = [req for req in reqs if view is None or not self._in_place(req, view, planner)]
                view = None
                if rest:
                    super().read_data(replace(plan, items=rest), planner)
            except UnsafeItem as e:
                self.refusal = refused(e, self.where, name)
                raise self.refusal from None
            finally:
                self.release(name)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _in_place(self, req: Any, view: memoryview, planner: LoadPlanner) -> bool:
        """Read one tensor item in place into its destination; False where it is not a plain tensor item."""
        stored = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO or stored.transform_descriptors:
            return False
        blob = view[stored.offset : stored.offset + stored.length]
        tensor = self._raw(req, blob) if stored.relative_path.endswith(RAW_SUFFIX) else tensor_in_place(blob)
        if tensor is None:
            return False
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
        return True

    def _raw(self, req: Any, blob: memoryview) -> torch.Tensor:
        """A raw item's tensor (its chunk's dtype and size), a read-only view of ``blob``."""
        chunk = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset)))
        if chunk is None:  # (a KeyError would read as a file no live node holds)
            raise ValueError(f"{req.storage_index.fqn}: no chunk at {tuple(req.storage_index.offset)} in the metadata")
        dtype, size = chunk
        numel = size.numel()
        if len(blob) != numel * dtype.itemsize:
            raise ValueError(f"{req.storage_index.fqn}: {len(blob)} bytes stored, its chunk {tuple(size)} needs "
                             f"{numel * dtype.itemsize}")  # fmt: skip
        if numel == 0:
            return torch.empty(size, dtype=dtype)
        with warnings.catch_warnings():  # the view is read-only: it is only ever copied from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(blob, dtype=dtype, count=numel).view(size)
