"""The in-memory checkpoint tier's building blocks (issue 29): DCP snapshots held in host memory, where they are
kept, and which one a restart can use.

A snapshot is what a durable DCP checkpoint is (:mod:`raytrn.checkpoint.dcp`: every rank's shard file and rank 0's
``.metadata``), written into a dict of bytes instead of a directory, so it reshards the same way on the way back
(N ranks' files into M ranks). Here:

- :class:`MemoryFileSystem`, :func:`save_to_memory`, :func:`load_from_memory`: DCP's file operations on
  ``{file name: bytes}``; the reader takes a ``fetch(name)`` for files held elsewhere (another node's store).
- :class:`SnapshotStore`: what one node keeps (its ranks' files and the copies of other nodes'), bounded in bytes:
  a snapshot that does not fit is refused with the bytes it needed, never an out-of-memory; a newer complete
  snapshot frees the older ones.
- :func:`replica_nodes`: ring placement, so a node's state always lives on ``replicas`` other nodes too.
- :func:`newest_restorable`: the newest snapshot whose every rank's files and manifest are on a live store, with
  why each newer one was passed over.

Not yet wired into the loop (the store actors, the per-step snapshot and the restore choice against the durable
commit are the next steps): see docs/elasticity.md.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from raytrn.checkpoint.dcp import load_state, save_state
from raytrn.errors import CheckpointError

#: The directory name DCP sees for a snapshot (it only joins file names to it).
_ROOT = "memory"


class MemoryFileSystem(FileSystemBase):
    """DCP's file operations on ``files`` (``{name: bytes}``). A file is there once its stream closed without an
    error; a name not in ``files`` is asked of ``fetch`` (then kept), else FileNotFoundError."""

    def __init__(self, files: dict[str, bytes] | None = None, fetch: Callable[[str], bytes] | None = None) -> None:
        self.files: dict[str, bytes] = {} if files is None else files
        self.fetch = fetch
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
        yield io.BytesIO(self._read(name))

    def _read(self, name: str) -> bytes:
        with self._lock:
            data = self.files.get(name)
        if data is None:
            if self.fetch is None:
                raise FileNotFoundError(name)
            data = self.fetch(name)
            with self._lock:
                self.files[name] = data
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
    def __init__(self) -> None:
        super().__init__(_ROOT, thread_count=1, sync_files=False)  # fsync has no meaning for bytes in memory
        self.fs = MemoryFileSystem()  # type: ignore[assignment]  # as DCP's own FsspecWriter does


class _MemoryReader(FileSystemReader):
    def __init__(self, fs: MemoryFileSystem) -> None:
        super().__init__(_ROOT)
        self.fs = fs  # type: ignore[assignment]


def save_to_memory(state: dict[str, Any]) -> dict[str, bytes]:
    """Write ``state`` as DCP does (every rank its shards, rank 0 also ``.metadata``; a collective when a process
    group is up): the files this rank wrote, ``{name: bytes}``."""
    writer = _MemoryWriter()
    save_state(state, writer)
    return dict(writer.fs.files)  # type: ignore[attr-defined]


def load_from_memory(
    fetch: Callable[[str], bytes], model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
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


# -- one node's store ----------------------------------------------------------------------------------------


@dataclass
class Holding:
    """What one store holds of one snapshot: the ranks whose files it has, and the manifest when it has it."""

    ranks: set[int] = field(default_factory=set)
    manifest: dict[str, Any] | None = None
    nbytes: int = 0


class SnapshotStore:
    """One node's snapshots of one run: its own ranks' files and the copies it keeps for other nodes.

    Bounded: :meth:`put` refuses (returns the reason) what would take it past ``capacity_bytes`` after freeing
    snapshots older than the newest complete one; it never holds more. :meth:`seal` marks a snapshot complete
    (every rank's files everywhere they belong, as the caller checked) and frees everything older."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._files: dict[int, dict[int, dict[str, bytes]]] = {}  # step -> rank -> name -> bytes
        self._manifests: dict[int, dict[str, Any]] = {}
        self._sealed: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for ranks in self._files.values() for files in ranks.values() for b in files.values())

    def put(self, step: int, rank: int, files: Mapping[str, bytes]) -> str | None:
        """Keep ``rank``'s files of snapshot ``step``; None when kept, else why not (nothing is kept then)."""
        if self._sealed is not None and step <= self._sealed:
            return f"snapshot {step} is not newer than the complete snapshot {self._sealed}"
        size = sum(len(b) for b in files.values())
        held = self.nbytes - sum(len(b) for b in self._files.get(step, {}).get(rank, {}).values())
        if held + size > self.capacity_bytes:
            return (
                f"rank {rank}'s snapshot {step} needs {size / 2**20:.1f} MiB; this node's store holds "
                f"{held / 2**20:.1f} of {self.capacity_bytes / 2**20:.1f} MiB"
            )
        self._files.setdefault(step, {})[rank] = dict(files)
        return None

    def put_manifest(self, step: int, manifest: dict[str, Any]) -> None:
        self._manifests[step] = dict(manifest)

    def seal(self, step: int) -> None:
        """Snapshot ``step`` is complete: everything older is freed."""
        self._sealed = step if self._sealed is None else max(self._sealed, step)
        for old in [s for s in self._files if s < self._sealed]:
            del self._files[old]
        for old in [s for s in self._manifests if s < self._sealed]:
            del self._manifests[old]

    def drop(self, step: int) -> None:
        """Free snapshot ``step`` (one that will never complete: a rank failed to write it)."""
        self._files.pop(step, None)
        self._manifests.pop(step, None)

    def holdings(self) -> dict[int, Holding]:
        steps = set(self._files) | set(self._manifests)
        return {
            s: Holding(
                ranks=set(self._files.get(s, {})),
                manifest=self._manifests.get(s),
                nbytes=sum(len(b) for files in self._files.get(s, {}).values() for b in files.values()),
            )
            for s in steps
        }

    def read(self, step: int, name: str) -> bytes | None:
        """The file ``name`` of snapshot ``step`` (any rank's), None when this store has not got it."""
        for files in self._files.get(step, {}).values():
            if name in files:
                return files[name]
        return None


# -- placement and choice ------------------------------------------------------------------------------------


def replica_nodes(nodes: Iterable[str], node: str, replicas: int) -> list[str]:
    """The ``replicas`` nodes that keep copies of ``node``'s snapshot: the next ones on the ring of ``nodes``
    (sorted, so every rank computes the same ring), never ``node`` itself; fewer when there are fewer others."""
    ring = sorted(set(nodes) | {node})
    i = ring.index(node)
    others = ring[i + 1 :] + ring[:i]
    return others[: max(0, replicas)]


@dataclass(frozen=True)
class Choice:
    """The snapshot a restart can use (``step`` None: none), and why each newer one was passed over."""

    step: int | None
    manifest: dict[str, Any] | None
    skipped: tuple[str, ...]


def newest_restorable(holdings: Mapping[str, Mapping[int, Holding]], alive: Iterable[str]) -> Choice:
    """The newest snapshot whose manifest and every rank's files (0 .. the manifest's ``world_size`` - 1) are on
    a store of a live node. ``holdings``: each node's :meth:`SnapshotStore.holdings`."""
    live = {n: h for n, h in holdings.items() if n in set(alive)}
    steps = sorted({s for h in holdings.values() for s in h}, reverse=True)
    skipped: list[str] = []
    for step in steps:
        manifest = next((h[step].manifest for h in live.values() if step in h and h[step].manifest), None)
        if manifest is None:
            skipped.append(f"snapshot {step}: no manifest on a live node (never completed, or only on lost nodes)")
            continue
        world = int(manifest["world_size"])
        have = set().union(*(h[step].ranks for h in live.values() if step in h))
        missing = sorted(set(range(world)) - have)
        if missing:
            lost = sorted(
                n for n, h in holdings.items() if n not in live and step in h and set(missing) & h[step].ranks
            )
            where = f" (their only copies were on lost node(s) {', '.join(lost)})" if lost else ""
            skipped.append(f"snapshot {step}: rank(s) {_ranges(missing)} of {world} missing{where}")
            continue
        return Choice(step, manifest, tuple(skipped))
    return Choice(None, None, tuple(skipped))


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
