"""The memory tier under live recovery (raytrn.train.live_snapshots): the live rank 0 snapshots its whole replica
alone, with no collective, while the other replicas train on; a member that becomes rank 0 takes over."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import memfiles
from raytrn.checkpoint.messages import StoresRewound
from raytrn.checkpoint.progress import Progress
from raytrn.train.build import build_training
from raytrn.train.step import train_step
from tests.unit.gloo_ranks import start_ranks
from tests.unit.memory_stand_ins import StandInKeeper
from tests.unit.test_dcp import job, trained
from tests.unit.test_memory_tier import _batches, _free_port, _moments, _params

pytestmark = pytest.mark.unit


class _Placed:
    """Records what a snapshot asked to place on the stores, in place of :func:`raytrn.checkpoint.memory.publish`
    (whose copies are Ray objects: a unit test starts no Ray; the placement itself is tested in test_memory_tier):
    the ring's nodes, the rank, the step, and the files (or the manifest); every placement succeeds."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, ring: dict[str, Any], node: str, step: int, rank: int, files: Any, **kw: Any) -> tuple[()]:
        self.calls.append({"ring": sorted(ring), "node": node, "step": step, "rank": rank,
                           "files": sorted(files or {}), "manifest": kw.get("manifest")})  # fmt: skip
        return ()


def _replica(rank: int, port: int, tmp: str, out: dict) -> None:
    """One of two live replicas (whole models, the same batches): rank 0 snapshots alone twice, through the tier's
    writer and through the snapshotter directly, while rank 1 only waits; then both meet in one barrier. A collective
    issued by rank 0's snapshots would meet rank 1's barrier instead (a mismatch, or the 20 s timeout)."""
    from raytrn.train import snapshots as tier
    from raytrn.train.snapshots import MemorySnapshots

    placed = tier.publish = _Placed()  # (this spawned process's own module)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    try:
        j = job(Path(tmp), "checkpoint.memory_every_n_steps=1")
        t = build_training(j, CpuBackend(), world_size=1)  # a whole replica (no layout), as the live loop builds it
        for batch in _batches(0, 2):
            train_step(t, iter([batch]), CpuBackend())
        if rank == 0:
            keeper = StandInKeeper()
            snaps = MemorySnapshots(j, keeper, rank=0, world_size=1, alone_on=["node-b"], node="node-a")
            snaps.starting_at(2)
            snaps.save(t, Progress(step=2))
            complete = snaps.written()
            snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
            files = snapshotter.write(snapshotter.stage(), process_group=None, alone=True)
            out[0] = {
                "complete": complete, "ring": sorted(snaps.ring), "rewinds": keeper.rewinds,
                "sealed": {n: list(s.sealed) for n, s in keeper.stores.items()},  # type: ignore[attr-defined]
                "placed": placed.calls,
                "files": {n: bytes(b) for n, b in files.items()}, "params": _params(t), "moments": _moments(t),
            }  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_live_rank_0_snapshots_its_whole_replica_alone_and_it_restores_exactly(tmp_path: Path) -> None:
    """Rank 0 of a two-replica live group writes, seals and copies its snapshot with no collective (its peer issues
    none meanwhile), its copies on its own node's store and the other member's; its files are one process's whole
    state, which a new process restores bit-equal (weights and moments)."""
    with mp.Manager() as manager:
        out = manager.dict()
        start_ranks(_replica, _free_port(), str(tmp_path), out, nprocs=2, join=True)
        r = dict(out[0])
    assert r["complete"] and r["rewinds"] == [2], r
    assert r["ring"] == ["node-a", "node-b"] and r["sealed"] == {"node-a": [2], "node-b": [2]}, r["sealed"]
    files, manifest = r["placed"]  # rank 0's files, then the manifest, on the ring over both members' nodes
    assert files["files"] == [".metadata", "__0_0.raw"] and files["ring"] == ["node-a", "node-b"], r["placed"]
    assert manifest["manifest"]["world_size"] == 1 and manifest["manifest"]["step"] == 2, manifest
    assert sorted(r["files"]) == [".metadata", "__0_0.raw"]  # one writer, the whole state
    fresh = build_training(job(tmp_path), CpuBackend(), world_size=1)
    memfiles.load_from_memory(r["files"].__getitem__, fresh.model, fresh.optimizer, fresh.scheduler)
    assert all(torch.equal(_params(fresh)[n], v) for n, v in r["params"].items())
    assert all(torch.equal(a, b) for a, b in zip(_moments(fresh), r["moments"], strict=True))
    assert fresh.scheduler.state_dict()["last_epoch"] == 2


@dataclass
class _Generation:
    members: tuple[str, ...]


@dataclass
class _Group:
    """What LiveSnapshots reads of a live group: the shared store, this member, its rank and the generation."""

    store: Any
    member: str
    rank: int
    generation: _Generation

    @property
    def size(self) -> int:
        return len(self.generation.members)


def _live(tmp: Path, keeper: StandInKeeper, store: Any, member: str, rank: int, members: tuple[str, ...]) -> Any:
    from raytrn.train.live_snapshots import LiveSnapshots

    group = _Group(store, member, rank, _Generation(members))
    every = job(tmp, "checkpoint.memory_every_n_steps=1")
    return LiveSnapshots(every, keeper, cast(Any, group), f"node-{member}"), group


def _settled(live: Any) -> Any:
    """``live`` once its rank 0's snapshot in flight (and a rollback's rewind) ended: the test's steps then find
    nothing in flight (rank 0 never waits for the tier: a step with a snapshot in flight takes none)."""
    writer = live.writer
    if writer is not None and writer._writing is not None:
        assert writer._writing.done.wait(20)
    if live._rewinding is not None:
        live._rewinding.join(20)
    return live


def test_the_founding_rank_0_writes_on_from_the_restore_and_a_new_rank_0_takes_over_in_its_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Founders restore through the tier (its rewind sets the stores' generation, kept in the live store); the
    founding rank 0 writes in it (every step, as asked); a member that is not rank 0 writes nothing; the ring widens
    to a newcomer's node (the same writer); after a member is lost rank 0 leaves the snapshot in flight and writes on
    with a new writer over the live nodes; a member that becomes rank 0 writes in the same generation (no rewind: a
    rewind waits on the lost node's store); a rollback marks itself done with the keeper and rewinds the stores in a
    thread (a new generation, in the live store), the steps meanwhile taking none."""
    from raytrn.train import snapshots as tier
    from raytrn.train.live_snapshots import GENERATION_KEY

    monkeypatch.setattr(tier, "publish", _Placed())
    store, keeper = dist.HashStore(), StandInKeeper()
    t = trained(job(tmp_path))
    a, group_a = _live(tmp_path, keeper, store, "a", 0, ("a", "b", "c"))
    b, group_b = _live(tmp_path, keeper, store, "b", 1, ("a", "b", "c"))
    _live(tmp_path, keeper, store, "c", 2, ("a", "b", "c"))
    restorer = a.restorer()
    assert restorer is not None and not restorer.taking  # the founders' restore takes no snapshots
    restorer.starting_at(0)  # (what the restore's find does: rank 0 rewinds, every founder gets the generation)
    a.started()
    assert store.get(GENERATION_KEY) == b"1"
    for step in (1, 2, 3):
        _settled(a).step_done(t, Progress(step=step), final=False, checkpoint=False)
        b.step_done(t, Progress(step=step), final=False, checkpoint=False)
    first = _settled(a).writer
    assert keeper.rewinds == [0] and first.generation == 1 and b.writer is None  # no second rewind; rank 1 none
    assert sorted(first.ring) == ["node-a", "node-b", "node-c"]
    assert keeper.stores["node-a"].sealed == [1, 2, 3]  # type: ignore[attr-defined]
    _live(tmp_path, keeper, store, "d", 3, ("a", "b", "c", "d"))
    group_a.generation = _Generation(("a", "b", "c", "d"))  # d admitted: the same writer, its ring widened
    a.step_done(t, Progress(step=4), final=False, checkpoint=False)
    assert a.writer is first and sorted(first.ring) == ["node-a", "node-b", "node-c", "node-d"]
    a.step_done(t, Progress(step=5), final=False, checkpoint=False)  # (4 in flight or done: 5 taken only if done)
    group_a.generation = _Generation(("a", "b", "d"))  # c lost: a new writer over the live nodes, nothing waited for
    _settled(a).step_done(t, Progress(step=6), final=False, checkpoint=False)
    assert (
        a.writer is not first and a.writer.generation == 1 and sorted(a.writer.ring) == ["node-a", "node-b", "node-d"]
    )
    _settled(a).step_done(t, Progress(step=7), final=True, checkpoint=True)  # the group's final step: none taken
    assert max(keeper.stores["node-d"].sealed) == 6  # type: ignore[attr-defined]
    second = a.writer
    a.close()
    # a lost: b becomes rank 0 and writes on in the group's generation from step 8
    group_b.rank, group_b.generation = 0, _Generation(("b", "d"))
    b.step_done(t, Progress(step=8), final=False, checkpoint=False)
    assert keeper.rewinds == [0] and b.writer.generation == 1 and sorted(b.writer.ring) == ["node-b", "node-d"]
    keeper.rewound = StoresRewound(2)
    _settled(b).rewound(5, 4)  # a rollback of steps 5 on, in place to step 4
    assert b.writer is None
    _settled(b).step_done(t, Progress(step=5), final=False, checkpoint=False)  # rank 0 rewinds, in its thread
    assert _settled(b).writer is None and keeper.forgotten == [5] and keeper.rewinds == [0, 4]
    assert store.get(GENERATION_KEY) == b"2"
    b.step_done(t, Progress(step=6), final=False, checkpoint=False)
    assert _settled(b).writer.generation == 2  # what it snapshots now the stores take
    last = _settled(b).writer
    group_b.rank = 1  # (were it no longer rank 0: its writer goes)
    b.step_done(t, Progress(step=7), final=False, checkpoint=False)
    assert b.writer is None and b.metrics() == {}
    # every writer's thread has ended (closed: none outlives the test, which would publish with Ray's objects)
    for writer in (first, second, last):
        assert writer._thread is not None
        writer._thread.join(20)
        assert not writer._thread.is_alive()


def test_by_default_the_live_rank_0_snapshots_at_the_checkpoint_steps_only(tmp_path: Path) -> None:
    """Auto under live recovery: a snapshot at each checkpoint step (a restart after every replica was lost reads that
    state from memory), not every step as the restart path's auto on several nodes; never the group's final step;
    N asked: every N steps and at the checkpoints."""
    from raytrn.train.snapshots import MemorySnapshots

    keeper = StandInKeeper()
    auto = MemorySnapshots(job(tmp_path), keeper, rank=0, world_size=1, alone_on=["node-b"], node="node-a")
    assert auto.taking and [s for s in range(1, 41) if auto.due(s, final=False, checkpoint=s % 20 == 0)] == [20, 40]
    assert not auto.due(40, final=True, checkpoint=True)
    every = MemorySnapshots(job(tmp_path, "checkpoint.memory_every_n_steps=15"), keeper, rank=0, world_size=1,
                            alone_on=["node-b"], node="node-a")  # fmt: skip
    assert [s for s in range(1, 41) if every.due(s, final=False, checkpoint=s % 20 == 0)] == [15, 20, 30, 40]
    off = MemorySnapshots(job(tmp_path, "checkpoint.memory_every_n_steps=0"), keeper, rank=0, world_size=1,
                          alone_on=["node-b"], node="node-a")  # fmt: skip
    assert not off.taking and not off.due(20, final=False, checkpoint=True)
