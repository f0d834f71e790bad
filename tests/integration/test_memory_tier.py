"""The in-memory tier's stores on a real local Ray (raytrn.checkpoint.memory): a rank's snapshot kept on its
node's store and the next one's on the ring, chosen and restored exactly after a store's node is gone, and a
snapshot that does not fit refused with the bytes it needed. (One node: three stores stand for three nodes.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import memfiles, memory, slabs
from raytrn.checkpoint.memory import MemoryTier, publish
from raytrn.checkpoint.memory_clients import StoreClient
from raytrn.checkpoint.messages import ObjectLocation, Passed, PassedOver, Refused, SlabLocation, StoresRewound
from raytrn.train.build import build_training
from tests.unit.test_dcp import job, trained
from tests.unit.test_memory_tier import snapshot_files

pytestmark = pytest.mark.integration


def test_a_snapshot_survives_its_nodes_store_and_restores_exactly_from_the_replica(ray_session, tmp_path: Path):
    import ray

    j = job(tmp_path)
    t = trained(j)
    files = snapshot_files(t)
    tier = MemoryTier("mem-test", capacity_bytes=64 * 2**20)
    try:
        stores = tier.ensure(["a", "b", "c"], pin=False).stores
        manifest = {"step": 2, "world_size": 1}
        assert publish(stores, "a", 2, 0, files, replicas=1, manifest=manifest) == ()
        held = tier.holdings()
        assert held["a"][2].ranks == {0} and held["b"][2].ranks == {0} and 2 not in held["c"]  # ring: a -> b
        assert held["b"][2].manifest == manifest and held["a"][2].nbytes == sum(len(b) for b in files.values())
        # The rank's own node keeps them in a slab (shared memory), the ring's next one as its own objects.
        in_a = stores["a"].locate(2, "__0_0.raw").result()
        assert isinstance(in_a, SlabLocation) and Path(in_a.path).name.startswith(f"raytrn-snapshot-{tier.token}-")
        in_b = stores["b"].locate(2, "__0_0.raw").result()
        assert isinstance(in_b, ObjectLocation) and isinstance(in_b.ref, ray.ObjectRef), in_b
        for node in ("a", None):  # read in place on a's node; from another node, a's slab is sent as an object
            fresh = build_training(j, CpuBackend(), world_size=1)
            fetch = memory.fetcher({"a": stores["a"]}, 2, node=node)
            assert bytes(fetch("__0_0.raw")) == bytes(files["__0_0.raw"])
            memfiles.load_from_memory(fetch, fresh.model, fresh.optimizer, fresh.scheduler)
            for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
                assert torch.equal(a, b), (node, name)
        # A worker group starting at step 2 numbers itself: what the one before it still sends is refused.
        assert tier.rewind(2) == StoresRewound(1)
        late = publish(stores, "a", 3, 0, files, replicas=1, generation=0)
        assert late and {r.kind for r in late} == {Refused.STALE} and late[0].generation == 0, late
        assert publish(stores, "a", 3, 0, files, replicas=1, generation=1) == ()

        tier.stores["a"].kill()  # node a is lost with its store
        _wait_gone(tier.stores["a"])
        choice = tier.choose(timeout_s=10)  # (3 never completed: no manifest)
        assert choice.step == 2 and choice.manifest == manifest, choice
        fresh = build_training(j, CpuBackend(), world_size=1)
        live = {n: h for n, h in stores.items() if n != "a"}
        memfiles.load_from_memory(memory.fetcher(live, 2), fresh.model, fresh.optimizer, fresh.scheduler)
        for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
            assert torch.equal(a, b), name
        # Every store is gone with the lost node's: nothing to restore from, and the reason is given.
        tier.stores["b"].kill()
        _wait_gone(tier.stores["b"])
        none = tier.choose(timeout_s=10)
        never = PassedOver(3, Passed.NO_MANIFEST)
        lost = PassedOver(2, Passed.NO_MANIFEST, lost_nodes=("a", "b"))
        assert none.step is None and none.skipped == (never, lost), none
    finally:
        tier.shutdown()
    # Every slab is gone, also those of a's store, killed before it could remove them.
    assert not list(slabs.SHM_DIR.glob(f"raytrn-snapshot-{tier.token}-*"))


def _wait_gone(store: StoreClient, timeout_s: float = 30) -> None:
    """Until a killed store no longer answers (ray.kill returns before it is dead)."""
    import ray

    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(int(timeout_s * 10)):
            store.holdings().result(timeout_s)
            time.sleep(0.1)


def test_a_snapshot_that_does_not_fit_is_refused_saying_how_much_it_needed(ray_session, tmp_path: Path):
    import ray

    t = trained(job(tmp_path))
    files = snapshot_files(t)
    size = sum(len(b) for b in files.values())
    tier = MemoryTier("mem-small", capacity_bytes=size // 2)
    try:
        node = ray.get_runtime_context().get_node_id()
        stores = tier.ensure([node]).stores  # pinned to this (real) node
        [reason] = publish(stores, node, 1, 0, files, replicas=1)
        assert reason.kind is Refused.NO_ROOM and (reason.nbytes, reason.capacity) == (size, size // 2), reason
        assert tier.holdings()[node] == {}
    finally:
        tier.shutdown()


def test_a_store_off_the_groups_nodes_goes_once_the_group_sealed_without_it(ray_session):
    """A node the worker group no longer runs on (drained, or left by a shrink) keeps no actor of the run once the
    group's snapshot is sealed on its own nodes: Ray's autoscaler counts a node with any actor as running, so the
    store would keep it from going idle (docs/elasticity.md). An older group's late call retires nothing."""
    tier = MemoryTier("mem-retire", capacity_bytes=2**20)
    try:
        stores = tier.ensure(["a", "b", "c"], pin=False).stores
        assert tier.rewind(0) == StoresRewound(1)
        manifest = {"step": 1, "world_size": 1}
        files = {"__0_0.raw": bytes(range(256)) * 8}
        assert publish(stores, "c", 1, 0, files, replicas=1, manifest=manifest, generation=1) == ()  # c -> a
        in_c = stores["c"].locate(1, "__0_0.raw").result()
        assert isinstance(in_c, SlabLocation) and Path(in_c.path).exists()
        assert tier.retire(["c"], 2, generation=0, asked=1) == () and sorted(tier.stores) == ["a", "b", "c"]
        assert tier.ensure(["c"], pin=False).asked == 2  # (someone asked for c's store after the caller's ensure)
        assert tier.retire(["c"], 2, generation=1, asked=1) == () and sorted(tier.stores) == ["a", "b", "c"]
        assert tier.retire(["c", "lost"], 2, generation=1, asked=2) == ("c",)
        _wait_gone(stores["c"])
        assert not Path(in_c.path).exists()  # its slab removed before it went
        assert sorted(tier.holdings()) == ["a", "b"] and tier.choose().alive == ("a", "b")
        # The group comes back to the node: a new store there.
        back = tier.ensure(["c"], pin=False).stores["c"]
        assert back is not stores["c"] and back.holdings().result(30) == {}
    finally:
        tier.shutdown()
    assert not list(slabs.SHM_DIR.glob(f"raytrn-snapshot-{tier.token}-*"))
