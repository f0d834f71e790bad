"""Elastic recovery on a local 3-node Ray: the tiny job, elastic 1..3 workers (one per node), checkpoint every 5
steps and no in-memory snapshots (the durable tier alone: bench/memory_tier.py measures the memory tier),
``scaling.resize_interval_s: 15``, losing nodes (3 times), getting them back (3 times), a SIGKILLed worker
and a spot interruption notice (``ray drain-node``, 15 s deadline), all in one run (``tests/chaos/elastic_cluster.py``
drives it in a subprocess: the cluster lives and dies with it).

Per event: the seconds from the event to the next step logged by the restarted group (recovery; for the notice,
from its deadline, when Ray Train restarts the group), the steps trained again (the last step the old group
started minus the one the new group resumed at), and after a node returns, the seconds until a 3-worker group
ran (scale-up). An event that could not be measured (the run ended before it, or before its restart or scale-up)
fails the benchmark, naming it: a row of the table is a measurement, never ``n/a``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO

#: Node loss and return three times, then a killed worker, then a preemption notice. The run goes on training
#: while a node comes back (15-30 s here): the events took 107-165 of 170 steps in three runs here, the last one
#: leaving the notice no restart to time; the steps leave room for the slowest of them.
EVENTS = "remove@10,add@+3,remove@+6,add@+3,remove@+6,add@+3,kill@+6,drain@+6"
STEPS = 240
QUICK_EVENTS = "remove@8,add@+3,kill@+5,drain@+5"
QUICK_STEPS = 110
#: What each kind of event measures (the row it feeds).
MEASURE = {"remove": "recovery_s", "kill": "recovery_s", "drain": "recovery_s", "add": "scale_up_s"}


def unmeasured(events: str, recorded: list[dict[str, Any]]) -> list[str]:
    """The scheduled events (``EVENT@STEP,…``) that ``recorded`` (the driver's events, in order) has no
    measurement for."""
    missing = []
    for i, spec in enumerate(filter(None, events.split(","))):
        kind = spec.split("@")[0]
        key = MEASURE.get(kind)
        if i >= len(recorded):
            missing.append(f"{spec} (the run ended before it)")
        elif key is not None and recorded[i].get(key) is None:
            missing.append(f"{spec} at step {recorded[i].get('at_step')} (no {key}: the run ended first)")
    return missing


def _median(xs: list[float | None]) -> float | None:
    values = [x for x in xs if x is not None]
    return statistics.median(values) if values else None


def drive(events: str, steps: int, *, sets: tuple[str, ...] = (), timeout_s: float = 900) -> dict[str, Any]:
    """One run of ``tests/chaos/elastic_cluster.py`` (a local 3-node Ray in a subprocess) with ``events``: its
    result (events, restores, steps logged)."""
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-elastic-") as tmp:
        data = Path(tmp) / "data"
        subprocess.run(
            [sys.executable, "-m", "raytrn.cli", "data", "prepare", "--input", str(REPO / "tests" / "fixtures" / "corpus"),
             "--output", str(data), "--seq-len", "32", "--vocab-size", "512"],
            cwd=REPO, check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        out = Path(tmp) / "result.json"
        proc = subprocess.run(
            [sys.executable, "-m", "tests.chaos.elastic_cluster", "--out", str(out), "--dataset", str(data),
             "--events", events, "--steps", str(steps), *(a for kv in sets for a in ("--set", kv))],
            cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if not out.exists():
            raise RuntimeError(f"the elastic cluster driver wrote no result:\n{proc.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    if not result.get("finished"):
        raise RuntimeError(f"the elastic run did not finish: {result.get('error')}")
    return result


def run(*, quick: bool = False, timeout_s: float = 900) -> dict[str, Any]:
    events, steps = (QUICK_EVENTS, QUICK_STEPS) if quick else (EVENTS, STEPS)
    # The durable tier alone (the memory tier's default is on, on 3 nodes: bench/memory_tier.py measures it).
    result = drive(events, steps, timeout_s=timeout_s, sets=("checkpoint.memory_every_n_steps=0",))
    missing = unmeasured(events, result["events"])
    if missing:
        raise RuntimeError(
            f"the elastic run of {steps} steps ended before it could measure: {'; '.join(missing)}. "
            "Give it more steps (bench/elastic.py: STEPS, QUICK_STEPS)"
        )

    def of(kind: str, key: str) -> list[Any]:
        return [e.get(key) for e in result["events"] if e["kind"] == kind]

    return {
        "events": result["events"],
        "steps": steps,
        "checkpoint_every_n_steps": 5,
        "resize_interval_s": 15,
        "node_loss_recovery_s": of("remove", "recovery_s"),
        "node_loss_recovery_s_median": _median(of("remove", "recovery_s")),
        "node_loss_steps_lost": of("remove", "steps_lost"),
        "node_loss_restarted_dp": of("remove", "restarted_dp"),
        "kill_recovery_s": _median(of("kill", "recovery_s")),
        "kill_steps_lost": of("kill", "steps_lost"),
        "notice_recovery_s": _median(of("drain", "recovery_s")),
        "notice_steps_lost": of("drain", "steps_lost"),
        "scale_up_s": of("add", "scale_up_s"),
        "scale_up_s_median": _median(of("add", "scale_up_s")),
        "steps_logged_once": result["steps_logged"] == result["distinct_steps"] == result["max_step"] == steps,
    }
