"""The ``raytrn`` entry itself, in a subprocess: ``python -m raytrn`` is the console script, and a reader that stops
early (``raytrn ... | head``) ends it quietly, without a ``BrokenPipeError`` traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

TINY = str(REPO / "jobs" / "tiny.yaml")


def test_python_dash_m_raytrn_is_the_raytrn_command(tmp_path) -> None:
    def raytrn(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "raytrn", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    helped = raytrn("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: raytrn "), helped.stderr
    misused = raytrn("validate", str(tmp_path / "missing.yaml"))
    assert misused.returncode == 2 and misused.stdout == ""
    assert misused.stderr.startswith("raytrn: error:") and len(misused.stderr.splitlines()) == 1, misused.stderr


def test_a_reader_that_stops_early_ends_raytrn_quietly(tmp_path) -> None:
    """``raytrn validate JOB | head -0``: the pipe is closed before raytrn writes (it starts in ~1 s)."""
    read, write = os.pipe()
    with subprocess.Popen([sys.executable, "-m", "raytrn", "validate", TINY, "--no-data"], cwd=tmp_path,
                          stdout=write, stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        os.close(write)
        os.close(read)  # the reader is gone before raytrn prints
        _, err = proc.communicate(timeout=120)
    assert err == "" and proc.returncode == 141, err
