"""Shared fixtures: one local Ray per test session (per pytest process: ``make test`` runs the Ray tests on two,
tests/lanes.py), one local trn-cluster simulator, a moto S3 server and an MLflow server per session, a prepared tiny
dataset, and test isolation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from raytrn.compat import PRESTART_WORKERS_ENV
from tests import lanes
from tests.simulator import Simulator

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
# Every worker group of every test compares its step-end collectives across its ranks before issuing each one: a
# collective issued on some ranks only fails the test on every rank, naming its phase (raytrn.train.protocol).
os.environ["RAYTRN_CHECK_COLLECTIVES"] = "1"
# Ray's own metrics pipeline is off in every Ray process the tests start (raytrn reads none of it). In Ray 2.60 a
# node's dashboard agent replays every histogram observation it is sent, one Python call each, and a GCS that
# retries a placement group's rescheduling with no capacity (a live replica's slot after its node was lost, before
# raytrn asked for it anew: raytrn/compat/replica_slots.py; still so in a Ray Tune trial) records
# millions of them: the head's agent then kept one of the machine's two cores busy for minutes (the live chaos
# test: 160-207 s with it, 128 s without; docs/testing.md, docs/elasticity.md).
os.environ["RAY_enable_metrics_collection"] = "0"
# Nor does any raylet start idle workers for the first driver (one per CPU of its node, for every cluster and node a
# test starts): Ray Train's actors never run in them, and a test's Ray Data tasks start theirs when they need them.
# raytrn's embedded local Ray does the same (raytrn.runtime.LOCAL_RAY_DEFAULTS); over the Ray tests of 2026-12-01,
# 32 of them never ran anything (78 CPU-seconds).
os.environ[PRESTART_WORKERS_ENV] = "0"


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: 3 logical CPUs (2 training workers and some room) and 2 logical
    ``neuron_cores`` (Ray assigns them and sets ``NEURON_RT_VISIBLE_CORES``, as on a trn node; no Neuron device).
    Its dashboard and its dashboard agent take free ports: 8265 (and 6379, 5000) stay free for the README's laptop
    path, and 52365 for every other Ray a test starts (an agent that finds it taken retries ~3.4 s:
    :mod:`raytrn.compat.local_ray`)."""
    import ray

    from raytrn.compat import agent_on_any_port

    with agent_on_any_port():  # Ray's fixed agent port stays free for the Rays the tests start beside it
        ray.init(
            address="local",
            num_cpus=3,
            resources={"neuron_cores": 2},
            logging_level="WARNING",
            dashboard_port=_free_port(),
        )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dataset(ray_session, tmp_path_factory) -> Path:
    """The fixture corpus packed for the tiny model (seq_len 32, BPE vocab 512)."""
    from raytrn.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare_dataset(inputs=[str(FIXTURE_CORPUS)], output=str(out), seq_len=32, vocab_size=512, progress=False)
    return out


_EMPTY_STORE: Path | None = None


def data_readers_ended(timeout_s: float = 60.0) -> None:
    """Wait for closed data readers' threads (``raytrn.data.source.ahead``) to end: a closed reader finishes the item
    it is making first (it may decide the next epoch's path), which must not reach the next test's stand-in."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "raytrn-data-ahead":
            thread.join(timeout_s)
            assert not thread.is_alive(), "a closed reader's thread did not end"


def mlflow_store(path: Path) -> str:
    """``sqlite:///path``: a new MLflow store there, copied from one empty store this test process made once.

    MLflow migrates a new sqlite store's schema on first use (~3 s here); a test that needs a store of its own takes
    a copy instead. A test that asserts nothing was written uses a bare ``sqlite:///`` URI, not this."""
    import atexit
    import shutil
    import tempfile

    global _EMPTY_STORE
    if _EMPTY_STORE is None:
        from mlflow.tracking import MlflowClient

        empty = Path(tempfile.mkdtemp(prefix="raytrn-empty-store-")) / "mlflow.db"
        atexit.register(shutil.rmtree, empty.parent, True)
        MlflowClient(f"sqlite:///{empty}").search_experiments()  # creates and migrates it
        _EMPTY_STORE = empty
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        shutil.copyfile(_EMPTY_STORE, path)
    return f"sqlite:///{path}"


_SIMULATOR: Simulator | None = None


@pytest.fixture(scope="session")
def _simulator_session(ray_session, tmp_path_factory):
    global _SIMULATOR
    _SIMULATOR = Simulator(tmp_path_factory.mktemp("simulator"))
    try:
        yield _SIMULATOR
    finally:
        _SIMULATOR.stop()


@pytest.fixture
def simulator(_simulator_session, request) -> Simulator:
    """The session's one local trn-cluster simulator (tests/simulator.py), up: the README's ``raytrn cluster up
    --local`` (token auth, MLflow server on the head, ports 6379/8265/5000) in a fresh copy of the repository.

    Every test that needs a simulator uses this one, e.g.::

        def test_x(simulator, tiny_dataset):
            proc = simulator.cli("submit", "jobs/tiny.yaml", "--address", simulator.address, "--set", ...)
            assert proc.returncode == 0, proc.stderr

    ``simulator.cli`` runs in ``simulator.clone`` (jobs/, cluster/; ``simulator.demo_data()`` adds data/stdlib) as
    a user's shell would (its HOME holds the token); ``simulator.cluster.mlflow_url`` is where jobs log by default;
    ``simulator.job_client()`` / ``worker_nodes()`` talk to it from the test process. Jobs share the simulator's
    two fake nodes and leave them up until their idle timeout (~30 s): a test that needs it without worker nodes
    calls ``simulator.wait_no_worker_nodes()``; give every job its own run name / checkpoint directory.

    The simulator tests run one after another (see :func:`pytest_collection_modifyitems`), the one marked
    ``simulator_down`` (it runs ``raytrn cluster down --local``) last; after the last simulator test the simulator
    is stopped. A test that finds it down starts it again.
    """
    if lanes.unit_of(request.node.nodeid) != "simulator":  # (its tests run in one pytest process: tests/lanes.py)
        module = request.node.nodeid.split("::", 1)[0]
        pytest.fail(f"{module} uses the simulator: add it to tests/lanes.py's SIMULATOR_MODULES", pytrace=False)
    simulator = _simulator_session.ensure_up()
    if any(item.get_closest_marker("simulator_down") for item in request.session.items):
        simulator.start_demo_data()  # for the laptop test (the last one), while the others wait on the autoscaler
    return simulator


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--slowest",
        type=int,
        default=0,
        metavar="N",
        help="at the end, the N slowest tests (setup, call and teardown together) with their share of the session",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "simulator_down: runs `raytrn cluster down --local` on the shared simulator")
    config.addinivalue_line(
        "markers", f"{lanes.ALONE}: runs while the other pytest process of the Ray tests waits (tests/lanes.py)"
    )
    config._raytrn_durations = {}  # nodeid -> seconds over its phases (--slowest)
    config._raytrn_idle = {}  # nodeid -> the machine's idle core-seconds during it (--slowest)
    config._raytrn_started = __import__("time").monotonic()
    config._raytrn_idle_at_start = _idle_core_seconds()


def pytest_runtest_logreport(report) -> None:
    """Each phase's seconds and the idle core-seconds, per test (with pytest-xdist, the controller sees every
    worker's reports)."""
    durations = getattr(_CONFIG, "_raytrn_durations", None)
    if durations is not None:
        durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
        for name, value in report.user_properties:
            if name == IDLE_PROPERTY:
                _CONFIG._raytrn_idle[report.nodeid] = value


_CONFIG = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session) -> None:
    global _CONFIG
    _CONFIG = session.config


def _idle_core_seconds() -> float | None:
    """The machine's idle (and I/O-wait) time since boot, summed over its cores (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Where the Ray tests run on two pytest processes (tests/lanes.py), each test holds the lanes' lock (an
    ``alone`` test alone); ``--slowest``: the cores' idle seconds from the test's setup to its teardown."""
    lock = lanes.alone_lock(item.config)
    if lock is not None:
        lock.acquire(alone=item.get_closest_marker(lanes.ALONE) is not None)
    item._raytrn_idle_before = _idle_core_seconds() if item.config.getoption("--slowest") else None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``--slowest``: the machine's idle core-seconds during the test, on its teardown's report (which reaches
    pytest-xdist's controller too): a test that leaves the machine idle waits on a clock (a poll, a timeout, a
    retry), not on work."""
    outcome = yield
    before = getattr(item, "_raytrn_idle_before", None)
    if call.when == "teardown" and before is not None:
        now = _idle_core_seconds()
        if now is not None:
            outcome.get_result().user_properties.append((IDLE_PROPERTY, now - before))


IDLE_PROPERTY = "raytrn_idle_core_s"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """``--slowest N``: the N slowest tests, each with its share of the session's wall time (what CI's time went to:
    .ci/run prints it for every suite) and the machine's idle core-seconds during each (of ``os.cpu_count()``
    cores; on several pytest processes, tests overlap: the session's idle total is read once, over its wall)."""
    n = config.getoption("--slowest")
    durations: dict[str, float] = getattr(config, "_raytrn_durations", {})
    if not n or not durations:
        return
    import time

    wall = time.monotonic() - config._raytrn_started
    tests = sum(durations.values())
    terminalreporter.section(
        f"{n} slowest tests (of {len(durations)}: {tests:.0f} s in tests, {wall:.0f} s of wall time)"
    )
    idle: dict[str, float] = getattr(config, "_raytrn_idle", {})
    now, before = _idle_core_seconds(), getattr(config, "_raytrn_idle_at_start", None)
    if idle and now is not None and before is not None:
        terminalreporter.write_line(
            f"the {os.cpu_count()} cores idle {now - before:.0f} core-s over the session's {wall:.0f} s "
            "(per test: idle core-s while it ran)"
        )
    cumulative = 0.0
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])[:n]:
        cumulative += seconds
        idle_s = f" idle {idle[nodeid]:6.1f}" if nodeid in idle else ""
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / tests:5.1f}% (cumulative {100 * cumulative / tests:5.1f}%){idle_s}"
            f"  {nodeid}"
        )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``: the units of work of tests/lanes.py (a module, or the simulator's modules together)."""
    return lanes.make_scheduler(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_collection_modifyitems(items) -> None:
    """The units of work in order (tests/lanes.py): the tests that use ``simulator`` one after another (the one
    marked ``simulator_down`` last), so that the simulator is started once and is not left idle between them, and
    in one process where there are several."""
    lanes.order(items)


def pytest_unconfigure(config) -> None:
    lock = getattr(config, "_raytrn_alone_lock", None)
    if lock is not None:
        lock.close()


def pytest_runtest_teardown(item, nextitem) -> None:
    """After the last test that uses the simulator, stop it (its processes would idle through the rest)."""
    uses = "simulator" in getattr(item, "fixturenames", ())
    if _SIMULATOR is not None and uses and (nextitem is None or "simulator" not in nextitem.fixturenames):
        _SIMULATOR.stop()


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


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 that a test can stop and start again (same port, same store).

    The command comes from :func:`raytrn.tracking.server.build_server_command`, the one ``raytrn mlflow
    serve`` runs. The server runs in its own process group; :meth:`stop` ends that group by the PID.
    """

    def __init__(self, cmd, port: int, artifacts: str, log_path: Path, env: dict | None = None) -> None:
        self.cmd = cmd
        self.port = port
        self.url = cmd.url  # http://127.0.0.1:PORT: use as tracking.mlflow_uri
        self.artifacts = artifacts  # where the server stores artifacts (clients upload through it)
        self.log_path = log_path
        self.env = env or {}  # extra variables for the server process (e.g. MLFLOW_S3_ENDPOINT_URL)
        self.proc = None

    def start(self, timeout_s: float = 60) -> None:
        """Start (again) and wait until /health answers, bounded; the log is appended to ``log_path``.

        Measured: healthy after 8-10 s on an idle 2-core machine, up to ~30 s under heavy load.
        """
        import subprocess

        from raytrn.tracking.server import prepare

        if self.proc is not None and self.proc.poll() is None:
            return
        prepare(self.cmd)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.cmd.argv,
                env={**self.cmd.environ(os.environ), **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches uvicorn's workers too
            )
        try:
            _wait_http(f"{self.url}/health", timeout_s, self.proc)
        except Exception as e:
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"mlflow server on port {self.port} did not start: {e}\n--- log tail ---\n{tail}") from e

    def stop(self) -> None:
        """SIGTERM the server's process group by its PID, wait (bounded), SIGKILL what is left.

        Only while the server's process is not yet reaped: once it is, its PID, the group's id, may belong to a
        stranger's process group (PIDs wrap at 32768 here within minutes), and a second stop() (a failed start()
        stops, then the fixture's teardown stops again) SIGTERMed and then SIGKILLed whatever group had it."""
        from raytrn.tracking.server import stop

        if self.proc is not None and self.proc.returncode is None:
            stop(self.proc)


@pytest.fixture(scope="session")
def mlflow_server(s3_endpoint, tmp_path_factory):
    """One ``mlflow server`` per session: sqlite store, artifacts proxied to s3://<bucket>/mlflow on moto.

    ``.url`` (``http://127.0.0.1:PORT``), ``.port``, ``.artifacts``, ``.stop()`` and ``.start()`` (same
    port and store; waits for /health). Runs with one worker and MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false.
    """
    import uuid

    import boto3

    from raytrn.tracking.server import build_server_command

    bucket = f"raytrn-mlflow-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    artifacts = f"s3://{bucket}/mlflow"
    cmd = build_server_command(
        backend_store_uri=f"sqlite:///{root}/mlflow.db", port=port, artifacts_destination=artifacts, workers=1
    )
    server = MlflowServer(cmd, port, artifacts, root / "server.log", env={"MLFLOW_S3_ENDPOINT_URL": s3_endpoint})
    try:
        server.start()
        yield server
    finally:
        server.stop()
