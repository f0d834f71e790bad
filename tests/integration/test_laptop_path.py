"""The README's "Try it on a laptop", verbatim, on a fresh copy of the repository after `make demo`:

    raytrn cluster up --local
    raytrn submit jobs/tiny.yaml --address http://127.0.0.1:8265
    raytrn jobs logs JOB_ID --address http://127.0.0.1:8265
    raytrn cluster down --local

It must train and end FINISHED: the job's relative paths (data/stdlib, checkpoints) made absolute by
`raytrn submit` (the simulator shares this filesystem), its metrics in the MLflow server the simulator runs on
its head, its checkpoints on disk, the 2 CPU workers taking every CPU of the two simulated nodes without
starving Ray Data's readers, and Ray token auth on (no token: refused). The CLI runs with HOME in a temporary
directory, so the simulator's state, token and MLflow store are the test's own; the default ports (6379, 8265,
5000) must be free.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration

ADDRESS = "http://127.0.0.1:8265"
SUBMIT_TIMEOUT_S = 420  # scale-up of two fake nodes, 100 steps, scale-down not awaited (measured ~130 s here)


def _clone(dest: Path) -> Path:
    """The repository's tracked files (what a fresh clone has), copied to ``dest``."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dest


README_COMMANDS = [
    "raytrn cluster up --local",
    f"raytrn submit jobs/tiny.yaml --address {ADDRESS}",
    f"raytrn jobs logs JOB_ID --address {ADDRESS}",
    "raytrn cluster down --local",
]


def test_the_readme_shows_these_commands() -> None:
    """The commands run below are the README's "Try it on a laptop" block, word for word."""
    text = (REPO / "README.md").read_text()
    block = text.split("**Try it on a laptop**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.strip().splitlines() == README_COMMANDS


def _busy(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_readme_laptop_path_verbatim(ray_session, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from raytrn.cluster import local
    from raytrn.data.prepare import prepare_dataset

    busy = [p for p in (6379, 8265, 5000) if _busy(p)]
    assert not busy, f"the README's laptop path needs ports {busy} free (a local cluster still up?)"
    clone = _clone(tmp_path / "raytrn")
    # `make demo`'s dataset, from a few standard-library modules instead of all of them (same seq_len, vocab).
    stdlib = sysconfig.get_paths()["stdlib"]
    prepare_dataset(
        inputs=[f"{stdlib}/[a-c]*.py"], output=str(clone / "data" / "stdlib"), seq_len=128, vocab_size=4096,
        progress=False,
    )  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    # A user's shell: no Ray settings (the tests' RAY_AUTH_MODE=disabled must not help), this HOME.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))} | {"HOME": str(home)}

    state = home / ".raytrn" / "local-cluster.json"
    up = run_cli("cluster", "up", "--local", cwd=clone, env=env, timeout=180)
    cluster = local.running(ADDRESS, state)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert cluster is not None and cluster.auth == "token" and cluster.mlflow_url == "http://127.0.0.1:5000"
        token = Path(cluster.token_path or "")
        assert token.stat().st_mode & 0o777 == 0o600  # generated on first use, private

        proc = run_cli("submit", "jobs/tiny.yaml", "--address", ADDRESS, cwd=clone, env=env, timeout=SUBMIT_TIMEOUT_S)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert "== raytrn: training finished ==" in proc.stdout
        match = re.search(r"raytrn: submitted (\S+) to \S+ \(run (\S+)\)", proc.stdout)
        assert match, proc.stdout[:2000]
        job_id, run_name = match.groups()
        assert f"run         {run_name}\n" in proc.stdout  # the printed name is the name the driver used
        # No error of raytrn's (Ray Train's own detached placement-group cleaner sometimes logs one at teardown).
        ours = [line for line in out.splitlines() if "PlacementGroupCleaner" not in line]
        assert not [line for line in ours if "Traceback" in line or "readonly database" in line], out[-6000:]

        logs = run_cli("jobs", "logs", job_id, "--address", ADDRESS, cwd=clone, env=env, timeout=60)
        assert logs.returncode == 0 and "== raytrn: training finished ==" in logs.stdout, logs.stderr

        # The run is on the simulator's MLflow server, FINISHED, with every logged step once.
        client = MlflowClient(cluster.mlflow_url)
        experiment = client.get_experiment_by_name("raytrn-demo")
        [run] = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(10, 101, 10))
        assert run.data.tags["ray.job_submission_id"] == job_id
        assert run.data.params["data.manifest"] == str(clone / "data" / "stdlib")
        # run.tune_malloc reaches the workers of a submitted job too (merged into the job's runtime env).
        from raytrn.backends.host_malloc import TUNED, describe, user_allocator_settings

        if not user_allocator_settings(env):
            assert run.data.tags["worker.malloc"] == describe(TUNED)
        # The checkpoints are on this disk, under the clone (keep_last 2), and the run's tags say so.
        kept = sorted(p.name for p in (clone / "checkpoints" / run_name).glob("checkpoint_0*"))
        assert kept == ["checkpoint_00000050", "checkpoint_00000100"]
        assert run.data.tags["checkpoint.latest"] == str(clone / "checkpoints" / run_name / "checkpoint_00000100")

        # Mistakes get one clear line and exit 2: an unknown job id, no token, a wrong token.
        for verb in ("logs", "stop"):
            bad = run_cli("jobs", verb, "no-such-job", "--address", ADDRESS, cwd=clone, env=env, timeout=60)
            assert bad.returncode == 2 and bad.stderr.startswith("raytrn: error: no job 'no-such-job'"), bad.stderr
            assert "Traceback" not in bad.stderr
        stranger = env | {"HOME": str(tmp_path)}  # no simulator state, no ~/.ray/auth_token
        paths = ["--set", f"data.manifest={clone}/data/stdlib", "--set", f"checkpoint.storage={tmp_path}/ckpt"]
        args = ["submit", "jobs/tiny.yaml", "--address", ADDRESS, "--no-follow", *paths]
        refused = run_cli(*args, cwd=clone, env=stranger)
        assert refused.returncode == 2 and "requires an auth token and none was found" in refused.stderr
        (tmp_path / "wrong").write_text("0" * 64)
        wrong = run_cli("jobs", "list", "--address", ADDRESS, "--token-file", str(tmp_path / "wrong"), env=stranger)
        assert wrong.returncode == 2 and "rejected the auth token" in wrong.stderr
        listed = run_cli("jobs", "list", "--address", ADDRESS, cwd=clone, env=env, timeout=60)
        assert listed.stdout.count("raytrn-") == 1, listed.stdout  # the refused submission submitted nothing
    finally:
        down = run_cli("cluster", "down", "--local", cwd=clone, env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not state.exists() and local.running(ADDRESS, state) is None
    # Every process it started is gone: the head's, the simulated nodes', the MLflow server.
    assert cluster is not None and not local._procs_alive(cluster.all_procs)
    assert local._cluster_procs(cluster.temp_dir) == [] and not Path(cluster.temp_dir).exists()
    assert (home / ".raytrn" / "local-cluster" / "mlflow.db").exists()  # the runs are kept
