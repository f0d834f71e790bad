"""`raytrn train` through the real command line: its own embedded Ray, the printed summary, exit codes."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration


def _train_args(tiny_dataset: Path, overrides: tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    """`raytrn train jobs/tiny.yaml`'s arguments, shrunk to the test dataset."""
    sets = [f"data.manifest={tiny_dataset}", "data.seq_len=32", "model.vocab_size=512", *overrides]
    args = [a for kv in sets for a in ("--set", kv)]
    return ["train", str(REPO / "jobs" / "tiny.yaml"), *args, "--no-progress", *flags]


def _train(tiny_dataset: Path, cwd: Path, *overrides: str, timeout: float = 300, flags: tuple[str, ...] = ()):
    """`raytrn train jobs/tiny.yaml` shrunk to the test dataset, run in ``cwd``."""
    return run_cli(*_train_args(tiny_dataset, overrides, flags), cwd=cwd, timeout=timeout)


def _train_watched(
    tiny_dataset: Path,
    cwd: Path,
    *overrides: str,
    on_line: Callable[[str, int], None],
    timeout: float = 300,
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """:func:`_train`, with ``on_line(line, pid)`` called on each line it prints to stdout while it runs."""
    args = [sys.executable, "-m", "raytrn.cli", *_train_args(tiny_dataset, overrides, flags)]
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = threading.Timer(timeout, proc.kill)  # a hung run ends the loop below
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)
    out: list[str] = []
    deadline.start()
    reader.start()
    try:
        for line in proc.stdout or ():
            out.append(line)
            on_line(line, proc.pid)
        proc.wait(timeout=60)
    finally:
        deadline.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=30)
    return subprocess.CompletedProcess(args, proc.returncode, "".join(out), "".join(err))


def _process_tree(pid: int) -> list[str]:
    """The command lines of ``pid``'s descendants (those still there when read)."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found.append(" ".join(child.cmdline()))
        except psutil.Error:
            pass
    return found


#: Ray's own lines that `raytrn train` printed between raytrn's before they went to the run's log file.
#: Ray Train's controller's lines (it runs in the driver: raytrn.compat.hosted_trainer), which raytrn's Ray log gets.
RAY_PLUMBING = (
    "Attempting to start training worker group",
    "world_rank=0, local_rank=0",
)


def _ray_log(out: str) -> Path:
    """The log file ``raytrn train`` printed (once) for Ray's lines."""
    paths = re.findall(r"^raytrn: Ray's logs: (\S+)$", out, flags=re.M)
    assert len(paths) == 1, out
    return Path(paths[0])


def test_cli_train_prints_summary(tiny_dataset: Path, tmp_path: Path) -> None:
    started = time.time()
    tree: list[str] = []  # the run's processes at its first progress line

    def watch(line: str, pid: int) -> None:
        if line.startswith("step ") and not tree:
            tree.extend(_process_tree(pid))

    proc = _train_watched(
        tiny_dataset,
        tmp_path,  # relative paths (checkpoints/, mlruns/) land here
        "data.micro_batch_size=4",
        "scaling.min_workers=1",
        "scaling.max_workers=1",
        "run.max_steps=6",
        "run.log_every=2",
        "checkpoint.every_n_steps=3",
        "tracking.usd_per_hour=3.6",  # a price: cost metrics appear (a CPU has no peak FLOP/s: no MFU)
        on_line=watch,
    )
    wall_s = time.time() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "== raytrn: training finished ==" in out
    assert re.search(r"steps\s+6 this run, 6 in total", out)
    assert re.search(r"loss\s+\d+\.\d+ \(first logged\) -> \d+\.\d+ \(final\)", out)
    run_id = re.search(r"mlflow run\s+([0-9a-f]{32})", out).group(1)
    ui = re.search(r"mlflow ui\s+(\S*mlflow ui --backend-store-uri (\S+) --port 5000)", out)
    assert ui and ui.group(2) == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    ckpt = re.search(r"^checkpoint\s+(\S+)$", out, flags=re.M).group(1)
    # Where the run's wall time went, in the summary (raytrn.tracking.goodput) and in MLflow
    assert re.search(r"^goodput\s+0\.\d\d \([\d.]+ of [\d.]+ s productive\); startup [\d.]+ s", out, flags=re.M), out
    assert ckpt.startswith(str(tmp_path / "checkpoints" / "tiny-")) and ckpt.endswith("checkpoint_00000006")
    meta = json.loads((Path(ckpt) / "meta.json").read_text())  # Ray's checkpoint points at the sharded state
    assert meta["step"] == 6 and (Path(meta["dcp"]) / ".metadata").is_file()
    # Progress lines were printed while it ran (one per logged step).
    assert re.findall(r"^step (\d+)/6 ", out, flags=re.M) == ["2", "4", "6"]
    # The terminal shows raytrn, not Ray's plumbing: that is in the run's log file (named once).
    log = _ray_log(out)
    assert log == tmp_path / "logs" / f"{run_name(out)}.log" and log.is_file()
    for line in RAY_PLUMBING:
        assert line not in proc.stdout + proc.stderr, (line, proc.stdout + proc.stderr)
        assert line in log.read_text(), line
    assert "Token authentication is enabled" not in proc.stderr
    assert "PYTHON worker processes" not in proc.stdout + proc.stderr
    assert "PlacementGroupCleaner" not in proc.stdout + proc.stderr
    # Its embedded Ray started its dashboard process without modules (--ray-dashboard: the next test): no URL
    dashboards = [c for c in tree if "dashboard/dashboard.py" in c]
    assert len(dashboards) == 1 and "--modules-to-load=UsageStatsHead" in dashboards[0], tree
    assert not [c for c in tree if "ray-dashboard-" in c] and "Ray dashboard" not in proc.stdout, tree
    # Its dashboard agent on a port the OS picked (raytrn.compat.local_ray), beside the session's Ray: it bound at
    # once (on Ray's fixed port, taken, it retried ~3.4 s, then ran without its HTTP server). The raylet starts it:
    # its command line holds the agent's (the agent's own is renamed ray::DashboardAgent)
    (raylet,) = [args for args in map(str.split, tree) if args and args[0].endswith("raylet/raylet")]
    assert "--listen-port=0" in raylet, raylet
    agent_log = Path(next(a for a in raylet if a.startswith("--log_dir=")).partition("=")[2]) / "dashboard_agent.log"
    assert "to bind" not in agent_log.read_text(), agent_log.read_text()[-3000:]

    from mlflow.tracking import MlflowClient

    run = MlflowClient(ui.group(2)).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["run.max_steps"] == "6"
    cost = [
        m.value for m in sorted(MlflowClient(ui.group(2)).get_metric_history(run_id, "cost_usd"), key=lambda m: m.step)
    ]
    assert len(cost) == 3 and 0 < cost[0] < cost[1] < cost[2] < 3.6  # running cost, well under an hour
    assert run.data.metrics["usd_per_1m_tokens"] > 0 and run.data.metrics["tokens_per_usd"] > 0
    ledger = {k: v for k, v in run.data.metrics.items() if k.startswith(("goodput", "badput_")) or k == "wall_s"}
    assert 0 < ledger["goodput"] < 1 and ledger["wall_s"] < wall_s and ledger["badput_startup_s"] > 0, ledger
    assert (
        abs(sum(v for k, v in ledger.items() if k.endswith("_s") and k != "wall_s") - ledger["wall_s"])
        < 0.02 * ledger["wall_s"]
    )
    assert "mfu" not in run.data.metrics
    # Start-up cost: from the process start to the end of step 1, in the summary and as a metric at step 1.
    shown = re.search(r"start-up\s+first step done (\d+\.\d) s after launch", out)
    assert shown and 0 < float(shown.group(1)) < wall_s
    (first,) = MlflowClient(ui.group(2)).get_metric_history(run_id, "time_to_first_step_s")
    assert first.step == 1 and abs(first.value - float(shown.group(1))) < 0.1


def run_name(out: str) -> str:
    return re.search(r"^run\s+(\S+)$", out, flags=re.M).group(1)


def test_cli_train_verbose_shows_rays_lines(tiny_dataset: Path, tmp_path: Path) -> None:
    """``--verbose``: Ray's lines on the terminal as before, and no log file of them. ``--ray-dashboard``: the embedded
    Ray's dashboard, its URL printed, answers while the run trains (without the flag it has no modules: the test
    above)."""
    import urllib.request

    versions: list[dict] = []

    def ask(line: str, pid: int) -> None:
        url = re.fullmatch(r"raytrn: Ray dashboard: (http://127\.0\.0\.1:\d+)", line.strip())
        if url:
            with urllib.request.urlopen(f"{url.group(1)}/api/version", timeout=30) as response:
                versions.append(json.loads(response.read()))

    proc = _train_watched(
        tiny_dataset,
        tmp_path,
        "scaling.min_workers=1",
        "scaling.max_workers=1",
        "run.max_steps=2",
        "run.log_every=1",
        "tracking.enabled=false",
        on_line=ask,
        flags=("--verbose", "--ray-dashboard"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = proc.stdout + proc.stderr
    assert "== raytrn: training finished ==" in proc.stdout
    assert len(versions) == 1 and versions[0]["ray_version"], both[-3000:]
    for line in RAY_PLUMBING:
        assert line in both, (line, both)
    assert "Ray's logs:" not in both and not (tmp_path / "logs").exists()


#: A process that starts raytrn's embedded local Ray and exits: every stop of a process of its node, in order, as Ray's
#: node makes them ((kind, whether it gave the process time to exit), printed last at exit, after Ray's shutdown).
EMBEDDED_RAY_EXIT = """
import atexit
stops = []
atexit.register(lambda: print("stops", stops, flush=True))  # (before Ray's import: runs after its shutdown)
import ray._private.node as node
from raytrn.runtime import ensure_ray
impl = node.Node._kill_process_impl
def watched(self, kind, allow_graceful=False, *args, **kwargs):
    if kind in self.all_processes:
        stops.append((kind, allow_graceful))
    return impl(self, kind, allow_graceful, *args, **kwargs)
node.Node._kill_process_impl = watched
assert ensure_ray()
import ray._private.worker as worker
print("monitor", worker._global_node.all_processes["monitor"][0].process.pid, flush=True)
"""


def test_an_embedded_local_rays_autoscaler_monitor_is_stopped_without_waiting_for_it() -> None:
    """At exit, raytrn stops its embedded local Ray's autoscaler monitor at once, before Ray's shutdown, which stops
    each of the node's processes with a second to exit: the monitor takes it whole (it exits at its next update, 5 s)
    and is then killed anyway (measured: 1.02 of ray.shutdown's 1.12 s, at the end of every local `raytrn train`).
    Ray's other processes still get their graceful stop; none outlives the process."""
    import psutil

    proc = subprocess.run([sys.executable, "-c", EMBEDDED_RAY_EXIT], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("stops ", "monitor ")))
    stops = ast.literal_eval(lines["stops"])
    assert stops[0] == ("monitor", False), stops  # first, and no wait for it
    assert ("raylet", True) in stops and ("gcs_server", True) in stops, stops
    assert [kind for kind, _ in stops].count("monitor") == 1, stops
    monitor = int(lines["monitor"])
    assert not psutil.pid_exists(monitor) or psutil.Process(monitor).status() == psutil.STATUS_ZOMBIE


def test_cli_train_unsatisfiable_resources_on_local_ray(tiny_dataset: Path, tmp_path: Path) -> None:
    """A local Ray cannot grow: asking for NeuronCores it would lack (no Neuron tools here) fails before it starts,
    exit 2, nothing tracked."""
    proc = _train(tiny_dataset, tmp_path, "scaling.resources_per_worker={neuron_cores: 1}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raytrn: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "needs 2 'neuron_cores' (2 workers x 1) but this local Ray has 0" in errors[0]
    assert "Ray's logs:" not in proc.stdout  # no Ray was started (raytrn names its log file once it is up)
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "mlruns").exists()  # the tracking actor that creates the run never started


def test_cli_train_stops_when_mlflow_refuses_the_run(tiny_dataset: Path, tmp_path: Path) -> None:
    """The run is created by the tracking actor while the workers start; when MLflow refuses it (here: the
    experiment is deleted) the training is stopped (it would run for minutes) with that one error, exit 2. (The
    actor creates the run before it lowers its priority: at nice 10 from its start, on cores busy with the other
    pytest process's tests and then this run's own training, the refusal had not come 240 s later: stop 94.)"""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()
    client = MlflowClient(store)
    client.delete_experiment(client.create_experiment("gone"))
    started = time.time()
    proc = _train(tiny_dataset, tmp_path, "tracking.experiment=gone", "run.max_steps=100000", timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.time() - started < 200  # stopped, not trained to the end
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raytrn: error:")]
    # (Ray's own actors may log a traceback while the aborted run is torn down; the driver prints none.)
    assert len(errors) == 1 and not re.search(r"^Traceback", proc.stderr, flags=re.M), proc.stderr[-3000:]
    assert "tracking.experiment='gone' is deleted in sqlite:" in errors[0] and "restore it" in errors[0]
    assert "training finished" not in proc.stdout
    assert client.search_runs([e.experiment_id for e in client.search_experiments(view_type=3)], run_view_type=3) == []
    assert not list((tmp_path / "checkpoints").glob("*/checkpoint_*"))
