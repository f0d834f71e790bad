"""A password in a URI is masked whatever its characters and whatever the scheme, everywhere raytrn prints, stores
or forwards the URI: warnings, the run marker, `raytrn submit`'s command line, `raytrn jobs` errors."""

from __future__ import annotations

import base64
import http.server
import json
import shlex
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raytrn import submit as sub
from raytrn.cli import main
from raytrn.config import load_job, resolve_paths
from raytrn.tracking import client as tc
from raytrn.tracking.mlflow_run import TrackedRun, marker_uri, plan_run
from tests.conftest import REPO, _free_port

#: (URI, password, the URI without its credentials): unencoded "/", "#", "?", "@", ":" in the password, any scheme.
CASES = [
    ("http://user:p/ss#w?rd@127.0.0.1:5000", "p/ss#w?rd", "http://127.0.0.1:5000"),
    ("https://user:p@ss:w/rd@mlflow.example:8443/", "p@ss:w/rd", "https://mlflow.example:8443/"),
    ("HTTP://user:s3cr?t@127.0.0.1:5000", "s3cr?t", "HTTP://127.0.0.1:5000"),
    ("https://user:se#cret@host", "se#cret", "https://host"),
    ("postgresql://mlflow:db/p#ss@db.internal:5432/mlflow", "db/p#ss", "postgresql://db.internal:5432/mlflow"),
    ("mysql+pymysql://mlflow:my?pw/x@db:3306/mlflow", "my?pw/x", "mysql+pymysql://db:3306/mlflow"),
    ("postgresql://me@corp.com:pw@db/mlflow", "pw", "postgresql://db/mlflow"),  # an "@" in the user name
]
PASSWORD_PIECES = ["p/ss", "w?rd", "p@ss", "s3cr", "se#c", "db/p", "my?pw"]


def _leaks(text: str, password: str) -> bool:
    return password in text or any(piece in text for piece in PASSWORD_PIECES if piece in password)


@pytest.mark.parametrize(("uri", "password", "clean"), CASES)
def test_one_function_masks_and_splits_every_spelling(uri: str, password: str, clean: str) -> None:
    shown = tc.redact_uri(f"cannot reach {uri} (refused)")
    assert not _leaks(shown, password), shown
    assert ":***@" in shown and shown.endswith(f"{clean.split('://', 1)[1]} (refused)")
    stripped, user, got = tc.split_credentials(uri)
    assert (stripped, got) == (clean, password) and user
    assert tc.redact("tracking.mlflow_uri", uri) == shown[len("cannot reach ") : -len(" (refused)")]


def test_uris_without_a_password_are_kept() -> None:
    for uri in ("http://127.0.0.1:5000", "sqlite:////tmp/a@b/mlflow.db", "s3://bucket/key", "file:///x/y:z"):
        assert tc.redact_uri(uri) == uri and tc.split_credentials(uri) == (uri, None, None)
    assert tc.split_credentials("http://alice@host:5000") == ("http://host:5000", "alice", None)


@pytest.mark.parametrize(("uri", "password", "clean"), CASES)
def test_the_run_marker_and_the_summary_link_hold_no_password(uri: str, password: str, clean: str) -> None:
    assert marker_uri(uri) == clean
    run = TrackedRun(uri=uri, run_id="r1", experiment_id="3", resumed=False, tags={}, params={})
    assert not _leaks(run.ui_command(), password)


@pytest.mark.parametrize("scheme", ["http", "HTTP", "https"])
def test_the_unreachable_server_warning_masks_the_password(
    scheme: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"{scheme}://user:p/ss#w?rd@127.0.0.1:{_free_port()}"
    raw = load_job(REPO / "jobs" / "tiny.yaml", [f"tracking.mlflow_uri={uri}"], resolve=False)
    run = plan_run(resolve_paths(raw, str(REPO)))
    assert run is not None and not run.reachable
    out = capsys.readouterr()
    printed = out.out + out.err + caplog.text
    assert "WARNING: MLflow at" in printed and "127.0.0.1" in printed
    assert "p/ss" not in printed and "w?rd" not in printed


@pytest.mark.parametrize(("uri", "password", "clean"), CASES)
def test_the_submitted_command_line_carries_no_password(uri: str, password: str, clean: str) -> None:
    fixed, env = sub.move_uri_credentials([f"tracking.mlflow_uri={uri}", "run.max_steps=4"])
    command = sub.entrypoint("jobs/tiny.yaml", fixed)
    assert not _leaks(command, password), command
    assert sub.secret_overrides(fixed) == []
    # ...and the job still gets the URI's credentials, through its environment
    if tc.is_http(uri):
        assert env["MLFLOW_TRACKING_PASSWORD"] == password and f"tracking.mlflow_uri={clean}" in fixed
    else:  # a database's password cannot be given apart from its URI: the URI goes by environment
        assert env == {"MLFLOW_TRACKING_URI": uri} and "tracking.mlflow_uri=null" in fixed
        raw = load_job(REPO / "jobs" / "tiny.yaml", fixed, resolve=False)
        assert raw.tracking.mlflow_uri is None  # the job on the cluster reads $MLFLOW_TRACKING_URI


class _Dashboard(http.server.BaseHTTPRequestHandler):
    """Just enough of Ray's dashboard for `raytrn submit` and `raytrn jobs list`: what each request carried is kept
    in ``seen`` (path, Authorization header, JSON body)."""

    seen: list[tuple[str, str | None, Any]] = []

    def _answer(self, code: int, body: Any = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        body = json.loads(data) if data and self.command == "POST" else None
        self.seen.append((self.path, self.headers.get("Authorization"), body))
        return body

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path == "/api/version":
            import ray

            self._answer(200, {"version": "4", "ray_version": ray.__version__, "ray_commit": "x"})
        elif self.path.startswith("/api/packages/"):
            self._answer(404)
        else:
            self._answer(200, [])

    def do_PUT(self) -> None:  # noqa: N802
        self._record()
        self._answer(200)

    def do_POST(self) -> None:  # noqa: N802
        body = self._record()
        self._answer(200, {"submission_id": body["submission_id"], "job_id": None})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dashboard() -> Iterator[int]:
    _Dashboard.seen = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize(("uri", "password"), [(c[0], c[1]) for c in CASES if "postgresql" in c[0] or "#w?rd" in c[0]])
def test_raytrn_submit_sends_the_dashboard_no_password_on_its_command_line(
    uri: str, password: str, dashboard: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    shutil.copy(REPO / "jobs" / "tiny.yaml", tmp_path / "tiny.yaml")
    monkeypatch.chdir(tmp_path)
    sets = ["data.manifest=/fsx/data", "checkpoint.storage=s3://bkt/ckpt", f"tracking.mlflow_uri={uri}"]
    sub.submit("tiny.yaml", address=f"http://127.0.0.1:{dashboard}", overrides=sets, follow=False, token="t")
    (posted,) = [body for path, _, body in _Dashboard.seen if path == "/api/jobs/" and body]
    assert not _leaks(posted["entrypoint"], password), posted["entrypoint"]
    assert "--set" in shlex.split(posted["entrypoint"])
    out = capsys.readouterr()
    assert not _leaks(out.out + out.err, password)


def test_jobs_list_errors_mask_a_password_in_the_address(capsys: pytest.CaptureFixture[str]) -> None:
    for address in (f"http://u:p/ss#w?rd@127.0.0.1:{_free_port()}", f"HTTP://u:s3cr?t@127.0.0.1:{_free_port()}"):
        assert main(["jobs", "list", "--address", address]) == 2
        err = capsys.readouterr().err
        assert "cannot reach the Ray dashboard at" in err and "127.0.0.1" in err
        assert not any(piece in err for piece in ("p/ss", "w?rd", "s3cr")), err


def test_jobs_list_sends_the_addresss_credentials_as_basic_auth(
    dashboard: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    assert main(["jobs", "list", "--address", f"http://u:p/ss#w?rd@127.0.0.1:{dashboard}"]) == 0
    expected = "Basic " + base64.b64encode(b"u:p/ss#w?rd").decode()
    assert [auth for path, auth, _ in _Dashboard.seen if path == "/api/jobs/"] == [expected, expected]
    assert "p/ss" not in capsys.readouterr().out


def test_mlflow_serve_keeps_a_database_password_off_its_command_line_and_errors() -> None:
    from raytrn.errors import ConfigError
    from raytrn.tracking.server import build_server_command

    uri = "postgresql://mlflow:p/ss#w?rd@db.internal:5432/mlflow"
    cmd = build_server_command(backend_store_uri=uri)
    assert cmd.env["MLFLOW_BACKEND_STORE_URI"] == uri and not any("p/ss" in a for a in cmd.argv)
    for wrong in ("http://u:p/ss#w?rd@mlflow:5000", "nosuch://u:p/ss#w?rd@db/x", "sqlite://u:p/ss#w?rd@x"):
        with pytest.raises(ConfigError) as e:
            build_server_command(backend_store_uri=wrong)
        assert "p/ss" not in str(e.value) and "w?rd" not in str(e.value) and ":***@" in str(e.value)


def test_serve_sh_masks_a_database_password_whatever_it_holds(tmp_path: Path) -> None:
    """mlflow/serve.sh, the operator's copy of `raytrn mlflow serve` in bash, masks the same passwords."""
    from tests.unit.test_mlflow_server import serve_sh

    uri = "postgresql://mlflow:p/ss#w?rd@db:5432/mlflow"
    proc = serve_sh({"MLFLOW_DATA_DIR": str(tmp_path), "MLFLOW_BACKEND_STORE_URI": uri}, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "store postgresql://mlflow:***@db:5432/mlflow" in proc.stderr
    assert "p/ss" not in proc.stdout + proc.stderr and "w?rd" not in proc.stdout + proc.stderr
    proc = serve_sh({"MLFLOW_DATA_DIR": str(tmp_path), "MLFLOW_BACKEND_STORE_URI": "http://u:p/ss@h:5000"}, "--dry-run")
    assert proc.returncode == 2 and "not a database URI" in proc.stderr and "p/ss" not in proc.stderr


def test_a_ray_address_with_a_password_is_masked_in_every_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime's RAY_ADDRESS messages (a dashboard URL given as the cluster address, an unreachable head) mask it as
    every other raytrn message does (raytrn.uris, below runtime and tracking alike)."""
    import socket

    from raytrn import runtime
    from raytrn.errors import RaytrnError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"http://admin:s3cr/t#x@127.0.0.1:{port}", f"HTTPS://admin:s3cr/t#x@127.0.0.1:{port}"):
        with pytest.raises(RaytrnError) as e:
            runtime._check_reachable(address, timeout_s=1.0)
        assert "s3cr" not in str(e.value) and "admin:***@" in str(e.value), str(e.value)
