"""A live replica's preemption notice (raytrn.train.live.notice) and the driver's watch of Ray's draining nodes
(raytrn.backends.live_ray.watch_draining), over a real c10d TCPStore; Ray's draining list is a function here (the
live chaos test drains a real node: tests/chaos/test_live_recovery.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from raytrn.backends.live_ray import draining_key, watch_draining
from raytrn.train.live.notice import LiveNotice

pytestmark = pytest.mark.unit


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_replica_sees_its_own_nodes_drain_and_no_other(store: TCPStore) -> None:
    polls: list[int] = []
    draining: set[str] = set()
    alive = [True]

    def ray_draining() -> set[str]:
        polls.append(1)
        if len(polls) == 2:
            raise ConnectionError("GCS busy")  # one failed poll: the next one tries again
        return set(draining)

    thread = watch_draining(store, lambda: alive[0], poll_s=0.01, draining=ray_draining)
    mine, other = LiveNotice(store, draining_key("node-a"), lambda: False), LiveNotice(store, draining_key("node-b"))
    deadline = time.monotonic() + 10
    while len(polls) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert mine.reason() is None
    draining.add("node-a")
    while mine.reason() is None:
        assert time.monotonic() < deadline, "the drain never reached the store"
        time.sleep(0.01)
    assert mine.reason() == "its node is draining" and other.reason() is None
    alive[0] = False  # the backend (or Ray) is gone: the watch ends
    thread.join(5)
    assert not thread.is_alive()


def test_a_sigterm_is_a_notice_and_a_notice_stays(store: TCPStore) -> None:
    signalled = [False]
    notice = LiveNotice(store, draining_key("node-a"), lambda: signalled[0])
    assert notice.reason() is None
    signalled[0] = True
    assert notice.reason() == "SIGTERM to this worker"
    signalled[0] = False
    assert notice.reason() == "SIGTERM to this worker"
