"""``raytrn runs compare`` and ``raytrn models promote`` as a user types them, on a real MLflow sqlite store (the
default one, ``mlruns/mlflow.db`` in the directory they run from): the experiment of the last ``raytrn train`` here
by default, the tables' 8-character run ids taken back, one line for a metric no run has, the MLflow UI's link to
the training view, and promote on sqlite (its model versions are ints there)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from raytrn import ray_output
from raytrn.cli import main
from tests.conftest import REPO, mlflow_store

pytestmark = pytest.mark.unit

TINY = str(REPO / "jobs" / "tiny.yaml")  # tracking.experiment: raytrn-demo
T0 = 1_700_000_000_000  # ms


@pytest.fixture
def here(tmp_path: Path, monkeypatch) -> tuple[str, MlflowClient]:
    """A directory to run from, with the default store (``mlruns/mlflow.db``) in it: (its URI, a client)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = mlflow_store(tmp_path / "mlruns" / "mlflow.db")
    return uri, MlflowClient(uri)


def _experiment(client: MlflowClient, name: str, root: Path, runs: int = 1) -> tuple[str, list[str]]:
    exp = client.create_experiment(name, artifact_location=(root / "artifacts").as_uri())
    ids = []
    for i in range(runs):
        run_id = client.create_run(exp, run_name=f"{name}-{i}", start_time=T0 + i).info.run_id
        client.log_batch(run_id, metrics=[Metric("loss", 3.0 - i / 100, T0, 10), Metric("mfu", 0.2, T0, 10)])
        ids.append(run_id)
    return exp, ids


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _train_here(run_id: str, monkeypatch) -> None:
    """``raytrn train jobs/tiny.yaml`` as ``make demo`` runs it, its training stubbed (no Ray in unit tests): what the
    command records when the run ends is real."""
    from raytrn.tracking.board import Summary
    from raytrn.train import trainer

    summary = Summary(run_name="tiny-x", start_step=0, final_step=100, tokens=1, tokens_per_s=1.0, first_loss=9.0,
                      final_loss=3.0, checkpoint=None, mlflow_run_id=run_id, mlflow_ui=None)  # fmt: skip
    monkeypatch.setattr(trainer, "run_training", lambda job, **kw: summary)
    monkeypatch.setattr(ray_output, "_ray_log_path", None)  # restored after the test: route_ray_output sets them
    monkeypatch.setattr(ray_output, "_verbose", False)
    assert main(["train", TINY]) == 0


def test_runs_compare_without_arguments_shows_the_experiment_of_the_last_train_here(here, tmp_path, monkeypatch,
                                                                                    capsys) -> None:  # fmt: skip
    uri, client = here
    exp, (run_id,) = _experiment(client, "raytrn-demo", tmp_path)
    assert main(["runs", "compare"]) == 2  # nothing trained here yet: which experiments there are
    assert "no experiment named raytrn" in (err := _one_error_line(capsys)) and "raytrn-demo" in err
    _train_here(run_id, monkeypatch)
    capsys.readouterr()
    assert main(["runs", "compare"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "experiment raytrn-demo (1 run)" and run_id[:8] in out
    # The MLflow UI's runs page of that experiment, in the training view (MLflow 3 opens on its GenAI overview).
    assert f"http://127.0.0.1:5000/#/experiments/{exp}?workflowType=machine_learning" in out
    assert f"--backend-store-uri {uri}" in out
    # Another tracking URI than the one trained against: the record does not apply there.
    other = mlflow_store(tmp_path / "other" / "mlflow.db")
    assert main(["runs", "compare", "--tracking-uri", other]) == 2
    assert "no experiment named raytrn at" in _one_error_line(capsys)


def test_the_tables_short_run_ids_are_taken_wherever_a_run_id_is(here, tmp_path, capsys) -> None:
    from raytrn.tracking.models import STEP_TAG

    uri, client = here
    exp, ids = _experiment(client, "e", tmp_path, runs=17)  # 17 ids: two share their first hex digit
    target = ids[0]
    client.create_logged_model(exp, name="ckpt-10", source_run_id=target, tags={STEP_TAG: "10"})
    argv = ["runs", "compare", "--experiment", "e", "--tracking-uri", uri]
    assert main([*argv, "--models", target[:8]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {target[:8]}") and "ckpt-10" in out, out
    assert main([*argv, "--models", "0123abcd"]) == 2 and "0123abcd" not in ids
    assert "no run of experiment e has an id starting 0123abcd" in _one_error_line(capsys)
    first = [i[0] for i in ids]
    shared = next(c for c in first if first.count(c) > 1)
    assert main([*argv, "--models", shared]) == 2
    assert f"--models {shared}: {first.count(shared)} runs" in _one_error_line(capsys)

    # --parent: a sweep's parent run, by the first characters of its id.
    sweep = client.create_run(exp, run_name="lr", tags={"raytrn.sweep": "lr", "raytrn.kind": "sweep"}).info.run_id
    client.log_param(sweep, "sweep.metric", "loss")
    trial = client.create_run(exp, run_name="lr-t01", tags={"mlflow.parentRunId": sweep, "raytrn.trial": "t01"})
    client.log_metric(trial.info.run_id, "loss", 2.0, step=5)
    assert main(["runs", "compare", "--tracking-uri", uri, "--parent", sweep[:8]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sweep lr: 1 trial(s)") and trial.info.run_id[:8] in out
    assert main(["runs", "compare", "--tracking-uri", uri, "--parent", target[:8]]) == 2
    assert f"--parent {target[:8]}: no sweep's parent run has an id starting {target[:8]}" in _one_error_line(capsys)
    assert main(["runs", "compare", "--tracking-uri", uri, "--parent", target]) == 2  # a whole id: that run
    assert "is not a raytrn sweep's parent run" in _one_error_line(capsys)


def test_a_metric_no_run_has_is_one_line_naming_those_they_have(here, tmp_path, capsys) -> None:
    uri, client = here
    _experiment(client, "e", tmp_path, runs=2)
    argv = ["runs", "compare", "--experiment", "e", "--tracking-uri", uri]
    assert main([*argv, "--metrics", "los"]) == 2
    err = _one_error_line(capsys)
    assert "--metrics los: no run of experiment e has that metric (did you mean loss?)" in err
    assert "their metrics: loss, mfu" in err
    assert main([*argv, "--metrics", "loss,nosuch"]) == 0  # one they have: the table, and a note for the other
    out = capsys.readouterr().out
    assert out.splitlines()[-2] == "no run has nosuch (their metrics: loss, mfu)", out


def test_promote_on_the_default_sqlite_store(here, tmp_path, capsys) -> None:
    uri, client = here
    client.create_registered_model("tiny")
    for _ in range(2):
        client.create_model_version("tiny", source=(tmp_path / "model").as_uri())
    argv = ["models", "promote", "tiny", "2", "--alias", "champion", "--tracking-uri", uri]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == "tiny version 2 is now 'champion'"
    assert main([*argv[:3], "1", *argv[4:]]) == 0
    assert capsys.readouterr().out.strip() == "tiny version 1 is now 'champion' (was version 2)"
    assert str(client.get_model_version_by_alias("tiny", "champion").version) == "1"
    assert main([*argv[:3], "9", *argv[4:]]) == 2
    assert "'tiny' has no version 9; its versions: 1, 2" in _one_error_line(capsys)
    assert main(["models", "promote", "nosuch", "1", "--alias", "champion", "--tracking-uri", uri]) == 2
    assert "no registered model 'nosuch'" in _one_error_line(capsys)
    assert main([*argv[:5], "v3", *argv[6:]]) == 2  # MLflow's own rule: no alias looks like a version
    assert "--alias 'v3'" in _one_error_line(capsys)


def test_the_training_summary_links_the_runs_own_page_in_the_training_view(tmp_path) -> None:
    from raytrn.tracking.mlflow_run import TrackedRun

    local = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    run = TrackedRun(uri=local, run_id="abc123", experiment_id="7", resumed=False)
    command, _, url = run.ui_command().partition("   # then open ")
    assert command.endswith(f"mlflow ui --backend-store-uri {local} --port 5000")
    assert url == "http://127.0.0.1:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"
    server = TrackedRun(uri="https://mlflow.example.com/", run_id="abc123", experiment_id="7", resumed=False)
    assert server.ui_command() == (
        "open https://mlflow.example.com/#/experiments/7/runs/abc123?workflowType=machine_learning"
    )
