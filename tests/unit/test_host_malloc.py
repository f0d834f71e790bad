"""run.tune_malloc: which allocator settings the training workers start with, and that they stop the faults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raytrn.backends import get_backend
from raytrn.backends.host_malloc import TUNED, describe, malloc_env, user_allocator_settings
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
    assert describe(TUNED) == "MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824"
    assert describe({"LD_PRELOAD": "libjemalloc.so"}) == "LD_PRELOAD=jemalloc"


def _setup(job: object, accelerator: str) -> tuple[object, dict[str, object]]:
    backend = get_backend(accelerator)
    return worker_setup(job, backend, backend.ray_backend_config(job))  # type: ignore[arg-type]


def _tuned(config: object, runtime_env: dict[str, object]) -> bool:
    """Whether the workers start with the settings: the runtime env's variables (glibc reads them at process start),
    and nothing else there (the driver's variables go in raytrn's backend config)."""
    assert runtime_env in ({}, {"env_vars": TUNED}), runtime_env
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


def test_a_worker_sets_the_drivers_variables_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker runs first on its main thread (raytrn.backends.ray_backend.start_worker and the neuron and live
    backends' own)."""
    monkeypatch.delenv("RAYTRN_TEST_VARIABLE", raising=False)  # (restored after the test)
    prepare_worker({"RAYTRN_TEST_VARIABLE": "eu-west-1"})
    assert os.environ["RAYTRN_TEST_VARIABLE"] == "eu-west-1"


_FAULTS = textwrap.dedent(
    """
    import resource, statistics, threading, torch
    torch.set_num_threads(1)
    out = []
    def faults():
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def train():  # a step's worth of activations, allocated and freed, in a thread as Ray Train runs it
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 4096))
        x = torch.randn(512, 128)
        per_step = []
        for i in range(25):
            before = faults()
            model(x).logsumexp(-1).mean().backward()
            per_step.append(faults() - before)
        # The median step after warm-up: a one-off heap growth (16 MB, seen in some runs) is not refaulting.
        out.append(statistics.median(per_step[5:]))
    t = threading.Thread(target=train)
    t.start()
    t.join()
    print(out[0])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and RUSAGE_THREAD are Linux's")
def test_tuned_settings_stop_the_page_faults_of_a_training_thread() -> None:
    """The reason for the feature, measured: minor page faults per step in a non-main thread."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def faults(env: dict[str, str]) -> float:
        proc = subprocess.run([sys.executable, "-c", _FAULTS], env={**base, **env}, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return float(proc.stdout.split()[-1])

    # glibc's default refaulting shows in most runs but not every one (a heap that happens to stay mapped: seen
    # 1 run in 3 with the Python 3.12 venv's torch build). Up to 3 tries; without it there is nothing to judge.
    defaults = []
    for _ in range(3):
        defaults.append(faults({}))
        if defaults[-1] > 100:
            break
    default = defaults[-1]
    if default <= 100:
        pytest.skip(f"glibc defaults did not refault in 3 runs here ({defaults} faults per step): nothing to compare")
    tuned = faults(TUNED)
    assert tuned < default / 20, (default, tuned)
