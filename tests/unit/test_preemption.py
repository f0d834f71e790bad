"""Preemption notices are agreed by every rank at the same step (raytrn.train.preemption): real gloo processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from raytrn import compat, sigterm
from raytrn.errors import RunStopped
from raytrn.tracking.board import StopAsked, StopOrder
from raytrn.tracking.roles import StopMailbox
from raytrn.train import preemption
from raytrn.train.preemption import Notice, NoticeFrom, PreemptionWatch
from tests.unit.gloo_ranks import spawn_ranks

pytestmark = pytest.mark.unit


def _agree(rank: int, world: int, port: int, noticed_at: dict[int, int], out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    step = 0
    # This rank's copy of the notice arrives at its own step (Ray's watcher reaches workers one by one).
    preemption._local_notice = lambda: "notice" if step >= noticed_at.get(rank, 10**9) else None
    watch = PreemptionWatch(world)
    seen = []
    for step in range(1, 8):  # noqa: B007 (read by the lambda)
        # rank 0 hears of a stop request (for step 6) at step 4, and that the run's lease was taken over at step 6:
        # every rank learns each in the same collective
        agreed = watch.agree(6 if rank == 0 and step >= 4 else 0, rank == 0 and step >= 6)
        # its own copy where it had one (Ray's details kept), else "another rank's"
        own = step >= noticed_at.get(rank, 10**9)
        source = NoticeFrom.RAY if own else NoticeFrom.PEER
        assert agreed.notice is None or (
            agreed.notice.source is source and agreed.notice.info == ("notice" if own else None)
        )
        seen.append((agreed.notice is not None, agreed.stop_at, agreed.abort))
    out[rank] = seen
    dist.destroy_process_group()


def test_every_rank_agrees_at_the_first_step_any_rank_has_a_notice() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        # rank 2 hears at step 3, rank 0 at step 5, rank 1 never (its node is the one going away, say).
        spawn_ranks(_agree, 3, {2: 3, 0: 5}, out, deadline_s=120)
        notices = [False, False, True, True, True, True, True]
        stops = [0, 0, 0, 6, 6, 6, 6]
        aborts = [False] * 5 + [True, True]
        expected = list(zip(notices, stops, aborts, strict=True))
        assert dict(out) == {0: expected, 1: expected, 2: expected}


def test_one_worker_needs_no_collective_and_outside_ray_there_is_no_notice() -> None:
    watch = PreemptionWatch(1)
    assert watch.notice() is None  # not in a Ray Train worker: Ray's context is missing, so no notice


def test_describe_names_nodes_ranks_and_deadline() -> None:
    from ray.train import PreemptionInfo

    info = PreemptionInfo(deadline_ms=int((time.time() + 25.4) * 1000), preempted_node_to_ranks={"n2": [2, 3]})
    shown = Notice(NoticeFrom.RAY, info).describe()
    assert shown in ("node n2, ranks [2, 3], deadline in 25 s", "node n2, ranks [2, 3], deadline in 24 s")
    assert Notice(NoticeFrom.PEER).describe() == "another rank's node"
    assert Notice(NoticeFrom.RAY, object()).describe() == "no details"


def test_ray_keeps_the_notice_where_raytrn_reads_it() -> None:
    context = compat.resolve(compat.PRIVATE_NAMES["Ray Train worker preemption notice"])
    assert "preemption_context" in context.__dataclass_fields__
    holder = compat.resolve(compat.PRIVATE_NAMES["Ray Train preemption context"])
    assert holder().preemption_info is None  # set by Ray's watcher on every worker of the group


@pytest.fixture
def sigterm_handler(monkeypatch):
    """raytrn's SIGTERM handler in this (main) thread over a recording one; uninstalled afterwards.

    Uninstalled, not only reset: a flagged SIGTERM's exit timer left running ended the whole pytest run with exit
    code 143 one grace period later (CI, stop 35: 3600 s after this test, in the chaos tests)."""
    import signal

    seen: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    monkeypatch.setattr(sigterm, "SIGTERM_GRACE_S", 3600.0)
    assert sigterm.install_sigterm_handler()
    yield seen
    sigterm.uninstall_sigterm_handler()
    signal.signal(signal.SIGTERM, original)


def test_sigterm_while_training_is_a_notice_not_an_exit(sigterm_handler) -> None:
    """A spot node's shutdown, or a scheduler, sends SIGTERM: the worker stays up to checkpoint first."""
    import signal

    sigterm.TRAINING.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # Python runs the handler between bytecodes of the main thread
    assert sigterm.sigterm_received() and sigterm_handler == []  # the old handler (an exit) was not called
    watch = PreemptionWatch(1)
    assert watch.notice() == Notice(NoticeFrom.SIGTERM)
    assert Notice(NoticeFrom.SIGTERM).describe() == "SIGTERM to this worker"


_MAIN_THREAD_IN_C = """
import ctypes, os, signal, sys, threading, time
from raytrn import sigterm
sigterm.SIGTERM_GRACE_S = 3600.0
assert sigterm.install_sigterm_handler()
sigterm.TRAINING.set()
seen = []
def training():  # the training function's thread, as in a Ray Train worker
    os.kill(os.getpid(), signal.SIGTERM)
    start = time.monotonic()
    while not sigterm.sigterm_received() and time.monotonic() - start < 10:
        time.sleep(0.01)
    seen.append(time.monotonic() - start)
thread = threading.Thread(target=training)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the main thread stays in C: it never takes it
thread.start()
ctypes.CDLL(None).sleep(4)  # like Ray's C++ task loop: no Python bytecode runs on the main thread
thread.join()
print(f"noticed after {seen[0]:.2f} s")
"""


def test_sigterm_is_noticed_while_the_main_thread_waits_in_c(tmp_path) -> None:
    """A Ray worker's main thread sits in Ray's C++ task loop: a Python handler alone would flag the SIGTERM only
    when that thread next runs Python (here after 4 s; in a short run, after the last step)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MAIN_THREAD_IN_C], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.returncode == 0, out.stderr
    seconds = float(out.stdout.split()[2])
    assert seconds < 2.0, out.stdout


def test_sigterm_outside_training_exits_as_before(sigterm_handler) -> None:
    import signal

    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert sigterm_handler == [signal.SIGTERM] and not sigterm.sigterm_received()


def test_uninstalling_cancels_the_pending_exit_and_restores_what_was_there(sigterm_handler) -> None:
    import signal
    import threading

    def threads(name: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == name]

    sigterm.TRAINING.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    (timer,) = threads("raytrn-sigterm-exit")
    (reader,) = threads("raytrn-sigterm")
    raytrns = signal.getsignal(signal.SIGTERM)
    sigterm.uninstall_sigterm_handler()
    timer.join(5)
    reader.join(5)
    assert not timer.is_alive() and not reader.is_alive()  # the exit is cancelled, the reader returned
    assert not sigterm.sigterm_received() and not sigterm.TRAINING.is_set()
    assert signal.getsignal(signal.SIGTERM) is not raytrns  # the handler it replaced is back (checked below)
    assert signal.set_wakeup_fd(-1) == -1  # and no wakeup fd is left set
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    assert sigterm_handler == [signal.SIGTERM]
    sigterm.uninstall_sigterm_handler()  # a second time: nothing left to undo


def test_the_handler_is_set_only_from_the_main_thread() -> None:
    import threading

    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(sigterm.install_sigterm_handler()))
    thread.start()
    thread.join()
    assert result == [False]


def test_raytrns_ray_backend_forms_the_process_group_without_importing_torch_on_the_driver() -> None:
    """The cpu/cuda backend config is Ray Train's public BackendConfig, so the driver imports no torch; its backend
    sets each worker up (environment, SIGTERM handler, process group) and tears nothing down (Ray kills the workers)."""
    import subprocess
    import sys

    from ray.train.backend import Backend as RayBackend
    from ray.train.backend import BackendConfig

    from raytrn.backends.cpu import CpuBackend
    from raytrn.backends.ray_backend import ProcessGroupBackend, ProcessGroupConfig
    from raytrn.config import load_job

    job = load_job(Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml", ["data.manifest=unused"], resolve=False)
    config = CpuBackend().ray_backend_config(job)
    assert isinstance(config, ProcessGroupConfig) and isinstance(config, BackendConfig)
    assert config.backend == "gloo" and config.backend_cls is ProcessGroupBackend
    assert ProcessGroupBackend.on_shutdown is RayBackend.on_shutdown  # nothing: a gone peer would block it 30 s
    code = (
        "import sys; from raytrn.backends.cpu import CpuBackend; from raytrn.config import load_job;"
        f"job = load_job({str(Path(__file__).resolve().parents[2] / 'jobs' / 'tiny.yaml')!r}, ['data.manifest=x'],"
        " resolve=False); CpuBackend().ray_backend_config(job); import raytrn.train.trainer;"
        "print(sorted(m for m in ('torch', 'mlflow', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


# -- stop requests (raytrn stop) -------------------------------------------------------------------------------------


class _Later:
    """The board's answer to rank 0's look at the stop order, there on the next look (the board's answer then)."""

    def __init__(self, board: _StopBoard) -> None:
        self.board = board

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float | None = None) -> StopOrder:
        return self.board.answer


class _StopBoard:
    """The job's stop mailbox (raytrn.tracking.roles.StopMailbox) as rank 0 sees it: only its ``order`` is asked."""

    def __init__(self, answer: StopOrder) -> None:
        self.answer, self.asked = answer, 0

    def order(self) -> _Later:
        self.asked += 1
        return _Later(self)

    def request(self, at_step: int | None, *, timeout_s: float = 30) -> StopAsked:
        raise AssertionError("raytrn stop's, not rank 0's")

    def lease_lost(self, lost: RunStopped) -> None:
        raise AssertionError("the driver's, not rank 0's")

    def stop(self, error: RunStopped) -> None:
        raise AssertionError("every rank's, as the run stops")


def test_rank_0_asks_the_board_without_waiting_and_names_the_step_to_end_at(monkeypatch) -> None:
    from raytrn.train import stopping

    board = _StopBoard(StopOrder())
    assert isinstance(board, StopMailbox)  # the stand-in has the role's methods
    clock = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: clock[0])
    stops = stopping.StopRequests(board)
    assert stops.stop_at(5) == 0 and board.asked == 1  # asked; the answer is looked at next step
    assert stops.stop_at(6) == 0 and board.asked == 1  # answered "none"; not asked again within POLL_S
    clock[0] += stopping.POLL_S
    board.answer = StopOrder(at_step=-1)  # `raytrn stop RUN`: the next step
    assert stops.stop_at(7) == 0 and board.asked == 2
    assert stops.stop_at(8) == 9  # answered: the step after the one just trained
    assert stops.stop_at(9) == 10 and board.asked == 2  # a request stands; asked again after POLL_S (an abort?)
    clock[0] += stopping.POLL_S
    board.answer = StopOrder(at_step=-1, abort="its lease was taken over")  # the driver lost the run's lease
    assert stops.stop_at(10) == 11 and stops.abort is None and board.asked == 3
    assert stops.stop_at(11) == 12 and stops.abort == "its lease was taken over"
    clock[0] += stopping.POLL_S
    assert stops.stop_at(12) == 13 and board.asked == 3  # an abort stands: never asked again
    late = stopping.StopRequests(board)
    late._requested = 4  # `--at-step 4` reaching a run already past it: the next step
    assert late.stop_at(7) == 8
    assert stopping.StopRequests(None).stop_at(3) == 0  # other ranks learn it in the agreement


def test_after_the_notices_checkpoint_every_rank_reports_it_committed_once_rank_0s_metrics_are_handed_over(
    monkeypatch,
) -> None:
    """The report the driver's controller restarts the group on (at once, not at the notice's deadline) comes after
    rank 0's metrics are in the tracking actor's hands (the teardown that follows ends this process); a sweep's
    trial never sees it as a result."""
    from types import SimpleNamespace

    import ray.train
    from ray.tune.integration import ray_train as bridge

    from raytrn.train import checkpointer as module
    from raytrn.train.trainer import _tune_callbacks

    calls: list[object] = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint: calls.append(("report", metrics, checkpoint)))
    monkeypatch.setattr(module, "wait_for_teardown", lambda: calls.append("teardown"))
    monkeypatch.setattr(module, "posts_submitted", lambda: calls.append("drained"))
    monkeypatch.setattr(module, "exit_after_sigterm", lambda logger, timeout_s, step: calls.append("exit"))
    job = SimpleNamespace(tracking=SimpleNamespace(flush_timeout_s=1.0))
    report = ("report", {compat.NOTICE_COMMITTED: 12}, None)
    # rank 0 with tracking (its posts in the tracking actor's hands first), without (its posts submitted first); a
    # worker sent SIGTERM reports too (a drain and a SIGTERM together: the restart still comes at once), then exits
    for logger, signalled, then in (
        (SimpleNamespace(handed_over=lambda: calls.append("handed over")), False, ["handed over", report, "teardown"]),
        (None, False, ["drained", report, "teardown"]),
        (None, True, ["drained", report, "exit", "teardown"]),
    ):
        calls.clear()
        monkeypatch.setattr(module, "sigterm_received", lambda s=signalled: s)
        c = module.Checkpointer.__new__(module.Checkpointer)
        c.rank, c.logger, c.job = 0, logger, job
        c.stop_after_notice(Notice(NoticeFrom.RAY), 12)
        assert calls == then, calls

    results: list[dict] = []
    monkeypatch.setattr(
        bridge.TuneReportCallback,
        "__init__",
        lambda self: setattr(self, "_training_actor_item_queue", SimpleNamespace(put=results.append)),
    )
    (trial,) = _tune_callbacks()
    trial.after_report(None, [{"loss": 2.0}], None)
    trial.after_report(None, [{compat.NOTICE_COMMITTED: 12}] * 2, None)
    assert results == [{"loss": 2.0}]
