"""Shared pieces of the benchmarks: the machine, the bench job, child processes, MLflow timestamps, moto.

Every measurement runs in a child process with the same environment (same torch thread count, no
RAY_ADDRESS), so a bare loop, stock Ray Train and ``raytrn train`` start from the same place. A child
prints one ``BENCH_RESULT {json}`` line; :func:`run_child` returns that dict.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY_JOB = REPO / "jobs" / "tiny.yaml"
DEMO_DATA = REPO / "data" / "stdlib"
RESULT_PREFIX = "BENCH_RESULT "


class Skip(Exception):
    """A benchmark cannot run here (a part is missing, or the time budget is spent): report why, go on."""


@dataclass(kw_only=True)
class BenchJob:
    """The one training setup every training benchmark shares: jobs/tiny.yaml on the demo data."""

    micro_batch_size: int = 8  # ~120 ms per step on one core for the tiny model: a meaningful step
    steps: int = 150
    warmup: int = 20  # steady state starts after this many steps (data pipeline up, caches warm)
    threads: int = 1  # torch intra-op threads per worker, equal in every variant
    manifest: str = str(DEMO_DATA)
    sets: tuple[str, ...] = ()  # more --set overrides (another dataset's seq_len / vocab_size)

    def overrides(self, *, workers: int = 1) -> list[str]:
        """``--set`` values for jobs/tiny.yaml (tracking and checkpointing stay at the job's defaults)."""
        return [
            f"data.manifest={self.manifest}",
            f"data.micro_batch_size={self.micro_batch_size}",
            f"run.max_steps={self.steps}",
            f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}",
            *self.sets,
        ]

    def tokens_per_step(self, seq_len: int, workers: int = 1) -> int:
        return self.micro_batch_size * seq_len * workers

    def as_args(self) -> list[str]:
        return [
            "--micro-batch-size",
            str(self.micro_batch_size),
            "--steps",
            str(self.steps),
            "--warmup",
            str(self.warmup),
            "--threads",
            str(self.threads),
            "--manifest",
            self.manifest,
            *[a for kv in self.sets for a in ("--set", kv)],
        ]


def add_job_args(parser: Any) -> None:
    """The child side of :meth:`BenchJob.as_args`."""
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--manifest", default=str(DEMO_DATA))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")


def job_from_args(args: Any) -> BenchJob:
    return BenchJob(
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        manifest=args.manifest,
        sets=tuple(args.sets),
    )


def load_bench_job(bench: BenchJob, *, workers: int = 1, extra: Sequence[str] = ()) -> Any:
    """The raytrn JobSpec of the bench job (the same file and overrides ``raytrn train`` gets)."""
    from raytrn.config import load_job

    return load_job(TINY_JOB, [*bench.overrides(workers=workers), *extra])


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every measured process: equal thread counts, a local Ray, no stray tracking URI
    (``extra``: more variables, for a variant that differs in them)."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    env.update(extra or {})
    return env


def emit(result: dict[str, Any]) -> None:
    """A child's answer to :func:`run_child`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(
    module: str,
    args: Sequence[str],
    *,
    threads: int,
    timeout_s: float,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run ``python -m bench.<module> ARGS`` (bounded in time) and return its BENCH_RESULT dict."""
    cmd = [sys.executable, "-m", f"bench.{module}", *args]
    start = time.time()
    try:
        proc = subprocess.run(
            cmd, cwd=cwd or REPO, env=child_env(threads, env), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench.{module} {' '.join(args[:1])} ran past {timeout_s:.0f} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["_started_at"] = start
            return result
    tail = (proc.stderr or proc.stdout)[-2000:]
    raise RuntimeError(f"bench.{module} exited {proc.returncode} without a result:\n{tail}")


def steady_rate(points: Sequence[tuple[int, float]], warmup: int, tokens_per_step: int) -> float | None:
    """Tokens/s between the first point at or after ``warmup`` and the last point.

    ``points`` are (step, time step ended in seconds); the span covers everything the run did in
    between (logging, checkpoints), which is what a user waits for.
    """
    kept = sorted(p for p in points if p[0] >= warmup)
    if len(kept) < 2 or kept[-1][1] <= kept[0][1]:
        return None
    (s0, t0), (s1, t1) = kept[0], kept[-1]
    return (s1 - s0) * tokens_per_step / (t1 - t0)


def timed_steps(
    t: Any, steps: int, *, vocab: int, rows: int = 8, seq_len: int = 128, seed: int = 0
) -> tuple[list[float], Any]:
    """raytrn's step (``train_step`` on a :class:`raytrn.train.step.Training`, CPU backend) over ``steps`` seeded
    random micro-batches of ``rows`` x (``seq_len`` + 1) tokens: each step's seconds, and the last step's result.
    (A data-parallel worker passes its rank as ``seed``: its own rows.)"""
    import torch

    from raytrn.backends.cpu import CpuBackend
    from raytrn.train.step import train_step

    gen = torch.Generator().manual_seed(seed)
    batches = iter([torch.randint(0, vocab, (rows, seq_len + 1), generator=gen) for _ in range(steps)])
    times, result = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        result = train_step(t, batches, CpuBackend())
        times.append(time.perf_counter() - t0)
    return times, result


def run_gloo(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` spawned processes joined in one gloo process group (127.0.0.1, a free
    port, 1 torch thread each; no Ray): each rank's return value (JSON-able), by rank. ``fn`` must be a module-level
    function (spawn pickles it by name)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="raytrn-bench-gloo-") as d:
        mp.start_processes(_gloo_rank, args=(world, free_port(), d, fn, args), nprocs=world, start_method="spawn")
        return [json.loads((Path(d) / f"{rank}.json").read_text()) for rank in range(world)]


def train_rank(rank: int, world: int, overrides: Sequence[str], steps: int) -> dict[str, Any]:
    """A rank of :func:`run_gloo`: jobs/tiny.yaml with ``overrides`` (not resolved: no data read), raytrn's build and
    :func:`timed_steps` on its own random rows (seeded by its rank; tokens below 4096): each step's seconds, and the
    bytes it holds (:func:`raytrn.train.memory_probe.held_state_bytes`)."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.train.build import build_training
    from raytrn.train.memory_probe import held_state_bytes

    job = load_job(TINY_JOB, list(overrides), resolve=False)
    t = build_training(job, CpuBackend(), world_size=world, rank=rank)
    rows, seq_len = job.data.micro_batch_size, job.data.seq_len
    times, _ = timed_steps(t, steps, vocab=4096, rows=rows, seq_len=seq_len, seed=rank)
    return {"held": held_state_bytes(t.model, t.optimizer), "step_s": times}


def _gloo_rank(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        (Path(out) / f"{rank}.json").write_text(json.dumps(result))
        # Every rank done before any tears down: a rank that exits while a peer's gloo pair still has work on the
        # wire can abort that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def spread(xs: Sequence[float]) -> float | None:
    """(max - min) / mean: how far apart the repeats were."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / m if m else None


def metric_points(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, wall time in s) of every value of ``key`` logged to an MLflow run."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.timestamp / 1000.0) for m in history)


def metric_values(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri).get_metric_history(run_id, key))


def parse_run_id(stdout: str) -> str | None:
    """The MLflow run id ``raytrn train`` prints in its summary."""
    m = re.search(r"^mlflow run\s+([0-9a-f]{32})", stdout, flags=re.M)
    return m.group(1) if m else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def moto_server(log_dir: str, timeout_s: float = 30) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the duration of the block (stopped by its PID)."""
    import urllib.request

    exe = Path(sys.executable).parent / "moto_server"
    if not exe.exists():
        raise Skip(f"moto_server not found next to {sys.executable} (pip install 'moto[server]')")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(os.path.join(log_dir, "moto.log"), "w") as log:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited with code {proc.returncode}")
                try:
                    urllib.request.urlopen(url, timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"moto_server not up after {timeout_s} s") from None
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def machine() -> dict[str, Any]:
    """Cores, RAM, CPU model, accelerator and software versions of this machine."""
    import psutil

    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model,
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "accelerator": _accelerator(),
        "python": platform.python_version(),
    }
    for name in ("torch", "ray", "mlflow", "pyarrow", "transformers"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:
            info[name] = None
    return info


def _accelerator() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    if Path("/dev/neuron0").exists():
        return "AWS Neuron device(s)"
    return "none (CPU only)"


def load_average() -> list[float]:
    """1/5/15-minute load averages: how busy the shared machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
