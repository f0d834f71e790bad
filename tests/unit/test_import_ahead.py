"""A worker imports its training loop beside Ray Train's set-up of it (raytrn.ahead): torch and every loop's modules as
its actor is constructed (raytrn.compat.worker), the job's own loop, which the driver names in raytrn's backend config,
once its process group is up; the training function's own import finds them done (or waits for the rest), once,
whatever the loop raises; code on the worker's main thread waits for torch before it touches it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from raytrn.ahead import import_ahead, wait_for
from raytrn.backends import get_backend, ray_backend
from raytrn.backends.ray_backend import ProcessGroupConfig
from raytrn.backends.worker_setup import worker_setup
from raytrn.compat import WORKER_SET_UP_MODULES
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


def test_modules_are_imported_in_order_in_one_thread_and_each_can_be_waited_for(tmp_path: Path) -> None:
    """The construction's list (torch first, then raytrn's modules) in one thread, in order; a module's end can be
    waited for alone; one never asked for is not waited for."""
    first = _module(tmp_path, "import time\nSTART = time.monotonic()\ntime.sleep(0.3)\nEND = time.monotonic()\n")
    second = _module(tmp_path, "import threading, time\nSTART = time.monotonic()\nTHREAD = threading.get_ident()\n")
    (thread,) = import_ahead([first, second, first])
    assert wait_for(second, timeout_s=10) and wait_for(first, timeout_s=0)
    a, b = sys.modules[first], sys.modules[second]
    assert b.START >= a.END and b.THREAD == thread.ident
    started = time.monotonic()
    assert wait_for(f"never_asked_{uuid.uuid4().hex[:6]}", timeout_s=10) and time.monotonic() - started < 5


def test_init_process_group_waits_for_torchs_import_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backends' first torch import on a worker's main thread (the process group) waits for the construction's
    import of torch to end."""
    import torch.distributed as dist

    from raytrn import ahead

    pending = threading.Event()
    monkeypatch.setitem(ahead._ended, "torch", pending)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # (no group of its own: only the wait is looked at)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ray_backend.init_process_group("gloo", 10), done.set()), daemon=True)
    worker.start()
    assert not done.wait(0.5)  # waiting for torch's import
    pending.set()
    assert done.wait(10)


def test_rays_worker_class_of_raytrns_own_imports_torch_and_every_loops_modules_as_it_is_constructed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """raytrn.compat.worker.RayTrainWorker: Ray Train's worker (its name kept: process titles), which starts
    AT_CONSTRUCTION's imports in the background when Ray constructs it."""
    from raytrn.compat import worker

    (rays,) = worker.RayTrainWorker.__bases__  # (its private name: raytrn.compat.PRIVATE_NAMES, test_compat)
    assert rays.__module__.startswith("ray.train.") and rays.__name__ == worker.RayTrainWorker.__name__
    assert worker.AT_CONSTRUCTION[0] == "torch"
    gate = tmp_path / "gate"  # the module's import ends once this file exists (or after 30 s)
    slow = _module(tmp_path, f"import os, threading, time\nEND = time.monotonic() + 30\n"
                             f"while not os.path.exists({str(gate)!r}) and time.monotonic() < END:\n"
                             f"    time.sleep(0.01)\nTHREAD = threading.current_thread().name\n")  # fmt: skip
    monkeypatch.setattr(worker, "AT_CONSTRUCTION", (slow,))
    worker.RayTrainWorker()
    assert not wait_for(slow, timeout_s=0)  # constructed while the import goes on (it cannot end before the gate)
    gate.touch()
    assert wait_for(slow, timeout_s=30) and sys.modules[slow].THREAD == "raytrn-import-ahead"


@pytest.mark.parametrize("recovery", sorted(LOOPS))
def test_every_loop_imports_what_its_workers_import_at_construction(recovery: str) -> None:
    """The construction imports only modules both loops import (no CPU spent on what a worker does not need)."""
    from raytrn.compat.worker import AT_CONSTRUCTION

    module = LOOPS[recovery][0]
    code = f"import sys, {module}; print([m for m in {list(AT_CONSTRUCTION)!r} if m not in sys.modules])"
    assert _printed(code) == "[]"


#: What a worker's main thread imports while Ray Train sets it up, before raytrn's backend waits for torch: the actor's
#: class (Ray Train's worker module with it), Ray Train's set-up modules (raytrn.compat: private), the functions the
#: controller runs on it (raytrn's backends) and what their arguments unpickle (the job's config and plan).
MAIN_THREAD_SET_UP = (
    "raytrn.compat.worker",
    *WORKER_SET_UP_MODULES,
    "raytrn.backends.ray_backend",
    "raytrn.backends.live_ray",
    "raytrn.backends.worker_setup",
    "raytrn.config",
    "raytrn.train.plan",
)


def test_nothing_a_workers_main_thread_imports_during_rays_set_up_imports_torch() -> None:
    """The rule :mod:`raytrn.ahead` relies on: while the construction's thread imports torch, the main thread imports
    no torch module (a torch submodule imported beside ``import torch`` is an import-lock cycle: a failed import or a
    half-initialised torch). A Ray, or a raytrn module, that starts importing torch in those modules fails here."""
    code = f"import sys\nfor m in {list(MAIN_THREAD_SET_UP)!r}: __import__(m)\n"
    code += "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5])"
    assert _printed(code) == "[]"


def _printed(code: str) -> str:
    """What ``python -c code`` prints, in a fresh process of this venv (it must exit 0)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def test_rank_0_imports_the_final_models_tokenizer_class_ahead_near_the_runs_end() -> None:
    """ExportAhead (rank 0, after each step): once the steps left look like at most 30 s at the group's pace, the
    tokenizer class the export saves with is imported in the background (the export then imports nothing more), and
    none of it is a module a loop imports (so the thread never imports beside the training thread's own imports:
    raytrn.ahead's rule); far from the end, or without ``tracking.log_model``, nothing is started."""
    code = (
        "import sys, time, raytrn.train.loop, raytrn.train.live_loop\n"
        "from raytrn.ahead import _ended, wait_for\n"
        "from raytrn.config import load_job\n"
        "from raytrn.tracking.export import TOKENIZER_IMPORTS, ExportAhead\n"
        "def steps(ahead, n):\n"
        "    for step in range(1, n + 1):\n"
        "        ahead.step_done(step)\n"
        "        time.sleep(0.01)\n"
        "    return ahead.done\n"
        "assert steps(ExportAhead(load_job('jobs/tiny.yaml', ['tracking.log_model=false'])), 3)\n"
        "assert not steps(ExportAhead(load_job('jobs/tiny.yaml', ['run.max_steps=1000000'])), 3)  # hours left\n"
        "assert not set(TOKENIZER_IMPORTS) & set(_ended), 'started'\n"
        "before = set(sys.modules)\n"
        "assert steps(ExportAhead(load_job('jobs/tiny.yaml', ['run.max_steps=100'])), 2)  # ~1 s left at its pace\n"
        "assert all(wait_for(m, 120) for m in TOKENIZER_IMPORTS)\n"
        "ahead = set(sys.modules) - before\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "print(sorted(set(sys.modules) - before - ahead), sorted(m for m in ahead if m.split('.')[0] in ('torch', 'raytrn', 'ray')))\n"
    )
    assert _printed(code) == "[] []"


def test_the_final_model_is_logged_while_its_tokenizer_import_ahead_is_still_running(tmp_path: Path) -> None:
    """A short run's rank 0 starts ExportAhead's import of transformers about a second before the run ends; the export
    on the training thread then imported from transformers beside that thread, and transformers' lazy module failed it
    ("cannot import name 'LlamaConfig'"): the final model was not logged (seen on a resumed 5-step run). The export now
    waits for that import first, and logs the model, its config and its tokenizer."""
    from tests.unit.test_cli import make_dataset

    data = make_dataset(tmp_path / "data", seq_len=32, vocab_size=512)
    code = (
        "import shutil, sys, tokenizers, raytrn.train.loop\n"
        "from raytrn.ahead import import_ahead\n"
        "from raytrn.config import load_job\n"
        "from raytrn.models import build_model\n"
        "from raytrn.tracking.export import TOKENIZER_IMPORTS, log_final_model\n"
        f"tokenizers.Tokenizer(tokenizers.models.BPE()).save({str(data / 'tokenizer.json')!r})\n"
        f"job = load_job('jobs/tiny.yaml', ['data.manifest={data}', 'model.vocab_size=512'], resolve=False)\n"
        "model = build_model(job.model, seed=0)\n"
        "class Logged:  # the tracking client's two members the export uses\n"
        "    run_id = 'r'\n"
        "    files = []\n"
        "    def log_artifacts(self, local_dir, artifact_path):\n"
        "        import os\n"
        "        self.files = sorted(os.listdir(local_dir))\n"
        "logged = Logged()\n"
        "assert 'transformers' not in sys.modules\n"
        "import_ahead(TOKENIZER_IMPORTS)  # what ExportAhead starts near the run's end\n"
        "log_final_model(job, model, lambda: iter(model.state_dict().items()), logged)\n"
        "print(logged.files)\n"
    )
    files = _printed(code)
    assert "config.json" in files and "model.safetensors" in files and "tokenizer.json" in files, files
