"""Parallelism applied to the single-device model, in one place: expert and tensor parallel (the family's plans),
activation checkpointing, ``torch.compile``, then FSDP2 or DDP (torchtitan's order).

The model code (:mod:`raytrn.models.decoder`) knows nothing of this. With ``parallel.tensor_parallel_size``
> 1 the workers form a ``(dp, tp)`` :class:`~torch.distributed.device_mesh.DeviceMesh` (consecutive ranks
form a TP group, all on one node) and the model's family lays each decoder block out by its plan
(``raytrn/models/<family>/parallelize.py``: Megatron style, q/k/v and gate/up column-wise, o and down row-wise, the
embedding by vocabulary rows and the head by vocabulary columns, norms replicated); a MoE family's experts are
spread by its expert parallelism first. ``parallel.data_parallel: fsdp`` then shards every
block and the root with ``fully_shard`` over the ``dp`` dimension; ``hsdp`` splits that dimension in two,
``(dp_replicate, dp_shard, tp)`` (torchtitan's), and ``fully_shard`` over the 2-D ``(dp_replicate, dp_shard)`` mesh
shards within a shard group of consecutive ranks (``parallel.hsdp_shard_size`` workers, one node by default) and
replicates across the groups; ``ddp`` wraps the model in ``DistributedDataParallel`` (TP 1 only). The data-parallel
rank (the batch a worker reads) is ``rank // (CP x TP)`` in every layout. The same code runs on cpu (gloo) and cuda
(nccl); a ``neuron`` device is one more device type.

Context parallelism (``parallel.context_parallel_size``) puts a ``cp`` dimension between data and tensor parallelism,
torchtitan's ``(dp, cp, tp)``: a group of CP x TP consecutive ranks holds one replica's sequences, each CP rank a
zigzag share of every row (:mod:`raytrn.models.context_parallel`). FSDP shards over the data and context ranks
together (torchtitan's ``dp_shard_cp``): the layout mesh's first dimension is then ``dp_cp`` (``dp_shard_cp`` under
hsdp): ``dp`` and ``cp`` flattened in order, so gradients are reduced (averaged) over DP x CP ranks;
DDP averages over every rank, the same DP x CP ranks (TP 1). The ring runs over the ``cp`` dimension of a
``(dp, cp, tp)`` mesh of the same ranks (:func:`context_parallel`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raytrn.backends.neuron_env import check_tp_groups
from raytrn.config.sizes import hsdp_shard_size
from raytrn.errors import ConfigError
from raytrn.models.context_parallel import ContextParallel
from raytrn.models.expert_parallel import expert_mesh, experts_fsdp_mesh
from raytrn.models.parallel import decoder_layers
from raytrn.models.registry import model_spec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from raytrn.config import JobSpec

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Parallelized:
    """The model as trained, and how it was laid out."""

    model: nn.Module
    #: None without a device mesh (one process, or DDP).
    mesh: DeviceMesh | None
    data_parallel: str  # "ddp" | "fsdp" | "hsdp" | "none" (one replica)
    tensor_parallel_size: int
    #: This rank's part of a pipeline (:class:`raytrn.train.pipelined.Pipeline`); None: no pipeline parallelism.
    pipeline: Any = None
    #: This rank's context-parallel group; None: no context parallelism.
    context: ContextParallel | None = None

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 holds the parameters (fsdp or hsdp): its mixed precision policy, its ``no_sync``."""
        return self.data_parallel in ("fsdp", "hsdp")

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Around every micro-batch but the last of a step: gradients accumulate locally, with no collective."""
        model = self.model
        if self.data_parallel == "ddp":
            return model.no_sync()  # type: ignore[operator,no-any-return]
        if self.sharded:
            return _fsdp_no_sync(model)  # under hsdp neither the reduce-scatter nor the all-reduce
        return contextlib.nullcontext()

    def full_state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """See :func:`full_state_items`."""
        return full_state_items(self.model)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def parallelize(
    model: nn.Module,
    job: JobSpec,
    *,
    device: torch.device,
    world_size: int,
    compile: dict[str, Any] | None = None,
    mixed_precision: torch.dtype | None = None,
) -> Parallelized:
    """Lay ``model`` (built on ``device``, identically seeded on every rank) out over ``world_size`` workers.

    ``mixed_precision``: under FSDP, parameters are cast to this dtype for compute and gradients reduced in
    float32 (FSDP's ``MixedPrecisionPolicy``, instead of ``torch.autocast``).
    """
    p = job.parallel
    tp, cp = p.tensor_parallel_size, p.context_parallel_size
    distributed = world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
    sharded = p.data_parallel in ("fsdp", "hsdp")
    shard = hsdp_shard_size(job) if distributed else None
    if distributed and p.data_parallel == "hsdp" and (shard is None or world_size % shard or shard % tp):
        raise ConfigError(  # raytrn validate says why (raytrn.config.layout); here for a job built without it
            f"{job.source}: parallel.data_parallel: hsdp at {world_size} workers needs a shard size (parallel."
            f"hsdp_shard_size, else scaling.workers_per_node: {shard}) that divides the workers and is a multiple "
            f"of TP {tp}; raytrn validate names the fix"
        )
    mesh = None
    if distributed and (tp > 1 or sharded):
        check_tp_placement(tp)
        mesh = device_mesh(device.type, world_size, tensor_parallel_size=tp, shard_size=shard, context_parallel_size=cp)
    context = context_parallel(device.type, world_size, context_parallel_size=cp, tensor_parallel_size=tp)
    family = model_spec(job.model.family)
    experts_mesh = None
    if mesh is not None and family.expert_parallel is not None and (tp > 1 or p.expert_parallel_size > 1):
        experts_mesh = expert_mesh(
            device.type,
            world_size,
            tensor_parallel_size=tp,
            expert_parallel_size=p.expert_parallel_size,
            shard_size=shard,
        )
        family.expert_parallel(model, experts_mesh)
    if mesh is not None and tp > 1:
        family.tensor_parallel(model, mesh["tp"], job.model.tie_word_embeddings)
    ring = p.context_parallel_size > 1
    if compile is not None and ring:  # the ring's transfers cannot be traced: each block compiled around them (in 4
        # pieces), before activation checkpointing wraps it (a break inside its region would leave the block eager)
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward, **{**compile, "fullgraph": False})  # type: ignore[method-assign]
    if p.activation_checkpointing != "none":
        apply_activation_checkpointing(model, p.activation_checkpointing)
    if compile is not None and not ring:  # per block under FSDP (torchtitan); the whole model in place otherwise
        if sharded:
            for layer in decoder_layers(model):
                if experts_mesh is not None and hasattr(layer.mlp, "experts"):
                    compile_around_experts(layer, compile)
                else:
                    layer.compile(**compile)
        else:
            model.compile(**compile)
    if not distributed:
        return Parallelized(model=model, mesh=None, data_parallel="none", tensor_parallel_size=1)
    if sharded:
        assert mesh is not None
        apply_fsdp(model, data_parallel_mesh(mesh), p.reshard_after_forward, mixed_precision, experts_mesh=experts_mesh)
        return Parallelized(
            model=model, mesh=mesh, data_parallel=p.data_parallel, tensor_parallel_size=tp, context=context
        )
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return Parallelized(
        model=DistributedDataParallel(model, device_ids=ids),
        mesh=None,
        data_parallel="ddp",
        tensor_parallel_size=1,
        context=context,
    )


def device_mesh(
    device_type: str,
    world_size: int,
    *,
    tensor_parallel_size: int,
    shard_size: int | None,
    context_parallel_size: int = 1,
) -> DeviceMesh:
    """The workers' mesh over consecutive ranks: ``(dp, tp)``, or under hsdp (``shard_size`` workers a shard group)
    ``(dp_replicate, dp_shard, tp)``; with context parallelism the first (the shard) dimension holds the data and
    context ranks together, named ``dp_cp`` (``dp_shard_cp``). A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    tp, cp = tensor_parallel_size, context_parallel_size
    if shard_size is None:
        return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp_cp" if cp > 1 else "dp", "tp"))
    shape = (world_size // shard_size, shard_size // tp, tp)
    return init_device_mesh(
        device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard_cp" if cp > 1 else "dp_shard", "tp")
    )


def context_parallel(
    device_type: str, world_size: int, *, context_parallel_size: int, tensor_parallel_size: int
) -> ContextParallel | None:
    """This rank's context-parallel group: the ``cp`` dimension of a ``(dp, cp, tp)`` mesh over the world
    (consecutive ranks: ``CP x TP`` of them hold one replica's sequences); None without context parallelism or
    without a process group. A collective: every rank calls it."""
    cp, tp = context_parallel_size, tensor_parallel_size
    if cp == 1 or world_size == 1 or not torch.distributed.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // (cp * tp), cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    return ContextParallel(group=mesh.get_group("cp"), rank=mesh.get_local_rank("cp"), size=cp)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What ``fully_shard`` takes of :func:`device_mesh`'s mesh: ``dp`` (FSDP; ``dp_cp`` with context parallelism),
    or the 2-D ``(dp_replicate, dp_shard)`` (HSDP: FSDP2 replicates over the first dimension and shards over the
    second; ``dp_shard_cp`` with context parallelism)."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard_cp" if "dp_shard_cp" in names else "dp_shard"]
    return mesh["dp_cp" if "dp_cp" in names else "dp"]


def compile_around_experts(layer: nn.Module, compile: dict[str, Any]) -> None:
    """A MoE block whose experts are an FSDP module of their own (expert parallelism, or TP): FSDP's hooks on a
    module called inside a compiled graph break it, so each of the block's parts is compiled but the experts
    (torchtitan's way): attention, the norms, the router. The experts, their all-to-alls and the routing's
    bookkeeping run eagerly."""
    for name, child in layer.named_children():
        if name != "mlp":
            child.compile(**compile)
            continue
        for part_name, part in child.named_children():
            if part_name != "experts":
                part.compile(**compile)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute each decoder block's activations in backward. ``full``: keep only the block's input;
    ``selective``: also keep the matmul and attention outputs (recompute only the cheap pointwise ops).

    The block's ``forward`` is wrapped in place, so parameter names (checkpoints, exports) do not change.
    """
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = None
    if mode == "selective":
        saved = {
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        }

        def policy(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            from torch.utils.checkpoint import CheckpointPolicy

            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = partial(create_selective_checkpoint_contexts, policy)
    for layer in decoder_layers(model):
        forward = layer.forward
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        layer.forward = _checkpointed(checkpoint, forward, kwargs)  # type: ignore[method-assign]


def _checkpointed(checkpoint: Callable[..., Any], forward: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    def run(*args: Any) -> Any:
        return checkpoint(forward, *args, **kwargs)

    return run


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool,
    mixed_precision: torch.dtype | None,
    *,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """``fully_shard`` every decoder block, then the root (embedding, final norm, head), over ``dp_mesh`` (1-D: FSDP;
    2-D: HSDP). With ``experts_mesh`` (:mod:`raytrn.models.expert_parallel`) each block's experts first, over its
    ``dp_mod_ep`` ranks (HSDP: sharded over ``dp_shard_mod_ep``, replicated over ``dp_replicate``), their gradients
    divided by the whole data-parallel size (each EP rank's already sums its EP peers' tokens)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last block's parameters are needed at once by backward: no point resharding them (torchtitan).
        reshard = reshard_after_forward and i < len(layers) - 1
        experts: Any = getattr(layer.mlp, "experts", None)
        if experts_mesh is not None and experts is not None:
            experts_dp = experts_fsdp_mesh(experts_mesh)
            fully_shard(experts, mesh=experts_dp, reshard_after_forward=reshard, **kwargs)
            experts.set_gradient_divide_factor(float(dp_mesh.size()))
            if experts_dp.size(experts_dp.ndim - 1) > 1:
                # Sum, then divide: gloo (and Neuron) have no PREMUL_SUM. Not when the reduce-scatter (the last
                # dimension) is over one rank: FSDP (torch 2.13) divides there by the factor and again after
                # (tests/integration/test_parallel.py compares the gradients).
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kwargs)


def check_tp_placement(tp: int) -> None:
    """BackendError unless every tensor-parallel group (consecutive ranks) sits on one node (a collective)."""
    if tp == 1:
        return
    import socket

    import torch.distributed as dist

    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, _node_id() or socket.gethostname())
    check_tp_groups([str(n) for n in nodes], tp)


def _node_id() -> str | None:
    """This process's Ray node, when it runs inside Ray (a Ray Train worker)."""
    import sys

    if "ray" not in sys.modules:
        return None
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None


def grad_norm_and_clip(params: Sequence[torch.Tensor], max_norm: float | None, pp_group: Any = None) -> torch.Tensor:
    """The total gradient norm over all workers (before clipping), clipping to ``max_norm`` when set.

    Plain tensors (DDP: already all-reduced) use torch's own function. DTensors may live on different meshes
    (e.g. TP-sharded and replicated): each mesh's partial norm is completed there, then combined. ``pp_group``
    (pipeline parallelism: each rank holds its stages' parameters): the squared norms summed over the pipeline's
    ranks, the norm of the whole model, as one process computes it.
    """
    grads = [p.grad for p in params if p.grad is not None]
    from torch.distributed.tensor import DTensor

    if pp_group is None and not any(isinstance(g, DTensor) for g in grads):
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares: list[torch.Tensor] = []
    for key, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members)
        if key is not None:
            norm = norm.full_tensor()  # type: ignore[attr-defined]  # a collective over that mesh
        squares.append(norm.float() ** 2)
    squared = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)  # a stage: no grads
    if pp_group is not None:
        torch.distributed.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for members in groups.values():
            torch._foreach_mul_(members, coef.to(members[0].dtype))
    return total


def full_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict one full CPU tensor at a time (HF names, DDP's ``module.`` dropped).

    Sharded tensors are gathered here: every rank must iterate (the gathers are collectives), in the same
    order; only one full tensor is held at a time.
    """
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "module", model)
    for name, value in inner.state_dict().items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, tensor.detach().cpu()
