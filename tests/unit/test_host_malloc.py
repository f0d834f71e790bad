"""run.tune_malloc: which allocator settings the training workers start with, and that they stop the faults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raytrn.backends import get_backend
from raytrn.backends.host_malloc import TUNED, describe, malloc_env, tune_this_process, user_allocator_settings
from raytrn.backends.ray_backend import ProcessGroupConfig, prepare_worker
from raytrn.backends.worker_setup import S3_ENV, worker_setup
from raytrn.config import load_job

pytestmark = pytest.mark.unit
TINY = Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml"


def test_tuned_by_default_and_off_when_disabled() -> None:
    assert malloc_env({"PATH": "/bin"}, enabled=True) == TUNED
    assert malloc_env({"PATH": "/bin"}, enabled=False) == {}


@pytest.mark.parametrize(
    "environ, kept",
    [
        ({"MALLOC_ARENA_MAX": "4"}, ["MALLOC_ARENA_MAX"]),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ["GLIBC_TUNABLES"]),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, ["LD_PRELOAD=jemalloc"]),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, ["LD_PRELOAD=tcmalloc"]),
    ],
)
def test_a_users_allocator_choice_wins(environ: dict[str, str], kept: list[str]) -> None:
    assert user_allocator_settings(environ) == kept
    assert malloc_env(environ, enabled=True) == {}


def test_an_unrelated_preload_is_not_an_allocator() -> None:
    assert malloc_env({"LD_PRELOAD": "libfakeroot.so"}, enabled=True) == TUNED


def test_describe_names_the_settings_the_process_has() -> None:
    assert describe({}) == "glibc defaults"
    assert describe(TUNED) == (
        "MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864 MALLOC_TRIM_THRESHOLD_=1073741824"
    )
    assert describe({"LD_PRELOAD": "libjemalloc.so"}) == "LD_PRELOAD=jemalloc"


def _setup(job: object, accelerator: str) -> tuple[object, dict[str, object]]:
    backend = get_backend(accelerator)
    return worker_setup(job, backend, backend.ray_backend_config(job))  # type: ignore[arg-type]


def _tuned(config: object, runtime_env: dict[str, object]) -> bool:
    """Whether the workers get the settings: in raytrn's backend config (set on the worker), else (the XLA path:
    Ray's own backend) as the runtime env's variables."""
    if isinstance(config, ProcessGroupConfig):
        assert runtime_env == {}  # nothing for a worker to start through Ray's runtime env agent
        return config.tune_malloc
    return runtime_env == {"env_vars": TUNED}


@pytest.mark.parametrize(
    "accelerator, override, tuned",
    [
        ("cpu", None, True),
        ("cpu", False, False),
        ("cuda", None, False),
        ("cuda", True, True),
    ],  # xla-cpu: test_neuron_xla_backend.py
)
def test_worker_setup_follows_backend_default_and_job(
    monkeypatch: pytest.MonkeyPatch, accelerator: str, override: bool | None, tuned: bool
) -> None:
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")]:
        monkeypatch.delenv(key)
    for key in S3_ENV:  # tested on its own below
        monkeypatch.delenv(key, raising=False)
    sets = [f"scaling.accelerator={accelerator}"] + ([] if override is None else [f"run.tune_malloc={override}"])
    job = load_job(TINY, sets)
    assert _tuned(*_setup(job, accelerator)) is tuned
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # the user's own setting: nothing added on top
    assert _tuned(*_setup(job, accelerator)) is False


def test_workers_get_the_drivers_s3_endpoint_and_region_never_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers write sharded checkpoints to S3 themselves: the driver's endpoint and region go with them (in raytrn's
    backend config; as the runtime env's variables on the XLA path, whose Ray Train backend is Ray's)."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # no allocator settings in the way
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    want = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-1"}
    config, runtime_env = _setup(load_job(TINY, []), "cpu")
    assert isinstance(config, ProcessGroupConfig) and config.worker_env == want and runtime_env == {}
    xla = load_job(TINY, ["scaling.accelerator=xla-cpu", "scaling.min_workers=1", "scaling.max_workers=1"])
    config, runtime_env = _setup(xla, "xla-cpu")
    assert not isinstance(config, ProcessGroupConfig) and runtime_env == {"env_vars": want}


def _without_allocator_settings() -> dict[str, str]:
    """This environment less any allocator setting (a fresh process then starts with glibc's defaults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def test_a_worker_sets_the_drivers_variables_and_tunes_its_allocator_itself() -> None:
    """What a worker runs first on its main thread (raytrn.backends.ray_backend.start_worker and the neuron and live
    backends' own), in a fresh process: the variables, and the allocator settings glibc took (mallopt)."""
    code = textwrap.dedent(
        """
        import os
        from raytrn.backends.ray_backend import prepare_worker
        prepare_worker({"AWS_REGION": "eu-west-1"}, True)
        print(os.environ["AWS_REGION"], os.environ.get("MALLOC_ARENA_MAX"))
        """
    )
    base = _without_allocator_settings()
    for environ, want in (({}, "eu-west-1 1"), ({"MALLOC_ARENA_MAX": "4"}, "eu-west-1 4")):  # the user's wins
        proc = subprocess.run([sys.executable, "-c", code], env={**base, **environ}, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.split()[-2:] == want.split(), proc.stderr[-2000:]


def test_tune_this_process_keeps_a_users_choice() -> None:
    environ = {"LD_PRELOAD": "libjemalloc.so.2"}
    assert tune_this_process(environ) is False and environ == {"LD_PRELOAD": "libjemalloc.so.2"}
    before = dict(os.environ)
    prepare_worker({}, False)  # nothing asked: nothing set (this process's allocator is not touched)
    assert dict(os.environ) == before


def test_tune_this_process_starts_no_process() -> None:
    # It runs at every worker start: ctypes.util.find_library("c") ran ldconfig -p there (the startup test's census of
    # the processes a job starts caught one in CI). Python's audit events see every process a call starts.
    code = textwrap.dedent(
        """
        import sys
        started = []
        sys.addaudithook(lambda event, args: started.append(event) if event in (
            "subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.system") else None)
        from raytrn.backends.host_malloc import tune_this_process
        print(tune_this_process({}), started)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_without_allocator_settings(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "[]"], (proc.stdout, proc.stderr[-2000:])


_FAULTS = textwrap.dedent(
    """
    import os, resource, statistics, threading, torch
    torch.set_num_threads(1)
    # As in a Ray worker, threads have made arenas of their own before the worker's code runs: one that has exited
    # leaves its arena free, and glibc gives the next new thread that one (not the main arena) whatever M_ARENA_MAX.
    gone = threading.Thread(target=lambda: torch.empty(1 << 20).fill_(1.0))
    gone.start()
    gone.join()
    if os.environ.get("RAYTRN_TEST_MALLOPT"):
        from raytrn.backends.host_malloc import tune_this_process
        assert tune_this_process()
    out = []
    def faults():
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def train():  # a step's worth of activations, allocated and freed, in a thread as Ray Train runs it
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 4096))
        x = torch.randn(64, 128)
        per_step = []
        for i in range(10):
            before = faults()
            model(x).logsumexp(-1).mean().backward()
            logits = torch.ones(16 * 128 * 4096)  # jobs/tiny.yaml's logits: 32 MB, glibc's largest mmap threshold
            (logits * 2).sum()
            del logits
            per_step.append(faults() - before)
        # The median step after warm-up: a one-off heap growth (16 MB, seen in some runs) is not refaulting.
        out.append(statistics.median(per_step[3:]))
    t = threading.Thread(target=train)
    t.start()
    t.join()
    print(out[0])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and RUSAGE_THREAD are Linux's")
def test_tuned_settings_stop_the_page_faults_of_a_training_thread() -> None:
    """The reason for the feature, measured: minor page faults per step in a non-main thread, with the settings in
    the environment at the process's start (the XLA path's workers) and set by the running process after another
    thread's arena exists (mallopt, as raytrn's backends do on a worker's main thread before Ray Train starts the
    training thread). A step has a 32 MB block, as jobs/tiny.yaml's logits."""
    base = _without_allocator_settings()

    def faults(env: dict[str, str]) -> float:
        proc = subprocess.run([sys.executable, "-c", _FAULTS], env={**base, **env}, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return float(proc.stdout.split()[-1])

    # With 4 kB pages the 32 MB block alone is 8,192 faults a step under glibc's defaults (14-16k a step measured
    # here); with transparent huge pages always on, a few dozen.
    default = faults({})
    if default <= 100:
        pytest.skip(f"glibc's defaults faulted {default} times a step here (huge pages?): nothing to compare")
    tuned = faults(TUNED)
    assert tuned < default / 20, (default, tuned)
    in_process = faults({"RAYTRN_TEST_MALLOPT": "1"})
    assert in_process < default / 20, (default, in_process)
