"""Real multi-process ``torch.distributed`` (gloo on 127.0.0.1) for the layout tests: a free port, a rank's process
group, and every rank's process (forked from a server that imported torch and raytrn once) bounded in time, ended by
handle on failure."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
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


def start_ranks(fn: Callable[..., None], *args: Any, nprocs: int, join: bool = False) -> Any:
    """``fn(rank, *args)`` on ``nprocs`` processes forked from a server that imported :data:`PRELOAD` and ``fn``'s
    module (started at the first call in this process: a fork, not a new interpreter paying ~3-5 s of imports each),
    with this process's environment; ``torch.multiprocessing.start_processes``' result (``join`` as there)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([*PRELOAD, fn.__module__])
    return mp.start_processes(
        _entered, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=join, start_method="forkserver"
    )


def process(target: Callable[..., None], *args: Any) -> Any:
    """A ``multiprocessing`` process (not started yet) running ``target(*args)`` with this process's environment,
    forked from the ranks' server as :func:`start_ranks`' are."""
    import multiprocessing

    multiprocessing.set_forkserver_preload([*PRELOAD, target.__module__])
    return multiprocessing.get_context("forkserver").Process(target=_with_env, args=(dict(os.environ), target, *args))


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any, deadline_s: float) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` processes (:func:`start_ranks`); fails the test past
    ``deadline_s``."""
    ctx = start_ranks(fn, world, free_port(), *args, nprocs=world)
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, f"the {world} ranks did not finish in {deadline_s} s"
    finally:
        for process in ctx.processes:  # only after a failure or the deadline: ours, by handle
            if process.is_alive():
                process.terminate()


@contextlib.contextmanager
def rank_records(rank: int, world: int, port: int, tmp: str) -> Iterator[dict[str, Any]]:
    """This rank's process group for the block, and a dict of its records the block fills: saved to
    ``tmp/out-<rank>.pt`` when the block ends (then a barrier: every rank's file is written before any leaves); the
    group destroyed either way. :func:`spawn_records` reads them back."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    out: dict[str, Any] = {}
    try:
        yield out
        torch.save(out, Path(tmp) / f"out-{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_records(fn: Callable[..., None], world: int, tmp: Path, *, deadline_s: float) -> list[dict[str, Any]]:
    """:func:`spawn_ranks` of ``fn(rank, world, port, tmp)``, then every rank's records (:func:`rank_records`)."""
    spawn_ranks(fn, world, str(tmp), deadline_s=deadline_s)
    return [torch.load(tmp / f"out-{r}.pt", weights_only=False) for r in range(world)]


def _entered(rank: int, env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    """A rank with the test's environment (a forked process has the server's)."""
    _with_env(env, fn, rank, *args)


def _with_env(env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(*args)


def tiny_job(tmp: Any, *overrides: str, workers: int, seq: int, rows: int, name: str) -> Any:
    """jobs/tiny.yaml as the layout tests train it (no data read: they feed their own rows): ``workers`` workers,
    ``rows`` sequences of ``seq`` tokens a step (micro-batches of one), vocabulary 512, run ``name``.

    AdamW's epsilon is 1e-6, not 1e-8: a layout sums its gradients in another order than one process does, off by
    ~1e-10 where terms cancel, and AdamW turns a gradient error ``d`` into a weight error of up to ``lr * d / eps``:
    3e-5 at eps 1e-8 (over the tests' 2e-5: an EP layout failed so on a CI machine), 3e-7 at 1e-6."""
    from pathlib import Path

    from raytrn.config import load_job

    return load_job(
        Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml",
        ["data.manifest=unused", f"data.seq_len={seq}", "model.vocab_size=512", "data.grad_accum=null",
         f"data.global_batch_size={rows}", "data.micro_batch_size=1", "optim.warmup_steps=2", "optim.eps=1e-6",
         f"scaling.min_workers={workers}", f"scaling.max_workers={workers}", f"checkpoint.storage={tmp}",
         f"tracking.run_name={name}", *overrides],
        resolve=False,
    )  # fmt: skip


def tiny_pipeline_job(tmp: Any, *overrides: str, workers: int, seq: int, rows: int, name: str) -> Any:
    """:func:`tiny_job` as the pipeline tests cut it: 4 layers, untied embeddings (the embedding and the head sit on
    different stages), no model export."""
    return tiny_job(tmp, "model.num_layers=4", "model.tie_word_embeddings=false", "tracking.log_model=false",
                    *overrides, workers=workers, seq=seq, rows=rows, name=name)  # fmt: skip
