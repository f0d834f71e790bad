"""Expert parallelism (``parallel.expert_parallel_size``): a MoE layer's experts spread over EP ranks (a MoE family's
``expert_parallel``, e.g. :func:`raytrn.models.qwen3_moe.parallelize.expert_parallel`; :mod:`raytrn.train.parallelize`
builds the experts' mesh, :func:`expert_mesh`, and calls it).

The layout (torchtitan's, on a device mesh of its own, ``(dp_mod_ep, ep, tp)``):

- **EP ranks are data-parallel ranks.** Each reads its own batch; ``workers / TP = dp_mod_ep x EP``. EP rank ``r``
  of a group holds experts ``r * E / EP`` to ``(r + 1) * E / EP - 1`` of every layer (``Shard(0)`` of the stacked
  ``gate_up_proj`` / ``down_proj`` over the ``ep`` mesh dimension, replicated over ``tp``: tensor parallelism
  splits attention, every rank of a TP group computes the same expert rows).
- **Tokens move, experts stay**: :class:`AllToAll` sends each assignment's row to its expert's rank and the
  result back (torch's functional ``all_to_all_single_autograd``, through :mod:`raytrn.compat`: uneven splits for
  the dropless dispatch, even ones for the capacity dispatch), differentiably, and traceable by ``torch.compile``
  (the capacity dispatch is what runs compiled on Neuron).
- **FSDP** shards the experts further over ``dp_mod_ep`` (the data-parallel ranks that hold the same experts) and
  everything else over all data-parallel ranks as before. An expert's gradient on its EP rank already sums every
  EP peer's tokens, so FSDP divides the experts' reduce-scatter by the whole data-parallel size, not by
  ``dp_mod_ep``: the same mean over the global batch as every other parameter.
- **HSDP** splits ``dp_mod_ep`` as the model's mesh splits ``dp``: ``(dp_replicate, dp_shard_mod_ep, ep, tp)``,
  every EP group inside one shard group (EP divides its data-parallel ranks), the experts sharded over
  ``dp_shard_mod_ep`` and replicated over ``dp_replicate`` (their gradients divided as under FSDP).
- Checkpoints (DCP) hold the stacked experts as one tensor of global shape: a checkpoint written at one EP size
  loads at any other (:mod:`raytrn.checkpoint.dcp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from raytrn import compat
from raytrn.models.parallel import decoder_layers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class AllToAll:
    """:class:`raytrn.models.moe.Exchange` over one expert-parallel process group."""

    group: Any  # a torch.distributed ProcessGroup
    size: int

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        return out.view(self.size, -1)

    def rows(self, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        return compat.all_to_all_rows(rows, send, receive, self.group)  # type: ignore[no-any-return]


def expert_mesh(
    device_type: str,
    world_size: int,
    *,
    tensor_parallel_size: int,
    expert_parallel_size: int,
    shard_size: int | None = None,
    pipeline_parallel_size: int = 1,
) -> DeviceMesh:
    """The experts' mesh ``(dp_mod_ep, ep, tp)``: consecutive ranks form TP groups (as the model's ``(dp, tp)``
    mesh), ranks ``tp`` apart form an EP group. Under HSDP (``shard_size`` workers a shard group, a multiple of
    ``TP x EP``) ``(dp_replicate, dp_shard_mod_ep, ep, tp)``. In a pipeline (``pipeline_parallel_size`` stages'
    blocks of ``world_size / PP`` consecutive ranks, the model's ``(pp, dp, tp)`` mesh) this rank's stage's part of
    it: the experts of a stage are spread over that stage's ranks. A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    tp, ep, pp = tensor_parallel_size, expert_parallel_size, pipeline_parallel_size
    inner = world_size // pp
    if shard_size is None:
        shape: tuple[int, ...] = (inner // (tp * ep), ep, tp)
        names: tuple[str, ...] = ("dp_mod_ep", "ep", "tp")
    else:
        shape = (inner // shard_size, shard_size // (tp * ep), ep, tp)
        names = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    if pp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    return init_device_mesh(device_type, (pp, *shape), mesh_dim_names=("pp", *names))[names]


def experts_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What ``fully_shard`` takes of :func:`expert_mesh`'s mesh for the experts: the data-parallel ranks holding the
    same experts, ``dp_mod_ep`` (FSDP), or ``(dp_replicate, dp_shard_mod_ep)`` (HSDP)."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp_replicate", "dp_shard_mod_ep"] if "dp_replicate" in names else mesh["dp_mod_ep"]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The sparse MLP blocks (``mlp.experts`` and ``mlp.gate``) of a Qwen3-MoE model's (or pipeline stage's)
    decoder layers."""
    mlps: list[Any] = [layer.mlp for layer in decoder_layers(model)]
    return [mlp for mlp in mlps if hasattr(mlp, "experts")]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Lay every MoE layer's experts out over ``mesh`` (:func:`expert_mesh`): each rank keeps its EP block of the
    stacked experts (a DTensor, ``Shard(0)`` on ``ep``, replicated on ``tp``) and sends its rows to the others'.
    The router's weight becomes a replicated DTensor on ``tp`` when TP > 1 (every parameter of a block on one mesh,
    as FSDP and the gradient norm need). The model is built identically seeded on every rank: no communication."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep, tp = mesh["ep"].size(), mesh["tp"].size()
    placed = mesh["ep", "tp"] if tp > 1 else mesh["ep"]
    placements = [Shard(0), Replicate()] if tp > 1 else [Shard(0)]
    rank = mesh["ep"].get_local_rank()
    for mlp in moe_layers(model):
        experts: Any = mlp.experts
        held = experts.num_experts // ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            shard = full.detach()[rank * held : (rank + 1) * held].clone()
            tensor = DTensor.from_local(shard, placed, placements, run_check=False)
            setattr(experts, name, nn.Parameter(tensor, requires_grad=full.requires_grad))
        if ep > 1:
            experts.exchange = AllToAll(mesh["ep"].get_group(), ep)
        if tp > 1:
            gate: Any = mlp.gate
            tensor = DTensor.from_local(gate.weight.detach().clone(), mesh["tp"], [Replicate()], run_check=False)
            gate.weight = nn.Parameter(tensor, requires_grad=gate.weight.requires_grad)
