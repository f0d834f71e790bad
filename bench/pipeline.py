"""Pipeline parallelism on CPU workers (gloo, no Ray): its bubble against the schedule's theory, and its tokens/s
against FSDP over the same 2 workers and one process, at the same model and global batch.

Each step trains ``m`` micro-batches of 8 rows x 128 tokens of a 4-layer model (width 256, vocabulary 16,000) a
replica: one process accumulates all ``m``; FSDP 2 splits them over 2 replicas (``m / 2`` each); PP 2 (1F1B)
runs the ``m`` micro-batches through 2 stages of 2 layers. The bubble is measured as the share of the pipeline's
step that is not the one process's work split in two: ``1 - T_one / (P x T_pp)`` (idle stages, and the pipeline's
own overhead: sends, receives, the schedule), against 1F1B's theory ``(P - 1) / (m + P - 1)``. On 2 cores each
worker has one; the ceiling of either 2-worker layout is 2x one process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bench.common import emit, run_child, run_gloo

MODEL = (
    "model.hidden_size=256", "model.intermediate_size=768", "model.num_layers=4", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.vocab_size=16000", "model.max_position_embeddings=512", "model.preset=null",
    "model.tie_word_embeddings=false",
)  # fmt: skip
ROWS, SEQ, VOCAB = 8, 128, 16000


def _job(world: int, micro: int, *overrides: str) -> Any:
    from raytrn.config import load_job

    return load_job(
        "jobs/tiny.yaml",
        [*MODEL, "data.manifest=unused", f"data.seq_len={SEQ}", f"data.micro_batch_size={ROWS}",
         "data.grad_accum=null", f"data.global_batch_size={ROWS * micro}", f"scaling.min_workers={world}",
         f"scaling.max_workers={world}", "tracking.log_model=false", *overrides],
        resolve=False,
    )  # fmt: skip


def _micro_batches(seed: int) -> Iterator[Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)


def step_rank(rank: int, world: int, micro: int, overrides: Sequence[str], steps: int) -> dict[str, Any]:
    """A rank of :func:`bench.common.run_gloo` (or the one process, ``world`` 1): raytrn's build and step, each
    step's seconds. The ranks of a pipeline read the same rows (their data-parallel rank's)."""
    import torch

    from raytrn.backends.cpu import CpuBackend
    from raytrn.config.sizes import data_parallel_rank
    from raytrn.train.build import build_training
    from raytrn.train.step import train_step

    torch.set_num_threads(1)
    job = _job(world, micro, *overrides)
    t = build_training(job, CpuBackend(), world_size=world, rank=rank)
    batches = _micro_batches(data_parallel_rank(job, rank, world))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(t, batches, CpuBackend())
        times.append(time.perf_counter() - t0)
    return {"step_s": times}


def child_main(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    for micro in (4, 8):
        out[f"one-{micro}"] = step_rank(0, 1, micro, (), args.steps)
        out[f"fsdp-{micro}"] = run_gloo(step_rank, 2, micro, ["parallel.data_parallel=fsdp"], args.steps)
        pp = ["parallel.data_parallel=fsdp", "parallel.pipeline_parallel_size=2"]
        out[f"pp-{micro}"] = run_gloo(step_rank, 2, micro, pp, args.steps)
    emit(out)


def run(*, steps: int) -> dict[str, Any]:
    r = run_child("pipeline", ["--steps", str(steps)], threads=1, timeout_s=900)
    warm = 2

    def step_s(times: list[float]) -> float:
        return statistics.median(times[warm:])

    result: dict[str, Any] = {"setup": f"4 layers, width 256, {ROWS} x {SEQ} tokens a micro-batch, PP 2 (1F1B)"}
    for micro in (4, 8):
        one = step_s(r[f"one-{micro}"]["step_s"])
        fsdp = step_s(r[f"fsdp-{micro}"][0]["step_s"])  # a step ends on every rank together (collectives)
        pp = step_s(r[f"pp-{micro}"][0]["step_s"])
        tokens = micro * ROWS * SEQ
        result[f"m{micro}"] = {
            "one_tokens_per_s": tokens / one,
            "fsdp_tokens_per_s": tokens / fsdp,
            "pp_tokens_per_s": tokens / pp,
            "pp_over_fsdp": fsdp / pp,
            "bubble_measured": 1 - one / (2 * pp),
            "bubble_theory": (2 - 1) / (micro + 2 - 1),
        }
    result["raw"] = r
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline")
    parser.add_argument("--steps", type=int, default=8)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
