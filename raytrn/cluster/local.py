"""The local trn-cluster simulator: a Ray head with the ``fake_multinode`` autoscaler on this machine.

``up()`` runs ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`` with its own Ray temp
directory, so every process of this cluster (head, autoscaler, the fake worker nodes it launches, their
workers) names that directory on its command line; ``down()`` stops exactly those processes by PID,
never by name, and never with ``ray stop`` (which stops every Ray cluster on the machine).

Authentication is explicit: ``auth="disabled"`` (the default: the head listens on 127.0.0.1 only, and
clients must then run with ``RAY_AUTH_MODE=disabled``), or ``auth="token"``, a fresh token in the state
directory handed to the cluster and clients through ``RAY_AUTH_TOKEN_PATH``. A token left in
``~/.ray/auth_token`` is never relied on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raytrn.errors import RaytrnError

DEFAULT_CONFIG = "cluster/local-sim.yaml"
DEFAULT_STATE_FILE = Path.home() / ".raytrn" / "local-cluster.json"


@dataclasses.dataclass(kw_only=True)
class LocalCluster:
    """What ``up()`` started, as recorded in its state file."""

    gcs_address: str  # 127.0.0.1:PORT: for ray.init(address=...) / RAY_ADDRESS
    dashboard_url: str  # http://127.0.0.1:PORT: for `ray job submit --address` / JobSubmissionClient
    temp_dir: str  # this cluster's Ray temp dir (sessions, logs, the resolved autoscaling config)
    session_dir: str
    state_file: str
    auth: str  # "disabled" or "token"
    token_path: str | None
    pids: dict[str, int]  # "gcs_server-123" -> 123, for people reading the state file
    procs: list[tuple[int, float]]  # (pid, create_time) of the head processes, to survive PID reuse

    @property
    def env(self) -> dict[str, str]:
        """Environment a client (ray CLI, ray.init, JobSubmissionClient) needs to talk to this cluster."""
        if self.auth == "token":
            assert self.token_path is not None
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}
        return {"RAY_AUTH_MODE": "disabled"}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalCluster:
        data = dict(data)
        data["procs"] = [tuple(p) for p in data.get("procs", [])]
        return cls(**data)


def up(
    *,
    config: str | os.PathLike[str] = DEFAULT_CONFIG,
    port: int | None = None,
    dashboard_port: int = 8265,
    timeout_s: float = 60,
    state_file: str | os.PathLike[str] | None = None,
    auth: str = "disabled",
) -> LocalCluster:
    """Start the simulator from ``config`` (a fake_multinode cluster YAML) and record it in ``state_file``.

    ``port`` is the GCS port (default 6379); the YAML's ``provider.gcs_address`` is rewritten to match.
    Raises RaytrnError when a cluster from the same state file is still running, a port is taken, or
    ``ray`` is not installed.
    """
    import yaml

    if auth not in ("disabled", "token"):
        raise RaytrnError(f"auth={auth!r}: expected 'disabled' or 'token'")
    state = Path(state_file) if state_file else DEFAULT_STATE_FILE
    if state.exists():
        old = _load_state(state)
        if old is not None and _alive(old.procs):
            raise RaytrnError(
                f"a local cluster is already running (GCS {old.gcs_address}, dashboard {old.dashboard_url}, state "
                f"{state}); stop it with `raytrn cluster down --local` first"
            )
        state.unlink()  # stale: its processes are gone
    config_path = Path(config)
    if not config_path.is_file():
        raise RaytrnError(f"{config}: cluster config not found (the simulator's is cluster/local-sim.yaml)")
    port = port or 6379
    for what, p in (("GCS port", port), ("dashboard port", dashboard_port)):
        if not _port_free(p):
            raise RaytrnError(
                f"{what} {p} on 127.0.0.1 is in use (another Ray cluster?); pick free ports, e.g. "
                f"up(port=..., dashboard_port=...)"
            )
    ray_bin = _ray_executable()

    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    if cfg.get("provider", {}).get("type") != "fake_multinode":
        raise RaytrnError(f"{config}: provider.type must be 'fake_multinode' for the local simulator")
    gcs_address = f"127.0.0.1:{port}"
    cfg["provider"]["gcs_address"] = gcs_address

    # A short private temp dir: unix socket paths under it stay below the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="raytrn-sim-", dir="/tmp"))
    resolved = temp_dir / "autoscaling.yaml"
    resolved.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    # Job drivers run `python -m raytrn.cli ...` in a shell: make it this interpreter (the venv's).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    token_path = None
    if auth == "token":
        token_path = str(temp_dir / "auth_token")
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
        env.pop("RAY_AUTH_TOKEN", None)
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=0",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        # Ray's other fixed defaults (agent HTTP 52365, client server 10001) collide with any other Ray on
        # this machine (a test's in-process one, a colleague's cluster): take free ports instead.
        f"--dashboard-agent-listen-port={_any_free_port()}",
        f"--ray-client-server-port={_any_free_port()}",
        f"--temp-dir={temp_dir}",
        f"--autoscaling-config={resolved}",
        "--disable-usage-stats",
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _terminate(_cluster_procs(str(temp_dir)))
        raise RaytrnError(f"`ray start` did not return within {timeout_s:g} s; see the logs under {temp_dir}") from None
    if proc.returncode != 0:
        _terminate(_cluster_procs(str(temp_dir)))
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise RaytrnError(f"`ray start` failed (exit {proc.returncode}):\n{tail}")

    session_dir = os.path.realpath(temp_dir / "session_latest")
    dashboard_url = f"http://127.0.0.1:{dashboard_port}"
    procs = _cluster_procs(str(temp_dir))
    cluster = LocalCluster(
        gcs_address=gcs_address,
        dashboard_url=dashboard_url,
        temp_dir=str(temp_dir),
        session_dir=session_dir,
        state_file=str(state),
        auth=auth,
        token_path=token_path,
        pids={_proc_name(pid): pid for pid, _ in procs},
        procs=procs,
    )
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(cluster.to_json(), indent=2))
    try:
        _wait_dashboard(dashboard_url, deadline=time.monotonic() + timeout_s, token_path=token_path)
    except RaytrnError:
        down(state)
        raise
    return cluster


def down(state_file: str | os.PathLike[str] | None = None, *, timeout_s: float = 15) -> None:
    """Stop every process of the cluster recorded in ``state_file`` (SIGTERM, then SIGKILL after ``timeout_s``).

    That is the head processes recorded at start plus whatever now names the cluster's temp dir on its
    command line (the fake worker nodes the autoscaler launched) and all their descendants (Ray workers
    rename themselves ``ray::...``). No-op when nothing is recorded.
    """
    state = Path(state_file) if state_file else DEFAULT_STATE_FILE
    cluster = _load_state(state)
    if cluster is None:
        return
    procs = _cluster_procs(cluster.temp_dir)
    known = {pid for pid, _ in procs}
    procs += [p for p in cluster.procs if p[0] not in known]
    _terminate(procs, timeout_s=timeout_s)
    state.unlink(missing_ok=True)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)


# --- the `raytrn cluster up/down --local` handlers (wired by raytrn/cluster/cli.py) -------------------


def cmd_up(args: argparse.Namespace) -> int:
    """``raytrn cluster up --local``: start the simulator and print how to use it."""
    cluster = up(
        config=getattr(args, "config", None) or DEFAULT_CONFIG,
        port=getattr(args, "port", None),
        dashboard_port=getattr(args, "dashboard_port", None) or 8265,
        state_file=getattr(args, "state_file", None),
        auth=getattr(args, "auth", None) or "disabled",
    )
    env = " ".join(f"{k}={v}" for k, v in cluster.env.items())
    print(f"raytrn: local trn cluster up (state {cluster.state_file})")
    print(f"  dashboard  {cluster.dashboard_url}")
    print(
        f"  submit     {env} ray job submit --address {cluster.dashboard_url} --working-dir . -- raytrn train JOB.yaml"
    )
    print(f"  connect    {env} RAY_ADDRESS={cluster.gcs_address}")
    print(f"  logs       {cluster.session_dir}/logs")
    print("  stop       raytrn cluster down --local")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """``raytrn cluster down --local``: stop the simulator's processes (and only those)."""
    state = Path(getattr(args, "state_file", None) or DEFAULT_STATE_FILE)
    if not state.exists():
        print(f"raytrn: no local cluster recorded in {state}")
        return 0
    down(state)
    print("raytrn: local trn cluster stopped")
    return 0


# --- helpers ------------------------------------------------------------------------------------------


def _psutil() -> Any:
    """psutil as vendored by Ray (``import ray`` puts ``ray/thirdparty_files`` on sys.path)."""
    import importlib

    import ray  # noqa: F401  (must come first)

    return importlib.import_module("psutil")


def _ray_executable() -> str:
    """The `ray` CLI of this Python environment (so the cluster runs the same Ray and raytrn)."""
    beside = Path(sys.executable).parent / "ray"
    if beside.is_file():
        return str(beside)
    found = shutil.which("ray")
    if found:
        return found
    raise RaytrnError("the `ray` command was not found; install Ray in this environment: pip install 'ray[default]'")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as sock:  # something listening on another address of this host?
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _any_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _wait_dashboard(url: str, *, deadline: float, token_path: str | None = None) -> None:
    import urllib.request

    headers = {}
    if token_path:  # a token cluster answers 401 without it
        headers["Authorization"] = f"Bearer {Path(token_path).read_text().strip()}"
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/version", headers=headers), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RaytrnError(f"the dashboard at {url} did not come up ({e})") from None
            time.sleep(0.5)


def _load_state(state: Path) -> LocalCluster | None:
    try:
        return LocalCluster.from_json(json.loads(state.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise RaytrnError(f"{state}: unreadable local-cluster state ({e}); remove it after checking `ps`") from None


def _cluster_procs(temp_dir: str) -> list[tuple[int, float]]:
    """(pid, create_time) of the processes whose command line names ``temp_dir``, and their descendants."""
    psutil = _psutil()

    found: dict[int, float] = {}
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmdline = p.info.get("cmdline") or []
        if p.pid != os.getpid() and any(temp_dir in arg for arg in cmdline):
            found[p.pid] = p.info["create_time"]
            try:
                for child in p.children(recursive=True):
                    found.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
    return sorted(found.items())


def _proc_name(pid: int) -> str:
    psutil = _psutil()

    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return str(pid)
    exe = Path(cmd[0]).name if cmd else "?"
    if exe.startswith("python"):  # python3 -u .../monitor.py -> monitor
        script = next((a for a in cmd[1:] if not a.startswith("-")), exe)
        exe = Path(script).stem
    return f"{exe}-{pid}"


def _procs_alive(procs: list[tuple[int, float]]) -> list[Any]:
    """The psutil processes still running among ``procs`` (same PID *and* start time: no reused PIDs)."""
    psutil = _psutil()

    alive = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1.0 and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _alive(procs: list[tuple[int, float]]) -> bool:
    return bool(_procs_alive(procs))


def _terminate(procs: list[tuple[int, float]], *, timeout_s: float = 15) -> None:
    """SIGTERM ``procs``, wait up to ``timeout_s``, then SIGKILL the survivors."""
    psutil = _psutil()

    alive = _procs_alive(procs)
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
