"""Real multi-process ``torch.distributed`` (gloo on 127.0.0.1) for the layout tests: a free port, a rank's process
group, and a spawn of every rank bounded in time whose processes are ended by handle on failure."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world: int, port: int) -> None:
    """This rank's default process group (one CPU thread: the ranks share the machine's cores)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


#: What the ranks' server imports once (each rank is a fork of it: a fresh process without the ~5 s of imports).
PRELOAD = ["torch", "torch.distributed", "raytrn.train.build", "raytrn.train.step", "raytrn.checkpoint.dcp"]


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any, deadline_s: float) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` processes forked from a server that imported :data:`PRELOAD`
    and ``fn``'s module (started at the first call in this process); fails the test past ``deadline_s``."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([*PRELOAD, fn.__module__])
    ctx = mp.start_processes(
        _entered,
        args=(dict(os.environ), fn, world, free_port(), *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, f"the {world} ranks did not finish in {deadline_s} s"
    finally:
        for process in ctx.processes:  # only after a failure or the deadline: ours, by handle
            if process.is_alive():
                process.terminate()


def _entered(rank: int, env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    """A rank with the test's environment (a forked process has the server's)."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def tiny_job(tmp: Any, *overrides: str, workers: int, seq: int, rows: int, name: str) -> Any:
    """jobs/tiny.yaml as the layout tests train it (no data read: they feed their own rows): ``workers`` workers,
    ``rows`` sequences of ``seq`` tokens a step (micro-batches of one), vocabulary 512, run ``name``."""
    from pathlib import Path

    from raytrn.config import load_job

    return load_job(
        Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml",
        ["data.manifest=unused", f"data.seq_len={seq}", "model.vocab_size=512", "data.grad_accum=null",
         f"data.global_batch_size={rows}", "data.micro_batch_size=1", "optim.warmup_steps=2",
         f"scaling.min_workers={workers}", f"scaling.max_workers={workers}", f"checkpoint.storage={tmp}",
         f"tracking.run_name={name}", *overrides],
        resolve=False,
    )  # fmt: skip
