"""The Ray tests on two pytest processes (``make test``: ``pytest -n 2 --dist loadscope --no-loadscope-reorder``).

Alone, the Ray tests leave ~30% of the 2 cores idle: most of them wait on a clock somewhere (a poll, a health
check, a node's death, an autoscaler's interval; docs/testing.md). Two pytest processes fill much of it. What that
needs, here and in tests/conftest.py's hooks:

- **Units of work** (:func:`unit_of`, :func:`make_scheduler`): a test module's tests run in one process (its
  module-scoped fixtures, its worker groups, are shared), and the tests of the modules that use the simulator run
  in one process, one after another, the one that takes it down last.
- **The longest units first** (:func:`order`, :data:`LONGEST_FIRST`): xdist hands each process the next unit in
  collection order when it is almost out of work; the longest last would leave one process running alone at the
  end.
- **Tests that run alone** (``@pytest.mark.alone``, :class:`AloneLock`): a test that compares two timings taken one
  after the other (raytrn's start against stock Ray Train's) runs while the other process waits between its tests:
  every test holds a shared lock for its run, an ``alone`` test the exclusive one.

Each process has its own session fixtures (its local Ray, S3 server, MLflow server); the simulator's fixed ports
(6379, 8265, 5000) are taken by no other test's Ray (the session Rays' and the chaos clusters' dashboards take
free ports, and raytrn's embedded Ray starts none).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: The Ray test modules' units by their time alone (stop 93's Ray suite, seconds), the longest first; a unit not
#: listed goes after them in collection order. Only the order of the first few matters much.
LONGEST_FIRST = (
    "tests/chaos/test_elastic_nodes.py",  # 156
    "tests/chaos/test_live_recovery.py",  # 145
    "simulator",  # 163: test_autoscaling.py, test_laptop_path.py, test_submit_paths.py
    "tests/integration/test_train.py",  # 124
    "tests/chaos/test_kill_worker.py",  # 97
    "tests/integration/test_sweep.py",  # 97
    "tests/integration/test_checkpoint_models.py",  # 75
    "tests/integration/test_parallel.py",  # 74
    "tests/integration/test_cli_train.py",  # 56
    "tests/integration/test_bench_smoke.py",  # 46
)

ALONE = "alone"


#: The modules whose tests use the simulator (tests/simulator.py): one unit, in one process (its ports are fixed).
SIMULATOR_MODULES = (
    "tests/integration/test_autoscaling.py",
    "tests/integration/test_submit_paths.py",
    "tests/integration/test_laptop_path.py",
)


def unit_of(nodeid: str) -> str:
    """The unit of work of the test ``nodeid``: ``simulator`` for the simulator's modules, else its module's path.
    (From the node id alone: pytest-xdist's controller, which schedules the units, collects no test itself.)"""
    path = nodeid.split("::", 1)[0]
    return "simulator" if path in SIMULATOR_MODULES else path


def make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's ``loadscope`` scheduling with :func:`unit_of`'s units: each unit to one process, the next unit
    in collection order to the process that is almost out of work (with ``--no-loadscope-reorder``: in
    :func:`order`'s order). (Its ``loadgroup`` would do it from ``xdist_group`` marks, but xdist 3.8 renames the
    node ids, which pytest 9.2 no longer reads, so every test became a unit of its own.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)


def order(items: list[pytest.Item]) -> None:
    """Put the units in :data:`LONGEST_FIRST`'s order, each unit's tests together and in their order (in the
    simulator's unit, the tests that do not use it first, the ``simulator_down`` one last)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(unit_of(item.nodeid), len(first_seen))

    def key(item: pytest.Item) -> tuple[int, int, bool, bool]:
        unit = unit_of(item.nodeid)
        # in the simulator's unit, its users one after another: a test between them that does not use it would
        # have it stopped (tests/conftest.py's pytest_runtest_teardown) and started again for the next
        uses = "simulator" in getattr(item, "fixturenames", ())
        down = uses and item.get_closest_marker("simulator_down") is not None
        return (rank.get(unit, len(rank)), first_seen[unit], uses, down)

    items.sort(key=key)  # (stable: a unit's tests keep their order)


class AloneLock:
    """A readers-writer lock between the pytest processes of one run (``flock`` on two files): a test holds it
    shared, an ``alone`` test exclusively. A turnstile keeps an ``alone`` test from waiting forever: it holds the
    turnstile while it waits, so the other process starts no new test meanwhile."""

    def __init__(self, run_id: str) -> None:
        base = Path(tempfile.gettempdir()) / f"raytrn-lanes-{run_id}"
        self._turnstile = os.open(f"{base}.turnstile", os.O_CREAT | os.O_RDWR, 0o600)
        self._lock = os.open(f"{base}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        self._paths = (f"{base}.turnstile", f"{base}.lock")

    def acquire(self, alone: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # (the turnstile held until the test ends)
        else:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        fcntl.flock(self._turnstile, fcntl.LOCK_UN)  # (a no-op where it was released already)

    def close(self) -> None:
        os.close(self._turnstile)
        os.close(self._lock)
        for path in self._paths:  # (the other process may have removed them, or still hold them: harmless)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def alone_lock(config: Any) -> AloneLock | None:
    """This pytest process's lock where it is one of several (an xdist worker), else None."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    lock = getattr(config, "_raytrn_alone_lock", None)
    if lock is None:
        lock = config._raytrn_alone_lock = AloneLock(worker["testrunuid"])
    return lock  # type: ignore[no-any-return]
