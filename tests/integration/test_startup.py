"""Start-up on a Ray that is already running (the session's: what ``ray job submit`` to a cluster, a restart or a
sweep's trial meets): ``raytrn train`` reaches its first step sooner than stock Ray Train reaches an empty train
function, and starts no process that docs/performance.md does not list.

A ratio in one test, not a time bound: both run on the same Ray, one after the other (the machine's speed and load
cancel). The processes are every process born while ``raytrn train`` ran (``bench.startup.ProcessSampler``), by their
Ray title (``ray::TrackingActor``); docs/performance.md's table "The processes of a run" is the list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench.common import RESULT_PREFIX
from bench.startup import ProcessSampler
from tests.conftest import REPO, mlflow_store

pytestmark = pytest.mark.integration


def _documented() -> set[str]:
    """The process names docs/performance.md lists in its table of a run's processes (first column, in backticks)."""
    text = (REPO / "docs" / "performance.md").read_text().split("### The processes of a run", 1)[1]
    rows = [line for line in text.split("\n#", 1)[0].splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


@pytest.mark.alone  # two timings one after the other: nothing else runs meanwhile (tests/lanes.py)
def test_on_a_running_ray_raytrn_reaches_its_first_step_before_stock_ray_train_reaches_an_empty_function(
    ray_session, tiny_dataset, tmp_path
):
    import ray
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    with ProcessSampler(root=os.getpid()) as stock_processes:
        stock = subprocess.run(
            [sys.executable, "-m", "bench.startup", "floor"], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    lines = [line for line in stock.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, stock.stderr[-3000:]
    floor = json.loads(lines[-1][len(RESULT_PREFIX) :])["train_fn_start_s"]

    uri = mlflow_store(tmp_path / "mlflow.db")
    sets = [
        f"data.manifest={tiny_dataset}", "data.seq_len=32", "model.vocab_size=512", "scaling.min_workers=1",
        "scaling.max_workers=1", f"checkpoint.storage={tmp_path / 'ckpt'}", f"tracking.mlflow_uri={uri}",
        "tracking.experiment=startup", "tracking.log_model=false", "run.max_steps=3", "run.log_every=1",
    ]  # fmt: skip
    with ProcessSampler(root=os.getpid()) as ours:
        proc = subprocess.run(
            [sys.executable, "-m", "raytrn.cli", "train", str(REPO / "jobs" / "tiny.yaml"), "--no-progress",
             *(a for kv in sets for a in ("--set", kv))],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("startup").experiment_id])
    [first] = client.get_metric_history(run.info.run_id, "time_to_first_step_s")
    assert first.value < floor, (first.value, floor)  # process start -> first step done, vs -> an empty function

    documented = _documented()
    # Ray's processes by their title (ray::TrackingActor), others by their program (git); Python itself (the driver, a
    # Ray worker before it takes its title) is no process raytrn adds; one never sampled with a command line (gone, or
    # a zombie, by its first sample: psutil reads none) has no name to check (stop 62's third rehearsal failed on one)
    started = {
        p["name"] if p["name"].startswith("ray::") else p["name"].split()[0]
        for p in ours.until(float("inf"))
        if p["name"].strip()
    }
    undocumented = {n for n in started if not n.startswith("python")} - documented
    assert not undocumented, (sorted(undocumented), sorted(documented))
    # Stock Ray Train starts processes raytrn does not (its controller's actor among them)
    assert "ray::TrainController" in {p["name"] for p in stock_processes.until(float("inf"))}
    assert "ray::TrainController" not in started
