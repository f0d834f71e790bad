"""The in-memory tier's shared-memory slabs (raytrn.checkpoint.slabs) and a node store's use of them
(raytrn.checkpoint.memory.RayStore without Ray: lease, put, locate, free): files in a test directory standing for
/dev/shm."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from raytrn.checkpoint import slabs
from raytrn.checkpoint.memory import RayStore
from raytrn.checkpoint.memory_clients import Leased
from raytrn.checkpoint.messages import Refusal, Refused, SlabLocation

pytestmark = pytest.mark.unit

TOKEN = "0123abcd"


def _files(step: int, n: int = 1000) -> dict[str, bytes]:
    return {".metadata": bytes([step % 256]) * 17, "__0_0.raw": bytes((step + i) % 256 for i in range(n))}


def _sizes(files: dict[str, bytes]) -> dict[str, int]:
    return {k: len(v) for k, v in files.items()}


def _read(lease: slabs.Lease, name: str) -> bytes:
    return bytes(slabs.read_slab(lease.path, lease.offsets[name], lease.sizes[name]))


def test_a_ranks_snapshots_reuse_two_slabs_and_read_back_exactly(tmp_path: Path) -> None:
    """Snapshot after snapshot (each freed once the next one is complete, as a seal does) a rank copies into the same
    two slabs: the complete one's is never the one written; the bytes reserved do not grow; each file is read back
    in place, byte for byte, at an aligned offset."""
    pool = slabs.SlabPool(TOKEN, tmp_path)
    writer = slabs.SlabWriter()
    paths = []
    for step in range(1, 9):
        files = _files(step)
        lease = pool.lease(step, 0, _sizes(files))
        assert lease is not None
        writer.write(lease, files)
        assert all(_read(lease, n) == b for n, b in files.items())
        assert all(off % 64 == 0 for off in lease.offsets.values())
        pool.release(lambda s, _, step=step: s < step)  # step is complete: the older snapshot is freed
        paths.append(lease.path)
    assert len(set(paths)) == 2 and paths[0] != paths[1] and paths[2] == paths[0], paths
    assert pool.nbytes == 2 * slabs.layout(_sizes(_files(1)))[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"raytrn-snapshot-{TOKEN}-{os.getpid()}-{i}" for i in (0, 1)]
    writer.close()
    pool.close()
    assert list(tmp_path.iterdir()) == []


def test_a_bigger_snapshot_grows_its_slab_and_the_writer_maps_it_again(tmp_path: Path) -> None:
    pool = slabs.SlabPool(TOKEN, tmp_path)
    writer = slabs.SlabWriter()
    small = _files(1, 100)
    first = pool.lease(1, 3, _sizes(small))
    assert first is not None
    writer.write(first, small)
    pool.release(lambda s, r: True)
    big = _files(2, 100_000)
    second = pool.lease(2, 3, _sizes(big))
    assert second is not None and second.path == first.path  # the same slab, grown
    writer.write(second, big)
    assert _read(second, "__0_0.raw") == big["__0_0.raw"]
    assert Path(second.path).stat().st_size == slabs.layout(_sizes(big))[1]
    with pytest.raises(ValueError, match="is 5 bytes, leased for"):
        writer.write(second, {".metadata": b"12345"})
    writer.close()
    pool.close()


def test_no_room_in_shared_memory_refuses_the_lease_and_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    """posix_fallocate says ENOSPC (a full tmpfs): no lease (the rank then sends its files through Ray), no file."""
    pool = slabs.SlabPool(TOKEN, tmp_path)

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert pool.lease(1, 0, {"a": 10}) is None
    assert list(tmp_path.iterdir()) == [] and pool.nbytes == 0


def test_sweep_removes_only_slabs_no_live_store_holds(tmp_path: Path) -> None:
    """A store killed with its node (or its driver) leaves its slabs, no longer locked; the next store on the machine
    removes those, never a slab a live store holds (its lock; also across PID namespaces), never a file raytrn did
    not name so."""
    live = slabs.SlabPool(TOKEN, tmp_path)
    lease = live.lease(1, 0, {"a": 10})
    assert lease is not None
    names = [
        f"raytrn-snapshot-{TOKEN}-111-0",  # a dead store's
        "raytrn-snapshot-notes.txt",  # not a slab
        "other-file",
        f"raytrn-snapshot-{TOKEN}-111-0.bak",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert slabs.sweep(tmp_path) == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[1:], Path(lease.path).name])
    # A tier's own shutdown removes every slab of its token, held or not.
    assert slabs.sweep(tmp_path, token="ffff") == []
    assert slabs.sweep(tmp_path, token=TOKEN) == [Path(lease.path).name]
    live.close()
    with pytest.raises(ValueError, match="lowercase hex"):
        slabs.SlabPool("../x", tmp_path)


def test_a_lease_leaves_the_room_ray_may_need_and_a_new_group_trims_the_free_slabs(tmp_path: Path) -> None:
    """No lease when it would leave /dev/shm less than ``keep_free`` (Ray's object store, unreserved, may be there);
    any rank reuses a free slab; a new worker group's rewind removes the free ones (its ranks may be elsewhere)."""
    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    assert slabs.SlabPool(TOKEN, tmp_path, keep_free=free).lease(1, 0, {"a": 10}) is None
    assert list(tmp_path.iterdir()) == []
    store = _store(tmp_path)
    for rank in (0, 1):
        leased = store.lease(1, rank, {"a": 100}, 0)
        assert leased.refused is None and leased.lease is not None
        assert store.put_slab(1, rank, leased.lease, 0) is None
    store.seal(1)
    leased = store.lease(2, 5, {"a": 100}, 0)  # rank 5 (another group's numbering) on this node
    assert leased.refused is None and leased.lease is not None
    store.rewind(1, generation=1)  # a new group from step 1: 2's slab is free, then removed
    assert len(list(tmp_path.iterdir())) == 2 and store._slabs.nbytes == 2 * 128  # type: ignore[union-attr]
    store.close()


def _store(tmp_path: Path, capacity: int = 10**6) -> RayStore:
    store = RayStore(capacity, None)
    store._slabs = slabs.SlabPool(TOKEN, tmp_path)
    return store


def test_a_store_keeps_a_ranks_files_in_its_slab_and_frees_it_with_the_snapshot(tmp_path: Path) -> None:
    """lease, copy, put_slab: the store holds the files (counted against its bound), locates them in the slab; the
    seal of a newer snapshot frees the slab for the next lease; a rewind and a drop free theirs; a put from an older
    worker group is refused and its slab freed."""
    store, writer = _store(tmp_path), slabs.SlabWriter()

    def snapshot(step: int, generation: int = 0) -> Refusal | None:
        files = _files(step)
        leased = store.lease(step, 0, _sizes(files), generation)
        assert leased.refused is None and leased.lease is not None
        writer.write(leased.lease, files)
        return store.put_slab(step, 0, leased.lease, generation)

    assert snapshot(1) is None and store.seal(1) == sum(_sizes(_files(1)).values())
    where = store.locate(1, "__0_0.raw")
    assert isinstance(where, SlabLocation) and where.size == len(_files(1)["__0_0.raw"])
    assert bytes(slabs.read_slab(where.path, where.offset, where.size)) == _files(1)["__0_0.raw"]
    assert snapshot(2) is None and store.seal(2) is not None
    assert store.locate(1, "__0_0.raw") is None and snapshot(3) is None  # 1's slab, freed by the seal of 2, reused
    assert len(store._slabs._sizes) == 2  # type: ignore[union-attr]
    store.rewind(2, generation=1)  # 3 forgotten: its slab free
    assert len(store._slabs._busy) == 1  # type: ignore[union-attr]  # only the complete snapshot's
    # A lease of the older group, then the rewind (its slab is freed), then its put: refused.
    lease = store.lease(3, 0, _sizes(_files(3)), 1).lease
    assert lease is not None
    store.rewind(2, generation=2)
    assert store.put_slab(3, 0, lease, 1) == Refusal(Refused.SLAB_FREED, 3, 0)
    assert len(store._slabs._busy) == 1  # type: ignore[union-attr]
    # A late put naming a slab that is no longer leased for that step and rank: refused, the current lease kept.
    newer = store.lease(3, 0, _sizes(_files(3)), 2).lease
    assert newer is not None
    assert store.put_slab(3, 0, slabs.Lease("/elsewhere", newer.offsets, newer.sizes), 2) == Refusal(
        Refused.SLAB_FREED, 3, 0
    )
    assert store._slabs.holds(newer, 3, 0)  # type: ignore[union-attr]
    assert store.lease(3, 0, _sizes(_files(3)), 1) == Leased(
        refused=Refusal(Refused.STALE, 3, 0, generation=1, current=2)
    )
    assert snapshot(3, generation=2) is None
    store.drop(3, generation=2)
    assert len(store._slabs._busy) == 1 and len(store._slabs._sizes) == 2  # type: ignore[union-attr]
    # Over the bound: refused at the lease, before anything is copied.
    (tmp_path / "small").mkdir()
    small = _store(tmp_path / "small", capacity=100)
    reason = small.lease(1, 0, _sizes(_files(1)), 0)
    assert reason.lease is None and reason.refused is not None
    assert reason.refused.kind is Refused.NO_ROOM and reason.refused.capacity == 100
    writer.close()
    store.close()
    assert [p for p in tmp_path.iterdir() if p.is_file()] == []
