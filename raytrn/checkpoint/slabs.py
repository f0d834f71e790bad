"""Shared-memory slabs: the in-memory tier's copy of a rank's snapshot on its own node (issue 29).

Through Ray's object store a snapshot cost two fresh allocations on the rank's node: the rank's ``ray.put`` and the
store's own copy (it must own it to outlive the rank). Each faults in every page of a new allocation (17 MB: ~3,300
page faults, ~20 ms of CPU). A slab is instead a file in ``/dev/shm`` (shared memory) that the node's store creates
and keeps: the rank maps it and copies its files in, one copy into pages that stay mapped, snapshot after snapshot.
Replicas on other nodes still go through Ray.

- :class:`SlabPool` (the store's side): slabs for this node's ranks, two per rank in steady state (the complete
  snapshot's and the one being made), any free one reused (grown when too small), the free ones removed when a new
  worker group starts; space reserved up front (``posix_fallocate``: writing into an unreserved tmpfs page would
  kill the writer with SIGBUS) and only while ``/dev/shm`` keeps ``keep_free`` bytes free beside it (Ray's object
  store may live there too, unreserved); else the lease is refused and the copy goes through Ray. The store frees a
  slab when it frees its snapshot.
- :class:`SlabWriter` (the rank's side): keeps each slab it wrote mapped and copies a snapshot's files into a lease.
- :func:`read_slab`: a reader on the same node maps a file read-only, in place.

Every slab is named ``raytrn-snapshot-<token>-<pid>-<n>``: the tier's token and the store's pid, and its store holds
an exclusive ``flock`` on it while it lives. The store removes its slabs when closed (:meth:`SlabPool.close`, at the
run's end); a store killed before (its node lost, the driver killed) leaves them, and the next store started on that
machine removes the slabs no store holds any more (:func:`sweep`: the kernel drops a dead process's locks, also
across PID namespaces sharing ``/dev/shm``), never any other file.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Where slabs live: the machine's shared memory (a tmpfs on Linux). None of it elsewhere: the copy goes through Ray.
SHM_DIR = Path("/dev/shm")
PREFIX = "raytrn-snapshot-"
_NAME = re.compile(r"^raytrn-snapshot-(?P<token>[0-9a-f]+)-(?P<pid>\d+)-(?P<n>\d+)$")
_ALIGN = 64  # each file's offset in a slab (the raw file's tensors keep their alignment)


@dataclass(frozen=True)
class Lease:
    """Where a rank copies its files of one snapshot: slab ``path``, each file's ``offsets`` and ``sizes``."""

    path: str
    offsets: dict[str, int]
    sizes: dict[str, int]


def layout(sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Each file's offset in a slab (in name order, aligned) and the bytes the slab needs."""
    offsets, end = {}, 0
    for name in sorted(sizes):
        offsets[name] = end
        end += -(-sizes[name] // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


def usable(directory: Path = SHM_DIR) -> bool:
    """Whether slabs can be made here: a writable directory (Linux's ``/dev/shm``; not on macOS)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def _held(path: str) -> bool:
    """Whether a live store holds slab ``path`` (its exclusive lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (drops the lock just taken)
    return False


def sweep(directory: Path = SHM_DIR, *, token: str | None = None) -> list[str]:
    """Remove the slabs no store holds any more (or, with ``token``, every slab of that tier), of this user, named
    as raytrn names them; returns their names."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = _NAME.match(entry.name)
            if m is None:
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_file(follow_symlinks=False):
                    continue
                if (token is not None and m["token"] == token) or not _held(entry.path):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


class SlabPool:
    """One node store's slabs (the store's side): leased per snapshot and rank, freed with the snapshot they hold,
    reused; removed by :meth:`close`. A slab is busy from its lease until its snapshot is freed, so the complete
    snapshot's slab is never written while a newer one is made."""

    def __init__(self, token: str, directory: Path = SHM_DIR, *, keep_free: int = 0) -> None:
        if not re.fullmatch(r"[0-9a-f]+", token):
            raise ValueError(f"slab token {token!r}: lowercase hex only")
        self.token, self.directory, self.keep_free = token, directory, keep_free
        self._prefix = f"{PREFIX}{token}-{os.getpid()}-"
        self._fds: dict[str, int] = {}  # every slab made: path -> its descriptor (holding the lock)
        self._sizes: dict[str, int] = {}  # path -> bytes reserved
        self._busy: dict[str, tuple[int, int]] = {}  # path -> (step, rank) it holds
        self._made = 0
        sweep(directory)  # what stores killed earlier on this machine left

    @property
    def nbytes(self) -> int:
        """The bytes reserved in shared memory (busy and free slabs)."""
        return sum(self._sizes.values())

    def lease(self, step: int, rank: int, sizes: Mapping[str, int]) -> Lease | None:
        """A slab for ``rank``'s files of snapshot ``step`` (a free one, grown when too small; else a new one), or
        None when shared memory has not the room (the copy then goes through Ray)."""
        self.release(lambda s, r: (s, r) == (step, rank))  # (a repeated put replaces the earlier one)
        offsets, need = layout(sizes)
        free = sorted((p for p in self._sizes if p not in self._busy), key=lambda p: self._sizes[p])
        path = next((p for p in free if self._sizes[p] >= need), free[-1] if free else None)
        if path is None:
            path = str(self.directory / f"{self._prefix}{self._made}")
            self._made += 1
        if self._sizes.get(path, 0) < need and not self._reserve(path, need):
            return None
        self._busy[path] = (step, rank)
        return Lease(path, offsets, dict(sizes))

    def holds(self, lease: Lease, step: int, rank: int) -> bool:
        """Whether ``lease``'s slab is still leased for ``rank``'s snapshot ``step`` (not freed, not re-leased)."""
        return self._busy.get(lease.path) == (step, rank)

    def _reserve(self, path: str, size: int) -> bool:
        grow = size - self._sizes.get(path, 0)
        try:
            room = os.statvfs(self.directory)
            if room.f_bavail * room.f_frsize - grow < self.keep_free:
                return False
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fds[path] = fd
            os.posix_fallocate(fd, 0, size)  # the pages exist now: a full tmpfs says so here, not as a SIGBUS later
        except OSError:
            if path not in self._sizes and path in self._fds:  # (made here just now: never another's file)
                self._remove(path)
            return False
        self._sizes[path] = size
        return True

    def _remove(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        self._sizes.pop(path, None)
        self._busy.pop(path, None)

    def release(self, which: Callable[[int, int], bool]) -> None:
        """Free the slabs holding the snapshots ``which(step, rank)`` names (kept, to be reused)."""
        for path, (step, rank) in list(self._busy.items()):
            if which(step, rank):
                del self._busy[path]

    def trim(self) -> None:
        """Remove the free slabs (a new worker group: its ranks may be others, on other nodes)."""
        for path in [p for p in self._sizes if p not in self._busy]:
            self._remove(path)

    def close(self) -> None:
        """Remove every slab (the run is over)."""
        for path in list(self._sizes):
            self._remove(path)


class SlabWriter:
    """The rank's side: its slabs stay mapped from one snapshot to the next (no page is faulted in again)."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def write(self, lease: Lease, files: Mapping[str, object]) -> None:
        """Copy ``files`` (bytes-like) into ``lease``'s slab."""
        need = max((lease.offsets[n] + lease.sizes[n] for n in lease.sizes), default=0)
        m = self._maps.get(lease.path)
        if m is None or len(m) < need:  # new, or grown by the store since
            if m is not None:
                m.close()
            for gone in [p for p in self._maps if p != lease.path and not os.path.exists(p)]:  # removed by the store
                with contextlib.suppress(BufferError):
                    self._maps.pop(gone).close()
            fd = os.open(lease.path, os.O_RDWR)
            try:
                m = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._maps[lease.path] = m
        slab = np.frombuffer(m, dtype=np.uint8)
        for name, data in files.items():
            src = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
            if src.size != lease.sizes[name]:
                raise ValueError(f"slab {lease.path}: {name} is {src.size} bytes, leased for {lease.sizes[name]}")
            start = lease.offsets[name]
            slab[start : start + src.size] = src
        del slab

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()


def read_slab(path: str, offset: int, size: int) -> memoryview:
    """A read-only view of ``size`` bytes at ``offset`` of slab ``path`` (this node's), mapped in place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return memoryview(m)[offset : offset + size]
