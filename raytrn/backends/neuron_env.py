"""The Trainium process layout and the environment of one worker: pure functions, no torch, no Ray.

Which stack an instance family trains with: trn2/trn2u and trn3 (whose instance layouts are UNCONFIRMED) use
TorchNeuron (``scaling.accelerator: neuron``, :func:`torchneuron_worker_env`); trn1 uses the frozen XLA path
(``neuron-xla``, whose worker environment is :func:`raytrn.xla.env.neuron_xla_worker_env`). Both run one
Ray Train worker per (logical) NeuronCore, wired the way ``torchrun`` wires a torch.distributed program: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (:func:`torchrun_env`,
checked by :func:`check_ranks`).

Layout rules: every node runs ``workers_per_node`` workers (or a single node runs fewer), ranks are
numbered node by node (``rank = node_rank * workers_per_node + local_rank``), and a tensor-parallel
group (consecutive ranks) never spans two nodes. The instance table and the layout checks serve both stacks.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from raytrn.backends.neuron_instances import (  # re-exported: the layout and the table are read together
    INSTANCES,
    NEURON_ACCELERATORS,
    InstanceSpec,
    check_stack,
    cores_per_instance,
    efa_devices,
    instance_spec,
)
from raytrn.config.sizes import elastic_world_sizes
from raytrn.errors import BackendError

if TYPE_CHECKING:
    from raytrn.config import JobSpec

#: Mount points of shared file systems (FSx for Lustre, EFS, the ``/shared`` of AWS's EKS samples).
#: A compile cache under one of them gets a per-host subdirectory: see :func:`compile_cache_env`.
SHARED_FS_PREFIXES = ("/fsx", "/efs", "/mnt/fsx", "/mnt/efs", "/shared")

#: In ``neuron.compile_cache``, replaced by the worker's host name (an explicit per-host cache).
HOST_PLACEHOLDER = "{host}"


def require_layout(job: JobSpec) -> tuple[str, int]:
    """``scaling.instance_type`` and ``scaling.workers_per_node`` of a Trainium job; BackendError when unset."""
    s = job.scaling
    missing = [f for f in ("instance_type", "workers_per_node") if getattr(s, f) is None]
    if missing:
        example = (
            "scaling.instance_type: trn2.48xlarge and scaling.workers_per_node: 64"
            if s.accelerator == "neuron"
            else "scaling.instance_type: trn1.32xlarge and scaling.workers_per_node: 32"
        )
        raise BackendError(
            f"{job.source}: scaling.accelerator={s.accelerator!r} needs "
            f"{' and '.join('scaling.' + f for f in missing)} (one worker per NeuronCore): set e.g. {example}"
        )
    assert s.instance_type is not None and s.workers_per_node is not None
    return s.instance_type, s.workers_per_node


def check_neuron_job(job: JobSpec) -> list[str]:
    """``raytrn validate``'s checks of a Trainium job, for either stack: the instance family's stack, the layout of
    every world size of the elastic range, the compile cache and the compiler flags. Info notes, or BackendError
    prefixed with the job file."""
    s, n = job.scaling, job.neuron
    instance_type, workers_per_node = require_layout(job)
    torchneuron = s.accelerator == "neuron"
    try:
        check_stack(s.accelerator, instance_type)
        notes = check_layout(
            min_workers=s.min_workers,
            max_workers=s.max_size,
            workers_per_node=workers_per_node,
            instance_type=instance_type,
            lnc=n.lnc,
            tensor_parallel_size=job.parallel.tensor_parallel_size,
            every_core=torchneuron,
            # a model replica's other dimensions: its pipeline stages and context-parallel ranks
            replica_factor=job.parallel.pipeline_parallel_size * job.parallel.context_parallel_size,
        )
        if torchneuron:
            neff_cache_env(n.compile_cache, hostname="<host>")
        else:
            compile_cache_env(n.compile_cache, hostname="<host>")
        flags = cc_flags_for(n.cc_flags, n.lnc)
    except BackendError as e:
        raise BackendError(f"{job.source}: {e}") from None
    resources = s.resources_per_worker
    if resources is not None and resources.get("neuron_cores") != 1:
        notes.append(
            f"scaling.resources_per_worker={resources} does not request neuron_cores: 1; each worker still "
            "uses one NeuronCore, which Ray then does not reserve for it (add neuron_cores: 1)"
        )
    if n.compile_cache is not None and flags and "--cache_dir" in flags:
        notes.append("neuron.cc_flags sets --cache_dir, which takes precedence over neuron.compile_cache")
    return notes


def check_layout(
    *,
    min_workers: int,
    max_workers: int,
    workers_per_node: int,
    instance_type: str,
    lnc: int | None,
    tensor_parallel_size: int,
    every_core: bool = False,
    replica_factor: int = 1,
) -> list[str]:
    """Check that every world size of the elastic range is a valid Neuron layout; return info notes.

    Sizes are taken at node granularity (``min_workers..max_workers`` stepping by ``workers_per_node``,
    plus both ends). Each must be whole nodes or a single partial node; the tensor-parallel size must
    divide ``workers_per_node`` (so a TP group never spans nodes) and every size. ``every_core``
    (TorchNeuron): ``workers_per_node`` must be the node's (logical) NeuronCore count. ``replica_factor``: a model
    replica's workers beyond its TP group (pipeline stages x context-parallel ranks), for the data-parallel count.
    """
    cores = cores_per_instance(instance_type, lnc)
    _check_counts(
        workers_per_node=workers_per_node, cores=cores, instance_type=instance_type, lnc=lnc, every_core=every_core
    )
    if min_workers < 1 or max_workers < min_workers:
        raise BackendError(f"scaling: need 1 <= min_workers <= max_workers, got {min_workers} and {max_workers}")
    tp = tensor_parallel_size
    if tp < 1:
        raise BackendError(f"parallel.tensor_parallel_size={tp}: must be >= 1")
    if workers_per_node % tp:
        raise BackendError(
            f"parallel.tensor_parallel_size={tp} does not divide scaling.workers_per_node={workers_per_node}: "
            f"a tensor-parallel group would span two nodes. Use a TP size that divides {workers_per_node} "
            f"({_divisors(workers_per_node)})"
        )
    sizes = elastic_world_sizes(min_workers, max_workers, workers_per_node)
    for n in sizes:
        if n > workers_per_node and n % workers_per_node:
            raise BackendError(
                f"scaling: {n} workers is not a whole number of nodes at workers_per_node={workers_per_node} "
                f"({n // workers_per_node} nodes + {n % workers_per_node} workers); with min_workers={min_workers} "
                f"and max_workers={max_workers} every size the job can take must be whole nodes (or one partial "
                f"node): set both to multiples of {workers_per_node}"
            )
        if n % tp:
            raise BackendError(
                f"scaling: {n} workers is not divisible by parallel.tensor_parallel_size={tp}; "
                f"every world size must hold whole tensor-parallel groups"
            )
    nodes = [max(1, n // workers_per_node) for n in sizes]
    node_range = f"{nodes[0]}" if nodes[0] == nodes[-1] else f"{nodes[0]}-{nodes[-1]}"
    spec = instance_spec(instance_type)
    lnc_note = f" at LNC={lnc or spec.default_lnc}" if spec.default_lnc else ""
    notes = [
        f"neuron layout: {instance_type} ({cores} NeuronCores{lnc_note}), {workers_per_node} workers per node, "
        f"{', '.join(map(str, sizes))} workers on {node_range} node(s), tensor parallel {tp} "
        f"(data parallel {', '.join(str(n // (tp * replica_factor)) for n in sizes)})"
    ]
    if workers_per_node < cores:
        notes.append(
            f"neuron layout: workers_per_node={workers_per_node} uses NeuronCores 0-{workers_per_node - 1} of "
            f"{cores} on each node; do not share these nodes with another Neuron job"
        )
    unconfirmed = spec.unconfirmed_note()
    if unconfirmed:
        notes.append(f"neuron layout: {unconfirmed}")
    return notes


def check_tp_groups(node_ids_by_rank: list[str], tensor_parallel_size: int) -> None:
    """Raise BackendError naming the first tensor-parallel group (consecutive ranks) that spans nodes."""
    tp, n = tensor_parallel_size, len(node_ids_by_rank)
    if tp < 1:
        raise BackendError(f"parallel.tensor_parallel_size={tp}: must be >= 1")
    if n % tp:
        raise BackendError(f"{n} workers is not divisible by parallel.tensor_parallel_size={tp}")
    for start in range(0, n, tp):
        nodes = list(dict.fromkeys(node_ids_by_rank[start : start + tp]))
        if len(nodes) > 1:
            raise BackendError(
                f"tensor-parallel group {start // tp} (ranks {start}-{start + tp - 1}) spans {len(nodes)} nodes "
                f"({', '.join(nodes)}); every TP group must sit on one node. Ray placed the workers unevenly: "
                f"make sure each node's NeuronCores are free, and that scaling.workers_per_node is a multiple of "
                f"parallel.tensor_parallel_size={tp}"
            )


# ---------------------------------------------------------------------------------------------------
# The environment


def compile_cache_env(cache: str | None, *, hostname: str) -> dict[str, str]:
    """``NEURON_COMPILE_CACHE_URL`` for ``neuron.compile_cache`` on host ``hostname``.

    - ``None``: nothing (the Neuron default, ``/var/tmp/neuron-compile-cache``, local to each host).
    - ``s3://bucket/prefix``: as is; S3 is the documented shared cache.
    - A path containing ``{host}``: the placeholder is replaced by the host name (explicit per-host).
    - An absolute path under a shared mount (``/fsx``, ``/efs``, ``/mnt/fsx``, ``/mnt/efs``, ``/shared``):
      ``<path>/<hostname>``, because the cache's file locks break on NFS/EFS/FSx (AWS Neuron
      troubleshooting guide: "limitations to file locking on NFS. EFS/FSx also exhibit similar").
    - Any other absolute path: as is (a local disk).

    Relative paths and other URI schemes raise BackendError.
    """
    if cache is None:
        return {}
    where = f"neuron.compile_cache={cache!r}"
    if cache.startswith("s3://"):
        if len(cache) <= len("s3://"):
            raise BackendError(f"{where}: name a bucket, e.g. s3://my-bucket/neuron-cache")
        return {"NEURON_COMPILE_CACHE_URL": cache}
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", cache):
        raise BackendError(f"{where}: the Neuron compile cache is an s3:// URI or a local/shared path")
    if not cache.startswith("/"):
        raise BackendError(
            f"{where}: use an absolute path (workers do not share the driver's working directory) or an s3:// URI"
        )
    if not hostname:
        raise BackendError(f"{where}: a per-host cache needs the worker's host name")
    if HOST_PLACEHOLDER in cache:
        return {"NEURON_COMPILE_CACHE_URL": cache.replace(HOST_PLACEHOLDER, hostname)}
    path = cache.rstrip("/") or "/"
    if is_shared_path(path):
        return {"NEURON_COMPILE_CACHE_URL": f"{path}/{hostname}"}
    return {"NEURON_COMPILE_CACHE_URL": path}


#: TorchNeuron's compiled-graph (NEFF) cache directory (UNCONFIRMED name: see NEURON-NOTES; one place to fix).
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"


def neff_cache_env(cache: str | None, *, hostname: str) -> dict[str, str]:
    """TorchNeuron's NEFF cache directory for ``neuron.compile_cache``: the same path rules as
    :func:`compile_cache_env` (per-host subdirectory under a shared mount, ``{host}``), but a directory only:
    the S3 cache is the XLA path's (``NEURON_COMPILE_CACHE_URL``)."""
    if cache is not None and cache.startswith("s3://"):
        raise BackendError(
            f"neuron.compile_cache={cache!r}: TorchNeuron's compiled-graph (NEFF) cache is a directory on the node; "
            "an s3:// cache is the XLA path's (neuron-xla). Use a local path, or a shared mount such as /fsx/neff-cache "
            "(raytrn gives each host its own subdirectory)"
        )
    xla = compile_cache_env(cache, hostname=hostname)
    return {NEFF_CACHE_ENV: xla["NEURON_COMPILE_CACHE_URL"]} if xla else {}


def is_shared_path(path: str) -> bool:
    """Whether ``path`` lies under one of :data:`SHARED_FS_PREFIXES` (by whole path components)."""
    return any(path == p or path.startswith(p + "/") for p in SHARED_FS_PREFIXES)


_LNC_FLAG = re.compile(r"(?:^|\s)(?:--logical-nc-config|--lnc|-lnc)(?:=|\s+)(\S+)")


def cc_flags_for(cc_flags: str | None, lnc: int | None) -> str | None:
    """``NEURON_CC_FLAGS``: the user's flags, plus ``--logical-nc-config N`` when ``neuron.lnc`` is set.

    The compiler's LNC must match the runtime's ``NEURON_LOGICAL_NC_CONFIG`` (the compiler defaults to
    2), so an explicit LNC is passed to both; a conflicting flag in ``neuron.cc_flags`` is an error.
    """
    flags = (cc_flags or "").strip()
    if lnc is None:
        return flags or None
    found = _LNC_FLAG.search(flags)
    if found:
        if found.group(1) != str(lnc):
            raise BackendError(
                f"neuron.cc_flags sets the compiler's logical NeuronCore config to {found.group(1)} but "
                f"neuron.lnc={lnc}; they must match (drop the flag from neuron.cc_flags)"
            )
        return flags
    return f"{flags} --logical-nc-config {lnc}".strip()


def torchneuron_worker_env(
    *,
    world_rank: int,
    local_rank: int,
    node_rank: int,
    world_size: int,
    workers_per_node: int,
    master_addr: str,
    master_port: int,
    instance_type: str,
    lnc: int | None = None,
    visible_cores: str | None = None,
    compile_cache: str | None = None,
    cc_flags: str | None = None,
    hostname: str | None = None,
) -> dict[str, str]:
    """Every environment variable one TorchNeuron worker (one logical NeuronCore, trn2/trn3) needs, validated.

    The process group is ``neuron`` with ``init_method="env://"``: torchrun's variables. ``visible_cores`` is
    ``NEURON_RT_VISIBLE_CORES`` as Ray assigned it from the worker's ``neuron_cores`` (kept: Ray reserved that
    core for this worker); None (no ``neuron_cores`` requested) falls back to ``LOCAL_RANK``, as TorchNeuron
    itself does. ``NEURON_LOGICAL_NC_CONFIG`` is always set (the instance default when ``lnc`` is None) and the
    compiler gets the same LNC. ``NEURON_RT_ROOT_COMM_ID`` is not set: TorchNeuron derives it from
    ``MASTER_ADDR`` at ``init_process_group`` (NEURON-NOTES: from the backend's source, not yet in AWS's docs).
    """
    spec = check_stack("neuron", instance_type)
    num_nodes = check_ranks(
        world_rank=world_rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world_size,
        workers_per_node=workers_per_node,
        master_addr=master_addr,
        ports={"master_port": master_port},
        instance_type=instance_type,
        lnc=lnc,
        every_core=True,
    )
    cores = spec.cores(lnc)
    if visible_cores is None:
        visible_cores = str(local_rank)
    elif not visible_cores.isdigit() or int(visible_cores) >= cores:
        raise BackendError(
            f"NEURON_RT_VISIBLE_CORES={visible_cores!r} (rank {world_rank}, as Ray assigned it): TorchNeuron needs "
            f"exactly one logical NeuronCore per worker, an id in 0-{cores - 1} on {instance_type}"
            f"{f' at LNC={lnc}' if lnc else ''}; request scaling.resources_per_worker: {{neuron_cores: 1}}"
        )
    effective_lnc = lnc or spec.default_lnc
    assert effective_lnc is not None  # trn2/trn3 have a logical NeuronCore config
    env = {
        # torchrun's contract, read by init_process_group("neuron", init_method="env://").
        **torchrun_env(
            master_addr, master_port, world_rank, local_rank, world_size, node_rank, num_nodes, workers_per_node
        ),
        # One logical NeuronCore per process: the device is neuron:0 of what this process sees.
        "NEURON_RT_VISIBLE_CORES": visible_cores,
        "NEURON_LOGICAL_NC_CONFIG": str(effective_lnc),
    }
    if spec.efa_devices:  # AWS's multi-node scripts; harmless on one node
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"})
    flags = cc_flags_for(cc_flags, effective_lnc)
    if flags:
        env["NEURON_CC_FLAGS"] = flags
    env.update(neff_cache_env(compile_cache, hostname=hostname or ""))
    return env


def torchrun_env(
    master_addr: str,
    master_port: int,
    world_rank: int,
    local_rank: int,
    world_size: int,
    node_rank: int,
    num_nodes: int,
    workers_per_node: int,
) -> dict[str, str]:
    """torchrun's variables for one worker (``GROUP_RANK`` is the node rank)."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(world_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(min(workers_per_node, world_size)),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes),
    }


def check_ranks(
    *,
    world_rank: int,
    local_rank: int,
    node_rank: int,
    world_size: int,
    workers_per_node: int,
    master_addr: str,
    ports: dict[str, int],
    instance_type: str,
    lnc: int | None,
    every_core: bool = False,
) -> int:
    """Validate one worker's place in the layout; return the number of nodes."""
    cores = cores_per_instance(instance_type, lnc)
    _check_counts(
        workers_per_node=workers_per_node, cores=cores, instance_type=instance_type, lnc=lnc, every_core=every_core
    )
    for name, value in (("world_rank", world_rank), ("local_rank", local_rank), ("node_rank", node_rank)):
        if value < 0:
            raise BackendError(f"{name}={value}: must be >= 0")
    if world_size < 1:
        raise BackendError(f"world_size={world_size}: must be >= 1")
    for name, port in ports.items():
        if not 0 < port < 65536:
            raise BackendError(f"{name}={port}: not a TCP port")
    if not master_addr:
        raise BackendError("master_addr is empty: it must be the IP of the rank-0 worker's node")
    if world_size > workers_per_node and world_size % workers_per_node:
        raise BackendError(
            f"{world_size} workers is not a whole number of nodes at workers_per_node={workers_per_node} "
            f"({world_size // workers_per_node} nodes + {world_size % workers_per_node} workers): an uneven "
            f"layout; use a multiple of {workers_per_node}"
        )
    num_nodes = -(-world_size // workers_per_node)
    local_world_size = min(workers_per_node, world_size)
    if world_rank >= world_size:
        raise BackendError(f"world_rank={world_rank} is out of range for world_size={world_size}")
    if node_rank >= num_nodes:
        raise BackendError(f"node_rank={node_rank} is out of range for {num_nodes} node(s)")
    if local_rank >= local_world_size:
        raise BackendError(f"local_rank={local_rank} is out of range for {local_world_size} worker(s) per node")
    if world_rank != node_rank * workers_per_node + local_rank:
        raise BackendError(
            f"world_rank={world_rank} is inconsistent with node_rank={node_rank}, local_rank={local_rank} and "
            f"workers_per_node={workers_per_node} (expected {node_rank * workers_per_node + local_rank}): "
            "ranks must be numbered node by node"
        )
    return num_nodes


def _check_counts(
    *, workers_per_node: int, cores: int, instance_type: str, lnc: int | None, every_core: bool = False
) -> None:
    if workers_per_node < 1:
        raise BackendError(f"scaling.workers_per_node={workers_per_node}: must be >= 1")
    at_lnc = f" at neuron.lnc={lnc}" if lnc is not None else ""
    spec = instance_spec(instance_type)
    if every_core and workers_per_node != cores:
        effective = lnc or spec.default_lnc
        at = at_lnc or (f" at the default LNC={effective}" if effective else "")
        other = {1: 2, 2: 1}.get(effective or 0)
        alt = f", or {spec.cores(other)} with neuron.lnc: {other}" if other else ""
        raise BackendError(
            f"scaling.workers_per_node={workers_per_node} does not match the {cores} NeuronCores of {instance_type}{at}: "
            f"TorchNeuron runs one worker per logical NeuronCore of every node; set scaling.workers_per_node: "
            f"{cores}{alt} (a job smaller than one node keeps max_workers below that)"
        )
    if workers_per_node > cores:
        raise BackendError(
            f"scaling.workers_per_node={workers_per_node} exceeds the {cores} NeuronCores of {instance_type}{at_lnc} "
            f"(one worker per NeuronCore); set scaling.workers_per_node <= {cores}"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


__all__ = [
    "INSTANCES",
    "NEURON_ACCELERATORS",
    "InstanceSpec",
    "check_stack",
    "cores_per_instance",
    "efa_devices",
    "instance_spec",
]
