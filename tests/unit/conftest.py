"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

import raytrn.backends.neuron_ray as neuron_ray


@pytest.fixture
def no_ray_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.get`` in the Trainium Ray backends returns what it is given (the fake worker group runs synchronously)."""
    monkeypatch.setattr(neuron_ray.ray, "get", lambda refs, timeout=None: refs)
