"""FSDP vs DDP on CPU workers (gloo, no Ray: the layouts themselves).

- Memory: bytes of parameters + gradients + AdamW state held by one worker after a step, 4 workers, ``fsdp``
  vs ``ddp`` (exact counts of the tensors each rank holds; the goal is fsdp <= 1/4 of ddp + 10%).
- Throughput: tokens/s of 2 workers with ``ddp`` and with ``fsdp`` (raytrn's build and step), against a bare
  PyTorch loop in one process on the same per-worker micro-batch (2 cores: the ceiling is 2x).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import emit, run_child, run_gloo, train_rank

SMALL = (
    "model.hidden_size=256", "model.intermediate_size=768", "model.num_layers=4", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.vocab_size=16000", "model.max_position_embeddings=512", "model.preset=null",
)  # fmt: skip


#: Every run's job: jobs/tiny.yaml, 8 rows of 128 tokens a worker, no data read.
BASE = ("data.manifest=unused", "data.seq_len=128", "data.micro_batch_size=8", "data.grad_accum=1",
        "scaling.min_workers=1", "scaling.max_workers=4")  # fmt: skip


def _job(*overrides: str) -> Any:
    from raytrn.config import load_job

    return load_job("jobs/tiny.yaml", [*BASE, *overrides], resolve=False)


def _bare(steps: int) -> list[float]:
    """A plain PyTorch loop: the same model, AdamW and batch shape, one process, no raytrn."""
    import torch
    import torch.nn.functional as F

    from raytrn.models import build_model

    torch.set_num_threads(1)
    model = build_model(_job().model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        batch = torch.randint(0, 4096, (8, 129), generator=gen)
        t0 = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def child_main(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    runs = [("ddp", "small", 4, 2), ("fsdp", "small", 4, 2)]
    runs += [("ddp", "tiny", 2, args.steps), ("fsdp", "tiny", 2, args.steps)]
    for layout, model, world, steps in runs:
        overrides = [*BASE, f"parallel.data_parallel={layout}", *(SMALL if model == "small" else ())]
        out[f"{layout}-{model}-{world}"] = run_gloo(train_rank, world, overrides, steps)
    out["bare-tiny-1"] = _bare(args.steps)
    emit(out)


def run(*, steps: int) -> dict[str, Any]:
    r = run_child("parallel", ["--steps", str(steps)], threads=1, timeout_s=600)
    warm = 3
    tokens = 8 * 128

    def held(key: str) -> int:
        return max(sum(rank["held"].values()) for rank in r[key])

    def tps(times: list[float], workers: int) -> float:
        steady = times[warm:]
        return workers * tokens * len(steady) / sum(steady)

    ddp_b, fsdp_b = held("ddp-small-4"), held("fsdp-small-4")
    bare = tps(r["bare-tiny-1"], 1)
    # A step ends at the same time on every worker (collectives): rank 0's times stand for the group.
    ddp_tps = tps(r["ddp-tiny-2"][0]["step_s"], 2)
    fsdp_tps = tps(r["fsdp-tiny-2"][0]["step_s"], 2)
    return {
        "memory_ddp_mb": ddp_b / 1e6,
        "memory_fsdp_mb": fsdp_b / 1e6,
        "fsdp_over_ddp": fsdp_b / ddp_b,
        "bare_tokens_per_s": bare,
        "ddp_2_tokens_per_s": ddp_tps,
        "fsdp_2_tokens_per_s": fsdp_tps,
        "ddp_over_bare": ddp_tps / bare,
        "fsdp_over_bare": fsdp_tps / bare,
        "raw": r,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.parallel")
    parser.add_argument("--steps", type=int, default=20)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
