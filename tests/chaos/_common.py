"""What the chaos tests share: the tiny job they train, training in a thread, bounded waits."""

from __future__ import annotations

import sys
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


def summary_of(thread: threading.Thread, result: dict[str, Any]) -> Any:
    """The summary of :func:`train_in_thread`'s run, once its thread was joined: the error it raised, if any."""
    assert not thread.is_alive(), "training did not finish"
    if "error" in result:
        raise result["error"]
    return result["summary"]


def wait_until(predicate: Any, timeout_s: float, what: str, *, poll_s: float = 0.2) -> None:
    """Poll ``predicate`` until it holds (then say on stderr how long it took: a slow test's log shows where its
    time went) or ``timeout_s`` passed (a ``TimeoutError`` naming ``what``)."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            print(f"chaos harness: {what}: after {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not seen after {timeout_s} s")


def read_trace(directory: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """``{step: [(row, first tokens), ...]}`` of a run's sample trace (``RAYTRN_SAMPLE_TRACE``, written by every
    worker per micro-batch): per step, the latest worker group that trained it (a failed group's steps are
    trained again by the next), its data-parallel ranks' rows in rank order.

    A group's files share their first step and data-parallel size (``group-<step>-dp<n>-<ns>-rank<r>``); groups
    run one after another, so when two groups share both, the later one's file of each rank is the newer."""
    import json

    groups: dict[tuple[str, str], dict[int, Path]] = {}
    for path in directory.glob("group-*.jsonl"):
        _, first, dp, ns, rank = path.stem.split("-")
        ranks = groups.setdefault((first, dp), {})
        if int(rank[4:]) not in ranks or ns > ranks[int(rank[4:])].stem.split("-")[3]:
            ranks[int(rank[4:])] = path
    by_step: dict[int, tuple[int, dict[int, list[tuple[int, list[int]]]]]] = {}
    for ranks in groups.values():
        started = min(int(p.stem.split("-")[3]) for p in ranks.values())
        rows: dict[int, dict[int, list[tuple[int, list[int]]]]] = {}
        for path in ranks.values():
            for line in path.read_text().splitlines():
                if not line.endswith("}"):
                    continue  # a line the kill cut short
                record = json.loads(line)
                if "rows" not in record:
                    continue  # the group's resume record
                per_rank = rows.setdefault(record["step"], {}).setdefault(record["dp_rank"], [])
                per_rank.extend(zip(record["rows"], record["heads"], strict=True))
        for step, per_rank in rows.items():
            if step not in by_step or by_step[step][0] < started:
                by_step[step] = (started, per_rank)
    return {step: sum((r[k] for k in sorted(r)), []) for step, (_, r) in sorted(by_step.items())}


def read_resumes(directory: Path) -> list[dict[str, Any]]:
    """The ``{"resumed_from", "step"}`` records the worker groups of a run wrote (rank 0's files), in the order the
    groups started (a file is ``group-<first step>-dp<size>-<start ns>-rank0.jsonl``: a group that stepped back
    to an older checkpoint comes after the groups before it)."""
    import json

    out = []
    for path in sorted(directory.glob("group-*-rank0.jsonl"), key=lambda p: int(p.stem.split("-")[3])):
        first = path.read_text().split("\n", 1)[0]
        if first.endswith("}") and "resumed_from" in (record := json.loads(first)):
            out.append(record)
    return out
