"""The README's "Try it on a laptop", verbatim, on a fresh copy of the repository after `make demo`:

    raytrn cluster up --local
    raytrn submit jobs/tiny.yaml --address http://127.0.0.1:8265
    raytrn jobs logs JOB_ID --address http://127.0.0.1:8265
    raytrn cluster down --local

The simulator is the session's shared one (the ``simulator`` fixture: `raytrn cluster up --local`, verbatim, in a
fresh copy of the repository, HOME in a temporary directory); this test is the last to use it and ends it with
`raytrn cluster down --local`. It must train and end FINISHED: the job's relative paths (data/stdlib, checkpoints) made absolute by
`raytrn submit` (the simulator shares this filesystem), its metrics in the MLflow server the simulator runs on
its head, its checkpoints on disk, the 2 CPU workers taking every CPU of the two simulated nodes (a small epoch
is read by the worker itself; Ray Data's readers beside workers that hold every CPU: test_data_source.py), and
Ray token auth on (no token: refused). The simulator's state, token and MLflow
store are the session's own (its HOME); the default ports (6379, 8265, 5000) must be free.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.simulator import ADDRESS, Simulator

pytestmark = pytest.mark.integration

SUBMIT_TIMEOUT_S = 420  # scale-up of two fake nodes, 100 steps, scale-down not awaited (measured ~130 s here)


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


@pytest.mark.simulator_down
def test_readme_laptop_path_verbatim(simulator: Simulator, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from raytrn.cluster import local

    # `raytrn cluster up --local`: the simulator fixture ran it, verbatim, in the clone (the first time).
    up, clone, env, state = simulator.up_result, simulator.clone, simulator.env, simulator.state
    home = simulator.home
    simulator.demo_data()  # `make demo`'s dataset: clone/data/stdlib
    cluster = simulator.cluster
    pool: ThreadPoolExecutor | None = None
    try:
        assert up is not None and up.returncode == 0, up
        assert cluster is not None and cluster.auth == "token" and cluster.mlflow_url == "http://127.0.0.1:5000"
        token = Path(cluster.token_path or "")
        assert token.stat().st_mode & 0o777 == 0o600  # generated on first use, private

        proc = simulator.cli("submit", "jobs/tiny.yaml", "--address", ADDRESS, timeout=SUBMIT_TIMEOUT_S)
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

        # The CLI calls that don't depend on each other run at once (each is a Python start: seconds).
        stranger = {"HOME": str(tmp_path)}  # no simulator state, no ~/.ray/auth_token
        (tmp_path / "wrong").write_text("0" * 64)
        wrong_token = ["--token-file", str(tmp_path / "wrong")]
        pool = ThreadPoolExecutor(4)  # shut down (its calls waited for) in `finally`
        logs_call = pool.submit(simulator.cli, "jobs", "logs", job_id, "--address", ADDRESS, timeout=60)
        bad_calls = {verb: pool.submit(simulator.cli, "jobs", verb, "no-such-job", "--address", ADDRESS, timeout=60)
                     for verb in ("logs", "stop")}  # fmt: skip
        before_call = pool.submit(simulator.cli, "jobs", "list", "--address", ADDRESS, timeout=60)
        wrong_call = pool.submit(simulator.cli, "jobs", "list", "--address", ADDRESS, *wrong_token, cwd=REPO,
                                 env=stranger, timeout=300)  # fmt: skip
        logs = logs_call.result()
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
        for call in bad_calls.values():
            bad = call.result()
            assert bad.returncode == 2 and bad.stderr.startswith("raytrn: error: no job 'no-such-job'"), bad.stderr
            assert "Traceback" not in bad.stderr
        wrong = wrong_call.result()
        assert wrong.returncode == 2 and "rejected the auth token" in wrong.stderr
        jobs_before = _job_ids(before_call.result().stdout)
        assert job_id in jobs_before, jobs_before
        paths = ["--set", f"data.manifest={clone}/data/stdlib", "--set", f"checkpoint.storage={tmp_path}/ckpt"]
        args = ["submit", "jobs/tiny.yaml", "--address", ADDRESS, "--no-follow", *paths]
        refused = simulator.cli(*args, env=stranger, timeout=300)
        assert refused.returncode == 2 and "requires an auth token and none was found" in refused.stderr
        listed = simulator.cli("jobs", "list", "--address", ADDRESS, timeout=60)
        # The refused submission submitted nothing (the shared simulator also lists the other tests' jobs).
        assert _job_ids(listed.stdout) == jobs_before, listed.stdout
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        down = simulator.down()  # `raytrn cluster down --local`
    assert down.returncode == 0, down.stderr
    assert not state.exists() and local.running(ADDRESS, state) is None
    # Every process it started is gone: the head's, the simulated nodes', the MLflow server.
    assert cluster is not None and not local._procs_alive(cluster.all_procs)
    assert local._cluster_procs(cluster.temp_dir) == [] and not Path(cluster.temp_dir).exists()
    assert (home / ".raytrn" / "local-cluster" / "mlflow.db").exists()  # the runs are kept


def _job_ids(listing: str) -> list[str]:
    """The job ids (first column) of ``raytrn jobs list``'s output, in its order."""
    return [line.split()[0] for line in listing.splitlines() if line.strip()]
