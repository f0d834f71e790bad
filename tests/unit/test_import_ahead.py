"""A worker imports its training loop beside Ray Train's set-up of it (raytrn.backends.ray_backend.import_ahead): the
driver names the loop in raytrn's backend config, the backend's first function on the worker starts the import, and
the training function's own import finds it done (or waits for the rest), once, whatever the loop raises."""

from __future__ import annotations

import importlib
import sys
import threading
import uuid
from pathlib import Path

import pytest

from raytrn.backends import get_backend, ray_backend
from raytrn.backends.ray_backend import ProcessGroupConfig, import_ahead
from raytrn.backends.worker_setup import worker_setup
from raytrn.config import load_job
from raytrn.train.entry import LOOPS, loop_module
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def _module(tmp_path: Path, body: str) -> str:
    """A module of its own on ``sys.path``: its name."""
    name = f"ahead_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return name


def test_the_training_functions_import_finds_the_module_imported_once_in_the_background(tmp_path: Path) -> None:
    """A slow module (0.5 s): imported in the background thread, the foreground import waits for its end (the whole
    module, not a partly run one) and runs nothing again; a second call starts nothing."""
    name = _module(
        tmp_path,
        "import threading, time\n"
        "RUNS = globals().get('RUNS', 0) + 1\n"
        "THREAD = threading.current_thread().name\n"
        "time.sleep(0.5)\n"
        "LAST = 'defined at the end'\n",
    )
    (thread,) = import_ahead([name])
    assert thread.daemon and thread.name == "raytrn-import-ahead"
    module = importlib.import_module(name)  # what the training function does meanwhile
    assert module.LAST == "defined at the end" and module.RUNS == 1
    assert module.THREAD == "raytrn-import-ahead"
    assert import_ahead([name]) == []  # once a process


def test_a_module_that_fails_in_the_background_fails_the_training_functions_import_itself(tmp_path: Path) -> None:
    name = _module(tmp_path, "raise ImportError('no torch-neuronx here')\n")
    (thread,) = import_ahead([name])
    thread.join(10)
    assert not thread.is_alive()  # nothing raised in the thread reaches the worker
    with pytest.raises(ImportError, match="no torch-neuronx here"):
        importlib.import_module(name)


def test_the_driver_names_its_jobs_loop_in_raytrns_backend_config() -> None:
    """What the trainer hands the backend (worker_setup's ``ahead``) is the loop its training function imports."""
    for recovery, overrides in (("restart", []), ("live", ["scaling.recovery=live", "parallel.data_parallel=hsdp"])):
        job = load_job(str(REPO / "jobs" / "tiny.yaml"), [*overrides, "scaling.min_workers=3", "scaling.max_workers=3"])
        module = loop_module(job)
        assert module == LOOPS[recovery][0]
        assert callable(getattr(importlib.import_module(module), LOOPS[recovery][1]))
        backend = get_backend("cpu")
        config, runtime_env = worker_setup(job, backend, backend.ray_backend_config(job), ahead=(module,))
        assert isinstance(config, ProcessGroupConfig) and config.ahead == (module,) and runtime_env == {}


def test_start_worker_imports_ahead_after_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendezvous first (these imports must not delay the other workers' process group), then the imports."""
    calls: list[str] = []
    monkeypatch.setattr(ray_backend, "torch_distributed_env", lambda addr, port: {})
    monkeypatch.setattr(ray_backend, "init_process_group", lambda backend, timeout_s: calls.append("group"))
    monkeypatch.setattr(ray_backend, "import_ahead", lambda modules: calls.append(f"ahead {list(modules)}"))
    monkeypatch.setattr("raytrn.sigterm.install_sigterm_handler", lambda: threading.current_thread().name != "")
    assert ray_backend.start_worker("127.0.0.1", 1, "gloo", 60, {}, False, ("raytrn.train.loop",))
    assert calls == ["group", "ahead ['raytrn.train.loop']"]
