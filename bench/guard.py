"""The per-step cost of the finiteness check (issue 28: a diverging run never poisons its state), one process.

The check is a host read of the step's gradient norm (``bool(torch.isfinite(norm))`` in
:func:`raytrn.train.build.clip_and_step`) and the guard's count (:meth:`raytrn.train.guard.NonFiniteGuard.check`).
Measured two ways on the tiny model (seq 128, micro-batch 8, 1 torch thread): the check's own time per step, timed
over many calls on a real step's norm, as a share of the median step time (precise); and the median step time
with the check vs a backend without it (the frozen XLA paths' setting), alternated rounds (the noise of the
machine is larger than the difference; shown for scale).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.common import emit, run_child


def _steps(check: bool, steps: int) -> list[float]:
    import torch

    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.train.build import build_training
    from raytrn.train.guard import NonFiniteGuard
    from raytrn.train.step import train_step

    class Unchecked(CpuBackend):
        skips_nonfinite_steps = False

    job = load_job("jobs/tiny.yaml", ["data.manifest=unused", "data.seq_len=128", "data.micro_batch_size=8"],
                   resolve=False)  # fmt: skip
    backend = CpuBackend() if check else Unchecked()
    torch.manual_seed(0)
    t = build_training(job, backend, world_size=1)
    guard = NonFiniteGuard(job, enabled=check)
    gen = torch.Generator().manual_seed(0)
    vocab = job.model.vocab_size
    batches = iter([torch.randint(0, vocab, (8, 129), generator=gen) for _ in range(steps)])
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        result = train_step(t, batches, backend)
        guard.check(result.grad_norm, step)
        times.append(time.perf_counter() - t0)
    return times


def _check_cost_s(calls: int) -> float:
    """Seconds per step of the check alone: the host read of a real norm and the guard's count."""
    import torch

    from raytrn.config import load_job
    from raytrn.train.guard import NonFiniteGuard

    job = load_job("jobs/tiny.yaml", ["data.manifest=unused"], resolve=False)
    guard = NonFiniteGuard(job)
    norm = torch.linalg.vector_norm(torch.randn(1000))
    t0 = time.perf_counter()
    for step in range(calls):
        if not bool(torch.isfinite(norm)):
            raise AssertionError("a finite norm")
        guard.check(norm, step)
    return (time.perf_counter() - t0) / calls


def child_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    on: list[float] = []
    off: list[float] = []
    for _ in range(args.rounds):
        on += _steps(True, args.steps)[args.warmup :]
        off += _steps(False, args.steps)[args.warmup :]
    emit({"step_s_checked": statistics.median(on), "step_s_unchecked": statistics.median(off),
          "check_s": _check_cost_s(args.calls), "steps": len(on)})  # fmt: skip


def run(*, quick: bool = False) -> dict[str, Any]:
    r = run_child(
        "guard",
        ["--steps", "8" if quick else "40", "--warmup", "3" if quick else "5", "--rounds", "1" if quick else "3",
         "--calls", "2000" if quick else "20000"],
        threads=1, timeout_s=600,
    )  # fmt: skip
    return {
        **r,
        "check_share": r["check_s"] / r["step_s_checked"],
        "checked_over_unchecked": r["step_s_checked"] / r["step_s_unchecked"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.guard")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20000)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
