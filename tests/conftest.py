"""Shared fixtures: one local Ray per test session, a prepared tiny dataset, and test isolation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_CORPUS = REPO / "tests" / "fixtures" / "corpus"

# Set before any Ray process starts, so every worker inherits them: tests never depend on a token
# file or AWS credentials left on the machine (the S3 endpoint is a local moto server).
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: 3 logical CPUs = 2 training workers + 1 for Ray Data."""
    import ray

    ray.init(num_cpus=3, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dataset(ray_session, tmp_path_factory) -> Path:
    """The fixture corpus packed for the tiny model (seq_len 32, BPE vocab 512)."""
    from raytrn.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare_dataset(inputs=[str(FIXTURE_CORPUS)], output=str(out), seq_len=32, vocab_size=512, progress=False)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, timeout_s: float, proc) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3 endpoint: a moto server on 127.0.0.1 (stopped by PID at the end)."""
    import subprocess

    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, 30, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A fresh bucket on the moto server; AWS_ENDPOINT_URL points raytrn (driver side) at it."""
    import uuid

    import boto3

    name = f"raytrn-test-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    return name


def run_cli(*args: str, cwd: str | Path | None = None, timeout: float = 300, env: dict | None = None):
    """Run ``python -m raytrn.cli ARGS`` in a subprocess (bounded in time)."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "raytrn.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
