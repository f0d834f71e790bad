"""raytrn.train.refused: a run MLflow refuses stops ``fit()`` with the refusal, also in a process that started with
SIGINT ignored (a background job of a script, a pytest-xdist worker's child), where ``_thread.interrupt_main`` did
nothing and the refused run trained on (stop 94); a real SIGINT the parent ignored stays ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# fit() as raytrn's controller runs it (asyncio.run in the main thread), refused once the file `go` exists
SCRIPT = r"""
import asyncio, os, signal, sys, time
from raytrn.errors import ConfigError
from raytrn.train.refused import RunRefusedWatch

class Refusal:  # the tracking actor's answer (raytrn.pending.Pending): a refusal, once the test says so
    def done(self):
        return os.path.exists("go")
    def result(self, timeout_s=None):
        while not os.path.exists("go"):
            time.sleep(0.05)
        raise ConfigError("tracking.experiment='gone' is deleted")

async def fit():
    for _ in range(600):
        await asyncio.sleep(0.05)

before = signal.getsignal(signal.SIGINT)
watch = RunRefusedWatch(Refusal())
started = time.monotonic()
try:
    with watch:
        print("fitting", flush=True)
        asyncio.run(fit())
    print("trained to the end", flush=True)
except KeyboardInterrupt:
    try:
        watch.raise_if_refused()
    except ConfigError as e:
        print(f"stopped: {e} after {time.monotonic() - started:.1f} s", flush=True)
print("handler restored:", signal.getsignal(signal.SIGINT) is before, flush=True)
"""


@pytest.mark.parametrize("sigint", ["ignored", "python"])
def test_a_refusal_stops_fit_and_a_real_sigint_the_parent_ignored_stays_ignored(tmp_path: Path, sigint: str) -> None:
    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=ignore_sigint if sigint == "ignored" else None,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "fitting\n", proc.stderr.read()
        if sigint == "ignored":
            os.kill(proc.pid, signal.SIGINT)  # a real one: ignored, as the parent meant
            time.sleep(0.5)
            assert proc.poll() is None
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("stopped: tracking.experiment='gone' is deleted after "), out + err
    assert float(lines[0].split()[-2]) < 20  # not the 30 s of training
    assert lines[1] == "handler restored: True"
