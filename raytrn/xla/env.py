"""The environment of one trn1 worker on the frozen XLA path (torch-neuronx's XLA build, PJRT on NeuronCores).

``TORCHELASTIC_RUN_ID`` makes torch-xla and torch-neuronx derive the PJRT process layout from torchrun's
variables, and the PJRT and Neuron runtime variables are set explicitly (Ray's stock ``TorchXLAConfig`` sets
neither ``NEURON_RT_ROOT_COMM_ID`` nor the PJRT variables; see ray-project/ray#65070). A worker must get this
environment before it imports ``torch_xla``: the XLA runtime reads it once, at import. The instance table and the
layout rules shared with TorchNeuron are :mod:`raytrn.backends.neuron_env`.
"""

from __future__ import annotations

from raytrn.backends.neuron_env import (
    cc_flags_for,
    check_ranks,
    check_stack,
    compile_cache_env,
    efa_devices,
    torchrun_env,
)

#: torch-xla's default root-communicator port (``MASTER_ADDR:62182``); raytrn picks a free one instead.
DEFAULT_ROOT_COMM_PORT = 62182


def neuron_xla_worker_env(
    *,
    world_rank: int,
    local_rank: int,
    node_rank: int,
    world_size: int,
    workers_per_node: int,
    master_addr: str,
    master_port: int,
    root_comm_port: int,
    instance_type: str,
    lnc: int | None = None,
    socket_ifname: str = "eth0",
    compile_cache: str | None = None,
    stochastic_rounding: bool = True,
    cc_flags: str | None = None,
    hostname: str | None = None,
    run_id: str = "raytrn",
) -> dict[str, str]:
    """Every environment variable one trn1 worker (one NeuronCore, the XLA path) needs, validated against the layout.

    ``master_addr`` is rank 0's IP: it hosts the torch.distributed store (``master_port``) and the Neuron
    runtime's root communicator (``root_comm_port``). ``hostname`` is needed only for a per-host compile
    cache. ``run_id`` becomes ``TORCHELASTIC_RUN_ID``, whose presence makes torch-xla read the torchrun
    variables.
    """
    check_stack("neuron-xla", instance_type)
    num_nodes = check_ranks(
        world_rank=world_rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world_size,
        workers_per_node=workers_per_node,
        master_addr=master_addr,
        ports={"master_port": master_port, "root_comm_port": root_comm_port},
        instance_type=instance_type,
        lnc=lnc,
    )
    env = {
        **torchrun_env(
            master_addr, master_port, world_rank, local_rank, world_size, node_rank, num_nodes, workers_per_node
        ),
        "TORCHELASTIC_RUN_ID": run_id,
        # PJRT on Neuron: one process per NeuronCore, global process index = rank.
        "PJRT_DEVICE": "NEURON",
        "NEURON_RT_ROOT_COMM_ID": host_port(master_addr, root_comm_port),
        "NEURON_PJRT_PROCESS_INDEX": str(world_rank),
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join(["1"] * world_size),
        "NEURON_PJRT_WORLD_SIZE": str(world_size),
        "PJRT_LOCAL_PROCESS_RANK": str(local_rank),
        "PJRT_LOCAL_PROCESS_COUNT": str(min(workers_per_node, world_size)),
        "NEURON_RT_VISIBLE_CORES": str(local_rank),
        # Collective bootstrap interface: CCOM finds no interface by subnet where hosts carry a /32.
        "CCOM_SOCKET_IFNAME": socket_ifname,
        "NCCL_SOCKET_IFNAME": socket_ifname,
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if stochastic_rounding else "0",
        "MALLOC_ARENA_MAX": "64",
        "XLA_TRANSFER_SEED_ASYNC": "1",
    }
    if efa_devices(instance_type):
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"})
    if lnc is not None:
        env["NEURON_LOGICAL_NC_CONFIG"] = str(lnc)
    flags = cc_flags_for(cc_flags, lnc)
    if flags:
        env["NEURON_CC_FLAGS"] = flags
    if compile_cache is not None:
        env.update(compile_cache_env(compile_cache, hostname=hostname or ""))
    return env


def host_port(addr: str, port: int) -> str:
    """``addr:port``, with an IPv6 address in brackets."""
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"
    return f"{addr}:{port}"
