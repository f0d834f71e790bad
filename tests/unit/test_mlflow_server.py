"""The ``mlflow server`` command line built by :func:`raytrn.tracking.server.build_server_command` (pure: no
server is started), and the checks ``raytrn mlflow serve`` makes before it starts one.
"""

from __future__ import annotations

import configparser
import os
import pickle
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raytrn.config import resolve_mlflow_uri
from raytrn.errors import ConfigError
from raytrn.tracking.server import (
    AUTH_ENV_VARS,
    build_server_command,
    check_port_free,
    default_backend_store_uri,
    render_auth_ini,
)
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.unit

AUTH_ENV = {"MLFLOW_AUTH_ADMIN_PASSWORD": "a-long-enough-password", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_serve_the_store_raytrn_train_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cmd = build_server_command(base_dir=str(tmp_path))
    # The same store `raytrn train` falls back to (one resolver for both).
    assert cmd.backend_store_uri == resolve_mlflow_uri(None, str(tmp_path)) == default_backend_store_uri(str(tmp_path))
    assert cmd.backend_store_uri == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert cmd.argv[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert option(cmd.argv, "--backend-store-uri") == cmd.backend_store_uri
    assert option(cmd.argv, "--host") == "127.0.0.1" and option(cmd.argv, "--port") == "5000"
    assert option(cmd.argv, "--workers") == "1"
    # Artifacts next to the database, where `raytrn train` puts them for a sqlite store.
    assert option(cmd.argv, "--artifacts-destination") == str(tmp_path / "mlruns" / "artifacts")
    assert cmd.env == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    assert "--app-name" not in cmd.argv and cmd.files == {}
    assert cmd.url == "http://127.0.0.1:5000"


def test_team_server_options() -> None:
    cmd = build_server_command(
        backend_store_uri="postgresql://mlflow@db.internal:5432/mlflow",
        artifacts_destination="s3://team-bucket/mlflow",
        host="10.0.1.5",
        port=5001,
        workers=4,
        mlflow_argv=["mlflow"],
        insecure=True,
    )
    assert cmd.argv == [
        "mlflow",
        "server",
        "--backend-store-uri",
        "postgresql://mlflow@db.internal:5432/mlflow",
        "--artifacts-destination",
        "s3://team-bucket/mlflow",
        "--host",
        "10.0.1.5",
        "--port",
        "5001",
        "--workers",
        "4",
    ]
    assert cmd.url == "http://10.0.1.5:5001"


def test_relative_paths_become_absolute(tmp_path: Path) -> None:
    cmd = build_server_command(
        backend_store_uri="sqlite:///store/runs.db", artifacts_destination="art", base_dir=str(tmp_path)
    )
    assert cmd.backend_store_uri == f"sqlite:///{tmp_path}/store/runs.db"
    assert cmd.artifacts_destination == str(tmp_path / "art")


def test_wildcard_host_gives_clients_the_host_name() -> None:
    cmd = build_server_command(host="0.0.0.0", port=5000, insecure=True)
    assert cmd.url == f"http://{socket.gethostname()}:5000"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "54.12.0.7", "2600:1f18::5", "mlflow.example.com"])
def test_a_host_beyond_private_networks_needs_auth_or_insecure(host: str) -> None:
    with pytest.raises(ConfigError, match=rf"--host {re.escape(host)} without --auth: the server would be reachable"):
        build_server_command(host=host)
    assert build_server_command(host=host, auth=True, environ=AUTH_ENV).argv[-2:] == ["--app-name", "basic-auth"]
    assert "--host" in build_server_command(host=host, insecure=True).argv
    for loopback in ("127.0.0.1", "127.0.1.1", "::1", "localhost", "10.0.1.5", "172.31.9.4", "192.168.0.2"):
        argv = build_server_command(host=loopback).argv
        assert argv[argv.index("--host") + 1] == loopback


def test_a_database_password_goes_to_the_server_by_environment_not_command_line() -> None:
    uri = "postgresql://mlflow:db-p@ss@db.internal:5432/mlflow"
    cmd = build_server_command(backend_store_uri=uri)
    assert cmd.env["MLFLOW_BACKEND_STORE_URI"] == uri
    assert not any("db-p" in a for a in cmd.argv) and "--backend-store-uri" not in cmd.argv


def test_auth_renders_an_ini_with_absolute_paths_and_no_password(tmp_path: Path) -> None:
    cmd = build_server_command(backend_store_uri=f"sqlite:///{tmp_path}/db/mlflow.db", auth=True, environ=AUTH_ENV)
    ini = str(tmp_path / "db" / "basic_auth.ini")
    assert cmd.argv[-2:] == ["--app-name", "basic-auth"]
    assert cmd.env["MLFLOW_AUTH_CONFIG_PATH"] == ini
    assert cmd.files == {ini: render_auth_ini(f"sqlite:///{tmp_path}/db/basic_auth.db")}
    assert f"database_uri = sqlite:///{tmp_path}/db/basic_auth.db" in cmd.files[ini]
    assert "admin_password" not in cmd.files[ini] and AUTH_ENV["MLFLOW_AUTH_ADMIN_PASSWORD"] not in cmd.files[ini]
    # The secrets stay in the caller's environment: the command does not copy them.
    assert not set(AUTH_ENV) & set(cmd.env)
    data_dir = build_server_command(auth=True, environ=AUTH_ENV, data_dir=str(tmp_path / "auth"))
    assert data_dir.env["MLFLOW_AUTH_CONFIG_PATH"] == str(tmp_path / "auth" / "basic_auth.ini")


@pytest.mark.parametrize(
    "environ, missing",
    [
        ({}, AUTH_ENV_VARS),
        ({"MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}, ("MLFLOW_AUTH_ADMIN_PASSWORD",)),
        ({"MLFLOW_AUTH_ADMIN_PASSWORD": "a-long-enough-password"}, ("MLFLOW_FLASK_SERVER_SECRET_KEY",)),
        ({**AUTH_ENV, "MLFLOW_AUTH_ADMIN_PASSWORD": ""}, ("MLFLOW_AUTH_ADMIN_PASSWORD",)),
    ],
)
def test_auth_names_the_missing_variables(environ: dict[str, str], missing: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        build_server_command(auth=True, environ=environ)
    message = str(info.value)
    assert message.startswith("--auth: ") and "not set" in message
    for name in AUTH_ENV_VARS:
        assert (name in message) == (name in missing), message
    pickle.loads(pickle.dumps(info.value))  # crosses process boundaries like every raytrn error


def test_auth_rejects_a_short_password() -> None:
    with pytest.raises(ConfigError, match="shorter than 12 characters"):
        build_server_command(auth=True, environ={**AUTH_ENV, "MLFLOW_AUTH_ADMIN_PASSWORD": "short"})


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"backend_store_uri": "http://10.0.0.1:5000"}, "unsupported scheme 'http'.*tracking server"),
        ({"backend_store_uri": "s3://bucket/mlflow"}, "unsupported scheme 's3'"),
        ({"backend_store_uri": "mlruns/mlflow.db"}, "not a database URI.*sqlite:///"),
        ({"backend_store_uri": "sqlite://mlflow.db"}, "three slashes"),
        ({"artifacts_destination": "ftp://host/x"}, "unsupported scheme 'ftp'"),
        ({"artifacts_destination": "s3:///mlflow"}, "no bucket"),
        ({"port": 0}, "not a TCP port"),
        ({"port": 70000}, "not a TCP port"),
        ({"workers": 0}, "at least 1"),
    ],
)
def test_bad_options_are_config_errors(kwargs: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        build_server_command(**kwargs)


def test_accepted_backend_schemes() -> None:
    for uri in ("postgresql+psycopg2://u@h/db", "mysql+pymysql://u@h/db", "sqlite:////abs/mlflow.db", "file:///abs"):
        assert build_server_command(backend_store_uri=uri).backend_store_uri == uri


def test_port_in_use_is_a_config_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port} is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again


def test_cli_bad_backend_uri_exits_2(tmp_path: Path) -> None:
    proc = run_cli("mlflow", "serve", "--backend-store-uri", "http://127.0.0.1:1", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("raytrn: error: --backend-store-uri 'http://127.0.0.1:1': unsupported scheme")
    assert "Traceback" not in proc.stderr and not (tmp_path / "mlruns").exists()


SERVE_SH = REPO / "mlflow" / "serve.sh"


def serve_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """mlflow/serve.sh with a clean MLflow environment (only ``env`` set), bounded in time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAYTRN_"))}
    return subprocess.run(
        ["bash", str(SERVE_SH), *args], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("auth", [False, True], ids=["plain", "auth"])
def test_serve_sh_runs_the_same_command_as_raytrn(tmp_path: Path, auth: bool) -> None:
    """The operator script and `raytrn mlflow serve` stay one command: same argv, same auth ini."""
    env = {"MLFLOW_DATA_DIR": str(tmp_path), "MLFLOW_HOST": "10.0.0.5", "MLFLOW_PORT": "5001"}
    env |= {"MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow:db-pw@db:5432/mlflow"} if auth else {}
    if auth:
        env |= {"RAYTRN_MLFLOW_AUTH": "1", "MLFLOW_ARTIFACTS_DESTINATION": "s3://team/mlflow", **AUTH_ENV}
    proc = serve_sh(env, "--workers", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    cmd = build_server_command(
        backend_store_uri=env.get("MLFLOW_BACKEND_STORE_URI", f"sqlite:///{tmp_path}/mlflow.db"),
        artifacts_destination=env.get("MLFLOW_ARTIFACTS_DESTINATION"),
        host="10.0.0.5",
        port=5001,
        workers=2,
        auth=auth,
        environ=AUTH_ENV,
        mlflow_argv=["mlflow"],
        data_dir=str(tmp_path),
    )
    assert shlex.split(proc.stdout) == cmd.argv and "db-pw" not in proc.stdout + proc.stderr
    for path, text in cmd.files.items():  # the rendered template has the same settings as raytrn's ini
        rendered, ours = configparser.ConfigParser(), configparser.ConfigParser()
        rendered.read(path)
        ours.read_string(text)
        assert dict(rendered["mlflow"]) == dict(ours["mlflow"])
        assert (
            "@" not in Path(path).read_text() and AUTH_ENV["MLFLOW_AUTH_ADMIN_PASSWORD"] not in Path(path).read_text()
        )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RAYTRN_MLFLOW_AUTH": "1", "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}, "MLFLOW_AUTH_ADMIN_PASSWORD not set"),
        ({"RAYTRN_MLFLOW_AUTH": "1", **AUTH_ENV, "MLFLOW_AUTH_ADMIN_PASSWORD": "short"}, "shorter than 12"),
        ({"MLFLOW_BACKEND_STORE_URI": "http://10.0.0.1:5000"}, "not a database URI"),
        ({"MLFLOW_BACKEND_STORE_URI": "sqlite:///rel.db"}, "absolute path"),
        ({"MLFLOW_ARTIFACTS_DESTINATION": "relative/dir"}, "s3://BUCKET/PREFIX"),
        ({"MLFLOW_PORT": "x"}, "not a TCP port"),
        ({"MLFLOW_HOST": "0.0.0.0"}, "MLFLOW_HOST=0.0.0.0 without RAYTRN_MLFLOW_AUTH=1: the server would be"),
        ({"MLFLOW_HOST": "54.12.0.7"}, "MLFLOW_HOST=54.12.0.7 without RAYTRN_MLFLOW_AUTH=1: the server would be"),
    ],
)
def test_serve_sh_refuses_bad_settings(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    proc = serve_sh({"MLFLOW_DATA_DIR": str(tmp_path), **env}, "--dry-run")
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "basic_auth.ini").exists()


def test_stop_never_signals_a_server_already_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped (reaped) server's PID may be another process group's by now: stopping it again signals nothing."""
    from raytrn.tracking import server

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(timeout=30)
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(server.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    server.stop(proc, timeout_s=1)
    assert sent == []
