"""MLflow never stops training: the tracking server is down when the job starts and again for a few seconds
mid-run; it comes back each time and nothing is lost.

A real ``mlflow server`` (sqlite store, artifacts on the moto S3 server) and a real local Ray; the job reaches the
server through a TCP forwarder (tests/outage_proxy.py) that is cut for each outage: its port refuses connections and
every open one is reset, as a stopped server's would be (until 2026-12-04 the server was stopped and started again,
~5 s a start on top of each outage). The same run checks what a tracked job records: params with versions and the git
commit, the dataset input with its digest, per-node system metrics, the final model in Hugging Face format on S3, and
its registry version.
"""

from __future__ import annotations

import urllib.request
import uuid

import pytest

from tests.chaos._common import summary_of, tiny_chaos_job, train_in_thread, wait_until
from tests.outage_proxy import OutageProxy

pytestmark = [pytest.mark.integration, pytest.mark.chaos]
OUTAGE_S = 4
#: the server's first outage: from before the job starts until the driver has found it down and gone on (its
#: check is its first second)
LATE_S = 5
EVERY = 100  # checkpoint.every_n_steps
#: run.max_steps: the schedule's horizon. The run ends once the server is back and has steps logged after the outage:
#: at the next checkpoint step (raytrn stop), however many steps the machine trained meanwhile.
HORIZON = 5000


@pytest.fixture(scope="module")
def outage_run(ray_session, tiny_dataset, mlflow_server, tmp_path_factory):
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("outage")
    name = f"outage-{uuid.uuid4().hex[:8]}"
    proxy = OutageProxy(("127.0.0.1", mlflow_server.port))  # the server as the job reaches it
    job = tiny_chaos_job(tiny_dataset, tmp / "ckpt", mlflow_uri=proxy.url, experiment="raytrn-outage",
                         name=name, extra=(f"checkpoint.every_n_steps={EVERY}", "tracking.register_model=raytrn-outage-tiny",
                                           "tracking.system_metrics_interval_s=1", f"run.max_steps={HORIZON}"))  # fmt: skip
    client = MlflowClient(mlflow_server.url)  # the test's own view: the server itself
    # down when the job starts: it trains anyway, rank 0 creates the run once the server answers
    late = proxy.cut_in_background(LATE_S)
    with pytest.raises(OSError):  # (the outage is real: nothing listens on the job's port)
        urllib.request.urlopen(f"{proxy.url}/health", timeout=5)
    thread, result = train_in_thread(job)
    late.join(timeout=60)

    def logged(after: float = 0.0) -> list[int]:
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments(filter_string="name = 'raytrn-outage'")],
            filter_string=f"attributes.run_name = '{name}'",
        )
        history = client.get_metric_history(runs[0].info.run_id, "loss") if runs else []
        return [m.step for m in history if m.timestamp / 1000 > after]

    try:
        wait_until(lambda: bool(logged()), 180, "the first logged step")
        proxy.cut(OUTAGE_S)
        down, up = proxy.outages[-1]
        wait_until(lambda: bool(logged(after=up)), 180, "a step trained after the outage")
        from raytrn.train.stopping import request_stop

        request_stop(name, max(2 * EVERY, (max(logged()) // EVERY + 1) * EVERY))  # at the next checkpoint step
    finally:
        thread.join(timeout=600)
        proxy.close()
    return job, summary_of(thread, result), client, (down, up)


def test_every_step_arrives_once_in_order(outage_run):
    job, summary, client, _ = outage_run
    assert summary.final_step >= 2 * EVERY
    # The server was down at the start: the driver learned the run that rank 0 created later, under the job's name.
    assert summary.mlflow_run_id, "the driver did not learn the run rank 0 created"
    assert client.get_run(summary.mlflow_run_id).info.run_name == job.run_name
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s", "world_size", "tokens_seen"):
        steps = [m.step for m in client.get_metric_history(summary.mlflow_run_id, key)]
        assert steps == list(range(1, summary.final_step + 1)), key
    assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"


def test_training_went_on_during_the_outage(outage_run):
    _, summary, client, (down, up) = outage_run
    recorded = [m.timestamp / 1000 for m in client.get_metric_history(summary.mlflow_run_id, "loss")]
    during = [t for t in recorded if down + 1 < t < up]
    assert during, "no step was recorded while the server was down: training waited for MLflow"


def test_run_records_versions_git_dataset_and_system_metrics(outage_run):
    job, summary, client, _ = outage_run
    run = client.get_run(summary.mlflow_run_id)
    params, tags = run.data.params, run.data.tags
    assert params["versions.torch"] and params["versions.ray"] and params["versions.raytrn"]
    assert params["optim.lr"] == str(job.optim.lr)
    assert len(params.get("git.commit", "")) >= 40  # the test runs from the repository
    assert tags["accelerator"] == "cpu"
    assert tags["world_size_history"] == "0:1"
    final = summary.final_step
    assert tags["checkpoint.latest_step"] == str(final)
    assert tags[f"checkpoint.step_{final:08d}"].endswith(f"{job.run_name}/checkpoint_{final:08d}")
    assert tags["checkpoint.step_00000100"].endswith(f"{job.run_name}/checkpoint_00000100")
    inputs = run.inputs.dataset_inputs
    assert len(inputs) == 1 and inputs[0].dataset.digest and inputs[0].dataset.name == "tiny"
    cpu = [k for k in run.data.metrics if k.startswith("system/node-") and k.endswith("/cpu_utilization_percentage")]
    assert len(cpu) == 1, run.data.metrics.keys()


def test_final_model_is_on_s3_in_hf_format_and_registered(outage_run, s3_endpoint, mlflow_server, tmp_path):
    import boto3
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, summary, client, _ = outage_run
    bucket, prefix = mlflow_server.artifacts[len("s3://") :].split("/", 1)
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_endpoint)
        .list_objects_v2(Bucket=bucket, Prefix=prefix)
        .get("Contents", [])
    ]
    assert any(k.endswith(f"{summary.mlflow_run_id}/artifacts/model/model.safetensors") for k in keys), keys
    local = client.download_artifacts(summary.mlflow_run_id, "model", str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    ids = torch.tensor([tokenizer.encode("def main():\n    return 0\n")])
    assert model(input_ids=ids).logits.shape[-1] == 512
    versions = client.search_model_versions("name = 'raytrn-outage-tiny'")
    assert [v.run_id for v in versions] == [summary.mlflow_run_id]
    # tracking.register: last (register_model's former spelling): the final model, alias candidate, linked by tag to
    # the last checkpoint's LoggedModel, the run's output model; every checkpoint a LoggedModel, through the outage
    run = client.get_run(summary.mlflow_run_id)
    models = {int(m.tags["raytrn.step"]): m for m in client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{summary.mlflow_run_id}'")}  # fmt: skip
    final = summary.final_step
    assert sorted(models) == sorted({*range(EVERY, final + 1, EVERY), final})
    candidate = client.get_model_version_by_alias("raytrn-outage-tiny", "candidate")
    assert candidate.version == versions[0].version and candidate.tags["raytrn.model_id"] == models[final].model_id
    assert [o.model_id for o in run.outputs.model_outputs] == [models[final].model_id]


def test_runs_compare_against_the_server(outage_run, mlflow_server, tmp_path):
    from tests.conftest import run_cli

    _, summary, _, _ = outage_run
    png = tmp_path / "runs.png"
    out = run_cli(
        "runs", "compare", "--experiment", "raytrn-outage", "--tracking-uri", mlflow_server.url, "--plot", str(png),
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert summary.run_name in out.stdout and summary.mlflow_run_id[:8] in out.stdout
    assert png.stat().st_size > 10_000
    missing = run_cli("runs", "compare", "--experiment", "no-such-experiment", "--tracking-uri", mlflow_server.url)
    assert missing.returncode == 2 and "no experiment named no-such-experiment" in missing.stderr
    assert "raytrn-outage" in missing.stderr  # the experiments that do exist
    from mlflow.tracking import MlflowClient

    MlflowClient(mlflow_server.url).create_experiment("raytrn-empty")
    empty = run_cli("runs", "compare", "--experiment", "raytrn-empty", "--tracking-uri", mlflow_server.url)
    assert empty.returncode == 0 and "raytrn-empty" in empty.stdout and "no runs" in empty.stdout.lower()
