"""Elastic recovery on a local 3-node Ray: the tiny job, elastic 1..3 workers (one per node), checkpoint every 5
steps and no in-memory snapshots (the durable tier alone: bench/memory_tier.py measures the memory tier),
``scaling.resize_interval_s`` (the harness's), losing nodes (3 times), getting them back (3 times), a SIGKILLed worker
and a spot interruption notice (``ray drain-node``, the harness's deadline), all in one run
(``tests/chaos/elastic_cluster.py`` drives it in a subprocess: the cluster lives and dies with it).

Per event: the seconds from the event to the next step logged by the restarted group (recovery; for the notice, from
the notice: the group restarts once its checkpoint is committed, not at the deadline), the steps trained again (the last step the old group
started minus the one the new group resumed at), and after a node returns, the seconds until a 3-worker group
ran (scale-up). An event that could not be measured (the run ended before it, or before its restart or scale-up)
fails the benchmark, naming it: a row of the table is a measurement, never ``n/a``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO

#: Node loss and return three times, then a killed worker, then a preemption notice, each at an observed step after
#: the previous one's effect was measured. STEPS is the job's run.max_steps (the schedule's horizon): the harness stops
#: the run a few steps after its last event (raytrn stop), however many steps the group trained while nodes came back.
EVENTS = "remove@10,add@+3,remove@+6,add@+3,remove@+6,add@+3,kill@+6,drain@+6"
STEPS = 2000
QUICK_EVENTS = "remove@8,add@+3,kill@+5,drain@+5"
QUICK_STEPS = 1000
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


def prepare_fixture_data(directory: Path) -> Path:
    """The test corpus packed for the tiny job (seq_len 32, vocabulary 512) in ``directory``/data: what every local
    cluster run here trains on."""
    data = directory / "data"
    subprocess.run(
        [sys.executable, "-m", "raytrn.cli", "data", "prepare", "--input", str(REPO / "tests" / "fixtures" / "corpus"),
         "--output", str(data), "--seq-len", "32", "--vocab-size", "512"],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return data


def drive(events: str, steps: int, *, sets: tuple[str, ...] = (), timeout_s: float = 900) -> dict[str, Any]:
    """One run of ``tests/chaos/elastic_cluster.py`` (a local 3-node Ray in a subprocess) with ``events``: its
    result (events, restores, steps logged)."""
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-elastic-") as tmp:
        data = prepare_fixture_data(Path(tmp))
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
            f"the elastic run (run.max_steps {steps}) ended before it could measure: {'; '.join(missing)}. "
            "Give it a longer horizon (bench/elastic.py: STEPS, QUICK_STEPS)"
        )

    def of(kind: str, key: str) -> list[Any]:
        return [e.get(key) for e in result["events"] if e["kind"] == kind]

    return {
        "events": result["events"],
        "steps": steps,
        "checkpoint_every_n_steps": 5,
        "resize_interval_s": result.get("resize_interval_s"),
        "node_loss_recovery_s": of("remove", "recovery_s"),
        "node_loss_recovery_s_median": _median(of("remove", "recovery_s")),
        "node_loss_steps_lost": of("remove", "steps_lost"),
        "node_loss_restarted_dp": of("remove", "restarted_dp"),
        "kill_recovery_s": _median(of("kill", "recovery_s")),
        "kill_steps_lost": of("kill", "steps_lost"),
        "notice_recovery_s": _median(of("drain", "recovery_s")),
        "notice_steps_lost": of("drain", "steps_lost"),
        # since 2026-12-04 from the notice itself (the restart comes once its checkpoint is committed), with the
        # harness's deadline; before, from the deadline (10 s), when Ray Train restarted the group
        "notice_measured_from": "notice",
        "notice_deadline_s": result.get("drain_deadline_s"),
        "scale_up_s": of("add", "scale_up_s"),
        "scale_up_s_median": _median(of("add", "scale_up_s")),
        "steps_logged_once": result["steps_logged"] == result["distinct_steps"] == result["max_step"],
    }


def run_live(
    *, rounds: int = 3, timeout_s: float = 600, ray_metrics: bool = False, paced: bool = False
) -> dict[str, Any]:
    """``scaling.recovery: live`` on the same local 3-node Ray (``tests/chaos/live_cluster.py``: 3 one-slot nodes,
    hsdp replicas of one worker, a node removed at step 5, a node added back): per round the seconds from the loss
    to the first step at 2 replicas, from the new node to the first step at 3 (from the call that adds it, and from
    the moment Ray has it alive: what the replacement itself takes), and whether any survivor restarted (pids
    compared). Beside the restart path's rows of :func:`run`, in the same bench run.

    ``ray_metrics`` False (the default): the simulated cluster runs with Ray's metrics pipeline off. While the lost
    node's slot has no place, Ray 2.60's GCS retries it with no backoff and the head's dashboard agent replays each
    retry's histogram observations in Python (docs/elasticity.md): on a real cluster that load is the head node's,
    here it takes the simulated worker nodes' two cores, and the returning node's imports wait behind it.

    ``paced``: the survivors' feeds hand out a micro-batch at most once per the live test's pace (``RAYTRN_PACE_S``,
    the harness's ``PACE_S``, recorded as ``pace_s``), so that their training leaves CPU for the returning node's
    start, as a real node's own CPUs would; unpaced (the default) trains flat out, the returning node's start sharing
    the 2 cores with it. ``rounds``: 3, so that the medians are not a mean of two."""
    lost, back, alive, restarted, pace = [], [], [], [], 0.0
    env = {**os.environ, **({} if ray_metrics else {"RAY_enable_metrics_collection": "0"})}
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-live-") as tmp:
        data = prepare_fixture_data(Path(tmp))  # once: every round reads the same dataset
        for i in range(rounds):
            out = Path(tmp) / f"result-{i}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "tests.chaos.live_cluster", "--out", str(out), "--dataset", str(data),
                 "--no-reference", "--loss-only", *(["--paced"] if paced else [])],
                cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env,
            )  # fmt: skip
            result = json.loads(out.read_text()) if out.exists() else {}
            if result.get("error") or "back_to_full_size_s" not in result:
                raise RuntimeError(
                    f"the live recovery run did not finish: {result.get('error')}\n{proc.stderr[-2000:]}"
                )
            pace = result["pace_s"]
            lost.append(result["lost_to_next_step_s"])
            back.append(result["back_to_full_size_s"])
            alive.append(result["alive_to_full_size_s"])
            survivors = set(result["pids_before"]) - set(result["victim_pids"])
            restarted.append(len(survivors - set(result["pids_after"])))
    return {
        "node_loss_to_next_step_s": lost,
        "node_loss_to_next_step_s_median": _median(lost),
        "back_to_full_size_s": back,
        "back_to_full_size_s_median": _median(back),
        # the same, from the moment Ray had the new node alive (its own processes started): the replacement's part
        "alive_to_full_size_s": alive,
        "alive_to_full_size_s_median": _median(alive),
        "survivors_restarted": restarted,
        "ray_metrics": ray_metrics,
        "pace_s": pace,
    }


# ---------------------------------------------------------------------------------------------------
# The baseline: stock Ray Train V2's elastic restart after the same node loss


def _stock_elastic_loop(config: dict[str, Any]) -> None:
    """Bench (b)'s model and step on rows of the job's dataset read with pyarrow (no Ray Data: the baseline is Ray
    Train's restart, not its data path), a Ray Train checkpoint every 5 steps, each step's end time to a file."""
    import os
    import tempfile
    import time

    import ray.train
    import ray.train.torch
    import torch

    from bench.training import _model_and_optimizer, _rows, _step

    job, steps_file = config["job"], config["steps"]
    model, opt, sched = _model_and_optimizer(job)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = ray.train.torch.prepare_model(model)
    rows = _rows(config["manifest"])
    ctx = ray.train.get_context()
    for step in range(start + 1, config["steps_total"] + 1):
        i = (step * 8 * ctx.get_world_size() + 8 * ctx.get_world_rank()) % max(1, len(rows) - 8)
        _step(model, opt, sched, rows[i : i + 8], None)
        if ctx.get_world_rank() == 0:
            with open(steps_file, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "world": ctx.get_world_size()}) + "\n")
        if step % 5 == 0:
            with tempfile.TemporaryDirectory() as d:
                if ctx.get_world_rank() == 0:
                    inner: Any = model.module if hasattr(model, "module") else model
                    torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))  # fmt: skip
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))


def stock_main(argv: list[str]) -> None:
    """A local 3-node Ray; stock ``TorchTrainer``, elastic 1..3 workers (one per node, Ray's defaults otherwise);
    after step ``--remove-at`` a node holding a worker is removed; writes the seconds to the next step."""
    import argparse
    import logging
    import os
    import threading
    import time

    import ray
    from ray.cluster_utils import Cluster
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.common import TINY_JOB
    from raytrn.config import load_job

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--remove-at", type=int, default=10)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args(argv)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    job = load_job(TINY_JOB, [f"data.manifest={args.manifest}", "data.seq_len=32", "model.vocab_size=512"])
    work = Path(args.out).parent
    steps_file = work / "stock-steps.jsonl"
    # the head's dashboard agent on a port the OS picks, as its worker nodes' (Cluster's default for them)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "dashboard_agent_listen_port": 0})
    nodes = [cluster.add_node(num_cpus=1, resources={"neuron_cores": 1}) for _ in range(3)]
    result: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, logging_level=logging.ERROR)
        cluster.wait_for_nodes(timeout=60)
        trainer = TorchTrainer(
            _stock_elastic_loop,
            train_loop_config={
                "job": job,
                "steps": str(steps_file),
                "steps_total": args.steps,
                "manifest": args.manifest,
            },  # fmt: skip
            # elastic 1..3 (V2's ScalingConfig; mypy sees V1's, which ray.train names statically)
            scaling_config=ScalingConfig(num_workers=(1, 3), resources_per_worker={"neuron_cores": 1}),  # type: ignore[arg-type]
            run_config=RunConfig(
                name="bench-stock-elastic",
                storage_path=str(work / "ckpt"),
                failure_config=FailureConfig(max_failures=3),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),  # fmt: skip
        )
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: outcome.update(result=trainer.fit()), daemon=True)
        thread.start()

        def steps() -> list[dict[str, Any]]:
            if not steps_file.exists():
                return []
            return [json.loads(x) for x in steps_file.read_text().splitlines() if x.endswith("}")]

        deadline = time.monotonic() + 600
        while (
            thread.is_alive()
            and time.monotonic() < deadline
            and not [s for s in steps() if s["step"] >= args.remove_at]
        ):
            time.sleep(0.1)
        before = steps()
        world = before[-1]["world"] if before else 3  # the group's size before the loss
        removed_at = time.time()
        cluster.remove_node(nodes[-1], allow_graceful=False)

        def restarted() -> list[dict[str, Any]]:  # the restarted group's steps (without the lost node: fewer
            return [s for s in steps() if s["time"] > removed_at and s["world"] != world]  # workers)

        # (a step the old group had in flight may still be logged after the removal: 0.7 s in the bench of
        # 2026-12-04 20:32, which counted it as the restart's)
        while thread.is_alive() and time.monotonic() < deadline and not restarted():
            time.sleep(0.1)
        after = restarted()
        result = {
            "node_loss_to_next_step_s": (after[0]["time"] - removed_at) if after else None,
            "restarted_world": after[0]["world"] if after else None,
        }
    finally:
        Path(args.out).write_text(json.dumps(result))
        ray.shutdown()
        cluster.shutdown()


def run_stock(*, timeout_s: float = 600) -> dict[str, Any]:
    """Stock Ray Train V2 on the same local 3-node cluster and node loss: the seconds to its next step."""
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-stock-elastic-") as tmp:
        data = prepare_fixture_data(Path(tmp))
        out = Path(tmp) / "stock.json"
        proc = subprocess.run(
            [sys.executable, "-m", "bench.elastic", "stock", "--out", str(out), "--manifest", str(data)],
            cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if not out.exists():
            raise RuntimeError(f"the stock elastic run wrote no result:\n{proc.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    if result.get("node_loss_to_next_step_s") is None:
        raise RuntimeError(f"stock Ray Train trained no step after the node loss:\n{proc.stderr[-2000:]}")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["stock"]:
        stock_main(sys.argv[2:])
