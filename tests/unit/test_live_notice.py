"""A live replica's preemption notice (raytrn.train.live.notice) and the driver's watch of Ray's draining nodes
(raytrn.backends.live_ray.watch_draining), over a real c10d TCPStore; Ray's draining list is a function here (the
live chaos test drains a real node: tests/chaos/test_live_recovery.py)."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from raytrn.backends.live_ray import draining_key, watch_draining
from raytrn.train.live.notice import LiveNotice
from tests.chaos._common import wait_until

pytestmark = pytest.mark.unit


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _watched(store: TCPStore, draining: dict[str, float | None]) -> tuple[list[int], list[bool], threading.Thread]:
    """The driver's watch over ``draining`` (Ray's list, read at each poll); its second poll fails (GCS busy: the
    next one tries again). Returns the polls made, the watch's alive flag and its thread."""
    polls: list[int] = []
    alive = [True]

    def ray_draining() -> dict[str, float | None]:
        polls.append(1)
        if len(polls) == 2:
            raise ConnectionError("GCS busy")
        return dict(draining)

    return polls, alive, watch_draining(store, lambda: alive[0], poll_s=0.01, draining=ray_draining)


def _seen(notice: LiveNotice) -> str:
    """``notice``'s reason, once the watch has put the drain in the store."""
    wait_until(lambda: notice.reason() is not None, 10, "the drain in the store", poll_s=0.01)
    return str(notice.reason())


def test_a_replica_sees_its_own_nodes_drain_and_its_deadline_and_no_other(store: TCPStore, caplog) -> None:
    draining: dict[str, float | None] = {}
    polls, alive, thread = _watched(store, draining)
    mine, other = LiveNotice(store, draining_key("node-a"), lambda: False), LiveNotice(store, draining_key("node-b"))
    wait_until(lambda: len(polls) >= 4, 10, "four polls of Ray's draining nodes", poll_s=0.01)
    assert mine.reason() is None and not mine.drained
    at = time.time() + 25.9
    draining["node-a"] = at
    seen = re.fullmatch(r"its node is draining, deadline in (\d+) s", _seen(mine))
    assert seen and 20 <= int(seen.group(1)) <= 26 and other.reason() is None
    assert mine.drained and mine.deadline == pytest.approx(at, abs=1e-3)
    assert not mine.warn_if_held("w1") and "live recovery" not in caplog.text  # its node goes at the deadline
    alive[0] = False  # the backend (or Ray) is gone: the watch ends
    thread.join(5)
    assert not thread.is_alive()


def test_a_drain_without_a_deadline_is_said_once_to_hold_the_node_until_the_run_ends(store: TCPStore, caplog) -> None:
    """The replica that left holds its slot on a draining node until the run ends, so a drain without a deadline
    cannot end before the run: the replica says so, with the ways out."""
    polls, alive, thread = _watched(store, {"node-a": None})
    notice = LiveNotice(store, draining_key("node-a"), lambda: False)
    assert _seen(notice) == "its node is draining, without a deadline"
    assert notice.drained and notice.deadline is None
    with caplog.at_level(logging.WARNING, logger="raytrn.train.live.notice"):
        assert notice.warn_if_held("w2")
    [record] = caplog.records
    assert record.getMessage().startswith("live recovery: w2's node is draining without a deadline")
    assert "until the run ends" in record.getMessage() and "raytrn stop" in record.getMessage()
    alive[0] = False
    thread.join(5)


def test_a_sigterm_is_a_notice_and_a_notice_stays(store: TCPStore) -> None:
    signalled = [False]
    notice = LiveNotice(store, draining_key("node-a"), lambda: signalled[0])
    assert notice.reason() is None
    signalled[0] = True
    assert notice.reason() == "SIGTERM to this worker"
    signalled[0] = False
    assert notice.reason() == "SIGTERM to this worker"
    assert not notice.drained and not notice.warn_if_held("w0")  # whoever sent it ends the process
