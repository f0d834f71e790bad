"""The step protocol (raytrn.train.protocol): the loop's components run in one documented order of phases, and a
collective issued on some ranks only (or a different one per rank) is caught on every rank, not a hang: real gloo
processes."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
import torch.multiprocessing as mp

from raytrn.train import components, protocol
from raytrn.train.evaluate import Evaluation
from raytrn.train.guard import NonFiniteGuard
from raytrn.train.metrics import MetricsReporter, TuneReport
from raytrn.train.preemption import PreemptionWatch
from raytrn.train.protocol import PHASES, CollectiveOrderError, Component, StepEnd, StepProtocol
from raytrn.train.step import StepResult
from raytrn.train.stopping import StopRequests
from raytrn.train.watchdog import HangWatch
from tests.unit.gloo_ranks import spawn_ranks

pytestmark = pytest.mark.unit


def _result() -> StepResult:
    return StepResult(loss=torch.tensor(1.0), grad_norm=torch.tensor(1.0), data_wait_s=0.0, forward_s=0.0)


def _end(step: int) -> StepEnd:
    return StepEnd(step, last=False, saving=False, logging=False, result=_result())


class _Recorder:
    """A component of a given phase that records when it ran (and what the earlier phases left)."""

    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(self, phase: str, ran: list[str]) -> None:
        self.phase = phase  # type: ignore[misc]  # (a stand-in of every phase: the class's is per instance here)
        self.ran = ran

    def step_ended(self, end: StepEnd) -> None:
        self.ran.append(self.phase)
        if self.phase == "agreement":
            end.stop_at = 7
        if self.phase == "checkpoint":
            end.stopping = end.stop_at == 7  # it saw the agreement's decision


def test_components_run_in_the_phases_order_whatever_order_they_were_registered_in() -> None:
    ran: list[str] = []
    shuffled = [_Recorder(p, ran) for p in reversed(PHASES)]
    end = StepProtocol(shuffled, check=None).step_ended(_end(3))
    assert ran == list(PHASES)
    assert end.stopping  # each phase reads what the earlier ones decided
    with pytest.raises(ValueError, match="not in PHASES"):
        StepProtocol([_Recorder("somewhere", ran)])


def test_long_and_blocking_components_run_inside_the_watch_and_the_clock() -> None:
    entered: list[str] = []

    @contextlib.contextmanager
    def working() -> Iterator[None]:
        entered.append("working")
        yield

    @contextlib.contextmanager
    def blocking(cause: str) -> Iterator[None]:
        entered.append(cause)
        yield

    class Save(_Recorder):
        long: ClassVar[bool] = True
        blocking: ClassVar[str | None] = "checkpoint"

    ran: list[str] = []
    StepProtocol([Save("checkpoint", ran), _Recorder("guard", ran)], working=working, blocking=blocking).step_ended(
        _end(1)
    )
    assert entered == ["working", "checkpoint"] and ran == ["guard", "checkpoint"]


def test_every_loop_component_declares_a_phase_of_the_protocol() -> None:
    """Each per-step concern of the loop is a component: its class names its phase, its bounds and its step end."""
    declared = {
        NonFiniteGuard: "guard", components.SnapshotWrite: "snapshot", components.Agreement: "agreement",
        MetricsReporter: "metrics", HangWatch: "watchdog", Evaluation: "eval", TuneReport: "report",
        components.CheckpointSave: "checkpoint",
    }  # fmt: skip
    for cls, phase in declared.items():
        assert cls.phase == phase and isinstance(cls.long, bool), cls
        assert cls.blocking in (None, "checkpoint", "eval"), cls
        assert callable(cls.step_ended), cls
    assert sorted(declared.values(), key=PHASES.index) == list(PHASES)  # every phase has its component


# -- the collectives' order, across real ranks ---------------------------------------------------------------------


class _AllReduce:
    """Issues an all-reduce at its phase, on the ranks and steps ``when(rank, step)`` says (``op``: which one)."""

    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(self, phase: str, rank: int, when, op: str = "all_reduce") -> None:  # noqa: ANN001
        self.phase = phase  # type: ignore[misc]
        self.rank, self.when, self.op = rank, when, op

    def step_ended(self, end: StepEnd) -> None:
        import torch.distributed as dist

        if not self.when(self.rank, end.step):
            return
        if self.op == "all_reduce":
            dist.all_reduce(torch.ones(1))
        else:
            dist.broadcast(torch.ones(1), src=0)


def _case(rank: int, world: int, case: str) -> tuple[int, str]:
    parts: list[Component]
    if case == "loop":  # the real agreement (an all-reduce every step) and guard, checked at every step
        guard = NonFiniteGuard.__new__(NonFiniteGuard)  # (its step end needs only what check reads)
        guard.enabled = False
        parts = [components.Agreement(PreemptionWatch(world), StopRequests(None)), guard]
    elif case == "missing":  # rank 0 reads the loss at step 2, rank 1 does not: a hang without the check
        parts = [
            _AllReduce("agreement", rank, lambda r, s: True),
            _AllReduce("metrics", rank, lambda r, s: r == 0 and s == 2),
        ]
    else:  # "different": at step 2 rank 1 broadcasts where rank 0 all-reduces
        op = "broadcast" if rank == 1 else "all_reduce"
        parts = [_AllReduce("eval", rank, lambda r, s: s == 2, op=op)]
    steps = StepProtocol(parts)
    assert steps.check is not None
    reached, error = 0, ""
    try:
        for step in (1, 2, 3):
            steps.step_ended(_end(step))
            reached = step
    except CollectiveOrderError as e:
        error = str(e)
    return reached, error


def _run(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RAYTRN_CHECK_COLLECTIVES="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    for case in ("missing", "different", "loop"):  # (after a caught mismatch the ranks go on together)
        out[(case, rank)] = _case(rank, world, case)
    dist.destroy_process_group()


def test_a_collective_issued_on_some_ranks_only_is_caught_on_every_rank_and_the_loops_agreement_passes() -> None:
    with mp.Manager() as manager:
        shared = manager.dict()
        spawn_ranks(_run, 2, shared, deadline_s=120)  # past it: a hang the check should prevent
        out = dict(shared)
    for case in ("missing", "different"):
        for rank in (0, 1):
            reached, error = out[(case, rank)]
            assert reached == 1, out  # step 1 agreed; step 2 stopped on both ranks, before the odd collective ran
            assert "the ranks' step-end collectives differ" in error, out
    missing, different = out[("missing", 0)][1], out[("different", 1)][1]
    assert "rank 0: all_reduce in phase 'metrics'" in missing and "rank 1: the end of step 2" in missing, missing
    assert "rank 0: all_reduce in phase 'eval'" in different and "rank 1: broadcast in phase 'eval'" in different
    assert out[("loop", 0)] == out[("loop", 1)] == (3, ""), out  # the real agreement: the same at every step


def test_the_check_is_off_unless_asked_and_on_a_single_rank(monkeypatch) -> None:
    monkeypatch.delenv(protocol.CHECK_ENV, raising=False)
    assert protocol.CollectiveCheck.from_env() is None
    monkeypatch.setenv(protocol.CHECK_ENV, "1")
    assert protocol.CollectiveCheck.from_env() is None  # no process group here: nothing to compare
