"""The Qwen3-MoE step on CPU: tokens/s of raytrn's step (build_training + train_step) for a MoE model.

- One process: the MoE dropless and with the capacity dispatch (factor 1.25, Neuron's fixed shapes), against a
  dense Qwen3 of the same active parameters a token (the MLP as wide as the experts a token goes to), and the
  parameters and AdamW state each holds.
- Expert parallelism (``parallel.expert_parallel_size``): the dropless MoE on 2 gloo workers (no Ray), FSDP over
  both, without EP (EP 1: every expert FSDP-sharded over the 2 workers, all-gathered for the step) and with EP 2
  (each worker holds 8 of the 16 experts whole; tokens move to them by all-to-all): tokens/s of both workers, and
  the parameter + gradient + AdamW bytes one worker holds (local shards, as bench/parallel.py counts them). At 2
  workers both layouts hold half of every tensor, so those bytes are equal; EP's saving is the experts'
  all-gathers it does not do (time, and a transient layer of experts), not held state.

The MoE: 4 layers, width 256, 4/2 heads of 64, 16 experts of width 128, 2 a token; the dense: the same with an
MLP of width 256 (2 x 128). seq 128, micro-batch 8 (a worker), 1 torch thread (a worker); the three one-process
variants alternated, then EP 1 and EP 2 alternated, each round.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench.common import emit, mean, run_child, run_gloo, timed_steps, train_rank
from raytrn.train.memory_probe import optimizer_state_bytes

SIZES = (
    "model.preset=null", "model.hidden_size=256", "model.num_layers=4", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.head_dim=64", "model.vocab_size=4096", "model.max_position_embeddings=512",
    "model.rope_theta=1000000.0",
)  # fmt: skip
MOE = ("model.family=qwen3_moe", "model.num_experts=16", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=128", "model.intermediate_size=512")  # fmt: skip
VARIANTS: dict[str, tuple[str, ...]] = {
    "dense": ("model.family=qwen3", "model.intermediate_size=256"),  # 3 x 256 x 256 = 2 experts of 128
    "moe_dropless": MOE,
    "moe_capacity": (*MOE, "model.moe_capacity_factor=1.25"),
}


#: The 2-worker rows (gloo, FSDP over both, 1 torch thread each, 8 rows a worker: a global batch of 16 rows): the
#: dropless MoE without expert parallelism (EP 1) and with its experts spread over the 2 workers (EP 2).
EP_ROWS = {"moe_dropless_ep1": 1, "moe_dropless_ep2": 2}
EP_WORKERS = 2


def _overrides(name: str, *extra: str) -> list[str]:
    """jobs/tiny.yaml's overrides for a variant: seq 128, micro-batch 8, no data read."""
    return [*SIZES, *VARIANTS[name], "data.manifest=unused", "data.seq_len=128", "data.micro_batch_size=8",
            "data.grad_accum=1", *extra]  # fmt: skip


def _variant(name: str, steps: int, warmup: int) -> dict[str, Any]:
    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.models import model_stats
    from raytrn.train.build import build_training
    from raytrn.train.step import read_metrics

    job = load_job("jobs/tiny.yaml", _overrides(name), resolve=False)
    t = build_training(job, CpuBackend(), world_size=1)
    times, result = timed_steps(t, steps, vocab=4096)
    stats = model_stats(job.model, 128)
    metrics = read_metrics(result, world_size=1) if result is not None else {}
    return {
        "params": stats.num_params,
        "active_params": stats.num_active_params,
        "optimizer_bytes": optimizer_state_bytes(t.optimizer),
        "tokens_per_s": 8 * 128 / (mean(times[warmup:]) or float("nan")),
        "dropped_fraction": metrics.get("moe_dropped_fraction"),
    }


def child_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            rows[name].append(_variant(name, args.steps, args.warmup))
    for _ in range(args.rounds if args.ep_steps else 0):
        for name, ep in EP_ROWS.items():
            rows.setdefault(name, []).append(_expert_parallel(ep, args.ep_steps, args.warmup))
    emit({name: {**r[-1], "tokens_per_s": mean([x["tokens_per_s"] for x in r])} for name, r in rows.items()})


def _expert_parallel(ep: int, steps: int, warmup: int) -> dict[str, Any]:
    """The dropless MoE on :data:`EP_WORKERS` gloo workers at FSDP 2 and expert parallelism ``ep``: tokens/s of both
    (rank 0's step times: a step ends on every worker together) and the bytes one worker holds (the larger rank)."""
    overrides = _overrides("moe_dropless", "parallel.data_parallel=fsdp", f"parallel.expert_parallel_size={ep}")
    ranks = run_gloo(train_rank, EP_WORKERS, overrides, steps)
    held = {key: max(r["held"][key] for r in ranks) for key in ("params", "grads", "optim")}
    return {
        "workers": EP_WORKERS,
        "expert_parallel": ep,
        "tokens_per_s": EP_WORKERS * 8 * 128 / (mean(ranks[0]["step_s"][warmup:]) or float("nan")),
        "param_bytes": held["params"],
        "grad_bytes": held["grads"],
        "optimizer_bytes": held["optim"],
        "held_bytes": max(sum(r["held"].values()) for r in ranks),
    }


def run(*, quick: bool = False) -> dict[str, Any]:
    r = run_child(
        "moe",
        ["--steps", "4" if quick else "12", "--warmup", "1" if quick else "2", "--rounds", "1" if quick else "2",
         "--ep-steps", "3" if quick else "8"],
        threads=1, timeout_s=600,
    )  # fmt: skip
    dense, ep1, ep2 = r["dense"], r["moe_dropless_ep1"], r["moe_dropless_ep2"]
    return {
        **r,
        "dropless_over_dense": r["moe_dropless"]["tokens_per_s"] / dense["tokens_per_s"],
        "capacity_over_dense": r["moe_capacity"]["tokens_per_s"] / dense["tokens_per_s"],
        "ep2_over_ep1": ep2["tokens_per_s"] / ep1["tokens_per_s"],
        "ep2_over_ep1_held": ep2["held_bytes"] / ep1["held_bytes"],
        "setup": "4 layers, width 256, 16 experts of 128 (top 2) vs a dense MLP of 256; seq 128 x micro 8",
        "ep_setup": "dropless, 2 gloo workers at FSDP 2, 1 thread each, micro 8 a worker (global batch 16 x 128)",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.moe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ep-steps", type=int, default=8, help="steps of each 2-worker run a round (0: none)")
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
