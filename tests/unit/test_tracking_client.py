"""raytrn.tracking.client: the one builder of MLflow clients (URI from a job, store set-up, fail-fast HTTP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrn.config import load_job
from raytrn.errors import ConfigError
from raytrn.tracking import client as tc

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, uri: str | None):
    return load_job(REPO / "jobs" / "tiny.yaml", [f"tracking.mlflow_uri={uri}"] if uri else [], resolve=False)


def test_a_uri_or_a_job_names_the_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert tc.tracking_uri(uri) == uri
    assert tc.tracking_uri(_job(tmp_path, uri)) == uri
    with pytest.raises(ConfigError, match="tracking.mlflow_uri is not resolved"):
        tc.tracking_uri(_job(tmp_path, None))

    client = tc.mlflow_client(_job(tmp_path, uri))
    assert isinstance(client, MlflowClient) and client.tracking_uri == uri


def test_the_writer_creates_a_local_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/a/b/mlflow.db"
    client = tc.mlflow_client(uri, create_store=True)
    assert (tmp_path / "a" / "b").is_dir()
    exp = client.create_experiment("e")
    assert client.get_experiment(exp).name == "e"


@pytest.mark.parametrize("uri", ["http://127.0.0.1:1", "https://mlflow.example:8443/"])
def test_fail_fast_caps_http_requests_and_user_values_win(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "42")
    tc.mlflow_client(uri, fail_fast=True)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "42"  # the user's


def test_without_fail_fast_mlflows_own_retries_stay(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rank 0's model upload, the sweep driver and runs compare keep MLflow's retries (a long upload must not
    be cut at 10 s); a local store never touches the HTTP settings."""
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    tc.mlflow_client("http://127.0.0.1:1")
    tc.mlflow_client(f"sqlite:///{tmp_path}/mlflow.db", fail_fast=True)
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_uri_helpers() -> None:
    assert tc.sqlite_path("sqlite:////abs/mlflow.db") == "/abs/mlflow.db"
    assert tc.sqlite_path("http://host:5000") is None
    assert tc.is_http("https://h") and not tc.is_http("sqlite:///x.db")
    assert tc.unreachable("sqlite:///x.db") is None
    assert tc.redact_uri("https://alice:pw@host:1/") == "https://alice:***@host:1/"


def test_importing_the_client_does_not_import_mlflow() -> None:
    """The driver imports raytrn.tracking (plan_run, the board) on its way to the first step: MLflow's import
    (about a second) is paid only by the processes that build a client."""
    code = "import sys, raytrn.tracking.client, raytrn.tracking.mlflow_run; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
