"""The progress board's typed clients (raytrn.tracking.roles): every call reaches the real board, through a Ray
actor handle (each argument and answer pickled, as Ray does) or in this process, and answers dataclasses; an error
that stops the run crosses from the workers to the driver keeping its type."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from raytrn.checkpoint.lease import LeaseLost
from raytrn.checkpoint.messages import Passed, PassedOver
from raytrn.errors import CheckpointsFailing, RunStopped
from raytrn.tracking.board import BoardSnapshot, ProgressBoard, RestoreRecord, StopAsked, StopOrder
from raytrn.tracking.goodput import GroupTimes
from raytrn.tracking.roles import (
    BoardClients,
    BoardReader,
    ProgressPosts,
    RestartLedger,
    RollbackRegistry,
    StopMailbox,
)
from raytrn.train.loop import stop_run

pytestmark = pytest.mark.unit


def _by_role(clients: BoardClients) -> tuple[Any, ...]:
    return (clients.progress, clients.restarts, clients.rollbacks, clients.stops, clients.reader)


def _crossed(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class _Method:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> _Ref:
        return _Ref(_crossed(self.method(*_crossed(args))))


class _Actor:
    """A board's Ray actor handle, in this process: ``handle.name.remote(...)``, arguments and answer pickled."""

    def __init__(self, board: ProgressBoard) -> None:
        self._board = board

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._board, name))


@pytest.fixture(params=["actor", "local"])
def clients(request, monkeypatch) -> BoardClients:
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.value)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (list(refs), []))
    board = ProgressBoard()
    return BoardClients.of(_Actor(board) if request.param == "actor" else board)


def test_every_client_call_reaches_the_board_and_answers_dataclasses(clients: BoardClients) -> None:
    roles = (ProgressPosts, RestartLedger, RollbackRegistry, StopMailbox, BoardReader)
    assert all(isinstance(client, role) for client, role in zip(_by_role(clients), roles, strict=True))
    assert clients.restarts.restored("storage", 0, 0.5).result() is None  # the job's first group: no restart
    assert clients.restarts.group_started(0, 2).result(timeout_s=1) == 1
    clients.progress.first_step_done(1, 3.5, 1.0)
    clients.progress.update(2, 10, {"loss": 1.5})
    clients.progress.reached(6)
    times = GroupTimes(group=1, world_size=2, restore_s=0.0, first_step_at=1.0, last_step_end_at=2.0, steps=6,
                       productive_s=1.0, retrained_s=0.0, warmup_s=0.0, data_wait_s=0.0, checkpoint_s=0.0,
                       eval_s=0.0, other_s=0.0)  # fmt: skip
    clients.progress.goodput(times)
    skipped = PassedOver(5, Passed.NO_MANIFEST, complete=True, lost_nodes=("n2",))
    restore = clients.restarts.restored("memory", 4, 0.25, [skipped])
    assert restore.done()
    assert restore.result() == RestoreRecord("memory", 4, 0.25, 2, (skipped,))
    assert clients.restarts.group_started(4, 1).result() == 2
    assert clients.rollbacks.rollbacks() == [] and clients.rollbacks.rolled_back(3, 4) == [(3, 4)]
    assert clients.rollbacks.rolled_back(3, 4) == [(3, 4)] == clients.rollbacks.rollbacks()
    assert clients.stops.order().result() == StopOrder()
    assert clients.stops.request(8) == StopAsked(step_reached=6, stop_at=8)
    assert clients.stops.order().result() == StopOrder(at_step=8)
    assert [e["step"] for e in clients.reader.since(0)] == [2] and clients.reader.since(2) == []
    snap = clients.reader.snapshot()
    assert isinstance(snap, BoardSnapshot) and snap.stopped is None
    assert snap.first == snap.last and snap.last is not None and snap.last["loss"] == 1.5
    assert (snap.first_step_s, snap.times, len(snap.restores)) == (3.5, (times,), 1)
    snap.raise_if_stopped()  # not stopped: nothing raised


@pytest.mark.parametrize("error", [CheckpointsFailing("3 saves in a row failed"), RunStopped("the run diverged")])
def test_the_workers_stop_reaches_the_driver_with_its_own_type(clients: BoardClients, error: RunStopped) -> None:
    """The driver used to raise a plain RunStopped with the workers' message (the board kept ``str(error)``)."""
    stop_run(clients.stops, error)  # every rank, as the run stops: the first record stays
    stop_run(clients.stops, RunStopped("another rank's"))
    with pytest.raises(type(error)) as raised:
        clients.reader.snapshot().raise_if_stopped()  # the driver, once the workers returned
    assert type(raised.value) is type(error) and str(raised.value) == str(error)


def test_a_lost_lease_stops_the_workers_at_once_and_the_driver_raises_lease_lost(clients: BoardClients) -> None:
    lost = LeaseLost("this job's lease was taken over by host b, pid 7")
    clients.stops.lease_lost(lost)  # the driver's lease thread: not waited on
    assert clients.stops.order().result() == StopOrder(abort=str(lost))  # rank 0's next look: abort
    stop_run(clients.stops, LeaseLost(str(lost)))  # the workers, at their next step
    with pytest.raises(LeaseLost, match="taken over by host b"):
        clients.reader.snapshot().raise_if_stopped()
