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


PASSWORD = "s3cr@t:pw"  # an "@" and a ":" in it: the host follows the last "@"
URI_WITH_PASSWORD = f"http://alice:{PASSWORD}@127.0.0.1:5999"


def test_credentials_in_a_uri_are_split_off_and_never_shown() -> None:
    assert tc.split_credentials(URI_WITH_PASSWORD) == ("http://127.0.0.1:5999", "alice", PASSWORD)
    assert tc.split_credentials("http://127.0.0.1:5999/x") == ("http://127.0.0.1:5999/x", None, None)
    assert tc.split_credentials("sqlite:////tmp/a@b/mlflow.db")[1:] == (None, None)
    shown = tc.redact_uri(f"no answer from {URI_WITH_PASSWORD}/api (refused)")
    assert shown == "no answer from http://alice:***@127.0.0.1:5999/api (refused)" and "cr@t" not in shown


def test_the_client_gets_the_uri_without_credentials_and_mlflows_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "before")  # recorded: restored after the test
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "before")
    client = tc.mlflow_client(URI_WITH_PASSWORD)
    assert client.tracking_uri == "http://127.0.0.1:5999"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice" and os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD


def test_the_health_check_of_a_server_with_basic_auth_sends_the_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real HTTP server on 127.0.0.1 that answers /health only with the right basic-auth header: the URI's
    credentials were handed to urllib whole before (an invalid URL: always "unreachable")."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    expected = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    seen: list[str | None] = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(self.headers.get("Authorization"))
            ok = self.path == "/health" and self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert tc.unreachable(f"http://alice:{PASSWORD}@127.0.0.1:{port}") is None
        assert seen == [expected]
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
        assert tc.unreachable(f"http://127.0.0.1:{port}") is None  # MLflow's variables, no URI credentials
        assert seen[-1] == expected
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_run_marker_and_the_summary_never_hold_the_password() -> None:
    from raytrn.tracking.mlflow_run import TrackedRun, marker_uri

    assert marker_uri(URI_WITH_PASSWORD) == "http://127.0.0.1:5999"
    run = TrackedRun(uri=URI_WITH_PASSWORD, run_id="r1", experiment_id="3", resumed=False, tags={}, params={})
    assert run.ui_command() == "open http://127.0.0.1:5999/#/experiments/3/runs/r1?workflowType=machine_learning"


def test_submit_moves_uri_credentials_off_the_command_line() -> None:
    from raytrn.submit import move_uri_credentials, secret_overrides

    fixed, env = move_uri_credentials([f"tracking.mlflow_uri={URI_WITH_PASSWORD}", "run.max_steps=4"])
    assert fixed == ["tracking.mlflow_uri=http://127.0.0.1:5999", "run.max_steps=4"]
    assert env == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    assert secret_overrides(fixed) == []


def test_the_client_keeps_mlflows_run_links_off_stdout(monkeypatch) -> None:
    """MLflow prints "View run ... / View experiment ..." as a run ends, from whichever process ends it (the tracking
    actor: a Ray job's log, four times); raytrn's summary gives the link once. The user's own setting wins."""
    from raytrn.tracking.client import mlflow_client

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    mlflow_client("sqlite:///")
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    mlflow_client("sqlite:///")
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "false"
