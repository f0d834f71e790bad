"""The one local trn-cluster simulator the test session shares (the ``simulator`` fixture in tests/conftest.py).

It is the README's simulator, started the README's way: ``raytrn cluster up --local``, run verbatim in a fresh copy
of the repository (its tracked files) with ``HOME`` in a temporary directory, so its state file, token and MLflow
store are the session's own. That is Ray token auth on and an MLflow server on the head, on the default ports
(GCS 6379, dashboard 8265, MLflow 5000: they must be free). Every simulator test submits to it; a test that needs
it without worker nodes waits for the idle ones to go (:meth:`Simulator.wait_no_worker_nodes`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ADDRESS = "http://127.0.0.1:8265"
PORTS = (6379, 8265, 5000)
#: idle_timeout_minutes 0.2 in cluster/local-sim.yaml (12 s; at 0.5 the node was gone 25-33 s after the last task).
SCALE_DOWN_TIMEOUT_S = 90


def clone_repo(dest: Path) -> Path:
    """The repository's tracked files (what a fresh clone has), copied to ``dest``."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dest


def busy_ports(ports: tuple[int, ...] = PORTS) -> list[int]:
    """Which of ``ports`` something listens on at 127.0.0.1."""
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    return busy


class Simulator:
    """The shared simulator, started on first use (:meth:`ensure_up`), stopped by :meth:`down` or at session end.

    - ``address``: its dashboard / job API (``http://127.0.0.1:8265``), what ``raytrn submit --address`` takes;
    - ``clone``: the fresh copy of the repository it was started in: a working directory for ``raytrn submit``
      (jobs/, cluster/); :meth:`demo_data` adds ``make demo``'s dataset at ``clone/data/stdlib``;
    - ``env``: a user's shell for the CLI (no ``RAY_*``/``MLFLOW_*`` of the tests, ``HOME`` = ``home``), so
      ``raytrn submit`` / ``raytrn jobs`` find the token and the simulator's filesystem as a user's would;
      :meth:`cli` runs ``python -m raytrn.cli ARGS`` with it, in ``clone``;
    - ``cluster``: :class:`raytrn.cluster.local.LocalCluster` (``.env`` has its token for the ``ray`` CLI,
      ``.mlflow_url`` its MLflow server, where submitted jobs log by default); ``up_result``: the
      ``raytrn cluster up --local`` that started it (the first one);
    - in this process: :meth:`job_client` (a JobSubmissionClient with the token), :meth:`worker_nodes`.
    """

    address = ADDRESS

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clone = root / "raytrn"
        self.home = root / "home"
        self.state = self.home / ".raytrn" / "local-cluster.json"
        # A user's shell: no Ray settings (the tests' RAY_AUTH_MODE=disabled must not help), this HOME.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
        self.env["HOME"] = str(self.home)
        self.cluster: Any = None  # raytrn.cluster.local.LocalCluster while up
        self.up_result: subprocess.CompletedProcess | None = None
        self.cluster_was: Any = None  # what the last down() stopped
        self.worker_nodes_at_start: list | None = None
        self._demo_data: Path | None = None
        self._demo_thread: threading.Thread | None = None
        self._demo_error: BaseException | None = None

    # --- life cycle ------------------------------------------------------------------------------------------

    def ensure_up(self) -> Simulator:
        """Start it (``raytrn cluster up --local`` in ``clone``) unless it is running; return self."""
        from raytrn.cluster import local

        if self.cluster is not None and local.running(self.address, self.state) is not None:
            return self
        if not self.clone.exists():
            clone_repo(self.clone)
            self.home.mkdir(parents=True, exist_ok=True)
        busy = busy_ports()
        assert not busy, f"the local simulator needs ports {busy} free (a local cluster still up?)"
        up = self.cli("cluster", "up", "--local", timeout=180)
        self.up_result = self.up_result or up
        self.cluster = local.running(self.address, self.state)
        assert up.returncode == 0 and self.cluster is not None, up.stdout + up.stderr
        self.worker_nodes_at_start = self.worker_nodes()
        return self

    def down(self) -> subprocess.CompletedProcess:
        """``raytrn cluster down --local`` (what a user runs); the result, for a test to check."""
        result = self.cli("cluster", "down", "--local", timeout=120)
        self.cluster_was, self.cluster = self.cluster, None
        return result

    def stop(self) -> None:
        """Down if still up (session end, or no simulator test left): the CLI, then by PID whatever is left."""
        from raytrn.cluster import local

        if self.cluster is None and not self.state.exists():
            return
        self.down()
        local.down(self.state)  # a no-op when the CLI stopped everything

    # --- using it --------------------------------------------------------------------------------------------

    def cli(self, *args: str, cwd: str | Path | None = None, timeout: float = 300, env: dict | None = None):
        """``python -m raytrn.cli ARGS`` in ``cwd`` (default ``clone``) with :attr:`env` (+ ``env``), bounded."""
        return subprocess.run(
            [sys.executable, "-m", "raytrn.cli", *args],
            cwd=cwd or self.clone,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
        )

    def demo_data(self) -> Path:
        """``make demo``'s dataset at ``clone/data/stdlib`` (same seq_len 128 and vocab 4096, from a few standard
        library modules instead of all of them), prepared once (or by :meth:`start_demo_data` beforehand); needs the
        session's local Ray (``ray_session``)."""
        if self._demo_data is None:
            self.start_demo_data()
            assert self._demo_thread is not None
            self._demo_thread.join(timeout=600)
            if self._demo_error is not None:
                raise self._demo_error
            assert self._demo_data is not None, "the demo dataset was not prepared within 600 s"
        return self._demo_data

    def start_demo_data(self) -> None:
        """Prepare :meth:`demo_data` in a thread of this process (Ray Data on the session's Ray), while the tests
        before the one that needs it wait on the simulator's autoscaler: that test's job then finds the worker
        nodes the previous job left, not a scale-down in progress."""
        if self._demo_thread is not None:  # started, or done
            return

        def prepare() -> None:
            from raytrn.data.prepare import prepare_dataset

            out = self.clone / "data" / "stdlib"
            try:
                stdlib = sysconfig.get_paths()["stdlib"]
                prepare_dataset(
                    inputs=[f"{stdlib}/[a-c]*.py"], output=str(out), seq_len=128, vocab_size=4096, progress=False
                )
                self._demo_data = out
            except BaseException as e:  # raised again by demo_data(), in the test that needs it
                self._demo_error = e

        self._demo_thread = threading.Thread(target=prepare, name="simulator-demo-data", daemon=True)
        self._demo_thread.start()

    @property
    def headers(self) -> dict[str, str]:
        """The token as an HTTP header, for Ray's clients in this process (which runs with auth disabled)."""
        from raytrn.submit import auth_headers

        return auth_headers(Path(self.cluster.token_path).read_text().strip())

    def job_client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address, headers=self.headers)

    def worker_nodes(self) -> list:
        """Alive nodes offering NeuronCores (the head offers none)."""
        from ray.util.state import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        # Filtered here, not server side: with a server-side filter the state API counts the dead nodes it
        # dropped as missing output and raises.
        client = StateApiClient(self.address, headers={"Content-Type": "application/json", **self.headers})
        nodes = client.list(StateResource.NODES, options=ListApiOptions(detail=True, timeout=10),
                            raise_on_missing_output=True)  # fmt: skip
        return [n for n in nodes if n.state == "ALIVE" and (n.resources_total or {}).get("neuron_cores", 0) > 0]

    def wait_no_worker_nodes(self, timeout_s: float = SCALE_DOWN_TIMEOUT_S) -> float:
        """Wait (bounded) until the idle worker nodes are gone; the seconds it took."""
        t0 = time.monotonic()
        while self.worker_nodes():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"idle worker nodes of the simulator still there after {timeout_s} s")
            time.sleep(2)
        return time.monotonic() - t0
