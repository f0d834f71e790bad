"""Typed clients of the job's progress board (:class:`~raytrn.tracking.board.ProgressBoard`), one per role.

The board is one Ray actor (the tracking actor, with tracking on) with five roles: rank 0's progress posts, the
restart ledger, the rollback registry (:mod:`raytrn.train.guard`), the stop mailbox (:mod:`raytrn.train.stopping`,
a lease lost, a run stopped) and the driver's reader. Each role is a Protocol, what the training code depends on,
and a client here that calls the board: through its Ray actor handle, or in this process when given a
:class:`ProgressBoard` itself (the bench's stand-in). A test's stand-in implements the protocol (mypy checks the
bench's; ``isinstance`` a test's, the protocols being runtime-checkable).

Each call blocks or not as the training needs: posts are fire-and-forget; the restart ledger's answers and the stop
order are :class:`~raytrn.pending.Pending`, looked at later; the rest wait, bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from raytrn.checkpoint.messages import PassedOver
from raytrn.errors import RunStopped
from raytrn.pending import Pending, RayPending, Ready
from raytrn.tracking.board import BoardSnapshot, ProgressBoard, RestoreRecord, StopAsked, StopOrder
from raytrn.tracking.goodput import GroupTimes
from raytrn.tracking.sender import sender

#: Rollbacks: ``(first, last)`` steps each, skipped by every later worker group.
Rollbacks = list[tuple[int, int]]


@runtime_checkable
class ProgressPosts(Protocol):
    """Rank 0's posts: its log steps' metrics, the step it reached, its first step's time and its group's time."""

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None: ...
    def reached(self, step: int) -> None: ...
    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None: ...
    def goodput(self, times: GroupTimes) -> None: ...


@runtime_checkable
class RestartLedger(Protocol):
    """Rank 0 of each worker group says where it restored from and that it started (answers looked at later)."""

    def restored(
        self, source: str | None, step: int, restore_s: float, passed_over: Sequence[PassedOver] = ()
    ) -> Pending[RestoreRecord | None]: ...
    def group_started(self, step: int, world_size: int) -> Pending[int]: ...


@runtime_checkable
class RollbackRegistry(Protocol):
    """The job's non-finite rollbacks: recorded by every rank of the group that rolls back, read by the next."""

    def rolled_back(self, first: int, last: int) -> Rollbacks: ...
    def rollbacks(self) -> Rollbacks: ...


@runtime_checkable
class StopMailbox(Protocol):
    """Ending the run: ``raytrn stop``'s request, rank 0's look at it, the driver's lost lease, the workers' stop."""

    def request(self, at_step: int | None, *, timeout_s: float = 30) -> StopAsked: ...
    def order(self) -> Pending[StopOrder]: ...
    def lease_lost(self, lost: RunStopped) -> None: ...
    def stop(self, error: RunStopped) -> None: ...


@runtime_checkable
class BoardReader(Protocol):
    """The driver's reads: the newest entries (its progress line) and the snapshot it ends the run with."""

    def since(self, step: int) -> list[dict[str, Any]]: ...
    def snapshot(self) -> BoardSnapshot: ...


class _Board:
    """How a client reaches the board: ``target`` a board actor's handle, or a ProgressBoard in this process."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.local = isinstance(target, ProgressBoard)

    def tell(self, method: str, *args: Any) -> None:
        """Fire and forget: an actor's call is submitted off this thread (:mod:`raytrn.tracking.sender`)."""
        if self.local:
            getattr(self.target, method)(*args)
        else:
            sender().post(getattr(self.target, method), *args)

    def ask(self, method: str, *args: Any) -> Pending[Any]:
        """Not waited on: the answer is looked at later (the call comes after every tell made before it)."""
        if self.local:
            return Ready(getattr(self.target, method)(*args))
        return RayPending(sender().ask(getattr(self.target, method), *args))

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        """Waits up to ``timeout_s`` for the answer."""
        return self.ask(method, *args).result(timeout_s)


class ProgressClient:
    def __init__(self, board: Any) -> None:
        self._board = _Board(board)

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        self._board.tell("update", step, max_steps, dict(metrics))

    def reached(self, step: int) -> None:
        self._board.tell("reached", step)

    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None:
        self._board.tell("first_step_done", step, since_launch_s, since_group_start_s)

    def goodput(self, times: GroupTimes) -> None:
        self._board.tell("goodput", times)


class RestartLedgerClient:
    def __init__(self, board: Any) -> None:
        self._board = _Board(board)

    def restored(
        self, source: str | None, step: int, restore_s: float, passed_over: Sequence[PassedOver] = ()
    ) -> Pending[RestoreRecord | None]:
        return self._board.ask("restored", source, step, restore_s, tuple(passed_over))

    def group_started(self, step: int, world_size: int) -> Pending[int]:
        return self._board.ask("group_started", step, world_size)


class RollbackClient:
    def __init__(self, board: Any, *, timeout_s: float = 60) -> None:
        self._board, self.timeout_s = _Board(board), timeout_s

    def rolled_back(self, first: int, last: int) -> Rollbacks:
        return _rollbacks(self._board.call("rolled_back", first, last, timeout_s=self.timeout_s))

    def rollbacks(self) -> Rollbacks:
        return _rollbacks(self._board.call("rolled_back_steps", timeout_s=self.timeout_s))


def _rollbacks(answer: Any) -> Rollbacks:
    return [(int(first), int(last)) for first, last in answer]


class StopMailboxClient:
    def __init__(self, board: Any, *, timeout_s: float = 60) -> None:
        self._board, self.timeout_s = _Board(board), timeout_s

    def request(self, at_step: int | None, *, timeout_s: float = 30) -> StopAsked:
        answer = self._board.call("request_stop", at_step, timeout_s=timeout_s)
        assert isinstance(answer, StopAsked), answer
        return answer

    def order(self) -> Pending[StopOrder]:
        return self._board.ask("stop_request")

    def lease_lost(self, lost: RunStopped) -> None:
        self._board.tell("lease_lost", lost)  # from the lease's thread: never waits

    def stop(self, error: RunStopped) -> None:
        self._board.call("stop", error, timeout_s=self.timeout_s)


class BoardReaderClient:
    def __init__(self, board: Any, *, since_timeout_s: float = 10, snapshot_timeout_s: float = 30) -> None:
        self._board = _Board(board)
        self.since_timeout_s, self.snapshot_timeout_s = since_timeout_s, snapshot_timeout_s

    def since(self, step: int) -> list[dict[str, Any]]:
        return list(self._board.call("since", step, timeout_s=self.since_timeout_s))

    def snapshot(self) -> BoardSnapshot:
        answer = self._board.call("snapshot", timeout_s=self.snapshot_timeout_s)
        assert isinstance(answer, BoardSnapshot), answer
        return answer


@dataclass(frozen=True)
class BoardClients:
    """The job's board by role (picklable: the worker plan carries it to every worker)."""

    progress: ProgressPosts
    restarts: RestartLedger
    rollbacks: RollbackRegistry
    stops: StopMailbox
    reader: BoardReader

    @classmethod
    def of(cls, board: Any) -> BoardClients:
        """The clients of ``board``: a board actor's handle, or a :class:`ProgressBoard` in this process."""
        return cls(
            progress=ProgressClient(board),
            restarts=RestartLedgerClient(board),
            rollbacks=RollbackClient(board),
            stops=StopMailboxClient(board),
            reader=BoardReaderClient(board),
        )
