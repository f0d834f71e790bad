"""A job's model laid out as a pipeline (``parallel.pipeline_parallel_size > 1``) and its training step.

**Layout.** The workers form a ``(pp, dp, tp)`` mesh (under hsdp ``(pp, dp_replicate, dp_shard, tp)``: torchtitan's
order, the pipeline outermost, so that on a cluster a stage's ranks share nodes and only the stage boundaries' small
activations cross the network). Each rank builds the whole model (identically seeded) for each stage it holds,
cuts it (:func:`raytrn.models.pipeline.split_model`), and lays the stage out as any model: tensor parallelism,
activation checkpointing, ``torch.compile`` per block, FSDP2 over the stage's data-parallel ranks with the stage as
FSDP's root (:func:`raytrn.train.parallelize.parallelize`'s pieces). What the rest of raytrn sees as the model
(:class:`PipelineRank`: the optimizer's parameters, the checkpoints, the gradient norm) holds this rank's stages
under the whole model's parameter names, so a checkpoint saved at one pipeline size loads at any other.

**Step.** The data-parallel rank's micro-batches (``data.grad_accum`` of them, the same rows one process would
accumulate) are the schedule's micro-batches: the first stage feeds the tokens (and the packed rows' document
numbers), the last computes each micro-batch's loss (:class:`raytrn.models.pipeline.PipelineLoss`: the mean over
its targets, or over the whole step's trained targets for masked rows), the schedule averages the gradients over
the micro-batches, the gradient norm is taken over every stage (:func:`grad_norm_and_clip` with the pipeline's
group) and each rank steps its own parameters. The step's loss is the last stage's, summed over the pipeline's
ranks (the others contribute zero), so every rank reports its replica's loss as one process does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raytrn.config.sizes import hsdp_shard_size
from raytrn.data.batch import TokenBatch
from raytrn.models.pipeline import build_schedule, pipeline_targets, split_model, stage_indices
from raytrn.models.registry import model_spec
from raytrn.train.loss import masked_loss_sum

if TYPE_CHECKING:
    from raytrn.backends.base import Backend
    from raytrn.config import JobSpec
    from raytrn.train.parallelize import Parallelized
    from raytrn.train.step import Routing, StepResult, Training


@dataclass
class PipelineLoss:
    """The schedule's loss of one micro-batch (the last stage calls it with its output and the micro-batch's
    targets, ``-100`` where a target does not count). ``scale``: set before each step; the per-micro-batch loss is
    the sum of the counted targets' cross entropy times ``scale``. Unmasked rows: ``1 / tokens`` of a micro-batch
    (the mean, as the one-process step; the schedule averages over micro-batches); masked rows: micro-batches /
    the counted targets of the whole step (the step's loss is then the mean over every counted target).

    A MoE model's output carries its load-balancing loss: added, times ``aux_loss_coef``, to what the gradients are
    taken of (as :func:`raytrn.train.step.with_aux_loss`); ``language`` keeps each micro-batch's loss without it
    (what is logged), in the schedule's order."""

    scale: float = 1.0
    aux_loss_coef: float = 0.0
    language: list[torch.Tensor] = field(default_factory=list)
    #: A MoE model's load-balancing loss of each micro-batch (unweighted), in the schedule's order.
    aux: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits, aux = output if isinstance(output, tuple) else (output, None)
        counted = targets != -100
        # raytrn.train.loss's: in chunks of rows above sizes.LOSS_CHUNK_LOGITS (no float32 copy of every logit)
        loss = masked_loss_sum(logits, targets.clamp(min=0), counted) * self.scale
        self.language.append(loss.detach())
        if aux is not None:
            self.aux.append(aux.detach())
        return loss if aux is None or not self.aux_loss_coef else loss + self.aux_loss_coef * aux


class PipelineRank(nn.Module):
    """This rank's stages as one module with the whole model's parameter names (``model.embed_tokens`` on the
    first stage's rank, ``model.layers.<i>`` for its layers, ``model.norm`` and ``lm_head`` on the last's): what the
    optimizer, the checkpoints and the gradient norm take. Never called: the schedule runs the stages."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for stage in stages:
            decoder: Any = stage.model
            for name in ("embed_tokens", "norm"):
                if getattr(decoder, name, None) is not None:
                    setattr(self.model, name, getattr(decoder, name))
            self.model.layers.update(decoder.layers)
            if getattr(stage, "lm_head", None) is not None:
                self.lm_head = stage.lm_head

    #: The whole model's tensors as a Hugging Face export writes them: name -> (dtype, shape), in the whole model's
    #: order (:meth:`Pipeline.export` yields them in it); set by :func:`parallelize_pipeline`.
    export_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule (Pipeline.step), not as one module")


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its schedule, whether it holds the first and the last stage, the
    pipeline's process group and the loss the last stage takes."""

    schedule: Any
    first: bool
    last: bool
    group: Any
    loss: PipelineLoss
    microbatches: int
    #: This rank's stages (:class:`PipelineRank`), its place in the pipeline, and which pipeline rank holds each of
    #: the whole model's tensors (the export's).
    model: PipelineRank
    pp_rank: int
    owners: dict[str, int]
    #: This rank's stage modules by stage index, how many stages the pipeline has and which pipeline rank holds
    #: each (the validation's forward-only walk: :mod:`raytrn.train.pipelined_eval`).
    stages: dict[int, nn.Module] = field(default_factory=dict)
    num_stages: int = 0
    stage_owner: dict[int, int] = field(default_factory=dict)
    #: A MoE model's MoE layers (whole-model indices, in order: the rows of the step's expert-load table), the
    #: pipeline's size and its experts; none for a dense model.
    moe_layers: list[int] = field(default_factory=list)
    pp_size: int = 1
    num_experts: int = 0

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's state, one full CPU tensor at a time in the whole model's order, on every rank (what a
        Hugging Face export streams): each tensor gathered within the stage holding it (a collective over that
        stage's data- and tensor-parallel ranks), then broadcast over the pipeline from the rank holding it."""
        from torch.distributed.tensor import DTensor

        state = self.model.state_dict()
        device = next(iter(state.values())).device if state else torch.device("cpu")
        for name, (dtype, shape) in self.model.export_specs.items():
            owner = self.owners[name]
            if owner == self.pp_rank:
                value = state[name]
                tensor = (value.full_tensor() if isinstance(value, DTensor) else value).detach().contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.broadcast(tensor, group=self.group, group_src=owner)
            yield name, tensor.cpu()

    def train_step(self, t: Training, batches: Iterator[torch.Tensor | TokenBatch], backend: Backend) -> StepResult:
        """:func:`raytrn.train.step.train_step` of a pipelined model: :func:`pipeline_step`."""
        return pipeline_step(t, batches, backend)


def parallelize_pipeline(
    model: nn.Module,
    job: JobSpec,
    *,
    device: torch.device,
    world_size: int,
    compile: dict[str, Any] | None = None,
    mixed_precision: torch.dtype | None = None,
) -> Parallelized:
    """``model`` (built on ``device``, identically seeded on every rank) cut into this rank's stages and each laid
    out over its data-parallel (and tensor-parallel) ranks. A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from raytrn.config.stages import SCHEDULES, ZERO_BUBBLE
    from raytrn.models.expert_parallel import expert_mesh
    from raytrn.models.parallel import decoder_layers
    from raytrn.train.parallelize import (
        Parallelized,
        apply_fsdp,
        check_tp_placement,
        data_parallel_mesh,
    )

    p = job.parallel
    pp, tp = p.pipeline_parallel_size, p.tensor_parallel_size
    shard = hsdp_shard_size(job)
    inner = world_size // pp
    if shard is None:
        mesh = init_device_mesh(device.type, (pp, inner // tp, tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        shape = (pp, inner // shard, shard // tp, tp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    per_rank = SCHEDULES[p.pipeline_schedule][1]
    num_stages = pp * per_rank
    indices = stage_indices(p.pipeline_schedule, pp_rank, pp)
    family = model_spec(job.model.family)
    sharded = p.data_parallel in ("fsdp", "hsdp") and inner // tp > 1
    dp_mesh = data_parallel_mesh(mesh["dp_replicate", "dp_shard", "tp"] if shard else mesh["dp", "tp"])
    if tp > 1:
        check_tp_placement(tp)
    experts_mesh = None  # a MoE stage's experts over the stage's ranks (expert parallelism, or TP), as without stages
    spread = family.expert_parallel
    if spread is not None and (tp > 1 or p.expert_parallel_size > 1):
        experts_mesh = expert_mesh(device.type, world_size, tensor_parallel_size=tp,
                                   expert_parallel_size=p.expert_parallel_size, shard_size=shard,
                                   pipeline_parallel_size=pp)  # fmt: skip
    # A zero-bubble schedule's input-gradient pass lists the weights to differentiate later from the stage's
    # registered parameters before FSDP's pre-backward hook gathers them again: a block resharded after its forward
    # would be listed by its shards, which the graph never used, and get no gradient. So those stages keep their
    # parameters gathered from forward to backward (torchtitan's default under a pipeline); the other schedules'
    # whole backward goes through autograd and FSDP's hooks.
    reshard = p.reshard_after_forward and p.pipeline_schedule not in ZERO_BUBBLE
    specs = {name: (value.dtype, tuple(value.shape)) for name, value in model.state_dict().items()}  # the whole's
    blocks: list[Any] = decoder_layers(model)  # (before the stages are cut from it)
    moe_layers = [i for i, layer in enumerate(blocks) if hasattr(layer.mlp, "experts")]
    num_experts = int(blocks[moe_layers[0]].mlp.experts.num_experts) if moe_layers else 0
    stages, modules = [], []
    for n, index in enumerate(indices):
        whole = model if n == len(indices) - 1 else copy.deepcopy(model)  # each stage cuts its own copy
        stage = split_model(whole, index, num_stages)  # type: ignore[arg-type]
        if spread is not None and experts_mesh is not None:
            spread(stage, experts_mesh)
        if tp > 1:
            family.tensor_parallel(stage, mesh["tp"], False)
        checkpoint_and_compile(stage, p.activation_checkpointing, compile, around_experts=experts_mesh is not None)
        if sharded:
            apply_fsdp(stage, dp_mesh, reshard, mixed_precision, experts_mesh=experts_mesh)
        modules.append(stage)
        stages.append(PipelineStage(stage, index, num_stages, device, group=mesh.get_group("pp")))
    microbatches = job.data.grad_accum_for(inner // tp)
    loss = PipelineLoss(aux_loss_coef=job.model.router_aux_loss_coef if job.model.is_moe else 0.0)
    rank_model = PipelineRank(modules)
    rank_model.export_specs = specs
    held: list[Any] = [None] * pp
    torch.distributed.all_gather_object(held, sorted(rank_model.state_dict()), group=mesh.get_group("pp"))
    owners = {name: r for r, names in enumerate(held) for name in names}
    pipeline = Pipeline(
        schedule=build_schedule(stages, p.pipeline_schedule, microbatches=microbatches, loss=loss),
        first=0 in indices,
        last=num_stages - 1 in indices,
        group=mesh.get_group("pp"),
        loss=loss,
        microbatches=microbatches,
        model=rank_model,
        pp_rank=pp_rank,
        owners=owners,
        stages=dict(zip(indices, modules, strict=True)),
        num_stages=num_stages,
        stage_owner={i: r for r in range(pp) for i in stage_indices(p.pipeline_schedule, r, pp)},
        moe_layers=moe_layers,
        pp_size=pp,
        num_experts=num_experts,
    )
    return Parallelized(
        model=rank_model,
        mesh=mesh,
        data_parallel=p.data_parallel if sharded else "none",
        tensor_parallel_size=tp,
        pipeline=pipeline,
    )


def checkpoint_and_compile(
    stage: nn.Module, activation_checkpointing: str, compile: dict[str, Any] | None, *, around_experts: bool = False
) -> None:
    """A stage's activation checkpointing, then each of its decoder blocks compiled on its own (``compile``: the
    backend's ``torch.compile`` options; None: eager): what every rank does to its stages, and what ``raytrn
    precheck`` compiles (:mod:`raytrn.train.precheck_compiled`). ``around_experts``: a MoE block's experts are laid
    out over ranks (an FSDP module of their own): its other parts are compiled, the experts not (as without stages)."""
    from raytrn.models.parallel import decoder_layers
    from raytrn.train.parallelize import apply_activation_checkpointing, compile_around_experts

    if activation_checkpointing != "none":
        apply_activation_checkpointing(stage, activation_checkpointing)
    if compile is not None:
        for layer in decoder_layers(stage):
            if around_experts and hasattr(layer.mlp, "experts"):
                compile_around_experts(layer, compile)
            else:
                layer.compile(**compile)


def pipeline_step(t: Training, batches: Iterator[torch.Tensor | TokenBatch], backend: Backend) -> StepResult:
    """One optimizer step over the data-parallel rank's ``grad_accum`` micro-batches, through the schedule (every
    rank of the pipeline draws the same micro-batches: the first stage feeds their tokens, the last their targets)."""
    from raytrn.train.step import StepResult, global_count

    pipe: Pipeline = t.pipeline
    t0 = time.perf_counter()
    micro: list[Any] = [next(batches) for _ in range(t.grad_accum)]
    data_wait = time.perf_counter() - t0
    masks: list[Any] = [None]
    segments = None
    if isinstance(micro[0], TokenBatch):
        tokens = torch.cat([b.tokens for b in micro])
        masks = [b.loss_mask for b in micro]
        if micro[0].segments is not None:
            segments = torch.cat([b.segments for b in micro])[:, :-1]
    else:
        tokens = torch.cat(micro)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    trained = None
    if masks[0] is not None:
        mask = torch.cat(masks)[:, 1:]
        local = mask.sum().to(dtype=torch.float32)
        total = global_count(local, t)  # over the data-parallel ranks (every stage's rank counts the same rows)
        trained = int(total.item())
        # the schedule averages over micro-batches and DP averages over replicas: sum / total overall
        pipe.loss.scale = float(t.data_parallel_size * pipe.microbatches / total)
        targets = pipeline_targets(targets, mask)
    else:
        pipe.loss.scale = 1.0 / targets[: targets.shape[0] // pipe.microbatches].numel()
    losses: list[torch.Tensor] = []  # the objective's (a MoE model's: with its load-balancing loss)
    pipe.loss.language.clear()
    args = (inputs,) if segments is None else (inputs, segments)
    t0 = time.perf_counter()
    with torch.autocast(inputs.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
        if pipe.first:
            pipe.schedule.step(*args, target=targets if pipe.last else None, losses=losses, return_outputs=False)
        elif pipe.last:
            pipe.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            pipe.schedule.step(return_outputs=False)
    forward_s = time.perf_counter() - t0  # forward and backward interleave: the whole schedule
    # the last stage's: each micro-batch's loss, what is logged (the schedule's first step also calls the loss once
    # while it infers the stages' shapes: the step's are the last ones)
    language = pipe.loss.language[-pipe.microbatches :]
    loss = torch.stack([x.float() for x in language]).mean() if language else torch.zeros(())
    torch.distributed.all_reduce(loss, group=pipe.group)  # the last stage's, on every rank of the pipeline
    grad_norm = t.clip_and_step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    backend.sync()
    return StepResult(
        loss=loss, grad_norm=grad_norm, data_wait_s=data_wait, forward_s=forward_s, trained_tokens=trained,
        routing=pipeline_routing(pipe),
    )  # fmt: skip


def pipeline_routing(pipe: Pipeline) -> Routing | None:
    """A MoE step's routing as :func:`raytrn.train.step.routing_metrics` reads it (a sum over every rank on log
    steps; on the device until then): this rank's stages' rows of the expert-load table (their MoE layers' top-k
    counts over the step's last ``microbatches`` forward calls: a stage's first step also runs once to infer its
    shapes), zeros elsewhere, their dropped assignments, and on the last stage the step's load-balancing losses
    times the pipeline's size (only ``1 / P`` of the ranks hold the last stage; the metric divides by every rank's
    micro-batches). None: a dense model."""
    from raytrn.train.step import Routing

    if not pipe.moe_layers:
        return None
    n = pipe.microbatches
    row = {layer: i for i, layer in enumerate(pipe.moe_layers)}
    calls = {index: stage.routing[-n:] for index, stage in pipe.stages.items()}  # type: ignore[index]
    device = next((c.device for made in calls.values() for c, _ in made), torch.device("cpu"))
    load = torch.zeros(len(pipe.moe_layers), pipe.num_experts, device=device)
    dropped = torch.zeros((), device=device)
    for index, made in calls.items():
        stage: Any = pipe.stages[index]
        for counts, lost in made:
            for layer, c in zip(stage.moe_layers, counts, strict=True):
                load[row[layer]] += c.float()
            dropped += lost.float()
        stage.routing.clear()
    aux = torch.zeros((), device=device)
    if pipe.last and pipe.loss.aux:
        aux = torch.stack([a.float() for a in pipe.loss.aux[-n:]]).sum().to(device) * pipe.pp_size
    pipe.loss.aux.clear()
    return Routing(aux_loss=aux, expert_load=load, dropped=dropped, micro_batches=n)
