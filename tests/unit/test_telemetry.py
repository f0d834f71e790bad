"""Third-party usage telemetry stays off in raytrn's processes unless the user turns it on (raytrn.telemetry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from raytrn.telemetry import OFF, keep_off
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def test_keep_off_sets_only_what_the_user_left_unset() -> None:
    environ: dict[str, str] = {}
    assert keep_off(environ) == OFF and environ == OFF
    users = {"MLFLOW_DISABLE_TELEMETRY": "false", "RAY_USAGE_STATS_ENABLED": "1"}
    environ = dict(users)
    assert keep_off(environ) == {} and environ == users  # the user's choice wins, either way


#: A fresh interpreter: imports raytrn (or not) before MLflow, records every host name it looks up (Python's audit
#: events), logs a run to a sqlite store (only without a telemetry client: this machine only), waits, and prints
#: what it saw.
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    looked_up = []
    sys.addaudithook(lambda event, args: looked_up.append(str(args[0])) if event == "socket.getaddrinfo" else None)
    if sys.argv[1] == "raytrn":
        import raytrn
    import mlflow
    from mlflow.telemetry.client import get_telemetry_client
    client = get_telemetry_client()
    if sys.argv[2] == "log" and client is None:  # (with a client, logging would look up the makers' host)
        mlflow.set_tracking_uri("sqlite:///" + sys.argv[3])
        mlflow.set_experiment("telemetry")
        with mlflow.start_run():
            mlflow.log_metric("loss", 1.0)
        time.sleep(1.5)  # (a thread the logging started, a telemetry client's or another's, has time to look up)
    print(json.dumps({"client": client is not None, "looked_up": looked_up,
                      "env": {k: os.environ.get(k) for k in ("MLFLOW_DISABLE_TELEMETRY", "RAY_USAGE_STATS_ENABLED")}}))
    """
)


def _probe(first: str, action: str, tmp_path, **env: str) -> dict:
    # no CI or test markers (MLflow turns its telemetry off by itself under pytest and on CI machines)
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, first, action, str(tmp_path / "mlflow.db")],
        env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_raytrn_process_writes_its_run_without_mlflows_telemetry(tmp_path) -> None:
    # without raytrn, this interpreter has MLflow's telemetry client (not exercised: it would look up the makers' host)
    assert _probe("mlflow", "import", tmp_path)["client"] is True
    seen = _probe("raytrn", "log", tmp_path)
    assert seen["client"] is False and seen["env"] == OFF, seen
    assert [h for h in seen["looked_up"] if h not in ("localhost", "127.0.0.1", "::1")] == [], seen
    # the user's choice stands
    kept = _probe("raytrn", "import", tmp_path, MLFLOW_DISABLE_TELEMETRY="false", RAY_USAGE_STATS_ENABLED="1")
    assert kept["client"] is True and kept["env"] == {
        "MLFLOW_DISABLE_TELEMETRY": "false",
        "RAY_USAGE_STATS_ENABLED": "1",
    }
