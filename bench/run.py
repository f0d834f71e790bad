"""``make bench``: run every benchmark within a time budget, write bench/results/<date>-<host>.json, print the
Markdown table and copy it into README.md (between the bench markers).

A benchmark whose parts are missing is skipped with a message; one that fails is reported as failed;
neither stops the others. ``--quick`` runs a few steps of each (the smoke test uses it).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    checkpoint,
    context,
    data,
    elastic,
    guard,
    lora,
    memory_tier,
    mlflow_overhead,
    moe,
    parallel,
    pipeline,
    recovery,
    startup,
    training,
    trainium,
)
from bench.common import REPO, BenchJob, Skip, load_average, machine
from bench.report import gpu_result, render, update_readme

ALL = (
    "peak",
    "training",
    "startup",
    "mlflow",
    "recovery",
    "elastic",
    "data",
    "checkpoint",
    "memory",
    "parallel",
    "pipeline",
    "context",
    "lora",
    "moe",
    "guard",
    "trainium",
)
#: Rough minutes each needs here (full mode, a busy 2-core machine): a benchmark starts only if this much
#: budget is left, and the training rounds stop early enough to leave it to the ones after them.
ESTIMATE_MIN = {"peak": 0.2, "training": 7.5, "startup": 2.5, "mlflow": 2.5, "recovery": 2.5, "elastic": 12.0, "data": 0.5,
                "checkpoint": 0.5, "memory": 6.0, "parallel": 2.0, "pipeline": 1.5, "context": 1.0, "lora": 1.0, "moe": 1.5, "guard": 0.7, "trainium": 0.1}  # fmt: skip


def _benchmarks(args: argparse.Namespace, results: dict[str, Any], deadline: float) -> dict[str, Callable[[], Any]]:
    quick = args.quick
    bench = BenchJob(steps=16, warmup=6) if quick else BenchJob()
    bench.sets = tuple(args.sets)
    if args.manifest:
        bench.manifest = args.manifest

    def train() -> Any:
        rounds = 1 if quick else args.rounds
        after = sum(ESTIMATE_MIN[b] for b in ALL[ALL.index("training") + 1 :] if b in args.only)
        out = training.overhead_and_scaling(bench, rounds=rounds, scaling=not quick, deadline=deadline - 60 * after)
        if quick:
            out["scaling_message"] = "not run in --quick (the same `raytrn train` path with 2 workers)"
        return out

    def train_tps() -> float | None:
        return results.get("training", {}).get("raytrn_tokens_per_s")

    return {
        "peak": lambda: training.run_peak(bench.threads, seconds=1.0 if quick else 3.0),
        "training": train,
        "startup": lambda: {
            **startup.run(bench, rounds=1 if quick else 2),
            "demo": startup.demo_goodput(bench),
        },
        "recovery": lambda: {
            **recovery.run(
                bench, steps=12 if quick else 40, checkpoint_every=2, kill_after=5 if quick else 15, timeout_s=300
            ),  # fmt: skip
            # the baseline: stock Ray Train restarting after the same kill
            "stock": recovery.run_stock(
                bench, steps=12 if quick else 40, checkpoint_every=2, kill_after=5 if quick else 15, timeout_s=300
            ),  # fmt: skip
        },
        "elastic": lambda: {
            **elastic.run(quick=quick),
            "stock": {} if quick else elastic.run_stock(),
            "live": {} if quick else elastic.run_live(),  # scaling.recovery: live, beside the restart path
            # the same with the survivors paced (the live test's pace): the returning node's start with CPU of its own
            "live_paced": {} if quick else elastic.run_live(paced=True),
        },
        "mlflow": lambda: mlflow_overhead.run(
            bench,
            log_every_values=(2,) if quick else (10, 1),
            pairs=1 if quick else 3,
            segment_steps=8 if quick else 30,
            warmup=3 if quick else 10,
        ),
        "data": lambda: data.run(
            bench, repeats=1 if quick else 3, training_tokens_per_s=train_tps(), copies=2 if quick else 20
        ),
        "checkpoint": lambda: checkpoint.run(
            models=("tiny",) if quick else ("tiny", "small"), repeats=1 if quick else 3
        ),
        "memory": lambda: memory_tier.run(bench, quick=quick),
        "parallel": lambda: parallel.run(steps=6 if quick else 20),
        "pipeline": lambda: pipeline.run(steps=4 if quick else 8),
        "context": lambda: context.run(steps=2 if quick else 4),
        "lora": lambda: lora.run(quick=quick),
        "moe": lambda: moe.run(quick=quick),
        "guard": lambda: guard.run(quick=quick),
        "trainium": trainium.targets,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps of each benchmark (smoke run)")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of: {','.join(ALL)}")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of the training variants")
    parser.add_argument("--budget-min", type=float, default=45.0, help="stop starting benchmarks after this")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the README block")
    parser.add_argument(
        "--render", metavar="RESULTS.json", help="only re-render a results file (and the README block), run nothing"
    )
    parser.add_argument("--manifest", help="another prepared dataset (default: the demo data, data/stdlib)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="more jobs/tiny.yaml overrides"
    )
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        saved["gpu"] = gpu_result() or saved.get("gpu")
        return _publish(saved, None, readme=not args.no_readme)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(only) - set(ALL))
    if unknown:
        print(f"bench: unknown benchmark(s) {unknown}; choose from {', '.join(ALL)}", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    deadline = t0 + args.budget_min * 60
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
        "load_start": load_average(),
        "results": {},
    }
    results = report["results"]
    benches = _benchmarks(args, results, deadline)
    for name in ALL:
        if name not in only:
            continue
        left_min = (deadline - time.monotonic()) / 60
        if not args.quick and left_min < ESTIMATE_MIN[name]:
            results[name] = {"status": "skipped", "message": f"time budget: {left_min:.1f} min left, needs ~"
                             f"{ESTIMATE_MIN[name]} min (raise --budget-min)"}  # fmt: skip
            print(f"bench: {name}: skipped (time budget)", flush=True)
            continue
        print(f"bench: {name} ...", flush=True)
        started = time.monotonic()
        try:
            results[name] = benches[name]()
        except Skip as e:
            results[name] = {"status": "skipped", "message": str(e)}
        except Exception as e:  # one broken benchmark must not lose the others' results
            results[name] = {"status": "failed", "message": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        if isinstance(results[name], dict):
            results[name].setdefault("status", "ok")
            results[name]["bench_s"] = round(time.monotonic() - started, 1)
        print(f"bench: {name}: {_status(results[name])} in {time.monotonic() - started:.0f} s", flush=True)
    report["gpu"] = gpu_result()
    report["load_end"] = load_average()
    report["wall_s"] = time.monotonic() - t0

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    path = out_dir / f"{time.strftime('%Y-%m-%d')}-{socket.gethostname()}{suffix}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    _publish(report, path, readme=not args.no_readme)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "failed"]
    if failed:
        print(f"bench: failed: {', '.join(failed)} (see the JSON for tracebacks)", file=sys.stderr)
    return 1 if failed else 0


def _publish(report: dict[str, Any], path: Path | None, *, readme: bool) -> int:
    """Print the Markdown block and copy it into README.md."""
    block = render(report)
    print("\n" + block)
    if path:
        print(f"bench: results in {path}")
    if readme:
        update_readme(block)
        print("bench: README.md Benchmarks block updated")
    return 0


def _status(r: Any) -> str:
    if isinstance(r, dict) and r.get("status") in ("skipped", "failed"):
        return f"{r['status']} ({r.get('message', '').splitlines()[0][:200]})"
    return "ok"


if __name__ == "__main__":
    sys.exit(main())
