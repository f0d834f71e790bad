"""The local simulator's bookkeeping: its token, its state file, what `down` may delete (no Ray started here;
the simulator itself runs in tests/integration/test_laptop_path.py and test_autoscaling.py)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from raytrn.cluster import local
from raytrn.errors import RaytrnError

pytestmark = pytest.mark.unit


def test_token_is_made_once_private_and_reused(tmp_path: Path) -> None:
    path = local.ensure_token(tmp_path / "d" / "local-cluster.token")
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local.ensure_token(path).read_text() == token  # reused by every `up`
    os.chmod(path, 0o644)
    local.ensure_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # made private again
    path.write_text("")
    with pytest.raises(RaytrnError, match="auth token file is empty"):
        local.ensure_token(path)


def test_state_files_from_before_mlflow_still_load(tmp_path: Path) -> None:
    old = {
        "gcs_address": "127.0.0.1:6379", "dashboard_url": "http://127.0.0.1:8265", "temp_dir": "/tmp/raytrn-sim-x",
        "session_dir": "/tmp/raytrn-sim-x/s", "state_file": str(tmp_path / "s.json"), "auth": "disabled",
        "token_path": None, "pids": {}, "procs": [[1, 2.0]], "an_unknown_key": 1,
    }  # fmt: skip
    cluster = local.LocalCluster.from_json(old)
    assert cluster.mlflow_url is None and cluster.procs == [(1, 2.0)] and cluster.all_procs == [(1, 2.0)]
    back = local.LocalCluster.from_json(json.loads(json.dumps({**cluster.to_json(), "mlflow_proc": [5, 6.0]})))
    assert back.mlflow_proc == (5, 6.0) and back.all_procs == [(1, 2.0), (5, 6.0)]


def test_same_dashboard_url() -> None:
    assert local._same_url("http://127.0.0.1:8265", "http://localhost:8265/")
    assert local._same_url("127.0.0.1:8265", "http://127.0.0.1:8265")
    assert not local._same_url("http://127.0.0.1:8266", "http://127.0.0.1:8265")
    assert not local._same_url("http://10.0.0.1:8265", "http://127.0.0.1:8265")  # an SSH tunnel's remote is not


def test_nothing_recorded_is_not_running(tmp_path: Path) -> None:
    assert local.running("http://127.0.0.1:8265", tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert local.running(None, tmp_path / "bad.json") is None


def test_down_deletes_only_the_simulators_temp_dir(tmp_path: Path) -> None:
    """The state file is the user's: a tampered temp_dir never makes `down` delete anything else."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "f").write_text("keep")
    local._remove_temp_dir(str(precious))  # not /tmp/raytrn-sim-*: left alone
    assert (precious / "f").exists()
    local._remove_temp_dir("/tmp/raytrn-sim-x/../../etc")  # not a simulator's name: left alone
    link = Path("/tmp") / f"{local._TEMP_PREFIX}link-{os.getpid()}"
    link.symlink_to(precious)  # a simulator's name pointing elsewhere: the link goes, not what it points to
    local._remove_temp_dir(str(link))
    assert not link.exists() and (precious / "f").read_text() == "keep"
    sim = Path("/tmp") / f"{local._TEMP_PREFIX}unit-{os.getpid()}"
    sim.mkdir()
    (sim / "session").mkdir()
    local._remove_temp_dir(str(sim))
    assert not sim.exists()


def test_a_marked_process_is_found_by_its_environment(tmp_path: Path) -> None:
    """Processes Ray starts detached, without the temp dir on their command line, carry the marker."""
    import subprocess
    import sys

    marker = f"/tmp/{local._TEMP_PREFIX}marker{os.getpid()}"
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, local.MARKER_ENV: marker}
    )
    try:
        deadline = time.monotonic() + 10  # its environment is readable once it runs (a loaded machine: not at once)
        found = [pid for pid, _ in local._cluster_procs(marker)]
        while found != [child.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
            found = [pid for pid, _ in local._cluster_procs(marker)]
        assert found == [child.pid]
    finally:
        child.kill()
        child.wait(timeout=10)


@pytest.mark.parametrize("temp_dir", ["", "/", "/tmp", "relative/raytrn-sim-x", "/home/me/project"])
def test_down_refuses_a_temp_dir_that_is_not_the_simulators(temp_dir: str) -> None:
    """An empty or edited state file must not name every process of the machine (an empty string is in every
    command line)."""
    with pytest.raises(RaytrnError, match="not one the simulator makes"):
        local._cluster_procs(temp_dir)


def test_a_process_is_found_only_by_the_whole_temp_dir(tmp_path: Path) -> None:
    """``/tmp/raytrn-sim-ab`` names neither ``/tmp/raytrn-sim-abc`` nor a file beside it."""
    import subprocess
    import sys

    ours = f"/tmp/{local._TEMP_PREFIX}unit{os.getpid()}"
    procs = {
        arg: subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", arg])
        for arg in (f"--temp-dir={ours}", f"{ours}/session_x/logs", f"{ours}c", f"{ours}.log")
    }
    try:
        found = {pid for pid, _ in local._cluster_procs(ours)}
        assert found == {procs[f"--temp-dir={ours}"].pid, procs[f"{ours}/session_x/logs"].pid}
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


def test_the_autoscaler_stops_first_and_the_gcs_last() -> None:
    """Stopped all at once the autoscaler hangs reporting to a GCS that is going and the GCS outlives its SIGTERM
    (measured: 15 s and SIGKILLs against 6 s in this order)."""
    site = "/venv/lib/python3.11/site-packages/ray"
    cmdlines = {
        1: [f"{site}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/raytrn-sim-x"],
        2: [f"{site}/core/src/ray/raylet/raylet", "--gcs-address=127.0.0.1:6379"],
        3: ["/venv/bin/python", "-u", f"{site}/autoscaler/_private/monitor.py", "--logs-dir=/tmp/raytrn-sim-x"],
        4: ["ray::DashboardAgent"],
    }
    procs = [(pid, 100.0 + pid) for pid in (1, 2, 3, 4, 5)]  # 5: gone before its command line was read
    assert local.stop_stages(procs, cmdlines) == [[(3, 103.0)], [(2, 102.0), (4, 104.0), (5, 105.0)], [(1, 101.0)]]
    assert local.stop_stages(procs, {}) == [[], procs, []]
