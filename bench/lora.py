"""LoRA vs full fine-tuning of the same model, from the same Hugging Face checkpoint (made here), one process.

A 4-layer, 512-wide Llama (vocab 4096), seq 128, micro-batch 8, 1 torch thread: trainable parameters, the AdamW
state held after a step (exact bytes of its moments), and tokens/s of raytrn's step (build_training + train_step)
over the same batches, the two variants alternated.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from bench.common import emit, mean, run_child, timed_steps
from raytrn.train.memory_probe import optimizer_state_bytes

MODEL: dict[str, Any] = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512)  # fmt: skip
LORA = "{rank: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj]}"


def _variant(ckpt: str, lora: bool, steps: int, warmup: int) -> dict[str, Any]:

    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.models.hf import load_weights
    from raytrn.models.lora import trainable_parameters
    from raytrn.train.build import build_training

    sets = ["model.preset=null", "model.hidden_size=null", "model.intermediate_size=null", "model.num_layers=null",
            "model.num_attention_heads=null", "model.vocab_size=null", f"model.init_from={ckpt}",
            "data.manifest=unused", "data.seq_len=128", "data.micro_batch_size=8", "data.grad_accum=1"]  # fmt: skip
    job = load_job("jobs/tiny.yaml", [*sets, *([f"model.lora={LORA}"] if lora else [])], resolve=False)
    t = build_training(job, CpuBackend(), world_size=1)
    load_weights(t.model, ckpt, tied=False, source="bench")
    times, _ = timed_steps(t, steps, vocab=4096)
    trainable, total = trainable_parameters(t.model)
    return {
        "trainable_params": trainable,
        "params": total,
        "optimizer_bytes": optimizer_state_bytes(t.optimizer),
        "tokens_per_s": 8 * 128 / (mean(times[warmup:]) or float("nan")),
    }


def child_main(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    rows: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-lora-") as d:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(d)
        for _ in range(args.rounds):
            for name in ("full", "lora"):
                rows[name].append(_variant(d, name == "lora", args.steps, args.warmup))
    emit({name: {**r[0], "tokens_per_s": mean([x["tokens_per_s"] for x in r])} for name, r in rows.items()})


def run(*, quick: bool = False) -> dict[str, Any]:
    r = run_child(
        "lora", ["--steps", "4" if quick else "12", "--warmup", "1" if quick else "2", "--rounds", "1" if quick else "2"],
        threads=1, timeout_s=600,
    )  # fmt: skip
    full, lora = r["full"], r["lora"]
    return {
        "full": full,
        "lora": lora,
        "trainable_ratio": lora["trainable_params"] / full["trainable_params"],
        "optimizer_ratio": lora["optimizer_bytes"] / full["optimizer_bytes"],
        "speed_ratio": lora["tokens_per_s"] / full["tokens_per_s"],
        "setup": f"{MODEL['num_hidden_layers']} layers, width {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}, "
        f"seq 128 x micro 8, LoRA {LORA}",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
