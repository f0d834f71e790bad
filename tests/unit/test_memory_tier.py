"""The in-memory checkpoint tier's building blocks (raytrn.checkpoint.memory): DCP snapshots in host memory that
reshard like durable checkpoints (real gloo processes), one node's bounded store, ring placement, and the choice of
the newest snapshot a restart can use. No Ray."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import dcp, memfiles
from raytrn.checkpoint.memory import Holding, SnapshotStore, newest_restorable, replica_nodes
from raytrn.checkpoint.messages import Passed, PassedOver, Refusal, Refused
from raytrn.errors import CheckpointError
from raytrn.train.build import build_training
from raytrn.train.step import train_step
from tests.unit.gloo_ranks import spawn_ranks
from tests.unit.memory_stand_ins import StandInKeeper
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit


def _params(t: Any) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in t.model.named_parameters()
    }


def _moments(t: Any) -> list[torch.Tensor]:
    return [s["exp_avg"].clone() for s in t.optimizer.state.values()]


def _batches(seed: int, steps: int = 2) -> Any:
    rows = torch.randint(0, 512, (steps * 16, 17), generator=torch.Generator().manual_seed(seed))
    return iter(rows.split(16))


def snapshot_files(t: Any) -> dict[str, bytes]:
    """This rank's files of a snapshot of ``t`` (one process), copied out of the snapshot writer's buffers."""
    snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
    return {name: bytes(data) for name, data in snapshotter.write(snapshotter.stage(), process_group=None).items()}


def test_a_snapshot_in_memory_restores_weights_moments_schedule_and_rng_exactly(tmp_path: Path) -> None:
    j = job(tmp_path)
    t = trained(j)
    files = snapshot_files(t)
    assert sorted(files) == [".metadata", "__0_0.raw"] and all(files.values())
    assert not any(tmp_path.iterdir())  # nothing reached the checkpoint storage
    rng = torch.get_rng_state()
    torch.manual_seed(123)  # the restore must bring the saved RNG back

    fresh = build_training(j, CpuBackend(), world_size=1)
    asked: list[str] = []
    memfiles.load_from_memory(lambda name: asked.append(name) or files[name], fresh.model, fresh.optimizer,
                            fresh.scheduler)  # fmt: skip
    assert sorted(set(asked)) == [".metadata", "__0_0.raw"]
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in _params(t).items():
        assert torch.equal(_params(fresh)[name], value), name
    assert all(torch.equal(a, b) for a, b in zip(_moments(t), _moments(fresh), strict=True))
    assert fresh.scheduler.state_dict() == t.scheduler.state_dict()
    # The next step is the same step: same loss, same weights.
    before, after = train_step(t, _batches(7), CpuBackend()), train_step(fresh, _batches(7), CpuBackend())
    assert before.loss.item() == after.loss.item() and before.grad_norm.item() == after.grad_norm.item()
    for name, value in _params(t).items():
        assert torch.equal(_params(fresh)[name], value), name


def _flat(obj: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, (*path, key)).items()}
    if isinstance(obj, list):
        return {k: v for i, value in enumerate(obj) for k, v in _flat(value, (*path, i)).items()}
    return {path: obj}


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        other = flat_b[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def test_the_live_state_is_the_training_state_after_every_step_and_is_rebuilt_when_tensors_are_replaced(
    tmp_path: Path,
) -> None:
    """Snapshots every step reuse one state dict (its tensors are the training's, updated in place): after more
    steps it still equals a fresh ``training_state`` (weights, moments, the learning rate the schedule moved, the
    schedule, the RNG) without being built again; a restore's new optimizer tensors build it again."""
    import copy

    t = trained(job(tmp_path))
    live = dcp.LiveState(t.model, t.optimizer, t.scheduler)
    lrs = [live()["optim"]["param_groups"][0]["lr"]]
    for seed in (3, 4):
        train_step(t, _batches(seed, 1), CpuBackend())
        _same_state(live(), dcp.training_state(t.model, t.optimizer, t.scheduler))
        lrs.append(live()["optim"]["param_groups"][0]["lr"])
    assert live.builds == 1 and len(set(lrs)) == 3  # the warmup moved the learning rate at every step
    t.optimizer.load_state_dict(copy.deepcopy(t.optimizer.state_dict()))  # new moment tensors, as a restore makes
    train_step(t, _batches(5, 1), CpuBackend())
    _same_state(live(), dcp.training_state(t.model, t.optimizer, t.scheduler))
    assert live.builds == 2
    live()
    assert live.builds == 2
    t.optimizer.param_groups[0]["weight_decay"] = torch.tensor(0.1)  # a plain value becomes a tensor: built again
    state = live()
    assert live.builds == 3 and torch.equal(state["optim"]["param_groups"][0]["weight_decay"], torch.tensor(0.1))


def test_repeated_snapshots_reuse_their_buffers_and_each_restores_its_own_step(tmp_path: Path) -> None:
    """One :class:`memfiles.Snapshotter` for every snapshot of a training (staging and file buffers, plain values'
    archives reused; new ones after a restore's new tensors): each snapshot, copied out before the next, restores
    exactly its own step."""
    import copy

    j = job(tmp_path)
    t = trained(j)
    snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
    taken = []
    for seed in (5, 6, None):
        files = snapshotter.write(snapshotter.stage(), process_group=None)
        taken.append(({n: bytes(b) for n, b in files.items()}, _params(t), _moments(t), t.scheduler.state_dict()))
        if seed is not None:
            train_step(t, _batches(seed, 1), CpuBackend())
    assert snapshotter.state.builds == 1
    assert len({repr(scheduler) for *_, scheduler in taken}) == 3  # the schedule moved between the snapshots
    buffers = snapshotter.writer._host
    t.optimizer.load_state_dict(copy.deepcopy(t.optimizer.state_dict()))  # new moment tensors, as a restore makes
    train_step(t, _batches(7, 1), CpuBackend())
    files = snapshotter.write(snapshotter.stage(), process_group=None)
    taken.append(({n: bytes(b) for n, b in files.items()}, _params(t), _moments(t), t.scheduler.state_dict()))
    assert snapshotter.state.builds == 2 and snapshotter.writer._host is not buffers  # staged anew
    # Planned by DCP once: the others were written into its layout (new tensors of the same shapes: the same layout).
    assert snapshotter.writer.repeats == 3
    for files, params, moments, scheduler in taken:
        fresh = build_training(j, CpuBackend(), world_size=1)
        memfiles.load_from_memory(files.__getitem__, fresh.model, fresh.optimizer, fresh.scheduler)
        assert all(torch.equal(_params(fresh)[n], v) for n, v in params.items())
        assert all(torch.equal(a, b) for a, b in zip(moments, _moments(fresh), strict=True))
        assert fresh.scheduler.state_dict() == scheduler
        assert fresh.optimizer.param_groups[0]["lr"] == scheduler["_last_lr"][0]


def test_a_snapshot_whose_layout_changed_is_planned_again_and_restores_exactly(tmp_path: Path) -> None:
    """A snapshot is written into the previous one's layout only when every item has the same size, dtype and
    shape: a plain value whose archive grew (a longer pickle, past torch.save's padding) or a tensor of another
    dtype (the same bytes) is planned by DCP again, and each snapshot restores exactly its own state."""
    j = job(tmp_path)
    t = trained(j)
    snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
    snapshotter.write(snapshotter.stage(), process_group=None)
    taken = []
    t.scheduler.last_epoch = 10**600  # its archive is 256 bytes longer: the items after it move in the file
    taken.append(({n: bytes(b) for n, b in snapshotter.write(snapshotter.stage(), process_group=None).items()},
                  _params(t), t.scheduler.state_dict()))  # fmt: skip
    assert snapshotter.writer.repeats == 0
    name, param = next((n, p) for n, p in t.model.named_parameters() if p.dim() == 2)
    with torch.no_grad():  # the same bytes as another dtype: every item of the same size, read otherwise
        param.data = param.data.view(torch.bfloat16)
    staged = snapshotter.stage()
    assert staged["model"][name].dtype == torch.bfloat16
    snapshotter.write(staged, process_group=None)
    assert snapshotter.writer.repeats == 0
    with torch.no_grad():
        param.data = param.data.view(torch.float32)
    snapshotter.write(snapshotter.stage(), process_group=None)
    taken.append(({n: bytes(b) for n, b in snapshotter.write(snapshotter.stage(), process_group=None).items()},
                  _params(t), t.scheduler.state_dict()))  # fmt: skip
    assert snapshotter.writer.repeats == 1  # the last one: the same layout as the one before it
    for files, params, scheduler in taken:
        fresh = build_training(j, CpuBackend(), world_size=1)
        memfiles.load_from_memory(files.__getitem__, fresh.model, fresh.optimizer, fresh.scheduler)
        assert all(torch.equal(_params(fresh)[n], v) for n, v in params.items())
        assert fresh.scheduler.state_dict() == scheduler


def test_a_file_missing_from_memory_fails_the_restore_naming_it(tmp_path: Path) -> None:
    j = job(tmp_path)
    t = trained(j)
    files = snapshot_files(t)
    del files["__0_0.raw"]
    fresh = build_training(j, CpuBackend(), world_size=1)
    with pytest.raises(CheckpointError, match=r"file\(s\) __0_0.raw not held by any live node"):
        memfiles.load_from_memory(lambda name: files[name], fresh.model, fresh.optimizer, fresh.scheduler)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fsdp_rank(rank: int, world: int, port: int, tmp: str, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        j = job(Path(tmp), "parallel.data_parallel=fsdp")
        t = build_training(j, CpuBackend(), world_size=world)
        group = dist.new_group(backend="gloo")
        snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
        for batch in _batches(0, 2):  # the same global batches on both ranks: a deterministic state
            train_step(t, iter([batch]), CpuBackend())
            if t.scheduler.state_dict()["last_epoch"] == 1:  # a snapshot of step 1, whose buffers step 2's reuses
                snapshotter.write(snapshotter.stage(), process_group=group)
        # Staged now, written in the background (its collectives on a group of its own) while the next step trains.
        pool = ThreadPoolExecutor(1)
        future = pool.submit(snapshotter.write, snapshotter.stage(), process_group=group)
        full = _params(t)  # a collective: every rank gathers (on the default group, beside the write's)
        train_step(t, iter([next(_batches(1, 1))]), CpuBackend())  # the state moves on; the snapshot keeps step 2
        moved = _params(t)
        files = future.result()
        pool.shutdown()
        assert snapshotter.state.builds == 1
        assert snapshotter.writer.repeats == 1  # step 2's snapshot: step 1's layout, agreed by both ranks
        files = {n: bytes(b) for n, b in files.items()}
        if rank == 1:  # as after a failed write on rank 1 only: it has no layout, so neither rank uses one
            snapshotter.writer._layout = None
        again = snapshotter.write(snapshotter.stage(), process_group=group)
        assert snapshotter.writer.repeats == 1
        out[rank] = {
            "files": files, "params": full if rank == 0 else None, "moved": moved if rank == 0 else None,
            "again": {n: bytes(b) for n, b in again.items()},
        }  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_a_two_rank_fsdp_snapshot_reshards_into_one_process(tmp_path: Path) -> None:
    """2 FSDP ranks each write their own shards to memory, in the background while they train the next step; one
    process reads both ranks' files and gets the whole model back as it was at the snapshot's step (the reshard a
    node loss needs), reading only through ``fetch``."""
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_fsdp_rank, 2, str(tmp_path), out, deadline_s=120)
        ranks = {r: dict(out[r]) for r in (0, 1)}
    assert sorted(ranks[0]["files"]) == [".metadata", "__0_0.raw"]
    assert sorted(ranks[1]["files"]) == ["__1_0.raw"]  # each rank its own shards, rank 0 the metadata
    held = {**ranks[0]["files"], **ranks[1]["files"]}
    one = build_training(job(tmp_path), CpuBackend(), world_size=1)
    read: list[str] = []
    memfiles.load_from_memory(lambda name: read.append(name) or held[name], one.model, one.optimizer, one.scheduler)
    assert sorted(set(read)) == [".metadata", "__0_0.raw", "__1_0.raw"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(_params(one)[name], value), name
    assert any(not torch.equal(ranks[0]["moved"][n], v) for n, v in ranks[0]["params"].items())  # step 3 moved them
    assert one.scheduler.state_dict()["last_epoch"] == 2
    # The snapshot after step 3 (planned by DCP again: rank 1 had no layout) restores step 3's state.
    held = {**ranks[0]["again"], **ranks[1]["again"]}
    memfiles.load_from_memory(held.__getitem__, one.model, one.optimizer, one.scheduler)
    assert all(torch.equal(_params(one)[n], v) for n, v in ranks[0]["moved"].items())
    assert one.scheduler.state_dict()["last_epoch"] == 3


# -- one node's store ----------------------------------------------------------------------------------------


def test_the_store_refuses_what_does_not_fit_saying_how_much_and_never_holds_more() -> None:
    store = SnapshotStore(capacity_bytes=3 * 2**20)
    assert store.put(1, 0, {"__0_0.distcp": b"x" * 2**20}) is None
    assert store.put(1, 1, {"__1_0.distcp": b"y" * 2**20}) is None
    reason = store.put(1, 2, {"__2_0.distcp": b"z" * (2 * 2**20)})
    assert reason == Refusal(Refused.NO_ROOM, 1, 2, nbytes=2 * 2**20, held=2 * 2**20, capacity=3 * 2**20)
    assert store.nbytes == 2 * 2**20 and store.holdings()[1].ranks == {0, 1}
    # A rank's second write of the same snapshot replaces its first (counted once).
    assert store.put(1, 1, {"__1_0.distcp": b"w" * 2**20}) is None
    assert store.nbytes == 2 * 2**20 and store.read(1, "__1_0.distcp") == b"w" * 2**20


def test_sealing_a_snapshot_frees_the_older_ones_and_refuses_writes_to_them() -> None:
    store = SnapshotStore(capacity_bytes=10 * 2**20)
    for step in (4, 5, 6):
        assert store.put(step, 0, {"__0_0.distcp": bytes([step]) * 100}) is None
        store.put_manifest(step, {"step": step, "world_size": 1})
    store.seal(5)
    assert sorted(store.holdings()) == [5, 6]  # 6 is newer than the complete one: kept
    assert [(s, h.sealed) for s, h in sorted(store.holdings().items())] == [(5, True), (6, False)]
    assert store.read(4, "__0_0.distcp") is None and store.read(5, "__0_0.distcp") == bytes([5]) * 100
    assert store.put(5, 0, {"__0_0.distcp": b""}) == Refusal(Refused.NOT_NEWER, 5, 0, sealed=5)
    store.drop(6)
    assert sorted(store.holdings()) == [5] and store.nbytes == 100
    assert store.read(5, "no-such-file") is None
    store.drop(5)  # a sealed snapshot was complete, and the seal freed the older ones: never dropped
    assert sorted(store.holdings()) == [5] and store.holdings()[5].manifest is not None


# -- placement and choice ------------------------------------------------------------------------------------


def test_ring_placement_keeps_every_nodes_state_elsewhere_too() -> None:
    nodes = ["n3", "n1", "n2"]
    assert replica_nodes(nodes, "n1", 1) == ["n2"]
    assert replica_nodes(nodes, "n3", 1) == ["n1"]
    assert replica_nodes(nodes, "n2", 2) == ["n3", "n1"]
    assert replica_nodes(nodes, "n2", 5) == ["n3", "n1"]  # only as many as there are other nodes
    assert replica_nodes(["n1"], "n1", 1) == []
    held = [r for n in nodes for r in replica_nodes(nodes, n, 1)]
    assert sorted(held) == sorted(nodes)  # every node holds exactly one other node's copy


def _holding(ranks: set[int], step: int | None = None, world: int = 3) -> Holding:
    return Holding(ranks=ranks, manifest=None if step is None else {"step": step, "world_size": world})


def test_the_newest_snapshot_on_live_nodes_is_chosen() -> None:
    holdings = {
        "n1": {9: _holding({0}, 9), 10: _holding({0}, 10)},
        "n2": {9: _holding({1, 0}), 10: _holding({1, 0})},  # rank 0's copy lives on n2 (ring)
        "n3": {9: _holding({2, 1}), 10: _holding({2, 1})},
    }
    choice = newest_restorable(holdings, ["n1", "n2", "n3"])
    assert choice.step == 10 and choice.manifest == {"step": 10, "world_size": 3} and choice.skipped == ()
    # n1 lost: rank 0's files live on n2 too, but the manifest only on n1 (it must be replicated like the files).
    lost_n1 = newest_restorable(holdings, ["n2", "n3"])
    assert lost_n1.step is None
    assert lost_n1.skipped[0] == PassedOver(10, Passed.NO_MANIFEST, lost_nodes=("n1",))
    # Sealed on a live store (so it was complete), its manifest only on n1: what n1 held when last asked predates it.
    holdings["n2"][10].sealed = True
    complete = PassedOver(10, Passed.NO_MANIFEST, complete=True, lost_nodes=("n1",))
    assert newest_restorable(holdings, ["n2", "n3"]).skipped[0] == complete
    del holdings["n1"][10]
    assert newest_restorable(holdings, ["n2", "n3"]).skipped[0] == PassedOver(10, Passed.NO_MANIFEST, complete=True)
    # A snapshot whose manifest no store ever had (rank 0 died before it): never completed.
    holdings["n2"][10].sealed = False
    assert newest_restorable(holdings, ["n2", "n3"]).skipped[0] == PassedOver(10, Passed.NO_MANIFEST)


def test_a_snapshot_whose_only_copy_was_on_a_lost_node_is_skipped_for_the_older_one_saying_why() -> None:
    holdings = {
        "n1": {9: _holding({0}, 9), 10: _holding({0}, 10)},
        "n2": {9: _holding({1, 0}, 9), 10: _holding({1}, 10)},  # rank 0's copy of 10 not yet there
        "n3": {9: _holding({2, 1}, 9), 10: _holding({2, 1}, 10)},
    }
    choice = newest_restorable(holdings, ["n2", "n3"])
    assert choice.step == 9
    lost = PassedOver(10, Passed.RANKS_MISSING, lost_nodes=("n1",), gone_nodes=("n1",), missing=(0,), world_size=3)
    assert choice.skipped == (lost,)
    # What n1 held was last asked before snapshot 10 was made (at the previous restart): n1 is named all the same,
    # from the manifest's nodes (the group that made it), not n0, lost long before.
    holdings["n1"] = {9: _holding({0}, 9)}
    holdings["n0"] = {3: _holding({0}, 3)}
    for h in holdings.values():
        if 10 in h and h[10].manifest:
            h[10].manifest["nodes"] = ["n1", "n2", "n3"]
    gone = PassedOver(10, Passed.RANKS_MISSING, gone_nodes=("n1",), missing=(0,), world_size=3)
    assert newest_restorable(holdings, ["n2", "n3"]).skipped == (gone,)


def test_a_snapshot_missing_one_ranks_shard_is_never_used() -> None:
    holdings = {"n1": {7: _holding({0, 2}, 7)}, "n2": {7: _holding({0, 2}, 7)}}
    choice = newest_restorable(holdings, ["n1", "n2"])
    missing = PassedOver(7, Passed.RANKS_MISSING, missing=(1,), world_size=3)
    assert choice.step is None and choice.skipped == (missing,)
    assert newest_restorable({}, []).step is None


def test_rewinding_forgets_the_newer_snapshots_so_a_restarted_group_can_replace_them() -> None:
    """A group that starts at step 5 (from a checkpoint older than the stores' newest snapshot, or a rollback)
    snapshots 6, 7, ... again: the stores forget theirs, or they would refuse the new ones."""
    store = SnapshotStore(capacity_bytes=2**20)
    for step in (5, 6, 7):
        assert store.put(step, 0, {"__0_0.distcp": bytes([step])}) is None
        store.put_manifest(step, {"step": step, "world_size": 1})
    store.seal(7)
    assert store.put(6, 0, {"__0_0.distcp": b"again"}) is not None  # refused: not newer than the sealed 7
    store.rewind(5)
    assert store.holdings() == {}  # 5 was freed by the seal of 7; 6 and 7 are forgotten now
    assert store.put(6, 0, {"__0_0.distcp": b"again"}) is None and store.read(6, "__0_0.distcp") == b"again"


def test_once_a_newer_worker_group_started_an_older_ones_late_sends_are_refused() -> None:
    """A dead group's put, manifest, seal or drop still in flight must not mix into, free or drop the snapshots of
    the group that replaced it (the same step numbers, another layout)."""
    store = SnapshotStore(capacity_bytes=2**20)
    assert store.put(8, 0, {"__0_0.distcp": b"old"}, generation=1) is None
    store.rewind(7, generation=2)  # the next group starts at step 7
    assert store.holdings() == {}
    assert store.put(8, 0, {"__0_0.distcp": b"new"}, generation=2) is None
    late = Refusal(Refused.STALE, 8, 0, generation=1, current=2)
    assert store.put(8, 0, {"__0_0.distcp": b"old"}, generation=1) == late
    assert store.put_manifest(8, {"step": 8, "world_size": 3}, generation=1) == replace(late, rank=None)
    store.drop(8, generation=1)
    assert store.seal(9, generation=1) is None  # refused: would free the new group's 8
    assert store.read(8, "__0_0.distcp") == b"new" and store.holdings()[8].manifest is None
    assert store.put_manifest(8, {"step": 8, "world_size": 1}, generation=2) is None
    assert store.seal(8, generation=2) == 3  # the bytes it holds then: what memory_checkpoint_bytes reports
    store.rewind(8, generation=1)  # a rewind never lowers the generation
    assert store.put(9, 0, {"__0_0.distcp": b"x"}, generation=1) is not None


def test_the_groups_store_bytes_are_reported_per_node_and_as_the_most_any_node_holds(tmp_path: Path) -> None:
    snaps = _taking(tmp_path)
    assert snaps.metrics() == {}  # nothing complete yet
    snaps.held = {"0a1b2c3d4e5f": 300, "ffeeddccbbaa": 500}
    snaps.blocked_s = 0.004
    assert snaps.metrics() == {
        "memory_snapshot_blocked_s": 0.004,
        "memory_checkpoint_bytes": 500.0,
        "memory_checkpoint_bytes/node-0a1b2c3d": 300.0,
        "memory_checkpoint_bytes/node-ffeeddcc": 500.0,
    }
    snaps.taking = False  # stopped: no figure that is not kept up to date
    assert snaps.metrics() == {}


def test_a_snapshot_read_in_place_restores_exactly(tmp_path: Path) -> None:
    """On Ray a restoring rank reads each file as a read-only view of the object store (fetcher); DCP reads its
    slices through a stream over the view."""
    import numpy as np

    j = job(tmp_path)
    t = trained(j)
    held = {name: np.frombuffer(bytes(b), dtype=np.uint8) for name, b in snapshot_files(t).items()}
    for a in held.values():
        assert not a.flags.writeable  # as ray.get hands them back
    fresh = build_training(j, CpuBackend(), world_size=1)
    memfiles.load_from_memory(lambda name: memoryview(held[name]), fresh.model, fresh.optimizer, fresh.scheduler)
    for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    moments = [s["exp_avg"] for s in t.optimizer.state.values()]
    restored = [s["exp_avg"] for s in fresh.optimizer.state.values()]
    assert len(moments) == len(restored) > 0 and all(torch.equal(a, b) for a, b in zip(moments, restored, strict=True))


def test_a_group_whose_stores_could_not_be_rewound_takes_no_snapshots(tmp_path, caplog) -> None:
    """The stores would refuse (or mix with) a group they were not rewound for: it stops taking snapshots at once,
    with one warning, rather than paying for snapshots that are all refused."""

    snaps = _taking(tmp_path)
    snaps.keeper = StandInKeeper(error=ConnectionError("keeper gone"))  # the keeper actor gone: its call raises
    with caplog.at_level("WARNING", logger="raytrn.train.snapshots"):
        snaps.starting_at(7)
    assert not snaps.taking
    [record] = [r for r in caplog.records if "stop for this worker group" in r.getMessage()]
    assert "could not rewind the stores to step 7 (ConnectionError: keeper gone)" in record.getMessage()


# -- the loop's side: a background write that never ends ----------------------------------------------------


def _taking(tmp: Path) -> Any:
    """One rank's MemorySnapshots taking a snapshot every step, with no store (no Ray: nothing to publish to)."""
    from raytrn.train.snapshots import MemorySnapshots

    snaps = MemorySnapshots(job(tmp, "checkpoint.memory_every_n_steps=1"), None, rank=0, world_size=1)
    snaps.taking, snaps.every, snaps.ring, snaps.node, snaps._group, snaps._writing = True, 1, {}, "n", None, None
    return snaps


def test_by_default_the_tier_runs_on_more_than_one_node_except_for_neuron_xla(tmp_path: Path) -> None:
    from raytrn.train.trainer import memory_tier_may_run

    default = job(tmp_path)
    assert default.checkpoint.memory_every_n_steps is None  # the default: auto
    assert not memory_tier_may_run(default, alive_nodes=1)  # one node: durable checkpoints only
    assert memory_tier_may_run(default, alive_nodes=3)
    xla = job(tmp_path, "scaling.accelerator=neuron-xla", "scaling.instance_type=trn1.32xlarge",
              "scaling.workers_per_node=32")  # fmt: skip
    assert not memory_tier_may_run(xla, alive_nodes=3)  # the frozen trn1 path: as it was
    assert not memory_tier_may_run(job(tmp_path, "checkpoint.memory_every_n_steps=0"), alive_nodes=3)  # off
    assert memory_tier_may_run(job(tmp_path, "checkpoint.memory_every_n_steps=5"), alive_nodes=1)  # asked for


def test_snapshots_are_due_every_n_steps_and_at_every_checkpoint_but_not_at_the_groups_last_step(tmp_path):
    """With a snapshot every 7 steps and a checkpoint every 50: steps 7, 14, ... and 50 (a restart after the
    checkpoint of step 50 reads that state from memory); never the group's final step (the run's end, a preemption:
    its checkpoint is synchronous), never once snapshots stopped or when they are off."""
    from raytrn.train.snapshots import MemorySnapshots

    snaps = _taking(tmp_path)
    snaps.every = 7
    due = [s for s in range(1, 101) if snaps.due(s, final=False, checkpoint=s % 50 == 0)]
    assert due == [7, 14, 21, 28, 35, 42, 49, 50, 56, 63, 70, 77, 84, 91, 98, 100]
    assert not snaps.due(49, final=True) and not snaps.due(50, final=True, checkpoint=True)
    snaps.taking = False
    assert not snaps.due(49, final=False) and not snaps.due(50, final=False, checkpoint=True)
    off = MemorySnapshots(job(tmp_path), None, rank=0, world_size=1)
    assert not any(off.due(s, final=False, checkpoint=True) for s in (1, 50))


def test_a_snapshot_is_written_by_the_ranks_thread_and_the_step_waits_only_for_its_staging(tmp_path, caplog):
    """The step waits for the staging copy; the rank's snapshot thread writes the files and sends them (here to no
    store: the snapshot is not kept, so it is never used, with one warning); the wait is reported."""
    from raytrn.checkpoint.progress import Progress

    snaps = _taking(tmp_path)
    t = trained(job(tmp_path))
    with caplog.at_level("WARNING", logger="raytrn.train.snapshots"):
        snaps.save(t, Progress(step=3))
        writing = snaps._writing
        assert writing is not None and writing.done.wait(60)  # written beside the step
        assert snaps.written() is False
    assert sorted(snaps._snapshotter.writer.fs.files) == [".metadata", "__0_0.raw"]  # type: ignore[union-attr]
    assert writing.reason == (Refusal(Refused.NO_STORE, 3, 0, nodes=("n",)),)
    assert 0 < writing.staged_s <= snaps.blocked_s < 60
    [warning] = [r.getMessage() for r in caplog.records if r.name == "raytrn.train.snapshots"]
    assert warning.startswith("in-memory snapshot of step 3 skipped: no memory store on node(s) n; training goes on")


def test_a_snapshot_that_cannot_be_staged_stops_the_groups_snapshots_with_one_warning(tmp_path, monkeypatch, caplog):
    """Staging to host memory fails on a rank: the other ranks' background writes would wait for it on the group,
    so no more snapshots are started in this worker group (training goes on; restores are unaffected)."""
    from raytrn.checkpoint.progress import Progress

    snaps = _taking(tmp_path)
    t = trained(job(tmp_path))

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("host memory")

    monkeypatch.setattr(memfiles._MemoryWriter, "stage", no_memory)  # the staging copy itself
    with caplog.at_level("WARNING", logger="raytrn.train.snapshots"):
        snaps.save(t, Progress(step=3))
    assert not snaps.taking and not snaps.due(4, final=False) and snaps._writing is None
    [warning] = [r.getMessage() for r in caplog.records if r.name == "raytrn.train.snapshots"]
    assert "in-memory snapshots stop for this worker group: snapshot 3: not staged on rank 0 (MemoryError: host " \
           "memory)" in warning  # fmt: skip


def test_a_write_that_does_not_end_in_time_stops_the_groups_snapshots(tmp_path, caplog) -> None:
    """A snapshot thread still going after the bound (it may still be in the group's collectives): the snapshot does
    not count and no other write is started on that group, even when the thread then ends saying it is complete."""
    from raytrn.checkpoint.progress import Progress
    from raytrn.train.snapshots import _Writing

    snaps = _taking(tmp_path)
    writing = snaps._writing = _Writing(Progress(step=5), 0.0)  # its thread never sets done
    with caplog.at_level("WARNING", logger="raytrn.train.snapshots"):
        assert snaps.written(timeout_s=0.05) is False
    writing.reason = ()  # the thread's late answer changes nothing
    writing.done.set()
    assert snaps.written() is False and not snaps.due(6, final=False)
    assert not snaps.taking and snaps._writing is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("stop for this worker group: snapshot 5: not written within 0 s" in m for m in messages), messages


def test_a_lost_nodes_old_snapshots_are_not_named_once_a_live_store_sealed_a_newer_one() -> None:
    """What a node lost long ago held when last asked (snapshot 8) is older than what the live stores sealed since
    (12): freed everywhere, so the restart's reasons do not name it; the live stores' own older snapshots still
    count."""
    holdings = {
        "n0": {8: _holding({0}, 8)},  # lost at an earlier restart
        "n1": {12: replace(_holding({0}, 12), sealed=True), 13: _holding({0})},
        "n2": {11: _holding({1}, 11), 12: replace(_holding({1}), sealed=True)},
    }
    choice = newest_restorable(holdings, ["n1", "n2"])
    assert choice.step is None
    assert [p.step for p in choice.skipped] == [13, 12, 11]
