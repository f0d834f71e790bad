"""Fixtures shared by the unit tests; every test under tests/unit is marked ``unit`` (``-m unit``: make unit,
make test-py312), whether or not its module says so."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import raytrn.backends.neuron_ray as neuron_ray

UNIT = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def no_ray_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.get`` in the Trainium Ray backends returns what it is given (the fake worker group runs synchronously)."""
    monkeypatch.setattr(neuron_ray.ray, "get", lambda refs, timeout=None: refs)


@pytest.fixture(autouse=True)
def starts_no_ray() -> Iterator[None]:
    """A unit test never starts Ray: ``ray.get``/``ray.put`` outside a Ray session start a local one on the spot
    (seconds, processes, and every later test of that process runs with it: one failed only under pytest-xdist)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this unit test started a local Ray (a ray.get or ray.put outside a Ray session?)")
