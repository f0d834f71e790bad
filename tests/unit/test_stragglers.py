"""Stragglers (raytrn.train.stragglers): each rank's own time per step, gathered at log steps over real gloo
processes; the slowest is named when it takes more than 1.5x the median."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from raytrn.backends.cpu import CpuBackend
from raytrn.train.build import build_training
from raytrn.train.step import train_step
from raytrn.train.stragglers import Stragglers
from tests.unit.gloo_ranks import spawn_ranks
from tests.unit.test_dcp import job

pytestmark = pytest.mark.unit


def _rank(rank: int, world: int, port: int, windows: list[list[float]], out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    stragglers = Stragglers(world, rank, node=f"node-{rank}")
    out[rank] = [(stragglers.metrics(own[rank], (1 + 10 * i, 10 + 10 * i)), stragglers.warned)
                 for i, own in enumerate(windows)]  # fmt: skip
    dist.destroy_process_group()


def test_the_slowest_rank_is_measured_and_named_on_every_rank() -> None:
    windows = [[0.10, 0.11, 0.40], [0.10, 0.12, 0.11]]  # rank 2 slow in the first window only
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_rank, 3, windows, out, deadline_s=120)
        results = dict(out)
    for rank in range(3):  # every rank gets the same figures (rank 0 logs them)
        (first, warned), (second, calm) = results[rank]
        assert first == {"step_time_max_s": 0.40, "step_time_min_s": 0.10, "step_time_max_rank": 2.0}
        assert second == {"step_time_max_s": 0.12, "step_time_min_s": 0.10, "step_time_max_rank": 1.0}
        assert warned is not None and calm is None
        assert "rank 2 on node node-2" in warned and "steps 1-10" in warned and "3.6x the median 0.110 s" in warned


def test_one_worker_is_its_own_slowest_and_fastest() -> None:
    one = Stragglers(1, 0, node="here")
    assert one.metrics(0.25, (1, 10)) == {"step_time_max_s": 0.25, "step_time_min_s": 0.25, "step_time_max_rank": 0.0}
    assert one.warned is None


def test_a_steps_forward_time_is_measured(tmp_path: Path) -> None:
    """A slow forward (here: a sleep in a forward hook, as a slow node would be) shows in the step's forward_s."""
    t = build_training(job(tmp_path), CpuBackend(), world_size=1)
    rows = torch.randint(0, 512, (32, 17), generator=torch.Generator().manual_seed(0))
    batches = iter(rows.split(16))
    fast = train_step(t, batches, CpuBackend())
    hook = t.model.register_forward_pre_hook(lambda module, args: time.sleep(0.5))
    slow = train_step(t, batches, CpuBackend())
    hook.remove()
    assert slow.forward_s >= 0.5 and 0 < fast.forward_s < slow.forward_s
