"""What `raytrn submit` forwards from this shell to the job: not the paths of this machine (credential and certificate
files, any forwarded variable naming a file or directory here), which the cluster does not have; one note names
them, and `--env` forwards one anyway. The local simulator shares this filesystem: its jobs get them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from raytrn import submit as sub
from raytrn.runtime import LAPTOP_PATH_VARS, forwarded_env, unforwarded_paths
from raytrn.tracking.actor import driver_env
from tests.conftest import REPO
from tests.unit.test_uri_secrets import _Dashboard, dashboard  # noqa: F401 (a fixture)

NAMED = {
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH": "/home/me/certs/client.pem",
    "MLFLOW_TRACKING_SERVER_CERT_PATH": "/home/me/certs/ca.pem",
    "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
    "AWS_CONFIG_FILE": "/home/me/.aws/config",
}


def _environ(tmp_path: Path) -> dict[str, str]:
    bundle = tmp_path / "ca-bundle.pem"
    bundle.write_text("cert")
    return {
        **NAMED,
        "AWS_CA_BUNDLE": str(bundle),  # a file on this machine
        "RAYTRN_SAMPLE_TRACE": str(tmp_path),  # a directory on this machine
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "AWS_REGION": "us-west-2",
        "RAYTRN_ON_CLUSTER": "/fsx/not-on-this-machine",  # a path only the cluster has: the user meant it
        "HOME": "/home/me",
    }


def test_paths_of_this_machine_are_not_forwarded(tmp_path: Path) -> None:
    environ = _environ(tmp_path)
    env = forwarded_env(environ)
    assert env == {
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "AWS_REGION": "us-west-2",
        "RAYTRN_ON_CLUSTER": "/fsx/not-on-this-machine",
    }
    assert unforwarded_paths(environ) == sorted([*NAMED, "AWS_CA_BUNDLE", "RAYTRN_SAMPLE_TRACE"])
    assert set(NAMED) <= LAPTOP_PATH_VARS


def test_env_forwards_one_anyway_and_the_local_simulator_gets_them(tmp_path: Path) -> None:
    environ = _environ(tmp_path)
    explicit = {"AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"}
    env = forwarded_env(environ, explicit)
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == "/var/run/token"
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" not in unforwarded_paths(environ, explicit)
    local = forwarded_env(environ, same_machine=True)
    assert {k: local[k] for k in [*NAMED, "AWS_CA_BUNDLE", "RAYTRN_SAMPLE_TRACE"]} == {
        k: environ[k] for k in [*NAMED, "AWS_CA_BUNDLE", "RAYTRN_SAMPLE_TRACE"]
    }
    assert unforwarded_paths(environ, same_machine=True) == []


def test_the_tracking_actor_on_the_drivers_node_keeps_them(tmp_path: Path) -> None:
    environ = _environ(tmp_path)
    env = driver_env(environ)
    assert all(env[k] == environ[k] for k in [*NAMED, "AWS_CA_BUNDLE", "RAYTRN_SAMPLE_TRACE"])


def test_raytrn_submit_leaves_them_out_with_one_note(
    dashboard: int,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    job_dir = tmp_path / "wd"
    job_dir.mkdir()
    shutil.copy(REPO / "jobs" / "tiny.yaml", job_dir / "tiny.yaml")
    monkeypatch.chdir(job_dir)
    for key, value in _environ(tmp_path).items():
        monkeypatch.setenv(key, value)
    sets = ["data.manifest=/fsx/data", "checkpoint.storage=s3://bkt/ckpt"]
    sub.submit("tiny.yaml", address=f"http://127.0.0.1:{dashboard}", overrides=sets, follow=False, token="t",
               env={"MLFLOW_TRACKING_SERVER_CERT_PATH": "/etc/ssl/cluster-ca.pem"})  # fmt: skip
    (posted,) = [body for path, _, body in _Dashboard.seen if path == "/api/jobs/" and body]
    sent = posted["runtime_env"]["env_vars"]
    assert sent["MLFLOW_TRACKING_SERVER_CERT_PATH"] == "/etc/ssl/cluster-ca.pem"  # given with --env
    assert not {"AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE", "RAYTRN_SAMPLE_TRACE"} & set(sent)
    assert sent["RAYTRN_ON_CLUSTER"] == "/fsx/not-on-this-machine"
    out = capsys.readouterr()
    notes = [line for line in (out.out + out.err).splitlines() if "not forwarded" in line]
    assert len(notes) == 1, notes
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" in notes[0] and "RAYTRN_SAMPLE_TRACE" in notes[0]
    assert "MLFLOW_TRACKING_SERVER_CERT_PATH" not in notes[0] and "paths on this machine" in notes[0]
    assert "--env" in notes[0]
