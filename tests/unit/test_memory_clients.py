"""The in-memory tier's actors behind typed clients (raytrn.checkpoint.memory_clients): every call of the keeper and
the stores in raytrn goes through them; through a Ray handle (each argument and answer pickled, as Ray does) they
reach the real actor classes and answer the tier's dataclasses; the calls made together (a rank's copies, the seals,
the keeper's questions to every store) are waited for together; the clients and the stand-ins agree with the
protocols, parameter for parameter. No Ray: its calls are played in this process."""

from __future__ import annotations

import ast
import inspect
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import raytrn
from raytrn.checkpoint.memory import MemoryTier, RayStore, fetcher, publish
from raytrn.checkpoint.memory_clients import KeeperClient, Leased, NodeStore, SnapshotKeeper, StoreClient
from raytrn.checkpoint.messages import Choice, Holding, ObjectLocation, Refusal, Refused, StoresRewound
from raytrn.checkpoint.progress import Progress
from raytrn.pending import Pending, RayPending, Ready, wait_all
from tests.unit.memory_stand_ins import StandInKeeper, StandInStore
from tests.unit.test_memory_tier import _taking

pytestmark = pytest.mark.unit

RAYTRN = Path(raytrn.__file__).parent

#: Every method of the keeper's and a store's actor class: not called with ``.remote(`` outside the clients' module.
TIER_METHODS = frozenset(
    name
    for cls in (MemoryTier, RayStore)
    for name in dir(cls)
    if not name.startswith("_") and callable(getattr(cls, name))
)


def remote_calls(root: Path) -> list[str]:
    """Each ``<handle>.<method>.remote(...)`` of a keeper or store method in the package at ``root``, outside
    ``checkpoint/memory_clients.py``: where it is and what it calls."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "checkpoint/memory_clients.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and call.attr == "remote":
                if isinstance(call.value, ast.Attribute) and call.value.attr in TIER_METHODS:
                    found.append((str(path.relative_to(root.parent)), call.lineno, ast.unparse(call)))
    return [f"{path}:{line}: {call}(...)" for path, line, call in sorted(found)]


def test_every_call_of_the_keeper_and_the_stores_goes_through_their_clients() -> None:
    """A raw ``handle.method.remote(...)`` answers an untyped ObjectRef: call the actor through its client
    (KeeperClient, StoreClient in raytrn.checkpoint.memory_clients) instead, so a change of either side is a type
    error. (A method of another actor that shares a name with one of the tier's: rename it or widen this test.)"""
    assert {"ensure", "choose", "rewind", "forget_rollback", "shutdown", "put_slab", "lease", "locate"} <= TIER_METHODS
    assert remote_calls(RAYTRN) == []


# -- Ray played in this process ----------------------------------------------------------------------------------


def _crossed(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


class _Ref:
    """A call's answer: its value (pickled), or the error its get raises; ``late``: not there in time."""

    def __init__(self, value: Any = None, *, error: Exception | None = None, late: bool = False) -> None:
        self.value, self.error, self.late = value, error, late


class _Actor:
    """An actor's Ray handle, in this process: ``handle.name.remote(...)`` runs the method on ``target``, arguments
    and answer pickled. The methods named in ``late`` do not answer in time; once ``gone``, every call's answer
    raises RayActorError (its node lost)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.late: set[str] = set()
        self.gone = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (pickle's look-ups)
            raise AttributeError(name)
        actor, method = self, getattr(self.target, name)

        class Method:
            @staticmethod
            def remote(*args: Any) -> _Ref:
                import ray

                if actor.gone:
                    return _Ref(error=ray.exceptions.RayActorError())
                return _Ref(_crossed(method(*_crossed(args))), late=name in actor.late)

        return Method()


class _Ray:
    """ray.get, ray.wait, ray.put and ray.kill for :class:`_Actor` handles (an object's "ref": the value itself)."""

    def __init__(self) -> None:
        self.waits = 0
        self.killed: list[Any] = []

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if isinstance(ref, _Ref):
            if ref.error is not None:
                raise ref.error
            return ref.value
        return ref

    def wait(self, refs: list[_Ref], *, num_returns: int = 1, timeout: float | None = None) -> Any:
        self.waits += 1
        return [r for r in refs if not r.late], [r for r in refs if r.late]

    def kill(self, handle: Any, *, no_restart: bool = True) -> None:
        self.killed.append(handle)


@pytest.fixture
def fake_ray(monkeypatch) -> _Ray:
    import ray

    played = _Ray()
    for name in ("get", "wait", "kill"):
        monkeypatch.setattr(ray, name, getattr(played, name))
    monkeypatch.setattr(ray, "put", lambda value: value)
    return played


# -- the clients reach the actors ----------------------------------------------------------------------------


def test_a_store_client_reaches_a_store_and_answers_the_tiers_types(fake_ray: _Ray) -> None:
    store = StoreClient(_Actor(RayStore(10**6, None)))
    assert store.lease(1, 0, {"f": 3}, 0).result() == Leased()  # no slab on this node: the files go as objects
    assert store.put(1, 0, {"f": np.frombuffer(b"abc", dtype=np.uint8)}, 0, {"f": 3}).result() is None
    manifest = {"step": 1, "world_size": 1}
    assert store.put_manifest(1, manifest, 0).result() is None
    assert store.holdings().result() == {1: Holding({0}, manifest, 3)}
    assert store.seal(1, 0).result(timeout_s=1) == 3
    found = store.locate(1, "f").result()
    assert isinstance(found, ObjectLocation) and bytes(found.ref) == b"abc"
    assert store.locate(1, "g").result() is None and store.export(1, "g").result() is None
    assert store.rewind(0, 1).result() is None and store.holdings().result() == {}
    late = store.put(2, 0, {"f": np.frombuffer(b"abc", dtype=np.uint8)}, 0, {"f": 3}).result()
    assert late == Refusal(Refused.STALE, 2, 0, generation=0, current=1)
    store.drop(2, 1)
    assert store.close().result() is None
    store.kill()
    assert fake_ray.killed == [store.handle]


def test_the_keeper_client_reaches_the_keeper_which_asks_its_stores_together(fake_ray: _Ray) -> None:
    tier = MemoryTier("clients", capacity_bytes=10**6)
    actors = {node: _Actor(RayStore(10**6, None)) for node in ("a", "b", "c")}
    tier.stores = {node: StoreClient(actor) for node, actor in actors.items()}
    keeper = KeeperClient(_Actor(tier))
    assert isinstance(_crossed(keeper), KeeperClient)  # (the worker plan carries it)
    ensured = keeper.ensure(["a", "b"], timeout_s=1)
    stores = ensured.stores
    assert sorted(stores) == ["a", "b", "c"] and all(isinstance(s, StoreClient) for s in stores.values())
    assert ensured.asked == 1 and keeper.ensure(["a"], timeout_s=1).asked == 2  # (the keeper numbers its ensures)
    # A rank's copies on its node and the ring's next one, then rank 0's manifest: each batch waited for at once.
    waits = fake_ray.waits
    assert publish(tier.stores, "a", 1, 0, {"__0_0.raw": b"abc"}, replicas=1) == ()
    assert publish(tier.stores, "a", 1, 0, None, replicas=1, manifest={"step": 1, "world_size": 1}) == ()
    assert fake_ray.waits == waits + 2
    assert bytes(fetcher(tier.stores, 1, node="a")("__0_0.raw")) == b"abc"
    choice = keeper.choose(timeout_s=1)
    assert choice == Choice(1, {"step": 1, "world_size": 1}, (), alive=("a", "b", "c"))
    # A store that answers late is named; one whose node is gone is left out of the choice.
    actors["c"].late = {"rewind"}
    assert keeper.rewind(1, timeout_s=1) == StoresRewound(1, ("c",))
    actors["b"].gone = True
    assert keeper.choose(timeout_s=1).alive == ("a", "c")
    keeper.forget_rollback(2, timeout_s=1)
    keeper.forget_rollback(2, timeout_s=1)  # (once per rollback)
    assert tier.generation == 2
    # The copies: one store late, one gone.
    actors["b"].gone, actors["b"].late = False, {"put"}
    [late] = publish(tier.stores, "a", 3, 0, {"__0_0.raw": b"abc"}, replicas=1, generation=2, timeout_s=5)
    assert late == Refusal(Refused.COPIES_LATE, 3, 0, timeout_s=5)
    actors["b"].gone = True
    [failed] = publish(tier.stores, "a", 4, 0, {"__0_0.raw": b"abc"}, replicas=1, generation=2)
    assert failed.kind is Refused.COPIES_FAILED and failed.error.startswith("RayActorError"), failed
    # A store off the group's nodes goes once the group (the current generation) sealed without it, its slabs
    # closed; an older group's late call retires nothing.
    keeper.retire(["c", "x"], 4, 1, asked=2)
    assert sorted(tier.stores) == ["a", "b", "c"] and fake_ray.killed == []
    # ... nor one whose store someone asked for after the caller's ensure (a newer group's before its rewind, a live
    # rank 0's regroup after the former writer's late seal): it is theirs now.
    assert keeper.ensure(["c"], timeout_s=1).asked == 3
    keeper.retire(["c", "x"], 4, 2, asked=2)
    assert sorted(tier.stores) == ["a", "b", "c"] and fake_ray.killed == []
    closed = []
    actors["c"].target.close = lambda: closed.append("c")
    actors["c"].late = {"close"}  # (a lost node's store: its close is not answered; the keeper answers at once)
    keeper.retire(["c", "x"], 4, 2, asked=3)
    assert sorted(tier.stores) == ["a", "b"] and closed == ["c"]
    [ending] = tier._retiring
    ending.join(5)  # (in a thread of its own: the close waited for up to its bound, then the kill)
    assert fake_ray.killed == [actors["c"]]
    keeper.shutdown(timeout_s=1)
    assert fake_ray.killed == [actors["c"], actors["a"], actors["b"]] and tier.stores == {}
    keeper.kill()
    assert fake_ray.killed[-1] is keeper.handle
    # A retire never raises into its caller (a committed checkpoint, a sealed snapshot): Ray gone, the keeper gone.
    KeeperClient(_Gone()).retire(["a"], 5, 2, asked=3)


class _Gone:
    """A keeper handle whose every call raises as Ray's handles do once Ray is shut down."""

    class _Method:
        def remote(self, *args: Any) -> Any:
            raise RuntimeError("Ray has not been started yet")

    def __getattr__(self, name: str) -> Any:
        return self._Method()


def test_wait_all_waits_once_for_every_ray_answer() -> None:
    class Never:
        def done(self) -> bool:
            return False

        def result(self, timeout_s: float | None = None) -> int:
            raise TimeoutError

    import ray

    played = _Ray()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "wait", played.wait)
        pending: list[Pending[int]] = [RayPending(_Ref(1)), Ready(2), RayPending(_Ref(3, late=True)), Never()]
        assert wait_all(pending, 5) == [True, True, False, False] and played.waits == 1
        assert wait_all([Ready(1)], 5) == [True] and played.waits == 1  # (no Ray answer: no wait)


# -- the loop's side, against the stand-ins ------------------------------------------------------------------


def test_the_loop_asks_the_keeper_and_seals_on_the_stores_through_the_protocols(tmp_path: Path) -> None:
    from raytrn.train.snapshots import _Writing

    class Rollbacks:
        def rollbacks(self) -> list[tuple[int, int]]:
            return [(3, 4)]

    snaps = _taking(tmp_path)
    snaps.keeper = keeper = StandInKeeper()
    snaps.rollbacks = Rollbacks()  # type: ignore[assignment]
    assert snaps.newest() is None and keeper.forgotten == [3] and snaps.passed_over == ()
    ring, other = StandInStore(), StandInStore()
    snaps.ring, snaps.stores = {"n": ring}, {"n": ring, "m": other}
    snaps._asked = 7  # (its ensure's number, which the retire sends)
    writing = _Writing(Progress(step=5), 0.0, generation=3)
    assert snaps._seal(writing) == () and writing.held == {"n": 0}
    # Sealed on the ring; the store of a node the group no longer runs on is retired (its node can go idle).
    assert ring.sealed == [5] and other.sealed == [] and keeper.retired == [(("m",), 5, 3, 7)]
    assert snaps.stores == {"n": ring}
    assert snaps._seal(replace(writing, progress=Progress(step=6))) == () and len(keeper.retired) == 1  # (once)
    snaps.stores["m"] = other
    ring.held = None  # refused: a newer worker group started; nothing is retired
    assert snaps._seal(writing) == (Refusal(Refused.SEAL_UNANSWERED, 5),) and len(keeper.retired) == 1
    ring.held = 0
    snaps.close()  # a closed writer's late seal (a live group's former rank 0) retires nothing
    assert snaps._seal(writing) == () and len(keeper.retired) == 1


def test_a_group_on_one_node_retires_the_stores_it_left_once_a_checkpoint_after_its_start_commits(tmp_path: Path):
    """A group that restarted on one node takes no snapshots (auto), so no seal retires the stores of the nodes the
    larger group ran on; their snapshots are from before its start (rewound to it): a checkpoint committed after the
    start supersedes them, and then they go. A live group's restorer never retires (its rank 0's writer does)."""
    from raytrn.train.snapshots import MemorySnapshots
    from tests.unit.test_dcp import job

    keeper = StandInKeeper(StoresRewound(4))
    keeper.ensure(["m", "n"], timeout_s=1)  # (the larger group ran on m and n)
    snaps = MemorySnapshots(job(tmp_path), keeper, rank=0, world_size=1, node="n")
    assert snaps.restorable and not snaps.taking and sorted(snaps.stores) == ["m", "n"]
    snaps.starting_at(10)
    snaps.committed(10)  # (the checkpoint it started from: not after its start)
    assert keeper.retired == []
    snaps.committed(15)
    assert keeper.retired == [(("m",), 15, 4, 2)] and list(snaps.stores) == ["n"]  # (its ensure: the 2nd)
    snaps.committed(20)
    assert len(keeper.retired) == 1
    keeper.ensure(["m"], timeout_s=1)
    restorer = MemorySnapshots(job(tmp_path), keeper, rank=0, world_size=1, node="n", takes=False)
    restorer.starting_at(20)
    restorer.committed(25)
    assert len(keeper.retired) == 1


# -- the protocols -------------------------------------------------------------------------------------------


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def _parameters(function: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(
    ("protocol", "implementations"),
    [(NodeStore, (StoreClient(None), StandInStore())), (SnapshotKeeper, (KeeperClient(None), StandInKeeper()))],
)
def test_the_clients_and_the_stand_ins_implement_the_protocols(protocol: type, implementations: tuple) -> None:
    """Name for name and parameter for parameter (``isinstance`` of a runtime-checkable protocol checks names only);
    mypy checks the types of raytrn's and the bench's uses."""
    assert _methods(protocol)
    for implementation in implementations:
        assert isinstance(implementation, protocol)
        for name in _methods(protocol):
            got, want = _parameters(getattr(type(implementation), name)), _parameters(getattr(protocol, name))
            assert got == want, (type(implementation).__name__, name)
