"""The MLflow tracking server for real: ``mlflow server`` on 127.0.0.1 with artifacts proxied to the moto S3
server, basic auth, and ``raytrn mlflow serve`` end to end (started, healthy, stopped by its PID).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, MlflowServer, _free_port, _wait_http, run_cli

pytestmark = pytest.mark.integration

ADMIN_PASSWORD = "test-admin-password-0123"  # >= 12 characters (MLflow's password policy)

# Logs a run through the server from a process that has no AWS credentials and no S3 endpoint:
# artifacts go to the server (mlflow-artifacts:/), which writes them to S3.
_CLIENT = """
import json, os, tempfile
import mlflow
mlflow.set_experiment("raytrn-server-test")
with mlflow.start_run() as run:
    mlflow.log_params({"optim.lr": 0.001, "scaling.max_workers": 2})
    for step in range(3):
        mlflow.log_metric("loss", 3.0 - step, step=step)
    path = os.path.join(tempfile.mkdtemp(), "notes.txt")
    with open(path, "w") as f:
        f.write("hello from a client without S3 credentials")
    mlflow.log_artifact(path)
print(json.dumps({"run_id": run.info.run_id, "artifact_uri": run.info.artifact_uri}))
"""


def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    """HTTP status of a GET (401 and friends returned, not raised)."""
    request = urllib.request.Request(url)
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_server_is_healthy(mlflow_server) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", mlflow_server.url)
    assert mlflow_server.url.endswith(f":{mlflow_server.port}")
    assert mlflow_server.artifacts.startswith("s3://") and mlflow_server.artifacts.endswith("/mlflow")
    with urllib.request.urlopen(f"{mlflow_server.url}/health", timeout=10) as response:
        assert response.status == 200 and response.read().strip() == b"OK"


def test_client_logs_artifacts_to_s3_without_credentials(mlflow_server, s3_endpoint, tmp_path: Path) -> None:
    import boto3
    from mlflow.tracking import MlflowClient

    # A client environment without any AWS or S3 setting: only the tracking URI.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    env["MLFLOW_TRACKING_URI"] = mlflow_server.url
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["artifact_uri"].startswith("mlflow-artifacts:/"), out  # proxied: the client never saw S3

    run = MlflowClient(mlflow_server.url).get_run(out["run_id"])
    assert run.data.params == {"optim.lr": "0.001", "scaling.max_workers": "2"}
    history = MlflowClient(mlflow_server.url).get_metric_history(out["run_id"], "loss")
    assert [(m.step, m.value) for m in history] == [(0, 3.0), (1, 2.0), (2, 1.0)]

    bucket, prefix = mlflow_server.artifacts[len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    key = next((k for k in keys if out["run_id"] in k and k.endswith("/notes.txt")), None)
    assert key, keys
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert body == b"hello from a client without S3 credentials"


def test_serve_sh_refuses_a_port_in_use(mlflow_server, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env |= {"MLFLOW_DATA_DIR": str(tmp_path), "MLFLOW_PORT": str(mlflow_server.port)}
    proc = subprocess.run(
        ["bash", str(REPO / "mlflow" / "serve.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and f"127.0.0.1:{mlflow_server.port} is already in use" in proc.stderr, proc.stderr


def test_serve_auth_without_password_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_AUTH_ADMIN_PASSWORD",)}
    env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = "test-secret-key"
    proc = subprocess.run(
        [sys.executable, "-m", "raytrn.cli", "mlflow", "serve", "--auth", "--port", str(_free_port())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "MLFLOW_AUTH_ADMIN_PASSWORD" in proc.stderr and "MLFLOW_FLASK_SERVER_SECRET_KEY" not in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "mlruns").exists()  # nothing started, nothing written


def test_serve_refuses_a_port_in_use(mlflow_server, tmp_path: Path) -> None:
    proc = run_cli("mlflow", "serve", "--port", str(mlflow_server.port), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{mlflow_server.port} is already in use" in proc.stderr and "Traceback" not in proc.stderr


def test_raytrn_mlflow_serve_end_to_end(tmp_path: Path) -> None:
    """`raytrn mlflow serve` in a subprocess: prints the URI, is healthy, and `kill PID` stops the server too."""
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raytrn.cli", "mlflow", "serve", "--port", str(port)],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server_pid = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 60, proc)
        text = log.read_text()
        server_pid = int(re.search(r"MLflow server \(pid (\d+)\)", text).group(1))
        assert f"tracking.mlflow_uri: http://127.0.0.1:{port}" in text
        assert f"sqlite:///{tmp_path}/mlruns/mlflow.db" in text  # the store `raytrn train` writes by default
        assert (tmp_path / "mlruns" / "mlflow.db").exists()
        proc.send_signal(signal.SIGTERM)  # stop raytrn by its PID: it stops the server's process group
        assert proc.wait(timeout=30) == 130
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(server_pid):
            time.sleep(0.1)
        assert not _group_alive(server_pid), "the mlflow server outlived raytrn mlflow serve"
    finally:
        for pid in (proc.pid, server_pid):  # whatever a failed assertion left running
            if pid and _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# -- errors that will never succeed are not retried (raytrn.tracking.logger) ------------------------------


def _new_run(url: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    experiment = client.create_experiment(f"raytrn-refusals-{uuid.uuid4().hex[:8]}")
    return client.create_run(experiment).info.run_id


def test_a_refused_tag_is_dropped_and_everything_else_delivered(mlflow_server) -> None:
    """A tag key over MLflow's 250-character limit: HTTP 400. The batch it travels in is split until it is
    alone; it is dropped and counted, the metrics and the other tag arrive, and nothing is retried."""
    from mlflow.tracking import MlflowClient

    from raytrn.tracking.logger import AsyncLogger

    run_id = _new_run(mlflow_server.url)
    logger = AsyncLogger(mlflow_server.url, run_id, batch_window_s=0.05)
    for step in range(1, 21):
        logger.log_metrics({"loss": 1.0 / step}, step)
    logger.set_tags({"x" * 300: "too long a key", "checkpoint.latest": "/ckpt/20"})
    t0 = time.monotonic()
    assert logger.flush(30), "the queue must drain: a refused item is not retried"
    assert time.monotonic() - t0 < 20
    assert logger.rejected == 1 and logger.failures == 0
    assert logger.close(10) == 0
    client = MlflowClient(mlflow_server.url)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 21))
    tags = client.get_run(run_id).data.tags
    assert tags["checkpoint.latest"] == "/ckpt/20" and "x" * 300 not in tags


def test_a_deleted_run_stops_the_retries(mlflow_server) -> None:
    from mlflow.tracking import MlflowClient

    from raytrn.tracking.logger import AsyncLogger

    run_id = _new_run(mlflow_server.url)
    logger = AsyncLogger(mlflow_server.url, run_id, batch_window_s=0.05)
    logger.log_metrics({"loss": 1.0}, 1)
    assert logger.flush(30)
    MlflowClient(mlflow_server.url).delete_run(run_id)
    for step in range(2, 12):
        logger.log_metrics({"loss": 1.0 / step}, step)
    t0 = time.monotonic()
    assert logger.flush(30) and time.monotonic() - t0 < 20
    assert logger.rejected == 10
    logger.log_metrics({"loss": 0.0}, 12)  # later metrics are dropped at once, not queued
    assert logger.pending == 0 and logger.rejected == 11
    assert logger.close(10) == 0


def test_long_tag_values_are_cut_to_mlflows_limit(mlflow_server) -> None:
    from mlflow.tracking import MlflowClient

    from raytrn.tracking.logger import MAX_TAG_VALUE, AsyncLogger

    run_id = _new_run(mlflow_server.url)
    logger = AsyncLogger(mlflow_server.url, run_id, batch_window_s=0.05)
    logger.set_tags({"note": "y" * 20_000})
    assert logger.close(30) == 0 and logger.rejected == 0
    value = MlflowClient(mlflow_server.url).get_run(run_id).data.tags["note"]
    assert len(value) <= MAX_TAG_VALUE and value.endswith("[truncated]")


def test_a_password_in_the_tracking_uri_is_used_and_shown_nowhere(
    ray_session, tiny_dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 28 item 8 against a real basic-auth `mlflow server`: a job whose tracking.mlflow_uri carries the
    password (one with ``@`` and ``:`` in it) logs its run, and the password appears in no output, file of the
    run's directory, MLflow param or tag, Ray job or actor record, or Ray log. The server itself (one for both):
    refuses a request without credentials or with a wrong password, takes the admin's, and a user created as
    mlflow/README.md shows; its auth config names its own database and holds no password."""
    import ray
    from mlflow.server.auth.client import AuthServiceClient
    from mlflow.tracking import MlflowClient
    from ray.util.state import get_log, list_actors, list_jobs, list_logs

    from raytrn.config import load_job
    from raytrn.tracking.server import build_server_command
    from raytrn.train.trainer import run_training

    password = f"p@ss:{uuid.uuid4().hex[:12]}"
    secrets = {"MLFLOW_AUTH_ADMIN_PASSWORD": password, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key"}
    port = _free_port()
    cmd = build_server_command(
        backend_store_uri=f"sqlite:///{tmp_path}/mlflow.db", port=port, auth=True, environ=secrets
    )
    assert Path(tmp_path / "basic_auth.ini") == Path(cmd.env["MLFLOW_AUTH_CONFIG_PATH"])
    server = MlflowServer(cmd, port, cmd.artifacts_destination, tmp_path / "server.log", env=secrets)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    server.start(timeout_s=60)
    try:
        url = f"{server.url}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _status(url) == 401
        assert _status(url, ("admin", "wrong-password-0000")) == 401
        assert _status(url, ("admin", password)) == 200
        with monkeypatch.context() as admin:  # a user created with the admin's credentials in the environment
            admin.setenv("MLFLOW_TRACKING_USERNAME", "admin")
            admin.setenv("MLFLOW_TRACKING_PASSWORD", password)
            AuthServiceClient(server.url).create_user("alice", "alice-password-0123")
        assert _status(url, ("alice", "alice-password-0123")) == 200
        job = load_job(REPO / "jobs" / "tiny.yaml", [
            f"data.manifest={tiny_dataset}", "data.seq_len=32", "data.micro_batch_size=8", "model.vocab_size=512",
            "scaling.min_workers=1", "scaling.max_workers=1", f"checkpoint.storage={tmp_path / 'ckpt'}",
            "checkpoint.every_n_steps=3", "run.max_steps=6", "run.log_every=2", "tracking.log_model=false",
            f"tracking.mlflow_uri=http://admin:{password}@127.0.0.1:{port}", "tracking.experiment=raytrn-auth",
            f"tracking.run_name=auth-{uuid.uuid4().hex[:6]}",
        ])  # fmt: skip
        summary = run_training(job, live_progress=False)
        shown = capfd.readouterr()
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        run = MlflowClient(server.url).get_run(summary.mlflow_run_id)
    finally:
        server.stop()
    assert run.info.status == "FINISHED"
    assert run.data.metrics["loss"] > 0 and summary.final_step == 6  # tracked through the credentials
    ini = (tmp_path / "basic_auth.ini").read_text()
    assert "database_uri = sqlite:///" + str(tmp_path / "basic_auth.db") in ini and password not in ini

    places = {
        "stdout/stderr": shown.out + shown.err,
        "summary": repr(summary),
        "params and tags": json.dumps([run.data.params, run.data.tags]),
        "server log": (tmp_path / "server.log").read_text(errors="replace"),
    }
    for path in (tmp_path / "ckpt").rglob("*"):
        if path.is_file():
            places[str(path)] = path.read_bytes().decode(errors="replace")
    gcs = ray.get_runtime_context().gcs_address
    places["Ray jobs"] = repr(list_jobs(address=gcs, detail=True, timeout=30))
    places["Ray actors"] = repr(list_actors(address=gcs, detail=True, timeout=30, limit=10000))
    node = ray.get_runtime_context().get_node_id()  # the session's one node: every Ray log of the job (state API)
    for names in list_logs(address=gcs, node_id=node, timeout=30).values():
        for name in names:
            with contextlib.suppress(Exception):  # a log rotated away meanwhile
                places[f"Ray log {name}"] = "".join(
                    get_log(address=gcs, node_id=node, filename=name, timeout=30, errors="replace")
                )
    assert any("raylet" in where for where in places), list(places)  # Ray's logs were read
    leaked = [where for where, text in places.items() if password in text]
    assert not leaked, leaked
    assert "raytrn-mlflow.json" in " ".join(places)  # the run's marker was among the files read
