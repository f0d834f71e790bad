"""A trn1 worker's environment on the frozen XLA path (PJRT, the Neuron runtime, torchrun's variables), checked
against the layout: :mod:`raytrn.xla.env`. Moved from test_neuron_env.py with the function."""

from __future__ import annotations

import pytest

from raytrn.errors import BackendError
from raytrn.xla.env import neuron_xla_worker_env

pytestmark = pytest.mark.unit

ADDR = "10.0.1.17"
EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


def env(world_rank: int, *, world_size: int = 32, workers_per_node: int = 32, **kw) -> dict[str, str]:
    """The env of ``world_rank`` in a node-by-node layout."""
    per_node = max(workers_per_node, 1)
    args = dict(
        world_rank=world_rank,
        local_rank=world_rank % per_node,
        node_rank=world_rank // per_node,
        world_size=world_size,
        workers_per_node=workers_per_node,
        master_addr=ADDR,
        master_port=29500,
        root_comm_port=41000,
        instance_type="trn1.32xlarge",
    )
    args.update(kw)
    return neuron_xla_worker_env(**args)  # type: ignore[arg-type]


# --- the environment: 1 node x 32 ----------------------------------------------------------------------------------


def test_one_trn1_node_rank0_and_rank31_exactly() -> None:
    ones = ",".join(["1"] * 32)
    common = {
        "MASTER_ADDR": ADDR,
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "32",
        "LOCAL_WORLD_SIZE": "32",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "raytrn",
        "PJRT_DEVICE": "NEURON",
        "NEURON_RT_ROOT_COMM_ID": f"{ADDR}:41000",
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ones,
        "NEURON_PJRT_WORLD_SIZE": "32",
        "PJRT_LOCAL_PROCESS_COUNT": "32",
        "CCOM_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
        "MALLOC_ARENA_MAX": "64",
        "XLA_TRANSFER_SEED_ASYNC": "1",
        **EFA,
    }
    for rank in (0, 31):
        assert env(rank) == {
            **common,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NEURON_PJRT_PROCESS_INDEX": str(rank),
            "PJRT_LOCAL_PROCESS_RANK": str(rank),
            "NEURON_RT_VISIBLE_CORES": str(rank),
        }


def test_one_trn1_node_uses_every_core_once() -> None:
    envs = [env(r) for r in range(32)]
    assert [e["NEURON_RT_VISIBLE_CORES"] for e in envs] == [str(c) for c in range(32)]
    for e in envs:
        assert e["NEURON_PJRT_PROCESSES_NUM_DEVICES"].split(",") == ["1"] * 32


# --- 4 nodes x 32 --------------------------------------------------------------------------------------------------


def test_four_trn1_nodes() -> None:
    envs = [env(r, world_size=128) for r in range(128)]
    e95 = envs[95]
    assert (e95["RANK"], e95["GROUP_RANK"], e95["LOCAL_RANK"]) == ("95", "2", "31")
    assert e95["NEURON_RT_VISIBLE_CORES"] == "31" and e95["PJRT_LOCAL_PROCESS_RANK"] == "31"
    for rank, e in enumerate(envs):
        assert e["NEURON_RT_ROOT_COMM_ID"] == f"{ADDR}:41000"  # rank 0's address on every rank
        assert e["MASTER_ADDR"] == ADDR
        assert e["NEURON_PJRT_PROCESS_INDEX"] == e["RANK"] == str(rank)  # the global rank
        assert e["WORLD_SIZE"] == e["NEURON_PJRT_WORLD_SIZE"] == "128"
        assert e["LOCAL_WORLD_SIZE"] == e["PJRT_LOCAL_PROCESS_COUNT"] == "32"
        assert e["GROUP_RANK"] == str(rank // 32) and e["GROUP_WORLD_SIZE"] == "4"
        assert e["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == ",".join(["1"] * 128)
    assert {e["NEURON_RT_VISIBLE_CORES"] for e in envs} == {str(c) for c in range(32)}


def test_ipv6_root_comm_id_is_bracketed() -> None:
    assert env(0, master_addr="fd00::17")["NEURON_RT_ROOT_COMM_ID"] == "[fd00::17]:41000"


# --- other instances and options -----------------------------------------------------------------------------------


def test_trn1n_has_efa() -> None:
    e = env(40, world_size=64, instance_type="trn1n.32xlarge")
    assert {k: e[k] for k in EFA} == EFA
    assert e["GROUP_RANK"] == "1" and e["LOCAL_RANK"] == "8"


def test_trn1_2xlarge_two_cores_no_efa() -> None:
    envs = [env(r, world_size=2, workers_per_node=2, instance_type="trn1.2xlarge") for r in range(2)]
    assert [e["NEURON_RT_VISIBLE_CORES"] for e in envs] == ["0", "1"]
    for e in envs:
        assert not set(EFA) & set(e)
        assert e["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "1,1"
        assert e["CCOM_SOCKET_IFNAME"] == "eth0"
    with pytest.raises(BackendError, match="workers_per_node=3 exceeds the 2 NeuronCores of trn1.2xlarge"):
        env(0, world_size=3, workers_per_node=3, instance_type="trn1.2xlarge")


def test_the_xla_env_refuses_trn2() -> None:
    with pytest.raises(BackendError, match=r"trn2.48xlarge \(trn2\) trains with TorchNeuron"):
        env(0, world_size=64, workers_per_node=64, instance_type="trn2.48xlarge")


def test_options() -> None:
    e = env(
        3,
        socket_ifname="ens5",
        stochastic_rounding=False,
        cc_flags="--model-type transformer",
        compile_cache="s3://bucket/neuron-cache",
        hostname="ip-10-0-1-17",
        run_id="llama3-8b-trn1",
    )
    assert e["CCOM_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == "ens5"
    assert e["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"
    assert e["NEURON_CC_FLAGS"] == "--model-type transformer"
    assert e["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/neuron-cache"
    assert e["TORCHELASTIC_RUN_ID"] == "llama3-8b-trn1"
    assert "NEURON_COMPILE_CACHE_URL" not in env(3) and "NEURON_CC_FLAGS" not in env(3)


def test_single_partial_node() -> None:
    e = env(7, world_size=8)
    assert e["LOCAL_WORLD_SIZE"] == e["PJRT_LOCAL_PROCESS_COUNT"] == "8"
    assert e["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "1,1,1,1,1,1,1,1"


# --- invalid layouts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(world_size=33, workers_per_node=33), "workers_per_node=33 exceeds the 32 NeuronCores of trn1.32xlarge"),
        (dict(world_size=48), "48 workers is not a whole number of nodes at workers_per_node=32 (1 nodes + 16"),
        (dict(world_rank=32, local_rank=0, node_rank=1), "world_rank=32 is out of range for world_size=32"),
        (dict(world_size=64, local_rank=32, node_rank=0), "local_rank=32 is out of range for 32 worker(s) per node"),
        (dict(world_size=64, world_rank=5, node_rank=1), "world_rank=5 is inconsistent with node_rank=1"),
        (dict(world_size=64, node_rank=2, world_rank=0), "node_rank=2 is out of range for 2 node(s)"),
        (dict(world_rank=-1), "world_rank=-1: must be >= 0"),
        (dict(world_size=0), "world_size=0: must be >= 1"),
        (dict(workers_per_node=0), "workers_per_node=0: must be >= 1"),
        (dict(master_port=0), "master_port=0: not a TCP port"),
        (dict(master_addr=""), "master_addr is empty"),
        (dict(instance_type="p4d.24xlarge"), "unknown Trainium instance type"),
        (dict(lnc=2), "neuron.lnc=2: the logical NeuronCore config applies only to trn2"),
        (dict(compile_cache="/fsx/cache"), "a per-host cache needs the worker's host name"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_env(kw: dict, message: str) -> None:
    kw = dict(kw)
    with pytest.raises(BackendError) as e:
        env(kw.pop("world_rank", 0), **kw)
    assert message in str(e.value)
