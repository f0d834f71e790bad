"""The goodput ledger's arithmetic (raytrn.tracking.goodput), rank 0's clock (raytrn.train.goodput) and the driver's
event lines (raytrn.train.events): every second of a run booked to one cause, each gap to why its group ended."""

from __future__ import annotations

import pytest

from raytrn.errors import RaytrnError
from raytrn.pending import Ready
from raytrn.tracking import goodput
from raytrn.tracking.board import RestoreRecord
from raytrn.tracking.goodput import BADPUT, EndCause, GroupEnd, GroupTimes, close
from raytrn.tracking.roles import ProgressPosts
from raytrn.train import goodput as clock_module
from raytrn.train.events import RunEvents, describe_error

pytestmark = pytest.mark.unit


def _group(n: int, first: float, last: float, *, restore: float = 0.0, **parts: float) -> GroupTimes:
    """A group whose span ``[first, last]`` is filled by ``parts`` (the rest: productive)."""
    filled = sum(parts.values())
    return GroupTimes(
        group=n, world_size=2, restore_s=restore, first_step_at=first, last_step_end_at=last, steps=10,
        productive_s=(last - first) - filled, **{f"{k}_s": v for k, v in parts.items()},
    )  # fmt: skip


def test_one_group_books_startup_steps_and_shutdown_and_adds_up() -> None:
    g = _group(1, 110.0, 150.0, checkpoint=2.0, eval=1.0, data_wait=0.5, warmup=0.8, other=0.7)
    ledger = close(100.0, 155.0, [g], [])
    assert ledger.wall_s == 55.0
    assert ledger.startup == pytest.approx(10.0) and ledger.shutdown == pytest.approx(5.0)
    assert ledger.productive == pytest.approx(35.0)
    assert (ledger.checkpoint, ledger.eval, ledger.data_wait, ledger.warmup, ledger.other) == (2.0, 1.0, 0.5, 0.8, 0.7)
    assert ledger.unaccounted == pytest.approx(0.0, abs=1e-9)
    assert ledger.goodput == pytest.approx(35.0 / 55.0)
    assert ledger.events == []


def test_a_resumed_first_group_books_its_restore_apart_from_startup() -> None:
    ledger = close(100.0, 130.0, [_group(1, 112.0, 128.0, restore=1.5)], [])
    assert ledger.restore == pytest.approx(1.5) and ledger.startup == pytest.approx(10.5)
    assert ledger.unaccounted == pytest.approx(0.0, abs=1e-9)


def test_each_gap_lands_in_the_cause_of_the_group_that_ended_before_it() -> None:
    groups = [
        _group(1, 110.0, 140.0),
        _group(2, 150.0, 170.0, restore=0.4, retrained=3.0),  # after a failure at 141
        _group(3, 185.0, 200.0),  # after a resize decided at 168, while group 2 still trained
        _group(4, 230.0, 240.0, restore=1.0),  # after a preemption notice's deadline
    ]
    ends = [GroupEnd(141.0, EndCause.FAILURE), GroupEnd(168.0, EndCause.RESIZE), GroupEnd(205.0, EndCause.PREEMPTION)]
    ledger = close(100.0, 245.0, groups, ends)
    assert ledger.restart == pytest.approx(10.0 - 0.4)
    assert ledger.resize == pytest.approx(15.0)
    assert ledger.preemption == pytest.approx(30.0 - 1.0)
    assert ledger.restore == pytest.approx(1.4) and ledger.retrained == pytest.approx(3.0)
    assert ledger.events == ["restart", "resize", "preemption"]
    assert ledger.unaccounted == pytest.approx(0.0, abs=1e-9)


def test_a_group_that_never_stepped_is_part_of_the_gap_and_an_unrecorded_end_is_a_failure() -> None:
    never = GroupTimes(group=2, world_size=2)
    ledger = close(0.0, 100.0, [_group(1, 10.0, 40.0), never, _group(3, 60.0, 90.0)], [])
    assert ledger.restart == pytest.approx(20.0) and ledger.events == ["restart"]
    assert ledger.unaccounted == pytest.approx(0.0, abs=1e-9)


def test_a_run_that_never_stepped_was_all_startup() -> None:
    ledger = close(0.0, 12.0, [], [])
    assert ledger.startup == 12.0 and ledger.goodput == 0.0 and ledger.unaccounted == 0.0


def test_missing_time_shows_as_unaccounted_not_as_goodput() -> None:
    """A group whose posted parts do not fill its span (its rank 0 lost the last post): the difference is visible."""
    g = GroupTimes(group=1, world_size=1, first_step_at=10.0, last_step_end_at=30.0, steps=5, productive_s=15.0)
    ledger = close(0.0, 30.0, [g], [])
    assert ledger.unaccounted == pytest.approx(5.0)


def test_metrics_name_every_cause_and_add_across_invocations() -> None:
    ledger = close(0.0, 50.0, [_group(1, 10.0, 40.0, checkpoint=5.0)], [])
    metrics = ledger.metrics()
    assert set(metrics) == set(goodput.METRICS)
    assert metrics["badput_checkpoint_s"] == 5.0 and metrics["goodput_s"] == 25.0 and metrics["goodput"] == 0.5
    total = goodput.add(metrics, metrics)  # an earlier invocation logged the same
    assert total["wall_s"] == 100.0 and total["goodput_s"] == 50.0 and total["goodput"] == 0.5
    assert total["badput_startup_s"] == 20.0
    assert goodput.add({}, metrics) == metrics
    assert ledger.render().startswith("0.50 (25.0 of 50.0 s productive); startup 10.0 s, checkpoint 5.0 s")
    assert set(BADPUT) | {"productive"} == set(ledger.seconds())


# -- rank 0's clock ----------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + 5e8  # another origin: only differences matter

    def advance(self, s: float) -> None:
        self.now += s


class _Board:
    """The board's progress posts (raytrn.tracking.roles.ProgressPosts): the group's times kept."""

    def __init__(self) -> None:
        self.posted: list[GroupTimes] = []

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        pass

    def reached(self, step: int) -> None:
        pass

    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None:
        pass

    def goodput(self, times: GroupTimes) -> None:
        self.posted.append(times)


def test_the_clock_splits_its_groups_time_and_covers_it_contiguously(monkeypatch) -> None:
    fake, board = _Clock(), _Board()
    assert isinstance(board, ProgressPosts)  # the stand-in has the role's methods
    monkeypatch.setattr(clock_module, "time", fake)
    c = clock_module.GoodputClock(
        board,
        world_size=2,
        restore_s=0.7,
        start_step=10,
        group=3,
        restored=Ready(RestoreRecord(source="storage", step=10, restore_s=0.7, steps_retrained=2)),
    )
    durations = {11: 3.0, 12: 1.0, 13: 1.0, 14: 1.0}  # step 11: 2 s of warm-up; 11 and 12 were trained before
    for step, took in durations.items():
        c.step_started()
        fake.advance(took)
        c.stepped(step, data_wait_s=0.25)
        fake.advance(0.1)  # logging
        with c.blocking("checkpoint"):
            fake.advance(0.5 if step == 12 else 0.0)
        with c.blocking("eval"):
            fake.advance(0.3 if step == 14 else 0.0)
        c.iteration_done(final=step == 14)
    times = board.posted[-1]
    assert (times.group, times.world_size, times.steps, times.restore_s) == (3, 2, 4, 0.7)
    steady = 0.75  # a step less its wait
    assert times.warmup_s == pytest.approx(3.0 - 0.25 - steady)
    assert times.retrained_s == pytest.approx(2 * steady) and times.productive_s == pytest.approx(2 * steady)
    assert times.data_wait_s == pytest.approx(1.0) and times.checkpoint_s == pytest.approx(0.5)
    assert times.eval_s == pytest.approx(0.3) and times.other_s == pytest.approx(0.4)
    span = times.last_step_end_at - times.first_step_at
    parts = sum(getattr(times, f"{k}_s") for k in ("productive", "retrained", "warmup", "data_wait", "checkpoint",
                                                 "eval", "other"))  # fmt: skip
    assert parts == pytest.approx(span)


def test_an_iteration_cut_short_is_left_to_the_gap_not_booked_twice(monkeypatch) -> None:
    """A peer's node is lost: rank 0's step trained, then its snapshot write waits and fails. The posted time ends at
    the last completed iteration, with every part inside it (CI saw -3.2 s unaccounted when the cut iteration's
    step and checkpoint time were posted with the earlier end)."""
    fake, board = _Clock(), _Board()
    monkeypatch.setattr(clock_module, "time", fake)
    c = clock_module.GoodputClock(board, world_size=3, restore_s=0.0, start_step=0, restored=None, group=2)
    for step in (1, 2):
        c.step_started()
        fake.advance(1.0)
        c.stepped(step, data_wait_s=0.0)
        c.iteration_done()
        fake.advance(1.0)  # past POST_EVERY_S: each completed iteration posts
    c.step_started()
    fake.advance(1.0)
    c.stepped(3, data_wait_s=0.0)
    with pytest.raises(RuntimeError), c.blocking("checkpoint"):
        fake.advance(3.2)
        raise RuntimeError("Connection closed by peer")
    c.post()  # the loop's `finally`
    times = board.posted[-1]
    assert times.steps == 2 and times.checkpoint_s == 0.0
    span = times.last_step_end_at - times.first_step_at
    parts = sum(getattr(times, f"{k}_s") for k in ("productive", "retrained", "warmup", "data_wait", "checkpoint",
                                                 "eval", "other"))  # fmt: skip
    assert parts == pytest.approx(span)
    # the ledger: the group's cut iteration lands in the restart that followed, and every second once
    ledger = close(times.first_step_at - 5, times.last_step_end_at + 10, [times], [])
    assert ledger.unaccounted == pytest.approx(0.0)


def test_only_rank_0_measures() -> None:
    c = clock_module.GoodputClock(None, world_size=2, restore_s=0.0, start_step=0, restored=None, group=1)
    c.step_started()
    c.stepped(1, 0.0)
    with c.blocking("eval"):
        pass
    c.iteration_done(final=True)
    c.post()
    assert c.steps == 0


# -- the driver's lines --------------------------------------------------------------------------------------------


class ActorDiedError(Exception):
    """Named as Ray's (describe_error reads the type's name: no Ray here)."""


def test_a_failure_is_one_line_naming_the_rank_its_node_and_what_happens_next() -> None:
    from raytrn.compat import WorkerPlace

    lines: list[str] = []
    events = RunEvents(2, out=lines.append)
    events.group_starting(2)
    events.group_started([WorkerPlace(0, "n0", "10.0.0.1", 11), WorkerPlace(1, "n1", "10.0.0.2", 12)])
    died = ActorDiedError("The actor died unexpectedly before finishing this task (SIGKILL)")
    events.failure_decided(True, {1: died}, RuntimeError("group"), False)
    assert lines == [
        "raytrn: rank 1 on 10.0.0.2 failed: its process died (killed, out of memory, or its node lost); restarting "
        "the group from the newest state (failure 1 of scaling.max_failures=2)"
    ]
    events.failure_decided(False, {0: RaytrnError("the loss diverged\nmore"), 1: RaytrnError("the loss diverged")},
                           RuntimeError("group"), False)  # fmt: skip
    assert lines[-1] == (
        "raytrn: ranks 0, 1 on 10.0.0.1, 10.0.0.2 failed: the loss diverged; no restarts left "
        "(scaling.max_failures=2): the run fails"
    )
    assert [e.cause for e in events.ends] == [EndCause.FAILURE, EndCause.FAILURE]


def test_a_lost_node_is_named_before_its_survivors_collective_errors() -> None:
    """A node lost under a group of 3: the survivors' gloo all-reduce fails first (Ray has not reported the lost
    rank's actor yet), so the line names the rank on the node that is gone, then what the others saw."""
    from raytrn.compat import WorkerPlace

    lines: list[str] = []
    events = RunEvents(10, out=lines.append, alive_nodes=lambda: {"n0", "n1"})
    events.group_started([WorkerPlace(r, f"n{r}", f"10.0.0.{r + 1}", 10 + r) for r in range(3)])
    reset = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28371: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    events.failure_decided(True, {0: reset, 1: reset}, RuntimeError("group"), False)
    assert lines == [
        "raytrn: rank 2 on 10.0.0.3 failed: its node was lost; ranks 0, 1 on 10.0.0.1, 10.0.0.2 failed: a peer left "
        "its collective (another worker's process or node went away); restarting the group from the newest state "
        "(failure 1 of scaling.max_failures=10)"
    ]
    # Ray has not marked the node dead yet (or does not answer): the rank that said nothing is the likely one
    for alive in (lambda: {"n0", "n1", "n2"}, lambda: None):
        events.alive_nodes = alive
        events.failure_decided(True, {0: reset, 2: reset}, RuntimeError("group"), False)
        assert lines[-1].startswith(
            "raytrn: rank 1 on 10.0.0.2 failed: no word from it (its process or node likely gone); ranks 0, 2 on "
            "10.0.0.1, 10.0.0.3 failed: a peer left its collective"
        ), lines[-1]
    # a killed worker: its death named before the others' failed collectives, whatever the ranks' order
    died = ActorDiedError("The actor died because its worker process has died")
    events.failure_decided(True, {0: reset, 1: reset, 2: died}, RuntimeError("group"), False)
    assert lines[-1].startswith(
        "raytrn: rank 2 on 10.0.0.3 failed: its process died (killed, out of memory, or exited); ranks 0, 1 on "
        "10.0.0.1, 10.0.0.2 failed: a peer left its collective"
    ), lines[-1]
    # a rank's own error beside silent ranks: only what was reported
    events.failure_decided(True, {0: ValueError("bad batch")}, RuntimeError("group"), False)
    assert lines[-1].startswith("raytrn: rank 0 on 10.0.0.1 failed: ValueError: bad batch; restarting")


def test_a_live_replica_left_behind_is_named_alone_and_the_others_train_on() -> None:
    """Live recovery, a node cut off while Ray still has it alive and its worker's process still answers: the
    survivors re-form without it and say nothing; it reports its collective's peers gone. The line names it, not the
    silent survivors (the restart path's guess), and says the others train on (seen in the bench's live round)."""
    from raytrn.compat import WorkerPlace

    lines: list[str] = []
    events = RunEvents(10, live=True, out=lines.append, alive_nodes=lambda: {"n0", "n1", "n2"})
    events.group_started([WorkerPlace(r, f"n{r}", f"10.0.0.{r + 1}", 10 + r) for r in range(3)])
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28371: Connection reset by peer.")
    events.failure_decided(True, {2: reset}, RuntimeError("group"), False)
    assert lines == [
        "raytrn: rank 2 on 10.0.0.3 failed: the other replicas went on without it (they stopped hearing from it: its "
        "node or network went away); the other replicas train on; its replica is replaced when capacity allows "
        "(failure 1 of scaling.max_failures=10)"
    ]
    assert events.ends == []


def test_a_live_replica_lost_with_its_node_is_named_once_not_again_at_the_next_failure() -> None:
    """Live recovery: a failed replica waits for capacity at its place (no new group starts), so a later failure of
    another replica (frozen: Ray's health check gave it up) names only that one, whatever the first line said of
    it; a replacement's rank is named where it runs now; every replica failed is the restart Ray then does."""
    from raytrn.compat import WorkerPlace

    lines: list[str] = []
    alive = {"n0", "n1", "n2", "n3"}
    events = RunEvents(10, live=True, out=lines.append, alive_nodes=lambda: set(alive))
    events.group_started([WorkerPlace(r, f"n{r}", f"10.0.0.{r + 1}", 10 + r) for r in range(4)])
    died = ActorDiedError("The actor died unexpectedly before finishing this task (SIGKILL)")
    events.failure_decided(True, {0: died}, RuntimeError("group"), False)  # (its node still alive for Ray)
    assert lines[-1].startswith("raytrn: rank 0 on 10.0.0.1 failed: its process died"), lines[-1]
    alive.discard("n0")  # Ray marks it dead: rank 0 is not news again
    frozen = type("WorkerHealthCheckTimeoutError", (Exception,), {})("A worker health check has been hanging")
    events.failure_decided(True, {2: frozen}, RuntimeError("group"), False)
    assert lines[-1] == (
        "raytrn: rank 2 on 10.0.0.3 failed: it stopped answering Ray's health checks (a frozen process: killed); the "
        "other replicas train on; its replica is replaced when capacity allows (failure 2 of scaling.max_failures=10)"
    )
    # rank 2's replacement runs on n4: its node lost later is news again, named there
    events.replicas_started([WorkerPlace(2, "n4", "10.0.0.5", 30)])
    events.failure_decided(True, {}, RuntimeError("group"), False)
    assert lines[-1].startswith("raytrn: rank 2 on 10.0.0.5 failed: its node was lost; the other"), lines[-1]
    # the last two replicas killed: nothing live is left, Ray restarts the whole group
    events.failure_decided(True, {1: died, 3: died}, RuntimeError("group"), False)
    assert lines[-1].endswith("restarting the group from the newest state (failure 4 of scaling.max_failures=10)")
    # the new group: nothing told yet, rank 0 elsewhere; its node lost is news again
    events.group_started([WorkerPlace(0, "n5", "10.0.0.6", 20), WorkerPlace(1, "n1", "10.0.0.2", 21)])
    events.failure_decided(True, {}, RuntimeError("group"), False)
    assert lines[-1].startswith("raytrn: rank 0 on 10.0.0.6 failed: its node was lost"), lines[-1]


def test_resizes_notices_and_failed_starts_are_lines_and_ends_too() -> None:
    lines: list[str] = []
    events = RunEvents(3, out=lines.append)
    events.group_starting(2)
    events.resizing(3)
    events.preempting([2], None)
    events.failure_decided(True, {}, TimeoutError("placement group not ready"), False)
    events.failure_decided(True, {}, RuntimeError("deadline"), True)
    assert lines[0] == "raytrn: capacity for 3 workers (running 2): restarting the group at 3"
    assert lines[1].startswith("raytrn: preemption notice for rank 2 (no deadline given): checkpointing")
    assert lines[2].startswith("raytrn: the worker group of 2 failed (TimeoutError: placement group not ready); ")
    assert lines[3] == (
        "raytrn: the preempted node's deadline passed; restarting the group without the node from the checkpoint it took"
    )
    assert [e.cause for e in events.ends] == [EndCause.RESIZE, EndCause.FAILURE, EndCause.PREEMPTION]
    assert events.failures == 1  # the notice's deadline is not a failure
    # every rank stopped at the notice's committed checkpoint: the restart comes at once, said so; a later group's
    # preemption without that report is the deadline's again
    events.group_started([])
    events.notice_committed(12)
    events.failure_decided(True, {}, RuntimeError("preempted"), True)
    assert lines[4] == (
        "raytrn: every rank stopped at the notice's checkpoint (step 12); restarting the group without the node from "
        "that checkpoint, not waiting for its deadline"
    )
    events.group_started([])
    events.failure_decided(True, {}, RuntimeError("deadline"), True)
    assert lines[5].startswith("raytrn: the preempted node's deadline passed;"), lines[5]
    assert events.failures == 1 and events.ends[-1].cause is EndCause.PREEMPTION


def test_a_trials_events_are_recorded_not_printed() -> None:
    lines: list[str] = []
    events = RunEvents(1, quiet=True, out=lines.append)
    events.resizing(2)
    assert lines == [] and len(events.ends) == 1


def test_describe_error_digs_to_what_happened() -> None:
    class WorkerHealthCheckFailedError(Exception):
        def __init__(self, msg: str, failure: Exception) -> None:
            super().__init__(msg)
            self.health_check_failure = failure

    # Ray's own words (its GCS's messages), and a process's exit whose text names nodes elsewhere (Ray's advice on
    # out-of-memory kills) is not a lost node
    node = ActorDiedError("The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\n"
                          "The actor died because its node has died. Node Id: 67487bd7")  # fmt: skip
    nested = WorkerHealthCheckFailedError("A worker health check failed.", node)
    assert describe_error(nested) == "its node was lost"
    exited = ActorDiedError(
        "The actor died unexpectedly before finishing this task.\nThe actor is dead because its worker process has died. "
        "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
        "End of file. Some common causes include: (1) the process was killed by the OOM killer ... check dmesg of the "
        "OOMing node ... prevent node deaths by resource contention"
    )
    assert describe_error(exited) == "its process died (killed, out of memory, or exited)"
    assert describe_error(ValueError("bad thing\ntraceback...")) == "ValueError: bad thing"
    assert describe_error(KeyError()) == "KeyError"


def test_live_recovery_inside_a_group_is_booked_as_restart_time(monkeypatch) -> None:
    """``scaling.recovery: live``: a step whose first attempt a lost replica aborted (1.5 s of it, re-formation
    included) and a newcomer's admission after another (0.4 s) are the ledger's restart time, not productive; the
    group's span is still covered exactly once."""
    fake, board = _Clock(), _Board()
    monkeypatch.setattr(clock_module, "time", fake)
    c = clock_module.GoodputClock(board, world_size=3, restore_s=0.0, start_step=0, group=1, restored=None)
    for step, took, recovery, admission in ((1, 1.0, 0.0, 0.0), (2, 2.5, 1.5, 0.0), (3, 1.0, 0.0, 0.4)):
        c.step_started()
        fake.advance(took)
        c.stepped(step, data_wait_s=0.0, recovery_s=recovery)
        with c.blocking("recovery"):
            fake.advance(admission)
        c.iteration_done(final=step == 3)
    times = board.posted[-1]
    assert times.recovery_s == pytest.approx(1.9)
    assert times.productive_s + times.warmup_s == pytest.approx(3.0)
    ledger = close(times.first_step_at - 5.0, times.last_step_end_at + 1.0, [times], [])
    assert ledger.restart == pytest.approx(1.9) and ledger.events == []
    assert ledger.unaccounted == pytest.approx(0.0, abs=1e-6)
