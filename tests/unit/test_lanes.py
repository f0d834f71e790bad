"""tests/lanes.py, how ``make test`` runs the Ray tests on two pytest processes: the units of work, their order, the
scheduler that hands them out, and the lock that lets an ``alone`` test run while the other process waits."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import lanes

pytestmark = pytest.mark.unit


@dataclass
class _Item:  # what lanes.order reads of a pytest.Item
    nodeid: str
    markers: set[str] = field(default_factory=set)
    fixturenames: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


def test_a_module_is_a_unit_and_the_simulators_modules_are_one() -> None:
    assert lanes.unit_of("tests/integration/test_sweep.py::test_x[a::b]") == "tests/integration/test_sweep.py"
    for module in lanes.SIMULATOR_MODULES:
        assert lanes.unit_of(f"{module}::test_y") == "simulator"


def test_the_longest_units_come_first_each_together_and_the_simulator_taken_down_last() -> None:
    autoscaling, submit, laptop = lanes.SIMULATOR_MODULES
    uses = ("simulator",)
    items = [
        _Item("tests/integration/test_prepare.py::a"),
        _Item(f"{autoscaling}::job", fixturenames=uses),
        _Item(f"{laptop}::down", {"simulator_down"}, uses),
        _Item(f"{laptop}::shown"),  # (no simulator: not between its users, where it would have it stopped)
        _Item("tests/integration/test_sweep.py::a"),
        _Item("tests/integration/test_prepare.py::b"),
        _Item(f"{submit}::paths", fixturenames=uses),
        _Item("tests/chaos/test_elastic_nodes.py::suite"),
        _Item("tests/integration/test_sweep.py::b"),
    ]
    lanes.order(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/chaos/test_elastic_nodes.py::suite",
        f"{laptop}::shown",
        f"{autoscaling}::job",
        f"{submit}::paths",
        f"{laptop}::down",
        "tests/integration/test_sweep.py::a",
        "tests/integration/test_sweep.py::b",
        "tests/integration/test_prepare.py::a",  # not listed: after the listed ones, in collection order
        "tests/integration/test_prepare.py::b",
    ]


def test_the_scheduler_splits_the_collection_into_those_units() -> None:
    from xdist.scheduler import LoadScopeScheduling

    # the method xdist's loadscope scheduling splits node ids with (a rename would leave the override unused)
    assert callable(getattr(LoadScopeScheduling, "_split_scope", None))
    instance = _scheduler_without_config()
    assert isinstance(instance, LoadScopeScheduling)
    assert instance._split_scope(f"{lanes.SIMULATOR_MODULES[1]}::t") == "simulator"
    assert instance._split_scope("tests/chaos/test_kill_worker.py::t[x]") == "tests/chaos/test_kill_worker.py"


def _scheduler_without_config() -> Any:
    """The scheduler class of :func:`lanes.make_scheduler`, instantiated without running xdist's ``__init__``."""
    from xdist.scheduler import LoadScopeScheduling

    made: list[type] = []
    original = LoadScopeScheduling.__init__
    try:
        LoadScopeScheduling.__init__ = lambda self, config, log=None: made.append(type(self))  # type: ignore[method-assign]
        instance = lanes.make_scheduler(None, None)
    finally:
        LoadScopeScheduling.__init__ = original  # type: ignore[method-assign]
    assert made and made[0] is type(instance)
    return instance


def _hold_shared(run_id: str, held: multiprocessing.Event, release: multiprocessing.Event) -> None:
    lock = lanes.AloneLock(run_id)
    lock.acquire(alone=False)
    held.set()
    release.wait(30)
    lock.release()


def _take_shared(run_id: str, taken: multiprocessing.Event) -> None:
    lock = lanes.AloneLock(run_id)
    lock.acquire(alone=False)
    taken.set()
    lock.release()


def test_an_alone_test_waits_for_the_running_one_and_no_new_test_starts_meanwhile() -> None:
    run_id = uuid.uuid4().hex
    ctx = multiprocessing.get_context("fork")
    held, release, taken = ctx.Event(), ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_shared, args=(run_id, held, release))
    other.start()
    lock = lanes.AloneLock(run_id)
    late = None
    try:
        assert held.wait(30)
        lock.acquire(alone=False)  # tests share the lock
        lock.release()
        alone = threading.Event()

        def take_alone() -> None:
            lock.acquire(alone=True)
            alone.set()

        waiter = threading.Thread(target=take_alone, daemon=True)
        waiter.start()
        assert not alone.wait(0.5)  # the other process's test still runs
        late = ctx.Process(target=_take_shared, args=(run_id, taken))
        late.start()
        assert not taken.wait(0.5)  # a test the other process would start now waits behind the alone one
        release.set()
        assert alone.wait(30)  # the running test ended: the alone one runs, alone
        assert not taken.wait(0.5)
        lock.release()
        assert taken.wait(30)  # then the other process goes on
    finally:
        release.set()
        for proc in (other, late):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
        lock.close()
    assert other.exitcode == 0 and late is not None and late.exitcode == 0
