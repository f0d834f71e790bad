"""Every benchmark module imports, and the code their measurements run through that is not Ray's works at tiny
sizes: a stand-in drifting from the real class it stands for (mypy checks bench/ against the protocols too) or a
renamed import fails here, not at the next `make bench`. The Ray Train paths themselves run in
tests/integration/test_bench_smoke.py."""

from __future__ import annotations

import importlib
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

MODULES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")


def test_the_mlflow_overhead_benchs_board_is_the_real_one_behind_the_real_clients() -> None:
    """bench/mlflow_overhead.py's stand-in for the board actor: what the loop posts, through the clients it uses."""
    from bench.mlflow_overhead import _Board, _plan
    from raytrn.tracking.roles import BoardClients

    board = _Board()
    clients = BoardClients.of(board)
    assert clients.restarts.restored(None, 0, 0.0).result() is None
    assert clients.restarts.group_started(0, 1).result() == 1
    before = time.perf_counter()
    clients.progress.update(1, 4, {"loss": 2.0})
    clients.progress.reached(2)
    assert [s for s, _ in board.points] == [1] and board.points[0][1] >= before  # the step's time, recorded
    assert clients.stops.order().result().at_step is None and clients.rollbacks.rollbacks() == []
    assert clients.reader.snapshot().last is not None
    # a warm-up segment, then on/off in ABBA order per log interval
    assert _plan(2, [5]) == [(False, 5), (True, 5), (False, 5), (False, 5), (True, 5)]


def test_the_guard_benchs_check_runs() -> None:
    from bench.guard import _check_cost_s

    assert _check_cost_s(20) > 0
