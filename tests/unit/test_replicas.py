"""raytrn.compat.replicas.replace_together on a stand-in of Ray Train's WorkerGroup (no Ray: ``ray.get`` resolves
the stand-in's references): the groups' workers are created side by side, each group's failure is its own and
comes back as the start-up error Ray's failure policy retries, and Ray's bookkeeping (polls, state, result queues,
the barrier) is done as Ray's replacement of one group does it. Under Ray it runs in the live chaos test
(tests/chaos/test_live_recovery.py: two nodes back, a killed worker, a frozen one)."""

from __future__ import annotations

import importlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from raytrn import compat

pytestmark = pytest.mark.unit


def private(name: str) -> Any:
    """A private Ray name, through raytrn.compat's table (the only place that names them)."""
    return compat.resolve(compat.PRIVATE_NAMES[name])


class Ref:
    """What a stand-in actor's ``.remote()`` returns: a value, or the error ``ray.get`` raises."""

    def __init__(self, value: Any) -> None:
        self.value = value


def fake_get(refs: Any) -> Any:
    if isinstance(refs, list):
        return [fake_get(r) for r in refs]
    if isinstance(refs.value, BaseException):
        raise refs.value
    return refs.value


class Method:
    def __init__(self, calls: list[str], name: str, outcome: Any = None) -> None:
        self.calls, self.name, self.outcome = calls, name, outcome

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        self.calls.append(self.name)
        return Ref(self.outcome)


def worker(rank: int, calls: list[str], generation: str, queue_error: Any = None) -> Any:
    actor = SimpleNamespace(clear_result_queue=Method(calls, f"clear {generation}{rank}", queue_error))
    return SimpleNamespace(
        actor=actor, name=f"{generation}{rank}", placement_group_bundle_index=rank,
        distributed_context=SimpleNamespace(world_rank=rank), metadata=SimpleNamespace(node_ip="10.0.0.1", pid=rank),
    )  # fmt: skip


class Group:
    """Ray's ReplicaGroup as replace_together uses it."""

    def __init__(self, workers: list[Any], resources: Any = None, callbacks: Any = None) -> None:
        self.workers, self.active, self.training = workers, True, False

    def get_workers(self) -> list[Any]:
        return self.workers

    def is_active(self) -> bool:
        return self.active

    def shutdown(self) -> None:
        self.active = False

    def start_training(self, context: Any) -> None:
        self.training = True


class State:
    def __init__(self, workers: list[Any], calls: list[str]) -> None:
        self.workers = workers
        self.sync_actor = SimpleNamespace(reset=Method(calls, "reset"))
        self.placement_group_handle = SimpleNamespace(placement_group="pg")

    def replace_workers(self, old: list[Any], new: list[Any]) -> State:
        state = State([new[old.index(w)] if w in old else w for w in self.workers], [])
        state.sync_actor = self.sync_actor
        return state


class StandIn:
    """A WorkerGroup of ``n`` replica groups of one worker."""

    def __init__(self, n: int, *, create_fails: set[int] = frozenset(), init_fails: set[int] = frozenset(),
                 queue_error: Any = None, together: int = 1) -> None:  # fmt: skip
        self.calls: list[str] = []
        old = [worker(r, self.calls, "old", queue_error) for r in range(n)]
        self._replica_groups = [Group([w]) for w in old]
        self._world_rank_to_ongoing_poll = dict.fromkeys(range(n), "poll")
        self._worker_group_state = State(old, self.calls)
        self._worker_group_context = SimpleNamespace(resources_per_worker={"CPU": 1})
        self._replica_group_callbacks: list[Any] = []
        self.create_fails, self.init_fails = create_fails, init_fails
        self.side_by_side = threading.Barrier(together, timeout=10)  # a creation waits for the others to begin

    def _assert_active(self) -> None:
        pass

    def _create_workers(self, **kwargs: Any) -> list[Any]:
        rank = kwargs["starting_world_rank"]
        assert kwargs["placement_group_bundle_indices"] == [rank] and kwargs["placement_group"] == "pg"
        self.calls.append(f"create {rank}")
        self.side_by_side.wait()  # (one creation after another: BrokenBarrierError after 10 s)
        if rank in self.create_fails:
            raise private("Ray Train start-up failure")("an actor died")
        return [worker(rank, self.calls, "new")]

    def _init_train_context(self, workers: list[Any], sync_actor: Any) -> None:
        from ray.exceptions import RayActorError

        self.calls.append(f"init {[w.name for w in workers]}")
        if any(w.distributed_context.world_rank in self.init_fails for w in workers):
            raise RayActorError()


@pytest.fixture
def replace(monkeypatch: pytest.MonkeyPatch) -> Any:
    import ray

    from raytrn.compat.replicas import replace_together

    monkeypatch.setattr(ray, "get", fake_get)
    module = importlib.import_module(compat.PRIVATE_NAMES["Ray Train replica group"].split(":")[0])
    monkeypatch.setattr(module, "ReplicaGroup", Group)
    return replace_together


def test_groups_are_replaced_side_by_side_with_rays_bookkeeping(replace: Any) -> None:
    group = StandIn(3, together=2)
    assert replace(group, [0, 2]) == {}
    # the survivor's results cleared, the barrier reset once, before any creation; both created at once (the barrier)
    assert group.calls[:2] == ["clear old1", "reset"] and sorted(group.calls[2:4]) == ["create 0", "create 2"]
    assert group.calls[4:] == ["init ['new0']", "init ['new2']"]
    groups = group._replica_groups
    assert [g.get_workers()[0].name for g in groups] == ["new0", "old1", "new2"]
    assert groups[0].training and groups[2].training and not groups[1].training and groups[1].is_active()
    assert [w.name for w in group._worker_group_state.workers] == ["new0", "old1", "new2"]
    assert group._world_rank_to_ongoing_poll == {1: "poll"}  # the replaced ranks' polls dropped


def test_a_group_whose_worker_fails_to_start_is_left_alone_and_retryable(replace: Any) -> None:
    from ray.exceptions import RayActorError

    startup_failure = private("Ray Train start-up failure")
    group = StandIn(3, create_fails={2}, together=2)
    old2 = group._replica_groups[2]
    failed = replace(group, [0, 2])
    assert list(failed) == [2] and isinstance(failed[2], startup_failure)
    assert group._replica_groups[2] is old2 and not old2.is_active()  # shut down, the caller retries it
    assert group._replica_groups[0].training

    group = StandIn(3, init_fails={0}, together=2)
    failed = replace(group, [0, 2])
    # Ray's own error for it (its failure policy retries a start-up failure, not a bare actor error)
    assert list(failed) == [0] and isinstance(failed[0], startup_failure)
    assert isinstance(failed[0].__cause__, RayActorError)
    assert not group._replica_groups[0].is_active() and not group._replica_groups[0].training
    assert group._replica_groups[2].training  # the other group trains


def test_a_survivor_gone_before_any_creation_is_raised_with_nothing_started(replace: Any) -> None:
    from ray.exceptions import RayActorError

    group = StandIn(3, queue_error=RayActorError())
    with pytest.raises(RayActorError):
        replace(group, [0])
    assert not any(c.startswith("create") for c in group.calls)
    assert not group._replica_groups[0].is_active() and group._replica_groups[0].get_workers()[0].name == "old0"
