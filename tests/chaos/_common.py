"""What the chaos tests share: the tiny job they train, training in a thread, bounded waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from raytrn.config import JobSpec, load_job

REPO = Path(__file__).resolve().parents[2]


def tiny_chaos_job(
    tiny_dataset: Path, ckpt: Path, *, mlflow_uri: str, experiment: str, name: str, extra: tuple[str, ...] = ()
) -> JobSpec:
    """jobs/tiny.yaml on the test dataset, 1 worker, every step logged; ``extra`` overrides the rest."""
    return load_job(REPO / "jobs" / "tiny.yaml", tiny_chaos_overrides(
        tiny_dataset, ckpt, mlflow_uri=mlflow_uri, experiment=experiment, name=name, extra=extra
    ))  # fmt: skip


def tiny_chaos_overrides(
    tiny_dataset: Path, ckpt: Path, *, mlflow_uri: str, experiment: str, name: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """The ``--set`` values of :func:`tiny_chaos_job` (for a `raytrn train` command line)."""
    return [
        f"data.manifest={tiny_dataset}",
        "data.seq_len=32",
        "data.micro_batch_size=8",
        "model.vocab_size=512",
        "scaling.min_workers=1",
        "scaling.max_workers=1",
        f"checkpoint.storage={ckpt}",
        f"tracking.mlflow_uri={mlflow_uri}",
        f"tracking.experiment={experiment}",
        f"tracking.run_name={name}",
        "run.log_every=1",
        *extra,
    ]


def train_in_thread(job: JobSpec) -> tuple[threading.Thread, dict[str, Any]]:
    """``run_training(job)`` in a daemon thread (Ray's cluster calls stay in the main thread); the result
    dict gets ``summary`` or ``error``."""
    from raytrn.train.trainer import run_training

    result: dict[str, Any] = {}

    def train() -> None:
        try:
            result["summary"] = run_training(job, live_progress=False)
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread, result


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not seen after {timeout_s} s")
