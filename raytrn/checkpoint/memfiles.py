"""DCP snapshots in host memory (the in-memory checkpoint tier's files, issue 29): a snapshot is what a durable DCP
checkpoint is (:mod:`raytrn.checkpoint.dcp`: every rank's shard file and rank 0's ``.metadata``), written into a dict
of bytes instead of a directory, so it reshards the same way on the way back (N ranks' files into M ranks).

- :class:`MemoryFileSystem`, :func:`load_from_memory`: DCP's file operations on ``{file name: bytes}``; the reader
  takes a ``fetch(name)`` for files held elsewhere (another node's store).
- :class:`Snapshotter`: one rank's snapshots (the only way one is written), reusing what stays the same from one
  to the next.

Where the files are kept and which snapshot a restart can use: :mod:`raytrn.checkpoint.memory`.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raytrn.checkpoint.dcp import LiveState, load_state, save_state
from raytrn.checkpoint.inplace import RAW_SUFFIX, InPlaceReader, ViewStream, raw_tensor
from raytrn.compat import dcp_stage, dcp_storage_info
from raytrn.errors import CheckpointError

#: The directory name DCP sees for a snapshot (it only joins file names to it).
_ROOT = "memory"


class MemoryFileSystem(FileSystemBase):
    """DCP's file operations on ``files`` (``{name: bytes}``). A file is there once its stream closed without an
    error; a name not in ``files`` is asked of ``fetch`` (then kept), else FileNotFoundError."""

    def __init__(
        self, files: dict[str, bytes] | None = None, fetch: Callable[[str], bytes | memoryview] | None = None
    ) -> None:
        self.files: dict[str, bytes] = {} if files is None else files
        self.fetch = fetch
        self._fetched: dict[str, bytes | memoryview] = {}  # what fetch gave (a view is not copied into files)
        self._lock = threading.Lock()  # DCP writes files from several threads with thread_count > 1

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        name = os.path.basename(os.fspath(path))
        if "w" in mode:
            buffer = _KeptBytes()
            yield buffer
            with self._lock:
                self.files[name] = buffer.kept if buffer.closed else buffer.getvalue()
            return
        data = self._read(name)
        yield io.BytesIO(data) if isinstance(data, bytes) else ViewStream(data)

    def keep(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """File ``name`` is ``data`` (written whole: a raw snapshot file)."""
        with self._lock:
            self.files[name] = data  # type: ignore[assignment]

    def _read(self, name: str) -> bytes | memoryview:
        with self._lock:
            data: bytes | memoryview | None = self.files.get(name, self._fetched.get(name))
        if data is None:
            if self.fetch is None:
                raise FileNotFoundError(name)
            data = self.fetch(name)
            with self._lock:
                self._fetched[name] = data
        return data

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        with self._lock:
            self.files[os.path.basename(os.fspath(new_path))] = self.files.pop(os.path.basename(os.fspath(path)))

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        with self._lock:
            return os.path.basename(os.fspath(path)) in self.files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        with self._lock:
            self.files.pop(os.path.basename(os.fspath(path)), None)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        with self._lock:
            return [self.concat_path(path, name) for name in self.files]


class _KeptBytes(io.BytesIO):
    """A BytesIO whose contents outlive its close (DCP closes the streams it writes)."""

    kept = b""

    def close(self) -> None:
        if not self.closed:
            self.kept = self.getvalue()
        super().close()


class _MemoryWriter(FileSystemWriter):
    """DCP's file writer into a :class:`MemoryFileSystem`, one file per rank, each tensor item stored as its raw
    bytes (:data:`raytrn.checkpoint.inplace.RAW_SUFFIX`: its dtype and size are in the checkpoint's metadata), not
    as a ``torch.save`` archive of its own: that archive was ~60% of a snapshot's write (~0.5 ms an item).

    One writer serves a rank's repeated snapshots (:class:`Snapshotter`): what stays the same from one to the next is
    kept, not made again (each kept thing is free for the next snapshot once the previous one's files are copied
    out, :func:`publish`):

    - the staging buffers (:meth:`stage`: the state's tensors copied into the same host memory every time);
    - the file's buffer (each item copied in by torch, without Python's lock the step needs);
    - each plain value's ``torch.save`` archive (the optimizer's hyperparameters, the schedule's), made again only
      when the value changed;
    - the layout (:meth:`repeat`): DCP's plan for this rank, each item's size and rank 0's ``.metadata``. A snapshot
      whose every item has the size, dtype and shape it had in the previous one, on every rank, is written into
      that layout without DCP's planning and its collectives (pickled plans and metadata gathered and scattered on
      every call, ~70% of a write and nearly all of its time under Python's lock, which the step needs too).
    """

    def __init__(self) -> None:
        super().__init__(_ROOT, thread_count=1, sync_files=False)  # fsync has no meaning for bytes in memory
        self.fs = MemoryFileSystem()  # type: ignore[assignment]  # as DCP's own FsspecWriter does
        self._host: dict[str, Any] | None = None  # the staging buffers (raytrn.compat.dcp_stage)
        self._file: torch.Tensor | None = None
        self._archives: dict[str, tuple[bytes, torch.Tensor]] = {}  # a plain value's fqn: (its pickle, its archive)
        self._coordinator = False
        self._layout: _Layout | None = None  # the last write's, once it is complete
        self.repeats = 0  # writes into the previous write's layout (a test's and a profile's count)

    @property
    def memfs(self) -> MemoryFileSystem:
        """The filesystem this write goes into (``fs``, which torch types as its local one)."""
        return cast(MemoryFileSystem, self.fs)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """DCP's staging (the copy the step waits for): ``state_dict`` with every tensor (a DTensor's shard) copied
        into this writer's host-memory buffers, allocated at the first snapshot and again only when the state's
        structure changed."""
        staged, self._host = dcp_stage(state_dict, self._host)
        return staged

    def forget_buffers(self) -> None:
        """The next :meth:`stage` allocates new staging buffers (the state's tensors were replaced)."""
        self._host = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator
        self._layout = None  # DCP plans this write: the previous layout is not used again until it completes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = [self._item(item, planner) for item in plan.items]
        results = self._write(plan, items)
        self._layout = _Layout(plan, [data.numel() for data in items], set(_flat(planner)), self._coordinator)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self._layout is not None:  # (rank 0) the pickled metadata, the same for a write into the same layout
            self._layout.metadata = self.memfs.files[".metadata"]

    def repeat(self, staged: dict[str, Any], *, process_group: Any, alone: bool = False) -> bool:
        """Write ``staged`` into the previous write's layout, without DCP's planning and collectives, when every
        rank can (one flag, agreed on ``process_group``: a collective; none ``alone``); False when one cannot (no
        complete write yet, or an item of another size, dtype or shape, an item more or less: then DCP plans the
        write, every rank)."""
        layout, items = self._layout, None
        if layout is not None and (layout.metadata is not None or not layout.coordinator):
            try:  # (never raises past the flag: the other ranks wait for it)
                planner = DefaultSavePlanner()
                planner.set_up_planner(staged, storage_meta=None, is_coordinator=layout.coordinator)
                items = layout.items(planner, self)
            except Exception:  # DCP's planning then says what is wrong, on every rank
                items = None
        group = process_group if process_group is not None or not dist.is_initialized() else dist.group.WORLD
        every = torch.tensor([int(items is not None)])
        if group is not None and not alone:
            dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
        if not every.item() or items is None or layout is None:
            return False
        self._write(layout.plan, items)
        if layout.metadata is not None:
            self.memfs.keep(".metadata", layout.metadata)
        self.repeats += 1
        return True

    def _write(self, plan: SavePlan, items: list[torch.Tensor]) -> list[WriteResult]:
        """This rank's file: ``items`` (``plan``'s, as bytes) copied into the file's buffer; where each is."""
        name = f"{plan.storage_data.prefix}0{RAW_SUFFIX}"
        offsets = [0]  # each item at a multiple of 64 bytes: every tensor view of the file is aligned
        for data in items:
            offsets.append(offsets[-1] + -(-data.numel() // 64) * 64)
        if self._file is None or self._file.numel() != offsets[-1]:
            self._file = torch.empty(offsets[-1], dtype=torch.uint8)
        results = []
        for item, data, offset in zip(plan.items, items, offsets, strict=False):
            self._file[offset : offset + data.numel()].copy_(data)
            results.append(WriteResult(item.index, data.numel(), dcp_storage_info(name, offset, data.numel())))
        self.memfs.keep(name, memoryview(self._file.numpy().data))
        return results

    def _item(self, item: Any, planner: SavePlanner) -> torch.Tensor:
        """A write item's bytes as a flat uint8 tensor: a tensor's raw (:func:`raw_tensor`), a plain value's archive
        (the previous snapshot's when the value pickles the same)."""
        if item.type != WriteItemType.BYTE_IO:
            return raw_tensor(planner.resolve_data(item))  # type: ignore[arg-type]
        lookup = getattr(planner, "lookup_object", None)
        try:
            value = pickle.dumps(lookup(item.index), protocol=pickle.HIGHEST_PROTOCOL) if lookup else None
        except Exception:  # not picklable as such (torch.save may still manage): archived every time
            value = None
        kept = self._archives.get(item.index.fqn)
        if value is None or kept is None or kept[0] != value:
            archive = bytearray(planner.resolve_data(item).getbuffer())  # type: ignore[union-attr]
            kept = (value or b"", torch.frombuffer(archive, dtype=torch.uint8))
            if value is not None:
                self._archives[item.index.fqn] = kept
        return kept[1]


def _flat(planner: SavePlanner) -> dict[str, Any]:
    """The planner's state dict, flattened (``set_up_planner`` made it: DCP's item names)."""
    return planner.state_dict  # type: ignore[attr-defined,no-any-return]


class _Layout:
    """A complete write's layout on this rank: DCP's final plan, each item's size in bytes, the state dict's
    (flattened) names, and on rank 0 the pickled metadata (``.metadata``), which names every rank's items' places."""

    def __init__(self, plan: SavePlan, sizes: list[int], names: set[str], coordinator: bool) -> None:
        self.plan, self.sizes, self.names, self.coordinator = plan, sizes, names, coordinator
        self.metadata: bytes | None = None

    def items(self, planner: SavePlanner, writer: _MemoryWriter) -> list[torch.Tensor] | None:
        """``planner``'s state's items as bytes, when each fits this layout: the same names, every tensor of the
        dtype and shape the metadata says, every item of the same size (its place in the file); else None."""
        if set(_flat(planner)) != self.names:
            return None
        out = []
        for item, size in zip(self.plan.items, self.sizes, strict=True):
            if item.type != WriteItemType.BYTE_IO:
                tensor = planner.resolve_data(item)
                chunk = item.tensor_data
                assert isinstance(tensor, torch.Tensor) and chunk is not None
                if tensor.dtype != chunk.properties.dtype or tuple(tensor.shape) != tuple(chunk.chunk.sizes):
                    return None
                data = raw_tensor(tensor)
            else:
                data = writer._item(item, planner)
            if data.numel() != size:
                return None
            out.append(data)
        return out


class _MemoryReader(InPlaceReader):
    """DCP's reader on a :class:`MemoryFileSystem`, its tensors read in place from the files' buffers."""

    def __init__(self, fs: MemoryFileSystem) -> None:
        super().__init__(_ROOT)
        self.memory = fs
        self.fs = fs  # type: ignore[assignment]  # (torch types it as its local one)

    def buffer(self, name: str) -> memoryview:
        return memoryview(self.memory._read(name))  # the file DCP's fallback reads too

    @property
    def where(self) -> str:
        return "in-memory snapshot"


class Snapshotter:
    """One rank's repeated snapshots of one training (:mod:`raytrn.train.snapshots`): the state dict
    (:class:`raytrn.checkpoint.dcp.LiveState`), the staging and file buffers and the plain values' archives
    (:class:`_MemoryWriter`) are built at the first snapshot and reused while they fit. One snapshot at a time:
    :meth:`stage`, then :meth:`write` (in any thread), whose files are valid until the next :meth:`write`. A write
    whose items all fit the previous one's layout skips DCP's planning and collectives (:meth:`_MemoryWriter.repeat`).
    (DCP's own plan cache is not used: it is kept per process and class, does not compare dtypes, and still gathers
    every rank's results and broadcasts the metadata.)"""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.state = LiveState(model, optimizer, scheduler)
        self.writer = _MemoryWriter()
        self._staged_for = 0  # the state dict's build the writer's staging buffers were made for

    def stage(self) -> dict[str, Any]:
        """The training's state as of now, copied to host memory (what the step waits for)."""
        state = self.state()
        if self.state.builds != self._staged_for:  # tensors replaced (maybe reshaped): new staging buffers
            self.writer.forget_buffers()
            self._staged_for = self.state.builds
        return self.writer.stage(state)

    def write(self, staged: dict[str, Any], *, process_group: Any, alone: bool = False) -> dict[str, bytes]:
        """Write ``staged`` as DCP does, into memory (a collective on ``process_group``, a gloo group of its own; None
        without a process group; ``alone``: this process's whole state as one process writes it, no collective
        whatever process group exists): this rank's files, ``{name: bytes}``."""
        fs = self.writer.fs = MemoryFileSystem()  # type: ignore[assignment]
        if not self.writer.repeat(staged, process_group=process_group, alone=alone):  # the last layout, else DCP's
            save_state(staged, self.writer, process_group=process_group, alone=alone)
        return dict(fs.files)


def load_from_memory(
    fetch: Callable[[str], bytes | memoryview], model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """Restore a snapshot written in any layout into this rank's, reading each file it needs through ``fetch``
    (``.metadata`` first; then only the files holding pieces of this rank's shards). As
    :func:`raytrn.checkpoint.dcp.load`, from memory. A file ``fetch`` cannot give (KeyError, FileNotFoundError)
    fails it with one CheckpointError naming the file."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load_state(_MemoryReader(MemoryFileSystem(fetch=fetch)), model, optimizer, scheduler)
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]  # DCP keeps (error, stack)
        missing = sorted({str(c.args[0]) for c in causes if isinstance(c, (KeyError, FileNotFoundError)) and c.args})
        if not missing:
            raise
        raise CheckpointError(
            f"in-memory snapshot: file(s) {', '.join(missing)} not held by any live node; restore from an older "
            "snapshot or the durable checkpoint"
        ) from None
