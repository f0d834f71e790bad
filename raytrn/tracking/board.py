"""The job's progress board and what the driver prints from it: the live line and the end summary.

Rank 0 posts metrics to the board; the driver polls it (:class:`ProgressPrinter`). The board is the job's
tracking actor (:class:`~raytrn.tracking.actor.TrackingActor` extends :class:`ProgressBoard`: one process,
not two), or a board actor of its own when tracking is off. It outlives worker-group restarts (the driver
owns it), so progress and the final :class:`Summary` span the whole job. Its answers are the frozen dataclasses
below; nobody calls it through a raw actor handle: :mod:`raytrn.tracking.roles` has a typed client per role.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrn.checkpoint.messages import PassedOver, render
from raytrn.errors import RunStopped
from raytrn.tracking.goodput import GroupTimes, Ledger

#: The Ray namespace of every run's progress board, so that another driver (``raytrn stop``) finds it by name.
BOARD_NAMESPACE = "raytrn"
BOARD_PREFIX = "raytrn-board:"


@dataclass(frozen=True)
class StopOrder:
    """What the board tells rank 0 about ending the run (:mod:`raytrn.train.stopping`): ``at_step`` a stop request's
    step (-1: the next one; None: none), ``abort`` why the run must stop at once, FAILED, saving nothing (its lease was
    taken over by another job: :class:`raytrn.checkpoint.lease.LeaseLost`), or None."""

    at_step: int | None = None
    abort: str | None = None


@dataclass(frozen=True)
class StopAsked:
    """The board's answer to ``raytrn stop``: the highest step trained so far and the step asked (-1: the next)."""

    step_reached: int
    stop_at: int


@dataclass(frozen=True)
class RestoreRecord:
    """A worker-group restart's restore: where from (``memory``, ``storage``, ``none``), its step, the load's
    seconds, the steps trained again, and the newer in-memory snapshots it passed over, with why (if any)."""

    source: str
    step: int
    restore_s: float
    steps_retrained: int
    passed_over: tuple[PassedOver, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """As JSON holds it (``passed_over``: :meth:`PassedOver.record` each, only when not empty)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in ("source", "step", "restore_s", "steps_retrained")}
        return {**out, "passed_over": [p.record() for p in self.passed_over]} if self.passed_over else out


@dataclass(frozen=True)
class BoardSnapshot:
    """What the driver reads from the board once the workers returned: the first and last logged entries (a log
    step's metrics with ``step``, ``max_steps``, ``time``), the start-up time, why the workers stopped the run (the
    very :class:`~raytrn.errors.RunStopped` they raised, subclass kept), each restart's restore and each worker
    group's own time (by group number)."""

    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    first_step_s: float | None = None
    stopped: RunStopped | None = None
    restores: tuple[RestoreRecord, ...] = ()
    times: tuple[GroupTimes, ...] = ()

    def raise_if_stopped(self) -> None:
        """Raise the workers' RunStopped (its own subclass: ``CheckpointsFailing``, ``LeaseLost``), if they stopped."""
        if self.stopped is not None:
            raise self.stopped


def board_name(run_name: str) -> str:
    """A Ray actor name for a progress board of ``run_name`` (its tracking actor, with tracking on): unique (the
    board of the run's previous invocation in the same process may still be going away), found by its prefix."""
    import uuid

    return f"{BOARD_PREFIX}{run_name}:{uuid.uuid4().hex[:8]}"


class ProgressBoard:
    """Latest metrics of a run (held in a Ray actor with num_cpus=0)."""

    _KEEP = 1000  # recent entries kept for printers that poll less often than steps are logged

    def __init__(self) -> None:
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.recent: list[dict[str, Any]] = []
        self.first_step_s: float | None = None
        self.groups = 0
        #: Why the workers stopped the run (:class:`raytrn.errors.RunStopped`): the driver raises it, FAILED.
        self.stopped: RunStopped | None = None
        #: The steps a non-finite rollback skips (``(first, last)`` each; :mod:`raytrn.train.guard`), this job's.
        self.rollbacks: list[tuple[int, int]] = []
        #: The highest step a worker group of this job is known to have trained (rank 0 posts it at log steps,
        #: and between them at most every :data:`raytrn.train.metrics.REACHED_EVERY_S`).
        self.step_reached = 0
        #: Each worker-group restart's restore: where from, its step, the load's seconds, the steps trained again.
        self.restores: list[RestoreRecord] = []
        #: Each worker group's own time, by the group's number (rank 0 posts it: :mod:`raytrn.train.goodput`).
        self.times: dict[int, GroupTimes] = {}
        #: A stop request (:mod:`raytrn.train.stopping`): the step to end at, -1 for the next one; None: none.
        self.stop_at: int | None = None
        #: Why the run must stop at once (its lease was taken over), or None.
        self.abort: str | None = None

    def request_stop(self, at_step: int | None) -> StopAsked:
        """Ask the run to end at ``at_step`` (None: the next step all ranks agree on)."""
        self.stop_at = -1 if at_step is None else int(at_step)
        return StopAsked(step_reached=self.step_reached, stop_at=self.stop_at)

    def stop_request(self) -> StopOrder:
        """Rank 0 asks: the stop request (-1: at the next step) and whether the run must stop at once."""
        return StopOrder(self.stop_at, self.abort)

    def lease_lost(self, lost: RunStopped) -> None:
        """The driver found the run's lease taken over by another job (``lost``: a
        :class:`raytrn.checkpoint.lease.LeaseLost`): the workers stop at their next step, FAILED with it, and save
        nothing."""
        self.abort = str(lost)
        self.stop(lost)

    def group_started(self, step: int, world_size: int) -> int:
        """A worker group (re)started at ``step`` with ``world_size`` workers (rank 0 says so, not waiting for the
        answer: the group's number, 1 for the job's first)."""
        self.groups += 1
        return self.groups

    def goodput(self, times: GroupTimes) -> None:
        """Rank 0's newest measure of its group's time (:class:`raytrn.train.goodput.GoodputClock`)."""
        self.times[times.group] = times

    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None:
        """The current worker group finished its first step: the job's first group sets the start-up time
        (launch to first step); a restart does not change it. Calls from rank 0 arrive in order, after its
        :meth:`group_started`."""
        if self.groups <= 1 and self.first_step_s is None:
            self.first_step_s = since_launch_s

    def reached(self, step: int) -> None:
        """Rank 0 trained ``step`` (between log steps)."""
        self.step_reached = max(self.step_reached, step)

    def restored(
        self, source: str | None, step: int, restore_s: float, passed_over: Sequence[PassedOver] = ()
    ) -> RestoreRecord | None:
        """Rank 0 of a new worker group, before its :meth:`group_started`: it restored step ``step`` from ``source``
        (``memory``: an in-memory snapshot; ``storage``: a committed checkpoint; None: nothing, it starts at ``step``
        0) in ``restore_s`` seconds, passing over newer snapshots for the reasons ``passed_over``. A restart (an
        earlier group of this job ran) is recorded, with the steps trained again: the highest step reached minus
        ``step``; the job's first group is not (returns None)."""
        if self.groups == 0:
            return None
        record = RestoreRecord(
            source=source or "none",
            step=step,
            restore_s=restore_s,
            steps_retrained=max(0, self.step_reached - step),
            passed_over=tuple(passed_over or ()),
        )
        self.restores.append(record)
        return record

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        self.step_reached = max(self.step_reached, step)
        entry = {"step": step, "max_steps": max_steps, "time": time.time(), **metrics}
        if self.first is None:
            self.first = entry
        self.last = entry
        self.recent = [*self.recent[-(self._KEEP - 1) :], entry]

    def snapshot(self) -> BoardSnapshot:
        return BoardSnapshot(
            first=self.first,
            last=self.last,
            first_step_s=self.first_step_s,
            stopped=self.stopped,
            restores=tuple(self.restores),
            times=tuple(self.times[g] for g in sorted(self.times)),
        )

    def stop(self, error: RunStopped) -> None:
        """Every rank, as the run stops (the first error stays: every rank raised the same one)."""
        if self.stopped is None:
            self.stopped = error

    def rolled_back(self, first: int, last: int) -> list[tuple[int, int]]:
        """Every rank, before its group fails for a non-finite rollback: steps ``first``-``last`` are skipped from
        now on (recorded once, whichever rank comes first). The job's rollbacks."""
        if (first, last) not in self.rollbacks:
            self.rollbacks.append((first, last))
        return list(self.rollbacks)

    def rolled_back_steps(self) -> list[tuple[int, int]]:
        """The job's rollbacks so far (a restarted group reads them as it starts)."""
        return list(self.rollbacks)

    def since(self, step: int) -> list[dict[str, Any]]:
        """Entries logged after ``step``, oldest first."""
        return [e for e in self.recent if e["step"] > step]


def format_line(last: dict[str, Any]) -> str:
    step, total = last["step"], last["max_steps"]
    eta = max(0, total - step) * last.get("step_time_s", 0.0)
    return (
        f"step {step}/{total}  loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
        f"{last['tokens_per_s']:,.0f} tok/s  ETA {_duration(eta)}"
    )


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressPrinter:
    """Polls the board from a background thread and prints one line per new step (``since``: the board's entries
    logged after a step, :meth:`raytrn.tracking.roles.BoardReader.since`)."""

    def __init__(self, since: Callable[[int], list[dict[str, Any]]], *, live: bool, interval_s: float = 0.5) -> None:
        self._since = since
        self._live = live and sys.stdout.isatty()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrn-progress", daemon=True)
        self._shown = 0

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()
        if self._live and self._shown:
            print(flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll()

    def _poll(self) -> None:
        try:
            entries = self._since(self._shown)
        except Exception:  # the board is best effort: never fail a run over a progress line
            return
        if not entries:
            return
        self._shown = entries[-1]["step"]
        if self._live:
            print("\r\033[K" + format_line(entries[-1]), end="", flush=True)
        else:
            for entry in entries:
                print(format_line(entry), flush=True)


@dataclass(kw_only=True)
class Summary:
    """What ``raytrn train`` prints when it ends."""

    run_name: str
    start_step: int
    final_step: int
    tokens: int
    tokens_per_s: float | None
    first_loss: float | None
    final_loss: float | None
    checkpoint: str | None
    mlflow_run_id: str | None
    mlflow_ui: str | None
    first_step_s: float | None = None
    #: The worker-group restarts' restores (:meth:`ProgressBoard.restored`), in order.
    restores: list[RestoreRecord] = field(default_factory=list)
    #: Where this invocation's wall time went (None: not measured).
    goodput: Ledger | None = None
    #: The job's ``run.max_steps`` (a finished run short of it was stopped early: ``raytrn stop``); None: not said.
    max_steps: int | None = None

    def render(self) -> str:
        def num(x: float | None, fmt: str) -> str:
            return "n/a" if x is None else format(x, fmt)

        resumed = f" (resumed at step {self.start_step})" if self.start_step else ""
        if self.max_steps is not None and self.final_step < self.max_steps:
            resumed += (
                f"; stopped early as asked (`raytrn stop`): run.max_steps is {self.max_steps}, train the same job "
                "again to go on"
            )
        rows = [
            ("run", self.run_name),
            ("steps", f"{self.final_step - self.start_step} this run, {self.final_step} in total{resumed}"),
            ("tokens", f"{self.tokens:,}"),
            ("tokens/s", num(self.tokens_per_s, ",.0f")),
            ("start-up", f"first step done {num(self.first_step_s, '.1f')} s after launch"),
            ("loss", f"{num(self.first_loss, '.4f')} (first logged) -> {num(self.final_loss, '.4f')} (final)"),
            *([("restarts", describe_restores(self.restores))] if self.restores else []),
            *([("goodput", self.goodput.render())] if self.goodput is not None else []),
            ("checkpoint", self.checkpoint or "none"),
            ("mlflow run", self.mlflow_run_id or "tracking disabled"),
        ]
        if self.mlflow_ui:
            rows.append(("mlflow ui", self.mlflow_ui))
        width = max(len(k) for k, _ in rows)
        return "\n".join(["== raytrn: training finished =="] + [f"{k:<{width}}  {v}" for k, v in rows])


def describe_restores(restores: Sequence[RestoreRecord]) -> str:
    """``2: from storage step 20 (loaded in 0.4 s, 8 steps trained again); from step 0, no checkpoint yet (…)``."""
    parts = []
    for r in restores:
        where = "from step 0, no checkpoint yet" if r.source == "none" else f"from {r.source} step {r.step}"
        skipped = [f"snapshot {p.step}" if p.step is not None else render(p) for p in r.passed_over]
        newer = f", passed over {', '.join(skipped)} (see the log)" if skipped else ""
        parts.append(f"{where} (loaded in {r.restore_s:.1f} s, {r.steps_retrained} steps trained again{newer})")
    return f"{len(restores)}: " + "; ".join(parts)
