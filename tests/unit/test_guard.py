"""A step whose loss or gradient norm is NaN/inf skips its optimizer update, and too many in a row fail the group
(raytrn.train.guard, raytrn.train.build.clip_and_step). One process, CPU, no Ray."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.errors import RunStopped
from raytrn.tracking.board import ProgressBoard
from raytrn.tracking.roles import BoardClients
from raytrn.train.build import build_training, skips_on_device
from raytrn.train.guard import NonFiniteError, NonFiniteGuard
from raytrn.train.step import skip_step, train_step
from tests.unit.test_dcp import job

pytestmark = pytest.mark.unit


def _batches(steps: int, seed: int = 0):
    rows = torch.randint(0, 512, (steps * 16, 17), generator=torch.Generator().manual_seed(seed))
    return iter(rows.split(16))


def _state(t) -> tuple[dict[str, torch.Tensor], dict]:
    params = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    steps = {k: float(s["step"]) for k, s in t.optimizer.state.items() if "step" in s}
    return params, steps


def test_a_nonfinite_step_leaves_weights_and_optimizer_state_as_they_were(tmp_path: Path) -> None:
    t = build_training(job(tmp_path), CpuBackend(), world_size=1)
    batches = _batches(4)
    train_step(t, batches, CpuBackend())
    before_params, before_steps = _state(t)
    param = next(p for p in t.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("nan"))  # one gradient NaN: the (global) norm is NaN
    result = train_step(t, batches, CpuBackend())
    hook.remove()
    assert not torch.isfinite(result.grad_norm)
    after_params, after_steps = _state(t)
    assert after_steps == before_steps  # Adam's step count and moments untouched
    assert all(torch.equal(before_params[k], after_params[k]) for k in before_params)
    result = train_step(t, batches, CpuBackend())  # a finite step updates again
    assert torch.isfinite(result.grad_norm)
    assert not all(torch.equal(before_params[k], v) for k, v in t.model.state_dict().items())


def test_the_guard_counts_nonfinite_steps_and_rolls_back_once_at_the_limit_in_a_row(tmp_path: Path) -> None:
    recorded: list[tuple[int, int]] = []
    guard = NonFiniteGuard(
        job(tmp_path, "run.max_nonfinite_steps=2"), record_rollback=lambda a, b: recorded.append((a, b))
    )
    nan, ok = torch.tensor(float("nan")), torch.tensor(1.5)
    guard.check(ok, 1)
    guard.check(nan, 2)
    guard.check(ok, 3)  # a finite step ends the run of them
    guard.check(torch.tensor(float("inf")), 4)
    with pytest.raises(NonFiniteError) as e:  # the group fails: Ray Train restarts it from the newest checkpoint
        guard.check(nan, 5)
    assert "steps 4-5: the loss or gradient norm was nan for 2 steps in a row (run.max_nonfinite_steps=2)" in str(
        e.value
    )
    assert "nothing non-finite was saved" in str(e.value) and "skips the global batches of steps 4-5" in str(e.value)
    assert not isinstance(e.value, RunStopped)  # a restart, not the end of the run
    assert recorded == [(4, 5)] and guard.total == 3  # recorded before the group fails

    # The restarted group: the recorded steps' batches are skipped; diverging again stops the run.
    again = NonFiniteGuard(job(tmp_path, "run.max_nonfinite_steps=2"), rollbacks=recorded)
    assert [s for s in range(1, 8) if again.skips(s)] == [4, 5]
    again.check(nan, 8)
    with pytest.raises(RunStopped) as stop:
        again.check(nan, 9)
    assert "steps 8-9" in str(stop.value) and "again after the rollback that skipped steps 4-5" in str(stop.value)
    assert "lower optim.lr" in str(stop.value).lower() and "run.on_nonfinite=rollback" in str(stop.value)
    assert recorded == [(4, 5)]  # once per job

    off = NonFiniteGuard(job(tmp_path, "run.max_nonfinite_steps=1"), enabled=False)  # the frozen XLA paths
    off.check(nan, 1)
    assert off.total == 0 and not off.skips(1)


def test_on_nonfinite_fail_stops_the_run_at_the_limit(tmp_path: Path) -> None:
    recorded: list[tuple[int, int]] = []
    guard = NonFiniteGuard(
        job(tmp_path, "run.max_nonfinite_steps=1", "run.on_nonfinite=fail"),
        record_rollback=lambda a, b: recorded.append((a, b)),
    )
    with pytest.raises(RunStopped) as stop:
        guard.check(torch.tensor(float("inf")), 7)
    assert "steps 7-7" in str(stop.value) and "run.on_nonfinite=fail" in str(stop.value) and not recorded


def test_the_board_keeps_the_jobs_rollbacks_and_the_first_stop_reason() -> None:
    board = BoardClients.of(ProgressBoard())  # its clients, calling it in this process
    assert board.reader.snapshot().stopped is None and board.rollbacks.rollbacks() == []
    board.rollbacks.rolled_back(4, 5)
    assert board.rollbacks.rolled_back(4, 5) == [(4, 5)]  # every rank records it: once
    first = RunStopped("first")
    board.stops.stop(first)
    board.stops.stop(RunStopped("second"))
    assert board.reader.snapshot().stopped is first


def test_a_skipped_step_draws_its_batches_and_moves_the_schedule_on(tmp_path: Path) -> None:
    """A rollback's skipped step: the data position and the learning rate move on as if it had trained (and had
    its update skipped), the weights do not."""
    j = job(tmp_path, "optim.warmup_steps=4", "data.grad_accum=2")
    trained, skipped = (build_training(j, CpuBackend(), world_size=1) for _ in range(2))
    assert trained.grad_accum == 2
    a, b = _batches(6), _batches(6)
    train_step(trained, a, CpuBackend())
    before = {k: v.clone() for k, v in skipped.model.state_dict().items()}
    skip_step(skipped, b)
    assert trained.scheduler.get_last_lr() == skipped.scheduler.get_last_lr()
    assert torch.equal(next(a), next(b))  # both drew 2 micro-batches
    assert all(torch.equal(before[k], v) for k, v in skipped.model.state_dict().items())


def test_a_diverging_run_never_holds_a_nonfinite_weight(tmp_path: Path) -> None:
    """The issue's reproduction (optim.lr=1000, no warmup) on the real step: the updates that would write NaN are
    skipped, the guard stops the run, and every weight is still finite (what a checkpoint or export would hold)."""
    j = job(tmp_path, "optim.lr=1000", "optim.warmup_steps=0", "optim.grad_clip_norm=null")
    t = build_training(j, CpuBackend(), world_size=1)
    guard = NonFiniteGuard(j)
    batches = _batches(60, seed=1)
    with pytest.raises(NonFiniteError):  # the rollback (then, after it, RunStopped)
        for step in range(1, 61):
            guard.check(train_step(t, batches, CpuBackend()).grad_norm, step)
    assert guard.total == 3
    assert all(torch.isfinite(v).all() for v in t.model.state_dict().values())


class _FusedCpu(CpuBackend):
    """The CPU backend with torch's fused AdamW (its CPU kernel reads ``found_inf`` as the cuda one does): the
    non-finite skip stays on the device, as with ``optim.fused`` on cuda."""

    fused_optim = True


@contextmanager
def _no_host_read() -> Iterator[None]:
    """Inside: any read of a tensor's value on the host fails the test (what a device sync would be)."""

    def refuse(*_a, **_k):
        raise AssertionError("a host read of a tensor inside the step")

    with pytest.MonkeyPatch.context() as m:
        for name in ("__bool__", "__float__", "__int__", "item", "tolist"):
            m.setattr(torch.Tensor, name, refuse)
        yield


def test_with_the_fused_kernel_a_nonfinite_step_is_skipped_on_the_device_without_a_host_read(tmp_path: Path) -> None:
    """Issue 28 item 1's 'no extra host sync': the flag goes to the fused AdamW kernel as found_inf; the guard
    reads the norms only when the loop syncs anyway (settle), and then counts the exact steps."""
    j = job(tmp_path, "optim.fused=true", "run.max_nonfinite_steps=2")
    t = build_training(j, _FusedCpu(), world_size=1)
    assert skips_on_device(t.optimizer) and not skips_on_device(build_training(j, CpuBackend(), world_size=1).optimizer)
    batches = _batches(8)
    train_step(t, batches, CpuBackend())
    before_params, before_steps = _state(t)
    guard = NonFiniteGuard(j, deferred=True)
    param = next(p for p in t.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("nan"))
    for step in (2, 3):  # two non-finite steps: no host read in the step nor in the guard's unsettled check
        with _no_host_read():
            result = train_step(t, batches, CpuBackend())
            guard.check(result.grad_norm, step, settle=False)
    hook.remove()
    after_params, after_steps = _state(t)
    assert after_steps == before_steps  # the kernel skipped: Adam's step count and moments untouched
    assert all(torch.equal(before_params[k], after_params[k]) for k in before_params)
    assert guard.total == 0  # not read yet
    with pytest.raises(NonFiniteError) as e:  # read at the sync point: the exact steps
        guard.settle()
    assert "steps 2-3" in str(e.value) and guard.total == 2
    result = train_step(t, batches, CpuBackend())  # a finite step updates again
    assert torch.isfinite(result.grad_norm)
    assert not all(torch.equal(before_params[k], v) for k, v in t.model.state_dict().items())


def test_settled_late_the_guard_counts_each_step_in_order(tmp_path: Path) -> None:
    """Steps checked unsettled are counted at the next settle as if each had been read at once: a finite step
    between two non-finite ones still breaks their run."""
    guard = NonFiniteGuard(job(tmp_path, "run.max_nonfinite_steps=2"), deferred=True)
    nan, ok = torch.tensor(float("nan")), torch.tensor(1.5)
    for step, norm in enumerate([nan, ok, nan, ok], start=1):
        guard.check(norm, step, settle=False)
    guard.settle()
    assert guard.total == 2 and guard.in_a_row == 0
    guard.check(nan, 5, settle=False)
    with pytest.raises(NonFiniteError) as e:
        guard.check(nan, 6)  # settle (the default): reads 5 and 6
    assert "steps 5-6" in str(e.value)
    # Not deferred (the step read its flag already): each step is counted at once, whatever ``settle`` says.
    at_once = NonFiniteGuard(job(tmp_path, "run.max_nonfinite_steps=1"))
    with pytest.raises(NonFiniteError, match="steps 3-3"):
        at_once.check(nan, 3, settle=False)
