#!/usr/bin/env python3
"""GPU bench: raytrn's training step on the ``cuda`` backend against a bare PyTorch loop, as tokens/s and MFU.

For each model (a ~124M GPT-2-small-like Llama and Llama 3.2 1B) it builds the same model twice on one
GPU: once through raytrn (``build_training`` + ``train_step`` with ``CudaBackend``, in this process: one
worker, no Ray Train) and once as a plain loop written here (the same model class, AdamW, autocast).
Both use bf16 autocast with float32 master weights, SDPA attention, fused AdamW, gradient clipping and
(unless ``--no-compile``) ``torch.compile`` of the model and the loss. Timed rounds of the two alternate
(ABBA...) so clock and thermal drift cancel; tokens/s is steady state after warm-up. MFU uses raytrn's
own FLOPs/token (``raytrn.models.model_stats``: 6N + attention) over the datasheet peak and over the
GPU's bf16 matmul rate measured here (8192^3 products).

    python bench/gpu.py --out bench/results/gpu.json            # the full bench (minutes)
    python bench/gpu.py --quick --out /tmp/smoke.json           # tiny model, seconds: checks the plumbing

Needs torch with CUDA, transformers, pydantic and pyyaml; not Ray or MLflow. Without a CUDA device it
says so and exits 0. Tokens are random (a throughput bench: no data, no downloads).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing raytrn

#: Model sizes (raytrn ``model`` sections). 124m: GPT-2 small's width/depth/vocab as a Llama (SwiGLU
#: MLP at 8/3 x hidden, tied embeddings): 124.0M parameters.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"preset": "tiny"},
    "124m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_layers": 12,
        "num_attention_heads": 12,
        "vocab_size": 50304,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "1b": {"preset": "llama3.2-1b"},
}
#: (seq_len, micro_batch, grad_accum) per model: 32-64K tokens per optimizer step, micro-batches that
#: leave room for both copies of the model (raytrn's and the bare loop's) on one 80 GB GPU.
SHAPES = {"tiny": (256, 4, 2), "124m": (2048, 16, 2), "1b": (2048, 4, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the results as JSON here (also after each model)")
    p.add_argument(
        "--models",
        default="124m,1b",
        help=f"comma-separated, from {sorted(MODELS)}; NAME:MICROxACCUM (e.g. 1b:8x2) sets that model's batch shape",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, small matmuls: a smoke test")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per loop first (compiles)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per loop, alternating bare/raytrn")
    p.add_argument("--no-compile", action="store_true", help="eager mode (no torch.compile) in both loops")
    p.add_argument("--seq-len", type=int, help="override the per-model sequence length")
    p.add_argument("--micro-batch", type=int, help="override the per-model micro-batch")
    p.add_argument("--grad-accum", type=int, help="override the per-model gradient accumulation")
    p.add_argument("--profile", action="store_true", help="also write a kernel-time table per model next to --out")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.warmup, args.steps, args.rounds = "tiny", 2, 3, 2

    try:
        import torch
    except ImportError:
        print("bench/gpu.py: torch is not installed; skipping (exit 0)")
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); skipping (exit 0)")
        return 0
    unknown = [m for m in args.models.split(",") if m.split(":")[0] not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")

    results: dict[str, Any] = {"device": device_info(), "settings": vars(args) | {"out": str(args.out)}}
    n = 4096 if args.quick else 8192
    results["matmul_peak"] = matmul_peak(n=n, iters=5 if args.quick else 30)
    print(f"bf16 matmul {n}^3: {results['matmul_peak']['tflops_each']} TFLOP/s measured", flush=True)
    results["models"] = {}
    for spec in args.models.split(","):
        name, _, batch = spec.partition(":")
        seq, micro, accum = SHAPES[name]
        if batch:
            micro, accum = (int(x) for x in batch.split("x"))
        shape = (args.seq_len or seq, args.micro_batch or micro, args.grad_accum or accum)
        try:
            results["models"][spec] = bench_model(name, shape, args, results["matmul_peak"]["tflops"] * 1e12)
        except Exception as e:  # e.g. out of memory at a large micro-batch: keep the other models' numbers
            print(f"  {spec} failed: {e.__class__.__name__}: {str(e)[:500]}", flush=True)
            results["models"][spec] = {"error": f"{e.__class__.__name__}: {str(e)[:2000]}"}
            gc.collect()
            torch.cuda.empty_cache()
        if args.out:
            write_json(args.out, results)
    # The same products after the models: a GPU that slowed down while hot shows here.
    results["matmul_peak_after"] = matmul_peak(n=n, iters=5 if args.quick else 30)
    print(f"bf16 matmul {n}^3 after the models: {results['matmul_peak_after']['tflops_each']} TFLOP/s", flush=True)
    if args.out:
        write_json(args.out, results)
    print()
    print(markdown_table(results))
    return 0


# ---------------------------------------------------------------------------------------------------
# Device and peak


def device_info() -> dict[str, Any]:
    """GPU name, driver, memory, clocks as nvidia-smi and torch report them."""
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.sm,power.limit,temperature.gpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        info["nvidia_smi"] = dict(
            zip(query.split(","), [v.strip() for v in out.splitlines()[0].split(",")], strict=False)
        )
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def matmul_peak(*, n: int, iters: int, repeats: int = 5, warmup: int = 5) -> dict[str, Any]:
    """bf16 [n, n] @ [n, n] on random data: mean TFLOP/s of ``iters`` products, ``repeats`` times (median kept)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        rates.append(2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12)
    del a, b, c
    torch.cuda.empty_cache()
    return {
        "n": n,
        "iters": iters,
        "tflops_each": [round(r, 1) for r in rates],
        "tflops": statistics.median(rates),  # the figure MFU (measured peak) divides by
        "tflops_max": max(rates),
    }


def datasheet_peak(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s from raytrn's table (the one its MLflow ``mfu`` metric uses)."""
    from raytrn.tracking.cost import peak_flops_per_worker

    return peak_flops_per_worker("cuda", None, gpu=gpu_name)


# ---------------------------------------------------------------------------------------------------
# The two loops


def job_for(name: str, shape: tuple[int, int, int], *, compile: bool) -> Any:
    """The raytrn job both loops train: bf16 autocast, fp32 master weights, fused AdamW, clipping."""
    from raytrn.config import parse_job

    seq, micro, accum = shape
    raw = {
        "model": {**MODELS[name], "dtype": "float32", "autocast": "bfloat16"},
        "data": {"manifest": "unused (random tokens)", "seq_len": seq, "micro_batch_size": micro, "grad_accum": accum},
        "optim": {"lr": 3e-4, "warmup_steps": 0, "fused": True, "grad_clip_norm": 1.0, "weight_decay": 0.1},
        "scaling": {"accelerator": "cuda", "min_workers": 1},
        "tracking": {"enabled": False},
        "run": {"max_steps": 1_000_000, "compile": compile, "seed": 0},
    }
    return parse_job(raw, source=f"bench/gpu.py:{name}")


def raytrn_loop(job: Any) -> Callable[[Iterator[Any]], Any]:
    """raytrn's own step: ``build_training`` + ``train_step`` on ``CudaBackend`` (one process, world size 1)."""
    from raytrn.backends.cuda import CudaBackend
    from raytrn.train.build import build_training
    from raytrn.train.step import train_step

    backend = CudaBackend()
    training = build_training(job, backend, world_size=1)

    def step(batches: Iterator[Any]) -> Any:
        return train_step(training, batches, backend).loss

    step.state = training  # type: ignore[attr-defined]  # kept alive (and freed) with the closure
    return step


def bare_loop(job: Any) -> Callable[[Iterator[Any]], Any]:
    """The same training written as a plain PyTorch loop (what a user would write without raytrn)."""
    import torch
    import torch.nn.functional as F

    from raytrn.models import build_model

    # The model alone (plain PyTorch, HF's Llama op for op), as in bench/training.py's bare loop: the
    # difference measured is the training step, not the model class.
    model = build_model(job.model, seed=job.run.seed + 1).cuda()
    if job.run.compile:
        model.compile()
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": job.optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=job.optim.lr,
        betas=job.optim.betas,
        fused=True,
    )

    def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    loss_fn = torch.compile(ce) if job.run.compile else ce
    accum = job.data.grad_accum or 1

    def step(batches: Iterator[torch.Tensor]) -> torch.Tensor:
        model.train()
        total = torch.zeros((), device="cuda")
        for _ in range(accum):
            batch = next(batches)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(input_ids=batch[:, :-1]).logits, batch[:, 1:])
            (loss / accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, job.optim.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / accum

    step.state = (model, opt)  # type: ignore[attr-defined]
    return step


# ---------------------------------------------------------------------------------------------------
# Measuring


def bench_model(name: str, shape: tuple[int, int, int], args: argparse.Namespace, peak: float) -> dict[str, Any]:
    """Warm up both loops, then alternate timed rounds; tokens/s, MFU and the bare-loop ratio."""
    import torch

    from raytrn.models import model_stats

    compile = not args.no_compile
    job = job_for(name, shape, compile=compile)
    seq, micro, accum = shape
    stats = model_stats(job.model, seq)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [torch.randint(0, job.model.vocab_size, (micro, seq + 1), device="cuda", generator=gen) for _ in range(8)]
    batches = itertools.cycle(pool)  # on the device already: the step is timed, not host-to-device copies
    print(f"\n== {name}: {stats.describe()}; seq {seq} x micro {micro} x accum {accum}", flush=True)

    torch.cuda.reset_peak_memory_stats()
    loops: dict[str, Callable[[Iterator[Any]], Any]] = {}
    out: dict[str, Any] = {
        "num_params": stats.num_params,
        "flops_per_token": stats.flops_per_token,
        "seq_len": seq,
        "micro_batch": micro,
        "grad_accum": accum,
        "tokens_per_step": seq * micro * accum,
        "compile": compile,
        "precision": "bf16 autocast, fp32 master weights and AdamW state (model.dtype float32, model.autocast bfloat16)",
        "attention": "sdpa",
        "optimizer": "AdamW fused=True, grad clip 1.0",
    }
    warm: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    for label, make in (("bare", bare_loop), ("raytrn", raytrn_loop)):
        t0 = time.perf_counter()
        loops[label] = make(job)
        loss = None
        for _ in range(args.warmup):
            loss = loops[label](batches)
        torch.cuda.synchronize()
        warm[label] = time.perf_counter() - t0
        losses[label] = [float(loss)] if loss is not None else []
        print(
            f"  {label}: built + {args.warmup} warm-up steps in {warm[label]:.1f} s, loss {losses[label]}", flush=True
        )

    tps: dict[str, list[float]] = {"bare": [], "raytrn": []}
    for r in range(args.rounds):
        order = ("bare", "raytrn") if r % 2 == 0 else ("raytrn", "bare")
        for label in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = loops[label](batches)
            torch.cuda.synchronize()  # the only host-device sync of the round
            dt = time.perf_counter() - t0
            tps[label].append(args.steps * seq * micro * accum / dt)
        print(f"  round {r}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in tps.items()), flush=True)
    out["memory_peak_gib_both_loops"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)

    sheet = datasheet_peak(torch.cuda.get_device_name(0))
    for label in ("bare", "raytrn"):
        med = statistics.median(tps[label])
        flops = med * stats.flops_per_token
        out[label] = {
            "tokens_per_s_rounds": [round(x) for x in tps[label]],
            "tokens_per_s": round(med),
            "tflops": round(flops / 1e12, 1),
            "mfu_datasheet": round(flops / sheet, 4) if sheet else None,
            "mfu_measured_peak": round(flops / peak, 4),
            "warmup_s": round(warm[label], 1),
            "step_time_s": round(seq * micro * accum / med, 4),
        }
    out["datasheet_peak_tflops"] = sheet / 1e12 if sheet else None
    out["ratio_raytrn_to_bare"] = round(out["raytrn"]["tokens_per_s"] / out["bare"]["tokens_per_s"], 4)
    # Per-round ratios (each pair of adjacent rounds): their spread is the noise of the comparison.
    out["ratio_rounds"] = [round(a / b, 4) for a, b in zip(tps["raytrn"], tps["bare"], strict=True)]
    print(
        f"  median: bare {out['bare']['tokens_per_s']:,} tok/s, raytrn {out['raytrn']['tokens_per_s']:,} tok/s, "
        f"ratio {out['ratio_raytrn_to_bare']:.3f}, MFU raytrn {out['raytrn']['mfu_datasheet']} (datasheet) / "
        f"{out['raytrn']['mfu_measured_peak']} (measured peak)",
        flush=True,
    )
    if args.profile and args.out:
        out["profile"] = profile_step(
            loops["raytrn"], batches, args.out.with_name(f"{args.out.stem}-{name}-{micro}x{accum}-kernels.txt")
        )
    loops.clear()
    gc.collect()
    torch.cuda.empty_cache()
    import torch._dynamo

    torch._dynamo.reset()
    return out


def profile_step(step: Callable[[Iterator[Any]], Any], batches: Iterator[Any], path: Path) -> str:
    """One profiled raytrn step: the CUDA kernels by total time, written to ``path`` (where the time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(batches)
            torch.cuda.synchronize()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
        return str(path)
    except Exception as e:  # a bench extra: never lose the numbers over it
        return f"failed: {e.__class__.__name__}: {e}"


# ---------------------------------------------------------------------------------------------------
# Output


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def markdown_table(results: dict[str, Any]) -> str:
    """The results as a Markdown table (one row per model and loop) with the device and measured peak."""
    dev, peak = results["device"], results["matmul_peak"]
    lines = [
        f"Device: {dev['name']} (driver {dev['nvidia_smi'].get('driver_version', '?') if isinstance(dev['nvidia_smi'], dict) else '?'}), "
        f"torch {dev['torch']} (CUDA {dev['cuda']}), transformers {dev['transformers']}; "
        f"measured bf16 matmul peak {peak['tflops']:.0f} TFLOP/s ({peak['n']}^3)",
        "",
        "| model | params | seq x micro x accum | loop | tokens/s | TFLOP/s | MFU (datasheet) | MFU (measured peak) | raytrn / bare |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["models"].items():
        if "error" in m:
            lines.append(f"| {name} | | | | failed: {m['error'][:80]} | | | | |")
            continue
        for label in ("bare", "raytrn"):
            r = m[label]
            sheet = f"{r['mfu_datasheet']:.1%}" if r["mfu_datasheet"] is not None else "n/a"
            ratio = f"{m['ratio_raytrn_to_bare']:.3f}" if label == "raytrn" else ""
            lines.append(
                f"| {name} | {m['num_params'] / 1e6:,.0f}M | {m['seq_len']} x {m['micro_batch']} x {m['grad_accum']} | "
                f"{label} | {r['tokens_per_s']:,} | {r['tflops']} | {sheet} | {r['mfu_measured_peak']:.1%} | {ratio} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
