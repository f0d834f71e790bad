"""The learning-rate multiplier: linear warmup to 1.0, cosine decay to min_lr_ratio, then flat."""

from __future__ import annotations

import math

import pytest

from raytrn.config import JobSpec, parse_job
from raytrn.train.schedule import Schedule, resolve_schedule

pytestmark = pytest.mark.unit


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based count of steps already taken), cosine."""
    return Schedule(warmup_steps=warmup_steps, decay_steps=decay_steps, min_lr_ratio=min_lr_ratio).factor(step)


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


# ---------------------------------------------------------------------------------------------------
# Warmup-stable-decay, and the schedule pinned across resumes


def job(**optim: object) -> JobSpec:
    raw = {
        "model": {"preset": "tiny"},
        "data": {"manifest": "unused", "seq_len": 16, "micro_batch_size": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 5, "min_lr_ratio": 0.1, **optim},
        "run": {"max_steps": 30},
    }
    return parse_job(raw, source="job.yaml")


def with_max_steps(j: JobSpec, max_steps: int) -> JobSpec:
    return j.model_copy(update={"run": j.run.model_copy(update={"max_steps": max_steps})})


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_wsd_holds_the_peak_then_decays_over_the_last_fraction(shape: str) -> None:
    s = Schedule.from_job(job(schedule="wsd", decay_fraction=0.2, decay_shape=shape))
    f = [s.factor(step) for step in range(40)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # warmup
    assert f[5:24] == [1.0] * 19  # stable until the last 20% of 30 steps (6 steps: 24..30)
    assert f[30:] == [pytest.approx(0.1)] * 10  # floor at the horizon and after
    decay = f[24:31]
    assert all(b < a for a, b in zip(decay, decay[1:], strict=False))
    if shape == "linear":
        assert f[27] == pytest.approx(1 - 0.9 * 3 / 6)
    else:
        assert f[27] == pytest.approx(0.1 + 0.9 * 0.5)  # the cosine's midpoint


def test_schedule_round_trips_through_a_dict() -> None:
    s = Schedule.from_job(job(schedule="wsd", decay_shape="cosine", decay_fraction=0.3))
    assert Schedule.from_dict(s.to_dict()) == s
    assert Schedule.from_dict({**s.to_dict(), "added_later": 1}) == s  # newer checkpoints stay readable


def test_the_default_cosine_is_the_old_schedule() -> None:
    s = Schedule.from_job(job())
    assert [s.factor(i) for i in range(40)] == [
        lr_factor(i, warmup_steps=5, decay_steps=25, min_lr_ratio=0.1) for i in range(40)
    ]


def test_new_run_takes_the_jobs_schedule() -> None:
    j = job()
    assert resolve_schedule(j, None, 0) == (Schedule.from_job(j), None)
    # A checkpoint from before schedules were stored: nothing to keep.
    assert resolve_schedule(j, None, 30) == (Schedule.from_job(j), None)


def test_raising_max_steps_keeps_the_horizon_and_says_so() -> None:
    """The issue's case: 30 steps (lr at 0.1x peak), resumed with max_steps 60: the lr must stay, not jump."""
    first = Schedule.from_job(job())
    resumed, note = resolve_schedule(with_max_steps(job(), 60), first.to_dict(), 30)
    assert resumed.horizon == 30 and resumed.factor(30) == pytest.approx(0.1)
    assert [resumed.factor(i) for i in range(30, 60)] == [first.factor(i) for i in range(30, 60)]
    assert note is not None and "kept it so the learning rate does not jump at step 30" in note
    assert "optim.decay_steps" in note


def test_continuity_with_the_uninterrupted_curve_of_the_same_horizon() -> None:
    """Resumed at step 17 of a 30-step cosine with max_steps raised to 60: every later lr equals (1e-9) the lr
    of an uninterrupted 60-step run whose horizon is 30 (decay_steps 25)."""
    first = Schedule.from_job(job())
    resumed, _ = resolve_schedule(with_max_steps(job(), 60), first.to_dict(), 17)
    uninterrupted = Schedule.from_job(with_max_steps(job(decay_steps=25), 60))
    for step in range(17, 60):
        assert abs(resumed.factor(step) - uninterrupted.factor(step)) <= 1e-9


def test_an_explicit_decay_steps_moves_the_horizon() -> None:
    first = Schedule.from_job(job())
    resumed, note = resolve_schedule(with_max_steps(job(decay_steps=55), 60), first.to_dict(), 30)
    assert resumed.horizon == 60
    assert note is not None and note.startswith("optim.decay_steps=55: the learning-rate schedule's horizon moves")


def test_wsd_in_its_stable_phase_takes_the_longer_horizon() -> None:
    """WSD resumed before its decay: the new horizon leaves the lr at the peak, so the run simply goes on."""
    first = Schedule.from_job(job(schedule="wsd"))
    resumed, note = resolve_schedule(with_max_steps(job(schedule="wsd"), 100), first.to_dict(), 20)
    assert resumed.horizon == 100 and resumed.factor(20) == first.factor(20) == 1.0
    assert note is not None and "unchanged" in note
    # Resumed inside its decay, the stored horizon is kept.
    kept, note = resolve_schedule(with_max_steps(job(schedule="wsd"), 100), first.to_dict(), 27)
    assert kept.horizon == 30 and "kept it" in (note or "")


def test_resuming_during_warmup_takes_the_new_horizon() -> None:
    first = Schedule.from_job(job())
    resumed, _ = resolve_schedule(with_max_steps(job(), 60), first.to_dict(), 3)
    assert resumed.horizon == 60 and resumed.factor(3) == first.factor(3)


def test_same_max_steps_is_silent() -> None:
    first = Schedule.from_job(job())
    assert resolve_schedule(job(), first.to_dict(), 12) == (first, None)
