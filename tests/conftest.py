"""Shared fixtures: one local Ray per test session, a prepared tiny dataset, and test isolation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_CORPUS = REPO / "tests" / "fixtures" / "corpus"


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
