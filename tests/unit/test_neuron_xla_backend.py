"""The neuron-xla backend (trn1, frozen): job checks, the Ray backend config, and per-worker env planning (no Ray cluster)."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
from ray import cloudpickle

import raytrn.backends.neuron_ray as neuron_ray
import raytrn.xla.neuron_xla as neuron_xla
from raytrn.backends import get_backend
from raytrn.backends.neuron_ray import WorkerInfo
from raytrn.config import JobSpec, load_job
from raytrn.errors import BackendError
from raytrn.xla.backend import XlaBackend
from raytrn.xla.env import neuron_xla_worker_env
from raytrn.xla.neuron_xla import NeuronXlaBackend, NeuronXlaConfig
from raytrn.xla.neuron_xla import plan_xla_worker_envs as plan_worker_envs
from tests.unit import test_host_malloc
from tests.unit.neuron_fakes import FakeWorkerGroup, assert_never_kills, workers
from tests.unit.test_init_from import hf_checkpoint, job_for

pytestmark = pytest.mark.unit

JOB = Path(__file__).resolve().parents[2] / "jobs" / "llama3-8b-trn1.yaml"


def job(*overrides: str) -> JobSpec:
    return load_job(JOB, list(overrides), base_dir="/base")


def config(**kw: Any) -> NeuronXlaConfig:
    return NeuronXlaConfig(**{"instance_type": "trn1.32xlarge", "workers_per_node": 32, **kw})


PORTS = dict(master_addr="10.0.0.1", master_port=29500, root_comm_port=41000)


# --- registry and NeuronBackend ------------------------------------------------------------------------------------


def test_registered() -> None:
    backend = get_backend("neuron-xla")
    assert isinstance(backend, NeuronXlaBackend) and isinstance(backend, XlaBackend)
    assert backend.name == "neuron-xla"
    assert backend.default_resources == {"neuron_cores": 1}


def test_check_llama3_8b_trn1() -> None:
    spec = job()  # as shipped
    tp = spec.parallel.tensor_parallel_size
    notes = NeuronXlaBackend().check(spec)
    assert notes[0] == (
        "neuron layout: trn1.32xlarge (32 NeuronCores), 32 workers per node, 32, 64, 96, 128 workers on 1-4 "
        f"node(s), tensor parallel {tp} (data parallel {', '.join(str(n // tp) for n in (32, 64, 96, 128))})"
    )
    # Plain data parallelism over the same layout, pinned exactly.
    assert NeuronXlaBackend().check(job("parallel.tensor_parallel_size=1")) == [
        "neuron layout: trn1.32xlarge (32 NeuronCores), 32 workers per node, 32, 64, 96, 128 workers on 1-4 "
        "node(s), tensor parallel 1 (data parallel 32, 64, 96, 128)"
    ]


def test_check_notes() -> None:
    notes = NeuronXlaBackend().check(job("scaling.resources_per_worker={CPU: 1}", "parallel.tensor_parallel_size=8"))
    assert "tensor parallel 8 (data parallel 4, 8, 12, 16)" in notes[0]
    assert any("scaling.resources_per_worker={'CPU': 1.0} does not request neuron_cores: 1" in n for n in notes)
    notes = NeuronXlaBackend().check(job("neuron.compile_cache=/fsx/cache", "neuron.cc_flags='--cache_dir=/tmp/c'"))
    assert notes[-1] == "neuron.cc_flags sets --cache_dir, which takes precedence over neuron.compile_cache"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scaling.instance_type=null"], "scaling.accelerator='neuron-xla' needs scaling.instance_type (one worker"),
        (
            ["scaling.instance_type=null", "scaling.workers_per_node=null"],
            "needs scaling.instance_type and scaling.workers_per_node",
        ),
        (["scaling.workers_per_node=33"], "scaling.workers_per_node=33 exceeds the 32 NeuronCores of trn1.32xlarge"),
        (["scaling.min_workers=48", "scaling.max_workers=48"], "48 workers is not a whole number of nodes"),
        (["parallel.tensor_parallel_size=64"], "tensor_parallel_size=64 does not divide scaling.workers_per_node=32"),
        (["parallel.tensor_parallel_size=3"], "tensor_parallel_size=3 does not divide"),
        (["scaling.instance_type=trn1.64xlarge"], "unknown Trainium instance type"),
        (["neuron.lnc=2"], "neuron.lnc=2: the logical NeuronCore config applies only to trn2"),
        (["neuron.compile_cache=cache"], "neuron.compile_cache='cache': use an absolute path"),
    ],
)
def test_check_broken_jobs(overrides: list[str], message: str) -> None:
    with pytest.raises(BackendError) as e:
        NeuronXlaBackend().check(job(*overrides))
    assert str(e.value).startswith(f"{JOB}: ")
    assert message in str(e.value)


def test_check_refuses_trn2_and_trn3() -> None:
    trn2 = ["scaling.instance_type=trn2.48xlarge", "scaling.workers_per_node=64", "scaling.min_workers=64"]
    with pytest.raises(
        BackendError, match="trn2.48xlarge .trn2. trains with TorchNeuron: use scaling.accelerator: neuron"
    ):
        NeuronXlaBackend().check(job(*trn2, "scaling.max_workers=128"))
    with pytest.raises(
        BackendError, match=r"never ran on Trainium3 .*trn3 trains with TorchNeuron .scaling.accelerator: neuron"
    ):
        NeuronXlaBackend().check(job("scaling.instance_type=trn3.48xlarge"))


# --- the Ray backend config ----------------------------------------------------------------------------------------


def test_ray_backend_config_carries_plain_fields() -> None:
    spec = job(
        "neuron.compile_cache=s3://bkt/cache",
        "neuron.socket_ifname=ens5",
        "neuron.cc_flags='--model-type transformer'",
        "parallel.tensor_parallel_size=8",
    )
    cfg = NeuronXlaBackend().ray_backend_config(spec)
    assert isinstance(cfg, NeuronXlaConfig)
    assert cfg.to_dict() == {
        "backend": "xla",
        "init_method": "xla://",
        "timeout_s": 1800,
        "instance_type": "trn1.32xlarge",
        "workers_per_node": 32,
        "lnc": None,
        "tensor_parallel_size": 8,
        "compile_cache": "s3://bkt/cache",
        "socket_ifname": "ens5",
        "stochastic_rounding": True,
        "cc_flags": "--model-type transformer",
        "run_id": "llama3-8b-trn1",
        "extra_env": {},
    }
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(cfg))
        assert back == cfg and back.backend_cls is neuron_xla._NeuronXlaRayBackend


def test_precompile_switches_reach_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """neuron_parallel_compile sets its switches in the driver's env; Ray workers don't inherit it."""
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    monkeypatch.delenv("NEURON_PARALLEL_COMPILE_CACHE_PATH_LOG", raising=False)
    cfg = NeuronXlaBackend().ray_backend_config(job())
    assert cfg.extra_env == {"NEURON_EXTRACT_GRAPHS_ONLY": "1"}
    workers = [
        WorkerInfo(world_rank=r, local_rank=r, node_rank=0, world_size=2, local_world_size=2, node_id="n0",
                   node_ip="10.0.0.1", hostname="h0")
        for r in range(2)
    ]  # fmt: skip
    cfg2 = NeuronXlaConfig(instance_type="trn1.32xlarge", workers_per_node=2, extra_env=cfg.extra_env)
    envs = plan_worker_envs(workers, cfg2, master_addr="10.0.0.1", master_port=1, root_comm_port=2)
    assert all(e["NEURON_EXTRACT_GRAPHS_ONLY"] == "1" for e in envs)


def test_ray_backend_config_needs_the_layout() -> None:
    with pytest.raises(BackendError, match="needs scaling.workers_per_node"):
        NeuronXlaBackend().ray_backend_config(job("scaling.workers_per_node=null"))
    with pytest.raises(BackendError, match="unknown Trainium instance type"):
        config(instance_type="trn9.huge")


def test_the_ray_backend_never_kills_processes() -> None:
    """Ray's TorchXLAConfig runs ``pkill -f xrt_run_server`` on every worker; raytrn's must not."""
    from ray.train.torch.xla.config import _TorchAwsNeuronXLABackend

    assert not issubclass(neuron_xla._NeuronXlaRayBackend, _TorchAwsNeuronXLABackend)
    for module in (neuron_xla, neuron_ray):
        assert_never_kills(module)


# --- plan_worker_envs ----------------------------------------------------------------------------------------------


def test_plan_two_nodes_in_any_order() -> None:
    infos = workers([32, 32])
    shuffled = infos[:]
    random.Random(0).shuffle(shuffled)
    cfg = config(compile_cache="/fsx/neuron-cache", run_id="run-1")
    envs = plan_worker_envs(shuffled, cfg, **PORTS)
    assert len(envs) == 64
    for info, env in zip(shuffled, envs, strict=True):  # in the order given
        assert env == neuron_xla_worker_env(
            world_rank=info.world_rank,
            local_rank=info.local_rank,
            node_rank=info.node_rank,
            world_size=64,
            workers_per_node=32,
            instance_type="trn1.32xlarge",
            compile_cache="/fsx/neuron-cache",
            hostname=info.hostname,
            run_id="run-1",
            **PORTS,
        )
        assert env["RANK"] == str(info.world_rank)
        assert env["NEURON_COMPILE_CACHE_URL"] == f"/fsx/neuron-cache/{info.hostname}"
        assert env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.1:41000"


def test_plan_single_partial_node() -> None:
    envs = plan_worker_envs(workers([8]), config(), **PORTS)
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"8"}
    assert [e["NEURON_RT_VISIBLE_CORES"] for e in envs] == [str(i) for i in range(8)]


def test_plan_refuses_uneven_placement() -> None:
    with pytest.raises(BackendError) as e:
        plan_worker_envs(workers([30, 32, 2]), config(), **PORTS)
    assert str(e.value).startswith(
        "Ray placed 64 workers unevenly over 3 node(s) (ip-10-0-0-1: 30, ip-10-0-0-2: 32, ip-10-0-0-3: 2)"
    )
    assert "scaling.workers_per_node=32" in str(e.value)


def test_plan_refuses_tp_across_nodes() -> None:
    with pytest.raises(BackendError, match=r"tensor-parallel group 0 \(ranks 0-63\) spans 2 nodes"):
        plan_worker_envs(workers([32, 32]), config(tensor_parallel_size=64), **PORTS)


def test_plan_refuses_bad_ranks() -> None:
    infos = workers([2, 2], world_size=4)
    with pytest.raises(BackendError, match=r"worker ranks \[0, 1, 2\] are not 0..2"):
        plan_worker_envs(infos[:3], config(instance_type="trn1.2xlarge", workers_per_node=2), **PORTS)


# --- the Ray backend against a fake worker group -------------------------------------------------------------------


def test_on_start_sets_each_workers_env(no_ray_get: None) -> None:
    infos = workers([32, 32])
    infos = infos[5:] + infos[:5]  # rank 0 is at index 59
    group = FakeWorkerGroup(infos)
    neuron_xla._NeuronXlaRayBackend().on_start(group, config())
    assert ("free_ports", 59) in group.calls  # both ports come from rank 0's node
    assert sorted(group.applied) == list(range(64))
    for index, env in group.applied.items():
        assert env["RANK"] == str(infos[index].world_rank)
        assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == str(29500 + 59)
        assert env["NEURON_RT_ROOT_COMM_ID"] == f"10.0.0.1:{41000 + 59}"


def test_on_start_refuses_uneven_placement_before_setting_anything(no_ray_get: None) -> None:
    group = FakeWorkerGroup(workers([1, 2], world_size=3))
    with pytest.raises(BackendError, match="Ray placed 3 workers unevenly"):
        neuron_xla._NeuronXlaRayBackend().on_start(group, config(instance_type="trn1.2xlarge", workers_per_node=2))
    assert group.applied == {}


def test_training_start_and_shutdown_only_touch_the_process_group(no_ray_get: None) -> None:
    group = FakeWorkerGroup(workers([2]))
    cfg = config(instance_type="trn1.2xlarge", workers_per_node=2)
    neuron_xla._NeuronXlaRayBackend().on_training_start(group, cfg)
    neuron_xla._NeuronXlaRayBackend().on_shutdown(group, cfg)
    assert [name for name, _ in group.calls] == ["_init_xla_process_group"] * 2 + ["destroy_process_group"] * 2


# --- worker-side helpers -------------------------------------------------------------------------------------------


def test_free_ports_are_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(neuron_ray.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    addr, ports = neuron_ray.free_ports(2)
    assert addr == "127.0.0.1" and len(set(ports)) == 2 and all(0 < p < 65536 for p in ports)


def test_apply_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAYTRN_TEST_NEURON_VAR", raising=False)
    neuron_ray.apply_env({"RAYTRN_TEST_NEURON_VAR": "1"})
    assert os.environ["RAYTRN_TEST_NEURON_VAR"] == "1"
    monkeypatch.delenv("RAYTRN_TEST_NEURON_VAR")


def test_destroy_process_group_without_one_is_a_no_op() -> None:
    neuron_ray.destroy_process_group()


# --- the frozen path's refusals and defaults (moved from test_init_from.py and test_host_malloc.py) ----------------


def test_the_xla_path_refuses_init_from(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path)
    with pytest.raises(BackendError, match="model.init_from is not supported on scaling.accelerator='xla-cpu'"):
        get_backend("xla-cpu").check(job_for(tmp_path, "scaling.accelerator=xla-cpu", "scaling.min_workers=1",
                                             "scaling.max_workers=1"))  # fmt: skip


def test_the_xla_path_refuses_a_qwen3_model() -> None:
    job = load_job(Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml",
                   ["model.family=qwen3", "model.preset=qwen3-0.6b", "scaling.accelerator=xla-cpu",
                    "scaling.min_workers=1", "scaling.max_workers=1", "data.manifest=unused"], resolve=False)  # fmt: skip
    with pytest.raises(BackendError, match="model.family: qwen3 is not supported on scaling.accelerator='xla-cpu'"):
        get_backend("xla-cpu").check(job)


def test_xla_cpu_keeps_the_glibc_allocator_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    test_host_malloc.test_worker_setup_follows_backend_default_and_job(monkeypatch, "xla-cpu", None, False)


def test_a_trn2_job_on_the_xla_path_is_refused() -> None:
    """Moved from test_neuron_backend.py's test_check_refuses (the neuron-xla case)."""
    path = Path(__file__).resolve().parents[2] / "jobs" / "llama3.2-1b-trn2.yaml"
    spec = load_job(path, ["scaling.accelerator=neuron-xla"], base_dir="/base")
    with pytest.raises(BackendError) as e:
        get_backend(spec.scaling.accelerator).check(spec)
    assert str(e.value).startswith(f"{path}: ")
    assert "whose training support AWS ended with Neuron 2.30" in str(e.value)
