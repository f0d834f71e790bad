"""raytrn.tracking.sender: rank 0's fire-and-forget actor calls leave the training thread at once, are submitted in
the order they were made by the sender's own thread, come before any call that waits for its answer, and an error
a submission raises reaches the caller."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest

from raytrn.tracking import sender as sender_module
from raytrn.tracking.board import ProgressBoard
from raytrn.tracking.roles import BoardClients
from raytrn.tracking.sender import Sender, sender

pytestmark = pytest.mark.unit


class _Method:
    """An actor handle's method: ``remote`` records the call and the thread that submitted it (a Ray submission)."""

    def __init__(self, name: str, calls: list[tuple[str, Any, str]], gate: threading.Event | None = None) -> None:
        self.name, self.calls, self.gate = name, calls, gate

    def remote(self, *args: Any) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append((self.name, args, threading.current_thread().name))


def test_posts_return_at_once_and_are_submitted_in_order_by_the_senders_thread() -> None:
    calls: list[tuple[str, Any, str]] = []
    gate = threading.Event()
    s = Sender()
    t0 = time.perf_counter()
    for step in range(50):
        s.post(_Method("log", calls, gate), {"loss": float(step)}, step)
    posting = time.perf_counter() - t0
    assert calls == [] and posting < 0.5  # the submissions are held (gate): posting did not wait for them
    with pytest.raises(TimeoutError, match="50 fire-and-forget Ray call"):
        s.drain(timeout_s=0.2)  # a stuck submission is named, not waited for forever
    gate.set()
    s.drain()
    assert [args[1] for _, args, _ in calls] == list(range(50))
    assert {thread for _, _, thread in calls} == {"raytrn-posts"}


def test_a_call_that_waits_for_its_answer_comes_after_every_post_before_it() -> None:
    """Through the board's client with a Ray-like handle: the ask is submitted (in the caller's thread) only after the
    posts made before it were (by the sender's): an actor runs one process's calls in submission order."""
    order: list[str] = []
    board = ProgressBoard()

    class _Ref:
        def __init__(self, value: Any) -> None:
            self.value = value

    class _Handle:
        def __getattr__(self, name: str) -> Any:
            class _M:
                @staticmethod
                def remote(*args: Any) -> _Ref:
                    time.sleep(0.01 if name == "update" else 0)  # a slow submission: the ask would overtake it
                    order.append(name)
                    return _Ref(getattr(board, name)(*args))

            return _M

    import ray

    mp = pytest.MonkeyPatch()
    mp.setattr(ray, "get", lambda ref, timeout=None: ref.value)
    try:
        clients = BoardClients.of(_Handle())
        metrics = {"loss": 2.0}
        for step in (1, 2, 3):
            clients.progress.update(step, 10, metrics)
        metrics["loss"] = 99.0  # the caller's dict changed after its post: the post keeps what was posted
        assert [e["step"] for e in clients.reader.since(0)] == [1, 2, 3]
        assert order == ["update", "update", "update", "since"]
        assert [e["loss"] for e in clients.reader.since(0)] == [2.0, 2.0, 2.0]
    finally:
        mp.undo()


def test_an_error_a_submission_raises_is_raised_once_at_the_callers_next_call() -> None:
    class _Unpicklable:
        def remote(self, *args: Any) -> None:
            raise TypeError("cannot pickle '_thread.lock' object")

    calls: list[tuple[str, Any, str]] = []
    s = Sender()
    s.post(_Unpicklable(), object())
    with pytest.raises(TypeError, match="cannot pickle"):
        s.drain()
    s.post(_Method("log", calls), 1)  # raised once: the sender goes on
    s.drain()
    assert [name for name, _, _ in calls] == ["log"]


def _child(queue: Any) -> None:
    calls: list[tuple[str, Any, str]] = []
    sender().post(_Method("log", calls), 7)
    sender().drain(timeout_s=5)
    queue.put(calls)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")  # (the point)
def test_a_forked_child_gets_a_sender_of_its_own() -> None:
    """The parent's sender thread is not in a forked child: its posts would never be submitted there (Python 3.12
    warns of a fork beside threads: what this test does on purpose)."""
    calls: list[tuple[str, Any, str]] = []
    sender().post(_Method("log", calls), 1)
    sender().drain()
    parent = sender_module._SENDER
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    try:
        assert [(name, args) for name, args, _ in queue.get(timeout=30)] == [("log", (7,))]
    finally:
        child.join(30)
    assert child.exitcode == 0 and sender_module._SENDER is parent


def test_a_worker_ends_once_its_posts_are_submitted_and_a_failed_one_is_only_logged(caplog) -> None:
    """The end of Ray Train's function (raytrn.train.entry): rank 0's last posts (its final metrics, its goodput) are
    submitted before the worker reports done, when the driver reads the board; a post that failed does not replace
    the training's own outcome."""
    from raytrn.train.entry import posts_submitted

    calls: list[tuple[str, Any, str]] = []

    class _Slow(_Method):
        def remote(self, *args: Any) -> None:
            time.sleep(0.3)
            super().remote(*args)

    sender().post(_Slow("goodput", calls), "times")
    posts_submitted()
    assert [name for name, _, _ in calls] == ["goodput"]

    class _Refused:
        def remote(self, *args: Any) -> None:
            raise TypeError("cannot pickle 'generator' object")

    sender().post(_Refused(), object())
    posts_submitted()  # logged, not raised
    assert "progress posts were not sent: cannot pickle" in caplog.text
