"""What a hosted controller (:mod:`raytrn.compat.controller`) tells as it decides: the typed seam raytrn's terminal
lines and goodput ledger are built on (nothing is parsed back out of a log line). No Ray import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker of a started group runs."""

    rank: int
    node_id: str
    node_ip: str
    pid: int


class ControllerListener(Protocol):
    """What a hosted controller tells as it decides (called on the controller's thread; keep each call short)."""

    def group_starting(self, num_workers: int) -> None:
        """A worker group of ``num_workers`` is being started (placement group, actors, process group)."""

    def group_started(self, places: list[WorkerPlace]) -> None:
        """The group's workers are up and their training function was launched."""

    def replicas_started(self, places: list[WorkerPlace]) -> None:
        """A replica group was replaced while the others train on (``scaling.recovery: live``): where its new
        workers run (they train)."""

    def failure_decided(
        self, retry: bool, errors: dict[int, BaseException], error: BaseException, preemption: bool
    ) -> None:
        """The group failed (``errors``: its failed ranks' errors, or Ray's about them; empty when the group failed
        to start or the controller itself did: ``error``): ``retry`` (a new group), else the run fails.
        ``preemption``: the failure is a preemption notice's deadline (the group checkpointed and waited for it)."""

    def resizing(self, num_workers: int) -> None:
        """A running group is replaced by one of ``num_workers`` (capacity came back)."""

    def preempting(self, ranks: list[int], deadline_ms: int | None) -> None:
        """A preemption notice covers ``ranks`` (their nodes are being drained)."""

    def notice_committed(self, step: int) -> None:
        """Every worker of the group reported :data:`NOTICE_COMMITTED`: the notice's checkpoint of ``step`` is
        committed; the group is restarted without the draining node at the controller's next poll."""
