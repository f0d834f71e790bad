"""The learning-rate multiplier: linear warmup to 1.0, cosine decay to min_lr_ratio, then flat."""

from __future__ import annotations

import math

import pytest

from raytrn.train.schedule import lr_factor

pytestmark = pytest.mark.unit


def factors(n: int, *, warmup: int, decay: int, min_ratio: float = 0.1) -> list[float]:
    return [lr_factor(s, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=min_ratio) for s in range(n)]


def test_warmup_is_linear_to_one() -> None:
    f = factors(10, warmup=10, decay=100)
    assert f == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[-1] == 1.0  # the last warmup step reaches the peak
    assert all(b - a == pytest.approx(0.1) for a, b in zip(f, f[1:], strict=False))
    # The first step after warmup starts the cosine at the peak.
    assert lr_factor(10, warmup_steps=10, decay_steps=100, min_lr_ratio=0.1) == 1.0


def test_no_warmup_starts_at_peak() -> None:
    assert lr_factor(0, warmup_steps=0, decay_steps=100, min_lr_ratio=0.1) == 1.0
    assert lr_factor(1, warmup_steps=0, decay_steps=100, min_lr_ratio=0.1) < 1.0


@pytest.mark.parametrize("min_ratio", [0.0, 0.1, 0.5, 1.0])
def test_cosine_reaches_min_and_stays(min_ratio: float) -> None:
    warmup, decay = 5, 40
    f = factors(warmup + decay + 50, warmup=warmup, decay=decay, min_ratio=min_ratio)
    assert f[warmup + decay] == pytest.approx(min_ratio)
    assert all(x == pytest.approx(min_ratio) for x in f[warmup + decay :])
    # Halfway through the decay the cosine is at its midpoint.
    assert f[warmup + decay // 2] == pytest.approx((1 + min_ratio) / 2)
    assert all(min_ratio - 1e-12 <= x <= 1.0 + 1e-12 for x in f[warmup:])


@pytest.mark.parametrize(("warmup", "decay"), [(0, 1), (0, 100), (10, 90), (100, 7)])
def test_monotone_after_warmup(warmup: int, decay: int) -> None:
    f = factors(warmup + decay + 20, warmup=warmup, decay=decay)
    after = f[max(warmup - 1, 0) :]
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    assert all(b > a for a, b in zip(f[:warmup], f[1:warmup], strict=False))  # warmup strictly rises


def test_matches_closed_form() -> None:
    warmup, decay, min_ratio = 3, 20, 0.2
    for step in range(warmup, warmup + decay):
        progress = (step - warmup) / decay
        expected = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr_factor(step, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=min_ratio) == pytest.approx(
            expected
        )
