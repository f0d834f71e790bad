"""``raytrn sweep`` on the session's local Ray: a 3-trial ASHA sweep of the tiny job whose driver is killed after the
first trial and resumed (the finished trial is not run again; ASHA, holding its reports, stops the later ones),
MLflow's parent and child runs, best.yaml, ``runs compare --sweep``; bad input refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURE_CORPUS, REPO, mlflow_store, run_cli

pytestmark = pytest.mark.integration

TINY = str(REPO / "jobs" / "tiny.yaml")
LRS = ("3e-3", "1e-4", "1e-5")  # the best first: with one trial at a time, ASHA stops the later ones
STEPS = 30


@pytest.fixture(scope="module")
def val_dataset(ray_session, tmp_path_factory) -> Path:
    """The fixture corpus packed for the tiny model with a validation split."""
    from raytrn.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("sweep-data") / "tiny-val"
    prepare_dataset(inputs=[str(FIXTURE_CORPUS)], output=str(out), seq_len=32, vocab_size=512, validation_fraction=0.2,
                    progress=False)  # fmt: skip
    return out


def _sets(data: Path, tmp: Path, *, store: bool = True) -> list[str]:
    """The tiny job's overrides for a sweep in ``tmp``; ``store``: its MLflow store made up front (a refused sweep's
    test checks that nothing was written)."""
    if store:
        mlflow_store(tmp / "mlflow.db")
    sets = [
        f"data.manifest={data}", "data.seq_len=32", "data.micro_batch_size=8", "model.vocab_size=512",
        "scaling.min_workers=1", "scaling.max_workers=1", f"checkpoint.storage={tmp / 'ckpt'}",
        "checkpoint.every_n_steps=10", f"tracking.mlflow_uri=sqlite:///{tmp / 'mlflow.db'}",
        "tracking.experiment=sweep-test", "tracking.log_model=false", "tracking.system_metrics=false",
        f"run.max_steps={STEPS}", "run.log_every=5", "run.eval_every=5", "run.eval_batches=1",
    ]  # fmt: skip
    return [a for s in sets for a in ("--set", s)]


def _env() -> dict[str, str]:
    import ray

    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}  # the session's Ray: the driver starts none


def _state(root: Path) -> dict:
    try:
        return json.loads((root / "sweep.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_asha_sweep_survives_its_driver_and_records_every_trial(ray_session, val_dataset, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from raytrn.config import load_job

    name = "lr-sweep"
    root = tmp_path / "ckpt" / "sweeps" / name
    args = [
        sys.executable, "-m", "raytrn.cli", "sweep", TINY, *_sets(val_dataset, tmp_path), "--grid",
        f"optim.lr={','.join(LRS)}", "--scheduler", "asha", "--grace-steps", "10", "--max-concurrent", "1",
        "--name", name,
    ]  # fmt: skip
    log = open(tmp_path / "driver.log", "w")  # noqa: SIM115 (closed below)
    driver = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **_env()}, cwd=REPO)
    try:
        # The driver dies once the first trial finished and the second started.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None:
            trials = _state(root).get("trials") or [{}, {}]
            if trials[0].get("status") == "finished" and trials[1].get("status") == "running":
                break
            time.sleep(0.3)
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()
        first = _state(root)["trials"][0]
        driver.kill()
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=30)
        log.close()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    t00_history = [m.step for m in client.get_metric_history(first["run_id"], "loss")]
    assert t00_history == list(range(5, STEPS + 1, 5))

    # Resumed from its directory (its checkpoint.storage is not ./checkpoints): the trials that did not end.
    out = run_cli("sweep", "--resume", str(root), cwd=REPO, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 trial(s) ended, 2 to run" in out.stdout
    assert "ASHA holds the reports of 1 trial(s)" in out.stdout
    assert f"{name}: t00" not in out.stdout.split("resuming", 1)[1].split("sweep lr-sweep: t01")[0]
    assert "t00 [optim.lr=0.003] started" not in out.stdout  # the finished trial was not run again
    assert [m.step for m in client.get_metric_history(first["run_id"], "loss")] == t00_history

    state = _state(root)
    statuses = {t["run_name"]: t["status"] for t in state["trials"]}
    assert statuses[f"{name}-t00"] == "finished"
    stopped = [t for t in state["trials"] if t["status"] == "stopped"]
    assert stopped, statuses  # with the best trial first, ASHA stops the worse later ones at step 10
    assert all(t["reason"].startswith("ASHA at step 10: val_loss") for t in stopped)
    assert set(statuses.values()) <= {"finished", "stopped"}

    # MLflow: one parent (the space and the scheduler) and 3 children with their values, the stopped ones KILLED.
    exp = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("raytrn.kind") == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.info.run_name == name
    assert parent.data.params["space.optim.lr"] == "grid[0.003, 0.0001, 1e-05]"
    assert parent.data.params["sweep.metric"] == "val_loss" and parent.data.params["sweep.scheduler"] == "asha"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and len(runs) == 4
    by_name = {c.info.run_name: c for c in children}
    for t in state["trials"]:
        child = by_name[t["run_name"]]
        assert float(child.data.params["optim.lr"]) == t["values"]["optim.lr"]
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "loss")]
        if t["status"] == "stopped":
            assert child.info.status == "KILLED"
            assert child.data.tags["raytrn.stopped_early"] == t["reason"]
            assert max(steps) < STEPS and len(steps) == len(set(steps))
        else:
            assert child.info.status == "FINISHED" and steps == list(range(5, STEPS + 1, 5))
    best = min((t for t in state["trials"] if t["status"] == "finished"), key=lambda t: t["last"]["val_loss"])
    assert parent.data.tags["best_run_id"] == best["run_id"]
    assert parent.data.metrics["best_val_loss"] == pytest.approx(best["last"]["val_loss"])

    # best.yaml: the job file with the best trial's values, valid, a new run when trained.
    best_yaml = root / "best.yaml"
    job = load_job(best_yaml, resolve=False)
    assert job.optim.lr == float(by_name[best["run_name"]].data.params["optim.lr"])
    assert job.tracking.run_name is None and job.tracking.run_id is None and job.run.max_steps == STEPS
    assert "The best trial of sweep lr-sweep" in best_yaml.read_text()

    # runs compare --sweep: ranked by val_loss, the varied field as a column, and the plot.
    png = tmp_path / "sweep.png"
    out = run_cli("runs", "compare", "--sweep", name, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                  "--plot", str(png), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"sweep {name}: 3 trial(s) ranked by val_loss (min; best first)"
    assert lines[1].split()[:6] == ["rank", "trial", "id", "status", "steps", "lr"]
    assert lines[2].split()[1] == best["run_name"].rsplit("-", 1)[1]
    assert sum("stopped early" in ln for ln in lines) == len(stopped)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_sweeps_are_refused_before_anything_starts(ray_session, val_dataset, tmp_path) -> None:
    sets = _sets(val_dataset, tmp_path, store=False)
    # A grid point that is not a valid job (12 is not a multiple of the micro-batch of 8): no trial starts.
    out = run_cli("sweep", TINY, *sets, "--set", "data.grad_accum=null", "--grid", "data.global_batch_size=16,12",
                  cwd=REPO, env=_env(), timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "1 of 2 trials are invalid; no trial was started" in out.stderr
    assert "trial t01 (data.global_batch_size=12)" in out.stderr and "Traceback" not in out.stderr
    # More trials at once than the cluster can ever hold (3 CPUs, a trial takes 1).
    out = run_cli("sweep", TINY, *sets, "--grid", "optim.lr=1e-3,3e-3", "--max-concurrent", "4", cwd=REPO, env=_env(),
                  timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--max-concurrent 4: the cluster holds at most 3 trial(s) at once" in out.stderr
    # An unknown field, a metric never logged, an empty grid: exit 2 with the fix.
    for extra, message in [
        (["--grid", "optim.lrr=1e-3"], "--grid optim.lrr: unknown field. Did you mean 'optim.lr'?"),
        (["--grid", "optim.lr=1e-3", "--metric", "accuracy"], "--metric 'accuracy': the trials never log it"),
        (["--grid", "optim.lr="], "no values"),
        (["--grid", "optim.lr=1e-3,fast"], "--grid optim.lr: Input should be a valid number"),
    ]:
        out = run_cli("sweep", TINY, *sets, *extra, cwd=REPO, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "mlflow.db").exists()  # nothing written


def test_a_failed_trial_does_not_fail_the_sweep(ray_session, val_dataset, tmp_path) -> None:
    """A trial whose job fails (its checkpoint storage cannot be created) is recorded FAILED with the error; the other
    trial runs to the end and the sweep succeeds with it as the best."""
    from mlflow.tracking import MlflowClient

    name = "one-fails"
    sets = [*_sets(val_dataset, tmp_path), "--set", "run.max_steps=4", "--set", "run.eval_every=2"]
    bad = "/dev/null/ckpt"  # under a file: no directory can be made there
    out = run_cli("sweep", TINY, *sets, "--grid", f"checkpoint.storage={tmp_path / 'ckpt'},{bad}", "--name", name,
                  "--max-concurrent", "1", cwd=REPO, env=_env(), timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    state = _state(tmp_path / "ckpt" / "sweeps" / name)
    ok, failed = state["trials"]
    assert ok["status"] == "finished" and failed["status"] == "failed", state
    assert bad in failed["reason"] and "Traceback" not in failed["reason"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(failed["run_id"]).info.status == "FAILED"
    assert bad in client.get_run(failed["run_id"]).data.tags["raytrn.error"]
    assert client.get_run(ok["run_id"]).info.status == "FINISHED"
    table = out.stdout.split(f"sweep {name}: 2 trial(s) ranked by val_loss", 1)[1].splitlines()
    assert table[2].split()[:2] == ["1", "t00"] and table[3].split()[:4] == ["2", "t01", failed["run_id"][:8], "FAILED"]
    assert "failed:" in table[3], out.stdout
    # Neither Tune's boxes nor its traceback of the failed trial (lines that Ray forwards from its worker processes,
    # "(Name pid=N)", are theirs: a TrackingActor stopped at teardown may print one).
    ours = [ln for ln in (out.stdout + out.stderr).splitlines() if "pid=" not in ln and "(raylet)" not in ln]
    assert not [ln for ln in ours if "Traceback" in ln or "Configuration for experiment" in ln], out.stdout + out.stderr


def test_ctrl_c_stops_the_sweep_for_a_resume(ray_session, val_dataset, tmp_path) -> None:
    """Ctrl-C (which Ray Tune catches) ends the sweep as interrupted: exit 130 with the resume command, the cut-off
    trial pending again in sweep.json and its run KILLED, as is the sweep's."""
    import signal

    from mlflow.tracking import MlflowClient

    name = "interrupted"
    root = tmp_path / "ckpt" / "sweeps" / name
    args = [sys.executable, "-m", "raytrn.cli", "sweep", TINY, *_sets(val_dataset, tmp_path), "--set",
            "run.max_steps=2000", "--grid", "optim.lr=1e-3,3e-3", "--max-concurrent", "1", "--name", name]  # fmt: skip
    driver = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ,
                              **_env()}, cwd=REPO)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:
            trials = _state(root).get("trials") or [{}]
            if trials[0].get("history"):  # t00 reported its first val_loss
                break
            time.sleep(0.3)
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
    assert driver.returncode == 130, out + err
    assert f"raytrn: sweep {name} stopped; continue it with: raytrn sweep --resume {root}" in err
    state = _state(root)
    assert [t["status"] for t in state["trials"]] == ["pending", "pending"], state["trials"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(state["trials"][0]["run_id"]).info.status == "KILLED"
    assert client.get_run(state["parent_run_id"]).info.status == "KILLED"
