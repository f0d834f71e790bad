"""The local trn-cluster simulator: a Ray head with the ``fake_multinode`` autoscaler on this machine.

``up()`` runs ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`` with its own Ray temp
directory, so every process of this cluster (head, autoscaler, the fake worker nodes it launches, their
workers) names that directory on its command line; ``down()`` stops exactly those processes by PID,
never by name, and never with ``ray stop`` (which stops every Ray cluster on the machine).

Like the AWS cluster files, the simulator runs with Ray token authentication and an MLflow server on its
head. The token is generated on first use, stored with mode 0600 next to the state file
(``~/.raytrn/local-cluster.token``) and handed to the cluster and to ``raytrn submit`` / ``raytrn jobs``
through ``RAY_AUTH_TOKEN_PATH``; a token left in ``~/.ray/auth_token`` is never relied on. (Ray's GCS listens
on every interface of this machine whatever ``--node-ip-address`` says, so ``auth="disabled"`` lets anyone who
can reach it run code here; it stays available for tests.) The MLflow server (``127.0.0.1``, its store and
artifacts in ``~/.raytrn/local-cluster/``, kept across ``down``/``up``) is exported to every node as
``MLFLOW_TRACKING_URI``: submitted jobs log there by default.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
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

from raytrn import jsonfile
from raytrn.errors import RaytrnError
from raytrn.tracking.server import build_server_command, start, stop

DEFAULT_CONFIG = "cluster/local-sim.yaml"
DEFAULT_MLFLOW_PORT = 5000
_TEMP_PREFIX = "raytrn-sim-"
#: The node provider the simulator's autoscaler loads (provider.type external): Ray's fake_multinode one, each node
#: with its own runtime-env directory.
SIMULATOR_PROVIDER = "raytrn.cluster.simprovider.SimulatorNodeProvider"
#: Set (to the cluster's temp dir) in the environment of every process the simulator starts.
MARKER_ENV = "RAYTRN_LOCAL_CLUSTER"


def default_state_file() -> Path:
    """``~/.raytrn/local-cluster.json`` (read at call time: ``HOME`` decides)."""
    return Path.home() / ".raytrn" / "local-cluster.json"


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
    mlflow_url: str | None = None  # the head's MLflow server (MLFLOW_TRACKING_URI of every node)
    mlflow_proc: tuple[int, float] | None = None  # its (pid, create_time); its process group is stopped
    data_dir: str | None = None  # the MLflow store and artifacts (kept by `down`)

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
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in fields}
        data["procs"] = [tuple(p) for p in data.get("procs", [])]
        if data.get("mlflow_proc"):
            data["mlflow_proc"] = tuple(data["mlflow_proc"])
        return cls(**data)

    @property
    def all_procs(self) -> list[tuple[int, float]]:
        return [*self.procs, *([self.mlflow_proc] if self.mlflow_proc else [])]


def up(
    *,
    config: str | os.PathLike[str] = DEFAULT_CONFIG,
    port: int | None = None,
    dashboard_port: int = 8265,
    timeout_s: float = 60,
    state_file: str | os.PathLike[str] | None = None,
    auth: str = "token",
    mlflow: bool = True,
    mlflow_port: int = DEFAULT_MLFLOW_PORT,
) -> LocalCluster:
    """Start the simulator from ``config`` (a fake_multinode cluster YAML) and record it in ``state_file``.

    ``port`` is the GCS port (default 6379); the YAML's ``provider.gcs_address`` is rewritten to match.
    ``mlflow``: an MLflow server on 127.0.0.1:``mlflow_port`` that every node's processes log to. Raises
    RaytrnError when a cluster from the same state file is still running, a port is taken, or ``ray`` is not
    installed; on any failure whatever was started is stopped.
    """
    import yaml

    if auth not in ("disabled", "token"):
        raise RaytrnError(f"auth={auth!r}: expected 'disabled' or 'token'")
    state = Path(state_file) if state_file else default_state_file()
    if state.exists():
        old = _load_state(state)
        if old is not None and _alive(old.all_procs):
            raise RaytrnError(
                f"a local cluster is already running (GCS {old.gcs_address}, dashboard {old.dashboard_url}, state "
                f"{state}); stop it with `raytrn cluster down --local` first"
            )
        state.unlink()  # stale: its processes are gone
    config_path = _find_config(config)
    port = port or 6379
    ports = [("GCS port", port, "--port"), ("dashboard port", dashboard_port, "--dashboard-port")]
    if mlflow:
        ports.append(("MLflow port", mlflow_port, "--mlflow-port"))
    for what, p, flag in ports:
        if not _port_free(p):
            raise RaytrnError(
                f"{what} {p} on 127.0.0.1 is in use (another Ray cluster or MLflow server?); pick a free one with "
                f"`raytrn cluster up --local {flag} N`"
            )
    ray_bin = _ray_executable()

    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    if cfg.get("provider", {}).get("type") != "fake_multinode":
        raise RaytrnError(f"{config}: provider.type must be 'fake_multinode' for the local simulator")
    gcs_address = f"127.0.0.1:{port}"
    cfg["provider"]["gcs_address"] = gcs_address
    # Ray's fake_multinode provider, but each node unpacks a job's working_dir into its own directory (stock,
    # a node joining mid-job deletes the one the head's processes run in): raytrn.cluster.simprovider.
    cfg["provider"].update(type="external", module=SIMULATOR_PROVIDER)

    # A short private temp dir: unix socket paths under it stay below the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir="/tmp"))
    resolved = temp_dir / "autoscaling.yaml"
    resolved.write_text(yaml.safe_dump(cfg, sort_keys=False))
    # MARKER_ENV: every process of this cluster inherits it, including those Ray starts detached without the
    # temp dir on their command line (the Ray Client server): `down` finds them all by it.
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0", MARKER_ENV: str(temp_dir)}
    # Job drivers run `python -m raytrn.cli ...` in a shell: make it this interpreter (the venv's).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    # The autoscaler looks every second, not Ray's 5: a job's demand, and a node's idleness, are acted on sooner.
    env.setdefault("AUTOSCALER_UPDATE_INTERVAL_S", "1")
    token_path = None
    if auth == "token":
        token_path = str(ensure_token(state.parent / "local-cluster.token"))
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
        env.pop("RAY_AUTH_TOKEN", None)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
        env.pop("RAY_AUTH_TOKEN", None)
    data_dir = state.parent / "local-cluster"
    server = None
    mlflow_url = None
    if mlflow:  # started first: it and Ray start at the same time
        server, mlflow_url = _start_mlflow(data_dir, mlflow_port)
        env["MLFLOW_TRACKING_URI"] = mlflow_url
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=0",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        # Ray's dashboard agent's fixed default port (52365) collides with any other Ray on this machine (a
        # test's in-process one, a colleague's cluster): take a free one.
        f"--dashboard-agent-listen-port={_any_free_port()}",
        f"--ray-client-server-port={_any_free_port()}",
        f"--temp-dir={temp_dir}",
        f"--autoscaling-config={resolved}",
        "--disable-usage-stats",
    ]

    def undo() -> None:
        _terminate(_cluster_procs(str(temp_dir)))
        if server is not None:
            stop(server)
        _remove_temp_dir(str(temp_dir))

    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        undo()
        raise RaytrnError(f"`ray start` did not return within {timeout_s:g} s") from None
    except BaseException:
        undo()
        raise
    if proc.returncode != 0:
        undo()
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
        mlflow_url=mlflow_url,
        mlflow_proc=(server.pid, _create_time(server.pid)) if server is not None else None,
        data_dir=str(data_dir) if mlflow else None,
    )
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(cluster.to_json(), indent=2))
    try:
        deadline = time.monotonic() + timeout_s
        _wait_dashboard(dashboard_url, deadline=deadline, token_path=token_path)
        if server is not None and mlflow_url is not None:
            _wait_mlflow(server, mlflow_url, deadline=deadline + 30, log=data_dir / "mlflow-server.log")
    except BaseException:
        down(state)
        raise
    return cluster


def _find_config(config: str | os.PathLike[str]) -> Path:
    """``config`` as given; the default also beside this raytrn checkout, so `up --local` works from anywhere."""
    path = Path(config)
    if path.is_file():
        return path
    beside = Path(__file__).resolve().parents[2] / DEFAULT_CONFIG
    if str(config) == DEFAULT_CONFIG and beside.is_file():
        return beside
    raise RaytrnError(
        f"{config}: cluster config not found (the simulator's is cluster/local-sim.yaml in the raytrn repository: "
        "run from there, or pass --config PATH)"
    )


def ensure_token(path: Path) -> Path:
    """The simulator's Ray auth token file: created on first use (64 hex digits, mode 0600), reused after; a
    token file others could read is made private again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        if not path.read_text().strip():
            raise RaytrnError(
                f"{path}: the local cluster's auth token file is empty; remove it to make a new one"
            ) from None
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def running(address: str | None = None, state_file: str | os.PathLike[str] | None = None) -> LocalCluster | None:
    """The simulator recorded in ``state_file`` if it is running (and serves ``address``, a dashboard URL, when
    given), else None. ``raytrn submit`` and ``raytrn jobs`` ask this to find its token and its filesystem."""
    state = Path(state_file) if state_file else default_state_file()
    try:
        cluster = _load_state(state)
    except RaytrnError:
        return None
    if cluster is None or not _alive(cluster.procs):
        return None
    if address is not None and not _same_url(address, cluster.dashboard_url):
        return None
    return cluster


def _same_url(a: str, b: str) -> bool:
    """Whether two dashboard URLs name the same local endpoint (localhost and 127.0.0.1 alike)."""
    from urllib.parse import urlsplit

    def key(url: str) -> tuple[str, int | None]:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host = parts.hostname or ""
        return ("127.0.0.1" if host in ("localhost", "127.0.0.1", "::1") else host, parts.port)

    return key(a) == key(b)


def _start_mlflow(data_dir: Path, port: int) -> tuple[subprocess.Popen, str]:
    """The head's MLflow server: its sqlite store and artifacts under ``data_dir`` (kept across up/down)."""
    cmd = build_server_command(
        backend_store_uri=f"sqlite:///{data_dir}/mlflow.db",
        port=port,
        artifacts_destination=str(data_dir / "artifacts"),
        workers=1,
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "mlflow-server.log", "a")  # noqa: SIM115 (the server writes to it after we return)
    try:
        return start(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), cmd.url
    finally:
        log.close()


def _wait_mlflow(server: subprocess.Popen, url: str, *, deadline: float, log: Path) -> None:
    import urllib.request

    while True:
        if server.poll() is not None:
            tail = log.read_text()[-1500:] if log.exists() else ""
            raise RaytrnError(f"the MLflow server for the local cluster exited (code {server.returncode}):\n{tail}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RaytrnError(f"the MLflow server at {url} did not come up ({e}); see {log}") from None
            time.sleep(0.5)


def _create_time(pid: int) -> float:
    return float(_psutil().Process(pid).create_time())


def _remove_temp_dir(path: str) -> None:
    """Remove the simulator's Ray temp dir: only a ``/tmp/raytrn-sim-*`` directory (the state file is user
    data: a tampered one must not make raytrn delete anything else)."""
    from raytrn.storage import remove_inside  # pyarrow.fs: +0.2 s on `raytrn --help` (via submit), measured

    if os.path.basename(path.rstrip("/")).startswith(_TEMP_PREFIX):
        remove_inside(path, "/tmp")


def down(state_file: str | os.PathLike[str] | None = None, *, timeout_s: float = 15) -> None:
    """Stop every process of the cluster recorded in ``state_file`` (SIGTERM, then SIGKILL after ``timeout_s``).

    That is the head processes recorded at start plus whatever now names the cluster's temp dir on its
    command line (the fake worker nodes the autoscaler launched) and all their descendants (Ray workers
    rename themselves ``ray::...``). No-op when nothing is recorded.
    """
    state = Path(state_file) if state_file else default_state_file()
    cluster = _load_state(state)
    if cluster is None:
        return
    procs = _cluster_procs(cluster.temp_dir)
    known = {pid for pid, _ in procs}
    procs += [p for p in cluster.procs if p[0] not in known]
    for stage in stop_stages(procs, _cmdlines(procs)):
        _terminate(stage, timeout_s=timeout_s)
    if cluster.mlflow_proc and _procs_alive([cluster.mlflow_proc]):
        _terminate_group(cluster.mlflow_proc[0], timeout_s=timeout_s)
    state.unlink(missing_ok=True)
    try:
        _remove_temp_dir(cluster.temp_dir)
    except (OSError, RaytrnError) as e:
        print(f"raytrn: left {cluster.temp_dir} in place ({e})", file=sys.stderr)


# --- the `raytrn cluster up/down --local` handlers (wired by raytrn/cluster/cli.py) -------------------


def cmd_up(args: argparse.Namespace) -> int:
    """``raytrn cluster up --local``: start the simulator and print how to use it."""
    cluster = up(
        config=getattr(args, "config", None) or DEFAULT_CONFIG,
        port=getattr(args, "port", None),
        dashboard_port=getattr(args, "dashboard_port", None) or 8265,
        state_file=getattr(args, "state_file", None),
        auth=getattr(args, "auth", None) or "token",
        mlflow=not getattr(args, "no_mlflow", False),
        mlflow_port=getattr(args, "mlflow_port", None) or DEFAULT_MLFLOW_PORT,
    )
    env = " ".join(f"{k}={v}" for k, v in cluster.env.items())
    print(f"raytrn: local trn cluster up (state {cluster.state_file})")
    print(f"  dashboard  {cluster.dashboard_url}")
    if cluster.mlflow_url:
        print(f"  mlflow     {cluster.mlflow_url}   (submitted jobs log here; store: {cluster.data_dir})")
    print(f"  submit     raytrn submit JOB.yaml --address {cluster.dashboard_url}")
    print(f"  connect    {env} RAY_ADDRESS={cluster.gcs_address}")
    print(f"  logs       {cluster.session_dir}/logs")
    print("  stop       raytrn cluster down --local")
    if cluster.auth == "disabled":
        print(
            "  WARNING: Ray auth is disabled and the GCS listens on every interface: anyone who can reach this "
            "machine can run code on it"
        )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """``raytrn cluster down --local``: stop the simulator's processes (and only those)."""
    state = Path(getattr(args, "state_file", None) or default_state_file())
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
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT are no conflict
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
        return LocalCluster.from_json(jsonfile.loads(state.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise RaytrnError(f"{state}: unreadable local-cluster state ({e}); remove it after checking `ps`") from None


def _cluster_procs(temp_dir: str) -> list[tuple[int, float]]:
    """(pid, create_time) of the processes whose command line names ``temp_dir`` (as a whole path, or a path
    under it) or whose environment carries it in :data:`MARKER_ENV`, and their descendants. RaytrnError for a
    ``temp_dir`` that is not one of the simulator's own (``/tmp/raytrn-sim-*``: an empty or edited state file
    would otherwise name every process of the machine)."""
    psutil = _psutil()

    if not (os.path.isabs(temp_dir) and os.path.basename(temp_dir.rstrip("/")).startswith(_TEMP_PREFIX)):
        raise RaytrnError(
            f"the local cluster's state names {temp_dir!r} as its temp dir, not one the simulator makes "
            f"(/tmp/{_TEMP_PREFIX}*); refusing to look for its processes by it. Stop them by hand (`ray stop` "
            "stops every Ray on this machine) and delete the state file"
        )
    names = re.compile(r"(?:^|[=\s:])" + re.escape(temp_dir.rstrip("/")) + r"(?:/|$|[\s:])")
    found: dict[int, float] = {}
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmdline = p.info.get("cmdline") or []
        try:
            marked = p.environ().get(MARKER_ENV) == temp_dir
        except psutil.Error:
            marked = False
        if p.pid != os.getpid() and (marked or any(names.search(arg) for arg in cmdline)):
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


def stop_stages(procs: list[tuple[int, float]], cmdlines: dict[int, list[str]]) -> list[list[tuple[int, float]]]:
    """The order to stop a cluster's processes in: the autoscaler first (on SIGTERM it reports to the GCS, and waits
    on a GCS that is going), then the rest, the GCS last (the raylets unregister from it: 10 s each against a GCS that
    is going, which itself then outlived its SIGTERM). Measured: 6 s for a simulator where all at once took 15 s and
    SIGKILLs."""
    monitor = {pid for pid, cmd in cmdlines.items() if any(a.endswith("autoscaler/_private/monitor.py") for a in cmd)}
    gcs = {pid for pid, cmd in cmdlines.items() if cmd and cmd[0].endswith("gcs_server")}
    first, last = [p for p in procs if p[0] in monitor], [p for p in procs if p[0] in gcs]
    return [first, [p for p in procs if p[0] not in monitor | gcs], last]


def _cmdlines(procs: list[tuple[int, float]]) -> dict[int, list[str]]:
    found, gone = {}, _psutil().Error
    for p in _procs_alive(procs):
        with contextlib.suppress(gone):
            found[p.pid] = p.cmdline()
    return found


def _terminate_group(pid: int, *, timeout_s: float) -> None:
    """SIGTERM the process group led by ``pid`` (the MLflow server and its workers), SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


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
