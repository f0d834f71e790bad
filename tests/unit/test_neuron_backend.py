"""The neuron backend (TorchNeuron, trn2/trn3): topology and per-worker environment, job checks, the import guard,
the Ray backend against a fake worker group, and device memory (pure functions, no Ray cluster, no Neuron)."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle

import raytrn.backends.neuron as neuron
from raytrn.backends import get_backend
from raytrn.backends.base import Backend
from raytrn.backends.neuron import (
    NeuronBackend,
    TorchNeuronConfig,
    check_torch_neuronx_version,
    neuron_memory_metrics,
    plan_torchneuron_worker_envs,
)
from raytrn.backends.neuron_env import NEFF_CACHE_ENV, torchneuron_worker_env
from raytrn.config import JobSpec, load_job
from raytrn.errors import BackendError, BackendUnavailableError
from tests.unit.neuron_fakes import FakeWorkerGroup, assert_never_kills, workers

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
ADDR = "10.0.1.17"


def env(world_rank: int, *, world_size: int, workers_per_node: int = 64, **kw: Any) -> dict[str, str]:
    """The env of ``world_rank`` in a node-by-node layout on trn2.48xlarge (unless ``instance_type`` says)."""
    args: dict[str, Any] = dict(
        world_rank=world_rank,
        local_rank=world_rank % workers_per_node,
        node_rank=world_rank // workers_per_node,
        world_size=world_size,
        workers_per_node=workers_per_node,
        master_addr=ADDR,
        master_port=29500,
        instance_type="trn2.48xlarge",
    )
    args.update(kw)
    return torchneuron_worker_env(**args)


def job(name: str = "llama3.2-1b-trn2.yaml", *overrides: str) -> JobSpec:
    return load_job(JOBS / name, list(overrides), base_dir="/base")


# --- topology: the env of every worker, pinned ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance", "lnc", "per_node", "nodes"),
    [
        ("trn2.48xlarge", None, 64, 1),  # the default LNC=2: 64 logical cores
        ("trn2.48xlarge", 2, 64, 4),
        ("trn2.48xlarge", 1, 128, 1),  # LNC=1: every physical core is a worker
        ("trn2.48xlarge", 1, 128, 4),
        ("trn2u.48xlarge", None, 64, 4),  # an UltraServer: 4 trn2u
        ("trn3.48xlarge", None, 64, 2),  # Trainium3 (layout UNCONFIRMED): 16 chips x 8 cores at LNC=2
        ("trn3.48xlarge", 1, 128, 1),
        ("trn3p.48xlarge", None, 64, 4),  # an UltraServer member (UNCONFIRMED)
    ],
)
def test_every_worker_env(instance: str, lnc: int | None, per_node: int, nodes: int) -> None:
    world = per_node * nodes
    envs = [env(r, world_size=world, workers_per_node=per_node, instance_type=instance, lnc=lnc) for r in range(world)]
    for rank, e in enumerate(envs):
        local, node = rank % per_node, rank // per_node
        assert e == {
            "MASTER_ADDR": ADDR,
            "MASTER_PORT": "29500",
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes),
            "NEURON_RT_VISIBLE_CORES": str(local),  # no Ray assignment given: LOCAL_RANK, as TorchNeuron does
            "NEURON_LOGICAL_NC_CONFIG": str(lnc or 2),
            "NEURON_CC_FLAGS": f"--logical-nc-config {lnc or 2}",  # the compiler's LNC matches the runtime's
            **EFA,
        }
    # Neither the XLA variables nor the root communicator: TorchNeuron derives NEURON_RT_ROOT_COMM_ID itself.
    assert not any(
        k.startswith(("PJRT", "NEURON_PJRT", "XLA")) or k == "NEURON_RT_ROOT_COMM_ID" for e in envs for k in e
    )


def test_rays_core_assignment_is_kept() -> None:
    e = env(3, world_size=64, visible_cores="17")
    assert e["NEURON_RT_VISIBLE_CORES"] == "17" and e["LOCAL_RANK"] == "3"


@pytest.mark.parametrize("cores", ["0,1", "0-1", "64", "x"])
def test_one_logical_core_per_worker(cores: str) -> None:
    with pytest.raises(BackendError, match=rf"NEURON_RT_VISIBLE_CORES='{cores}' \(rank 3, as Ray assigned it\)"):
        env(3, world_size=64, visible_cores=cores)


def test_options_cache_and_flags() -> None:
    e = env(0, world_size=64, compile_cache="/fsx/neff", cc_flags="--model-type transformer", hostname="ip-10-0-1-17")
    assert e[NEFF_CACHE_ENV] == "/fsx/neff/ip-10-0-1-17"  # per host under a shared mount: its locks break on NFS
    assert e["NEURON_CC_FLAGS"] == "--model-type transformer --logical-nc-config 2"
    assert env(0, world_size=64, compile_cache="/var/cache/neff", hostname="h")[NEFF_CACHE_ENV] == "/var/cache/neff"
    with pytest.raises(BackendError, match="TorchNeuron's compiled-graph .NEFF. cache is a directory on the node"):
        env(0, world_size=64, compile_cache="s3://bucket/cache")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(instance_type="trn1.32xlarge", workers_per_node=32), "TorchNeuron, which runs on trn2 and trn3 only; "
         "trn1.32xlarge is trn1: use scaling.accelerator: neuron-xla"),
        (dict(instance_type="trn3.48xlarge", workers_per_node=128), "scaling.workers_per_node=128 does not match the "
         "64 NeuronCores of trn3.48xlarge at the default LNC=2"),
        (dict(instance_type="trn3e.24xlarge"), "does not match the 32 NeuronCores of trn3e.24xlarge at the default "
         "LNC=2: TorchNeuron runs one worker per logical NeuronCore of every node; set scaling.workers_per_node: 32, "
         "or 64 with neuron.lnc: 1"),
        (dict(lnc=3), "neuron.lnc=3: must be 1 or 2"),
        (dict(workers_per_node=32, world_size=32), "scaling.workers_per_node=32 does not match the 64 NeuronCores of "
         "trn2.48xlarge at the default LNC=2: TorchNeuron runs one worker per logical NeuronCore of every node; set "
         "scaling.workers_per_node: 64, or 128 with neuron.lnc: 1"),
        (dict(workers_per_node=64, lnc=1), "does not match the 128 NeuronCores of trn2.48xlarge at neuron.lnc=1"),
        (dict(workers_per_node=128), "scaling.workers_per_node=128 does not match the 64 NeuronCores"),
        (dict(world_size=96), "96 workers is not a whole number of nodes"),
        (dict(master_addr=""), "master_addr is empty"),
        (dict(master_port=0), "master_port=0: not a TCP port"),
    ],
)  # fmt: skip
def test_bad_layouts(kw: dict[str, Any], message: str) -> None:
    kw = {"world_size": 64, **kw}
    with pytest.raises(BackendError) as e:
        env(0, **kw)
    assert message in str(e.value)


def test_a_partial_node() -> None:
    """Fewer workers than one node (a small job) still run one per core of that node."""
    envs = [env(r, world_size=8) for r in range(8)]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"8"} and {e["GROUP_WORLD_SIZE"] for e in envs} == {"1"}


# --- the import guard -----------------------------------------------------------------------------------------------


def test_torchneuron_version_guard() -> None:
    with pytest.raises(
        BackendUnavailableError, match="needs TorchNeuron .torch-neuronx >= 2.13., which is not installed"
    ) as e:
        check_torch_neuronx_version(None)
    assert "/opt/aws_neuronx_venv_torch_neuronx_2_14_0/bin/activate" in str(e.value)
    with pytest.raises(
        BackendUnavailableError, match=r"torch-neuronx 2.9.0.2.11\+d6d5dd5c is the PyTorch/XLA build"
    ) as e:
        check_torch_neuronx_version("2.9.0.2.11+d6d5dd5c")
    assert "on trn1 use scaling.accelerator: neuron-xla" in str(e.value)
    for ok in ("2.13.3.1.0", "2.14.3.0.0+abc", "2.13.0"):
        check_torch_neuronx_version(ok)


def test_without_torchneuron_the_device_says_which_venv() -> None:
    with pytest.raises(BackendUnavailableError, match="TorchNeuron environment"):
        NeuronBackend().device()


# --- the backend ---------------------------------------------------------------------------------------------------


def test_registered_and_capabilities() -> None:
    backend = get_backend("neuron")
    assert isinstance(backend, NeuronBackend) and type(backend).__mro__[1] is Backend  # not the XLA loop
    assert (backend.name, backend.process_group_backend, backend.default_resources) == (
        "neuron",
        "neuron",
        {"neuron_cores": 1},
    )
    assert backend.compile_options == {"backend": "neuron", "fullgraph": True, "dynamic": False}
    j = job("llama3.2-1b-trn2.yaml", "model.autocast=bfloat16", "optim.fused=true", "run.compile=true")
    assert backend.autocast_dtype(j) == torch.bfloat16  # torch.autocast(device_type="neuron")
    assert backend.ignored_settings(j) == [
        "optim.fused=True is ignored on scaling.accelerator='neuron': it applies to cuda only"
    ]


def test_check_the_shipped_trn2_jobs() -> None:
    notes = NeuronBackend().check(job("llama3-8b-trn2.yaml"))
    assert notes[0].startswith("neuron layout: trn2.48xlarge (64 NeuronCores at LNC=2), 64 workers per node, ")
    notes = NeuronBackend().check(job("llama3.2-1b-trn2.yaml"))
    assert notes[0].startswith("neuron layout: trn2.48xlarge (64 NeuronCores at LNC=2), 64 workers per node, ")
    assert not [n for n in notes if "UNCONFIRMED" in n]


def test_a_trn2_job_on_trainium3_is_checked_and_marked_unconfirmed() -> None:
    """Issue 49 item 4: trn3.48xlarge has trn2.48xlarge's 64 logical cores at LNC 2 (UNCONFIRMED), so a trn2 job
    moves over by its instance type alone; the notes say UNCONFIRMED, with the table's source, once."""
    from raytrn.backends.neuron_env import INSTANCES

    notes = NeuronBackend().check(job("llama3-8b-trn2.yaml", "scaling.instance_type=trn3.48xlarge"))
    assert notes[0].startswith("neuron layout: trn3.48xlarge (64 NeuronCores at LNC=2), 64 workers per node, ")
    assert [n for n in notes if "UNCONFIRMED" in n] == [
        f"neuron layout: {INSTANCES['trn3.48xlarge'].unconfirmed_note()}"
    ]
    lnc1 = ["scaling.instance_type=trn3.48xlarge", "neuron.lnc=1", "scaling.workers_per_node=128",
            "scaling.min_workers=128", "scaling.max_workers=256"]  # fmt: skip
    assert "(128 NeuronCores at LNC=1)" in NeuronBackend().check(job("llama3.2-1b-trn2.yaml", *lnc1))[0]
    config = NeuronBackend().ray_backend_config(job("llama3.2-1b-trn2.yaml", "scaling.instance_type=trn3.48xlarge"))
    assert config.instance_type == "trn3.48xlarge"  # the driver-side config accepts it too


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scaling.instance_type=trn1.32xlarge", "scaling.workers_per_node=32"], "use scaling.accelerator: neuron-xla"),
        (["scaling.workers_per_node=32"], "does not match the 64 NeuronCores of trn2.48xlarge"),
        (["neuron.lnc=1"], "does not match the 128 NeuronCores of trn2.48xlarge at neuron.lnc=1"),
        (["scaling.instance_type=trn3e.24xlarge"], "does not match the 32 NeuronCores of trn3e.24xlarge"),
        (["neuron.compile_cache=s3://bkt/c"], "an s3:// cache is the XLA path's"),
        (["scaling.workers_per_node=null"], "scaling.accelerator='neuron' needs scaling.workers_per_node (one worker "
         "per NeuronCore): set e.g. scaling.instance_type: trn2.48xlarge and scaling.workers_per_node: 64"),
        (["neuron.lnc=2", "neuron.cc_flags='--lnc 1'"], "logical NeuronCore config to 1 but neuron.lnc=2"),
    ],
)  # fmt: skip
def test_check_refuses(overrides: list[str], message: str) -> None:
    spec = job("llama3.2-1b-trn2.yaml", *overrides)
    with pytest.raises(BackendError) as e:
        get_backend(spec.scaling.accelerator).check(spec)
    assert str(e.value).startswith(f"{JOBS / 'llama3.2-1b-trn2.yaml'}: ")
    assert message in str(e.value)


def test_lnc_other_than_1_or_2_is_refused_by_the_config() -> None:
    from raytrn.errors import ConfigError

    with pytest.raises(ConfigError, match="neuron.lnc"):
        job("llama3.2-1b-trn2.yaml", "neuron.lnc=4")


# --- the Ray backend config and the fake worker group ---------------------------------------------------------------


def test_ray_backend_config_pickles() -> None:
    cfg = NeuronBackend().ray_backend_config(job("llama3-8b-trn2.yaml", "neuron.compile_cache=/fsx/neff"))
    assert cfg.to_dict() == {
        "backend": "neuron",
        "timeout_s": 1800,
        "worker_env": {},  # what each worker sets first (raytrn.backends.worker_setup fills them in on the driver)
        "tune_malloc": False,
        "ahead": (),  # the training loop each worker imports beside Ray Train's set-up (the driver names it)
        "import_at_construction": False,  # not torch as its actor is constructed: torch autoloads torch_neuronx
        "instance_type": "trn2.48xlarge",
        "workers_per_node": 64,
        "lnc": None,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "compile_cache": "/fsx/neff",
        "cc_flags": cfg.cc_flags,
        "extra_env": {},
    }
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(cfg))
        assert back == cfg and back.backend_cls is neuron._TorchNeuronRayBackend
    with pytest.raises(BackendError, match="use scaling.accelerator: neuron-xla"):
        TorchNeuronConfig(instance_type="trn1.32xlarge", workers_per_node=32)


def test_plan_keeps_rays_cores_and_refuses_a_shared_core() -> None:
    infos = workers([64, 64], visible_cores=True)
    shuffled = infos[:]
    random.Random(0).shuffle(shuffled)
    cfg = TorchNeuronConfig(instance_type="trn2.48xlarge", workers_per_node=64)
    envs = plan_torchneuron_worker_envs(shuffled, cfg, master_addr="10.0.0.1", master_port=29500)
    for info, e in zip(shuffled, envs, strict=True):
        assert (e["RANK"], e["NEURON_RT_VISIBLE_CORES"]) == (str(info.world_rank), str(info.local_rank))
    clash = infos[:2] + [infos[2].__class__(**{**infos[2].__dict__, "visible_cores": "0"})] + infos[3:]
    with pytest.raises(BackendError, match="ranks 0 and 2 on ip-10-0-0-1 were both given NeuronCore.s. 0 by Ray"):
        plan_torchneuron_worker_envs(clash, cfg, master_addr="10.0.0.1", master_port=29500)


def test_on_start_sets_env_then_forms_the_process_group(no_ray_get: None) -> None:
    infos = workers([64, 64])
    infos = infos[3:] + infos[:3]  # rank 0 is at index 125
    group = FakeWorkerGroup(infos)
    cfg = TorchNeuronConfig(instance_type="trn2.48xlarge", workers_per_node=64, timeout_s=60)
    neuron._TorchNeuronRayBackend().on_start(group, cfg)
    assert ("free_ports", 125) in group.calls  # the store's port, on rank 0's node
    assert sorted(group.applied) == list(range(128))
    assert all(e["MASTER_ADDR"] == "10.0.0.1" and e["MASTER_PORT"] == str(29500 + 125) for e in group.applied.values())
    names = [name for name, _ in group.calls]
    # Every worker's environment is applied before any worker joins the process group (and installs its handler).
    assert names.index("_start_worker") > max(i for i, n in enumerate(names) if n == "apply_env")
    assert names.count("_start_worker") == 128
    # Nothing is torn down: Ray kills the workers, and a gone peer would block a process group's destroy for 30 s.
    calls = len(group.calls)
    neuron._TorchNeuronRayBackend().on_shutdown(group, cfg)
    assert len(group.calls) == calls


def test_the_torchneuron_backend_never_kills_processes() -> None:
    assert_never_kills(neuron)


# --- device memory --------------------------------------------------------------------------------------------------


class TorchNeuronMemoryDouble:
    """``torch.neuron``'s memory calls as TorchNeuron documents them (they mirror ``torch.cuda``'s): the counters
    are only current after ``synchronize()`` (the allocator is asynchronous), which this double enforces."""

    def __init__(self) -> None:
        self.pending = 3 << 20  # bytes allocated by queued work
        self.allocated, self.peak, self.reserved = 1 << 20, 2 << 20, 8 << 20

    def synchronize(self) -> None:
        self.allocated += self.pending
        self.peak = max(self.peak, self.allocated)
        self.pending = 0

    def _read(self, value: int) -> int:
        assert self.pending == 0, "read before torch.neuron.synchronize()"
        return value

    def memory_allocated(self) -> int:
        return self._read(self.allocated)

    def max_memory_allocated(self) -> int:
        return self._read(self.peak)

    def memory_reserved(self) -> int:
        return self._read(self.reserved)


def test_memory_metrics_are_read_after_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    double = TorchNeuronMemoryDouble()
    monkeypatch.setattr(torch, "neuron", double, raising=False)
    assert NeuronBackend().device_memory() == {
        "neuron_memory_allocated_megabytes": (4 << 20) / 1e6,
        "neuron_max_memory_allocated_megabytes": (4 << 20) / 1e6,
        "neuron_memory_reserved_megabytes": (8 << 20) / 1e6,
    }
    assert neuron_memory_metrics(double)["neuron_memory_allocated_megabytes"] == (4 << 20) / 1e6


def test_device_memory_reaches_the_system_metrics() -> None:
    from raytrn.tracking.system import SystemSampler

    double = TorchNeuronMemoryDouble()
    sampler = SystemSampler(
        logger=None, node="node-1", interval_s=60, device_memory=lambda: neuron_memory_metrics(double)
    )
    sampler._gpu_checked = True  # no MLflow GPU monitor here
    sample = sampler.sample()
    assert sample["system/node-1/neuron_memory_allocated_megabytes"] == (4 << 20) / 1e6
    assert "system/node-1/cpu_utilization_percentage" in sample
