"""Context parallelism on CPU workers (gloo, no Ray): the activations a worker keeps for backward against the
sequence length, one worker (CP 1) vs a sequence split over 2 (CP 2), and the step's tokens/s.

The activations are measured, not estimated: the bytes of every tensor autograd saves for backward during one
micro-batch's forward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once; parameters
excluded: DDP, whose weights stay whole), on a 4-layer model (width 256, vocabulary 16,000), one row of ``seq`` tokens. The goal: CP 2 keeps half
of CP 1's (the ring's own extra, a block of scores at a time, is in the measurement).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import emit, run_child, run_gloo
from bench.pipeline import MODEL, VOCAB

SEQS = (256, 512, 1024)


def _job(world: int, seq: int, cp: int) -> Any:
    from raytrn.config import load_job

    return load_job(
        "jobs/tiny.yaml",
        [*MODEL, "model.max_position_embeddings=4096", "data.manifest=unused", f"data.seq_len={seq}",
         "data.micro_batch_size=1", "data.grad_accum=1",
         f"scaling.min_workers={world}", f"scaling.max_workers={world}", "parallel.data_parallel=ddp",
         f"parallel.context_parallel_size={cp}", "tracking.log_model=false"],
        resolve=False,
    )  # fmt: skip


def measure_rank(rank: int, world: int, seqs: list[int], steps: int) -> dict[str, Any]:
    """A rank of :func:`bench.common.run_gloo` (or the one process, ``world`` 1, CP 1): per sequence length, the
    bytes saved for backward by one micro-batch's forward, and each training step's seconds."""
    import torch

    from raytrn.backends.cpu import CpuBackend
    from raytrn.train.build import build_training
    from raytrn.train.step import forward, train_step

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for seq in seqs:
        t = build_training(_job(world, seq, world), CpuBackend(), world_size=world, rank=rank)
        params = {p.data_ptr() for p in t.model.parameters()}
        gen = torch.Generator().manual_seed(0)  # every rank of the group the same row
        rows = [torch.randint(0, VOCAB, (1, seq + 1), generator=gen) for _ in range(steps + 1)]
        saved: dict[int, int] = {}

        def pack(x: torch.Tensor, params: set[int] = params, saved: dict[int, int] = saved) -> torch.Tensor:
            ptr = x.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            logits, _, _, _ = forward(t, rows[0])
        del logits
        times = []
        batches = iter(rows[1:])
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(t, batches, CpuBackend())
            times.append(time.perf_counter() - t0)
        out[str(seq)] = {"saved_bytes": sum(saved.values()), "step_s": times}
    return out


def child_main(args: argparse.Namespace) -> None:
    emit({"cp1": measure_rank(0, 1, list(SEQS), args.steps), "cp2": run_gloo(measure_rank, 2, list(SEQS), args.steps)})


def run(*, steps: int) -> dict[str, Any]:
    r = run_child("context", ["--steps", str(steps)], threads=1, timeout_s=900)
    result: dict[str, Any] = {"setup": "4 layers, width 256, one row a micro-batch, CP 2 over 2 workers (gloo)"}
    for seq in SEQS:
        one, two = r["cp1"][str(seq)], r["cp2"][0][str(seq)]
        steady = sorted(one["step_s"][1:]), sorted(two["step_s"][1:])
        result[f"seq{seq}"] = {
            "cp1_saved_mib": one["saved_bytes"] / 2**20,
            "cp2_saved_mib": max(rank[str(seq)]["saved_bytes"] for rank in r["cp2"]) / 2**20,
            "cp2_over_cp1": max(rank[str(seq)]["saved_bytes"] for rank in r["cp2"]) / one["saved_bytes"],
            "cp1_tokens_per_s": seq / steady[0][len(steady[0]) // 2],
            "cp2_tokens_per_s": seq / steady[1][len(steady[1]) // 2],
        }
    result["raw"] = r
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.context")
    parser.add_argument("--steps", type=int, default=4)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
