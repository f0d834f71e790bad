"""Preemption notices are agreed by every rank at the same step (raytrn.train.preemption): real gloo processes."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch.multiprocessing as mp

from raytrn import compat
from raytrn.train import preemption
from raytrn.train.preemption import PreemptionWatch, describe

pytestmark = pytest.mark.unit


def _agree(rank: int, world: int, port: int, noticed_at: dict[int, int], out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    step = 0
    # This rank's copy of the notice arrives at its own step (Ray's watcher reaches workers one by one).
    preemption._local_notice = lambda: "notice" if step >= noticed_at.get(rank, 10**9) else None
    watch = PreemptionWatch(world)
    seen = []
    for step in range(1, 8):  # noqa: B007 (read by the lambda)
        seen.append(watch.notice() is not None)
    out[rank] = seen
    dist.destroy_process_group()


def test_every_rank_agrees_at_the_first_step_any_rank_has_a_notice() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        # rank 2 hears at step 3, rank 0 at step 5, rank 1 never (its node is the one going away, say).
        ctx = mp.start_processes(_agree, args=(3, port, {2: 3, 0: 5}, out), nprocs=3, join=False, start_method="spawn")
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "gloo agreement did not finish"
        expected = [False, False, True, True, True, True, True]
        assert dict(out) == {0: expected, 1: expected, 2: expected}


def test_one_worker_needs_no_collective_and_outside_ray_there_is_no_notice() -> None:
    watch = PreemptionWatch(1)
    assert watch.notice() is None  # not in a Ray Train worker: Ray's context is missing, so no notice


def test_describe_names_nodes_ranks_and_deadline() -> None:
    from ray.train import PreemptionInfo

    info = PreemptionInfo(deadline_ms=int((time.time() + 25.4) * 1000), preempted_node_to_ranks={"n2": [2, 3]})
    assert describe(info) in ("node n2, ranks [2, 3], deadline in 25 s", "node n2, ranks [2, 3], deadline in 24 s")
    assert describe(True) == "another rank's node"


def test_ray_keeps_the_notice_where_raytrn_reads_it() -> None:
    context = compat.resolve(compat.PRIVATE_NAMES["Ray Train worker preemption notice"])
    assert "preemption_context" in context.__dataclass_fields__
    holder = compat.resolve(compat.PRIVATE_NAMES["Ray Train preemption context"])
    assert holder().preemption_info is None  # set by Ray's watcher on every worker of the group
