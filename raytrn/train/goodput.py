"""The loop's goodput component: rank 0 measures where its group's time goes and posts it to the job's board.

Each iteration of the loop (a step and what follows it up to the next) is split into the step (less its wait for
data), that wait, blocking checkpoint and evaluation time, and the rest (metrics, logging, collectives). A step an
earlier group of the job had trained is *retrained*; the group's first step beyond a steady step is *warm-up*.
The board keeps the newest :class:`~raytrn.tracking.goodput.GroupTimes` of each group; the driver books the gaps
between groups and closes the ledger (:mod:`raytrn.tracking.goodput`). Other ranks measure nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TypeVar

from raytrn.pending import Pending
from raytrn.tracking.board import RestoreRecord
from raytrn.tracking.goodput import GroupTimes
from raytrn.tracking.roles import ProgressPosts

T = TypeVar("T")

#: Rank 0 posts its group's times at most this often (and when the group stops): a killed rank 0's last second is
#: booked to the restart that follows, as the work it lost is.
POST_EVERY_S = 1.0


class GoodputClock:
    """Rank 0's measure of its group's time (``board``: the job's progress posts; None on other ranks: a no-op).

    ``restored``: the board's answer to this group's restore (:meth:`raytrn.tracking.roles.RestartLedger.restored`):
    the steps up to ``step + steps_retrained`` were trained by an earlier group. ``group``: the board's count of
    groups once this one started (an answer to come, or the number)."""

    def __init__(
        self,
        board: ProgressPosts | None,
        *,
        world_size: int,
        restore_s: float,
        start_step: int,
        restored: Pending[RestoreRecord | None] | None,
        group: Pending[int] | int | None,
    ) -> None:
        self.board = board
        self.world_size, self.restore_s, self.start_step = world_size, restore_s, start_step
        self._restored, self._group = restored, group
        self._retrained_until: int | None = None
        self._first_at: float | None = None  # wall clock of the first step's start
        self._iter_start: float | None = None  # perf_counter of the current iteration's start
        self._step_end = 0.0
        self._blocked = 0.0
        self._last_end_at: float | None = None
        self.steps = 0
        self._first: tuple[float, bool] | None = None  # the first step's time less data wait, and retrained?
        self._rest = {"productive": 0.0, "retrained": 0.0}
        self._steady_s, self._steady_n = 0.0, 0
        self.data_wait_s = self.checkpoint_s = self.eval_s = self.other_s = self.recovery_s = 0.0
        self._posted_at = 0.0
        self._done: GroupTimes | None = None  # the group's time up to its last completed iteration

    def step_started(self) -> None:
        """A training step begins (the first one opens the group's time; later ones continue an iteration)."""
        if self.board is None:
            return
        now = time.perf_counter()
        if self._first_at is None:
            self._first_at = time.time()
            self._iter_start = now
        elif self._iter_start is None:
            self._iter_start = now

    def stepped(self, step: int, data_wait_s: float, recovery_s: float = 0.0) -> None:
        """Step ``step`` was trained (its wait for data included ``data_wait_s``; ``recovery_s`` of it went to attempts
        a lost replica aborted and the group's re-formation: ``scaling.recovery: live``)."""
        if self.board is None or self._iter_start is None:
            return
        self._step_end = time.perf_counter()
        took = self._step_end - self._iter_start
        recovery = min(max(0.0, recovery_s), took)
        self.recovery_s += recovery
        took -= recovery
        wait = min(max(0.0, data_wait_s), took)
        self.data_wait_s += wait
        retrained = step <= self._retrained()
        if self._first is None:
            self._first = (took - wait, retrained)
        else:
            self._rest["retrained" if retrained else "productive"] += took - wait
            self._steady_s += took - wait
            self._steady_n += 1
        self.steps += 1

    def retrains_until(self, step: int) -> None:
        """The steps up to ``step`` are trained again from here on (a rollback in place: ``scaling.recovery: live``)."""
        self._retrained_until = max(self._retrained(), step)

    @contextlib.contextmanager
    def blocking(self, cause: str) -> Iterator[None]:
        """Time spent inside is ``cause`` (``checkpoint``, ``eval`` or live ``recovery``), not the loop's other time."""
        if self.board is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._blocked += spent
            setattr(self, f"{cause}_s", getattr(self, f"{cause}_s") + spent)

    def iteration_done(self, *, final: bool = False) -> None:
        """The step's iteration ended (after its checkpoint and evaluation); posts when due, or ``final``."""
        if self.board is None or self._iter_start is None:
            return
        end = time.perf_counter()
        self.other_s += max(0.0, end - self._step_end - self._blocked)
        self._blocked = 0.0
        self._iter_start = end  # the next iteration starts where this one ended: the group's time is contiguous
        self._last_end_at = time.time()
        self._done = self.times()
        if final or end - self._posted_at >= POST_EVERY_S:
            self.post()
            self._posted_at = end

    def times(self) -> GroupTimes:
        """The group's time so far."""
        rest = dict(self._rest)
        warmup = 0.0
        if self._first is not None:
            first, retrained = self._first
            typical = self._steady_s / self._steady_n if self._steady_n else first
            warmup = max(0.0, first - typical)
            rest["retrained" if retrained else "productive"] += first - warmup
        return GroupTimes(
            group=self._group_number(),
            world_size=self.world_size,
            restore_s=self.restore_s,
            first_step_at=self._first_at,
            last_step_end_at=self._last_end_at,
            steps=self.steps,
            productive_s=rest["productive"],
            retrained_s=rest["retrained"],
            warmup_s=warmup,
            data_wait_s=self.data_wait_s,
            checkpoint_s=self.checkpoint_s,
            eval_s=self.eval_s,
            other_s=self.other_s,
            recovery_s=self.recovery_s,
        )

    def post(self) -> None:
        """Send the group's time up to its last completed iteration to the board (not waited on). An iteration cut
        short (a lost peer's collective error, a stop raised mid-iteration) is left out: its step and blocking time
        lie after the posted ``last_step_end_at``, in the gap the driver books to what ended the group; posting them
        too would book those seconds twice."""
        if self.board is not None and self._done is not None:
            self.board.goodput(self._done)

    def _retrained(self) -> int:
        if self._retrained_until is None:
            record = _resolved(self._restored)
            self._retrained_until = self.start_step + (record.steps_retrained if record is not None else 0)
        return self._retrained_until

    def _group_number(self) -> int:
        if not isinstance(self._group, int):
            self._group = int(_resolved(self._group) or 0)
        return self._group


def _resolved(answer: Pending[T | None] | None, timeout_s: float = 60) -> T | None:
    """What ``answer`` resolves to (None when there is none or it fails: the ledger is best effort)."""
    if answer is None:
        return None
    try:
        return answer.result(timeout_s)
    except Exception:
        return None
