"""``raytrn precheck``'s torch.compile paths (TorchNeuron, cpu, cuda): the job's step, a pipeline's stages, a
context-parallel rank's step, each under a backend that records the graphs Dynamo hands it
(:mod:`raytrn.train.precheck` says what is checked)."""

from __future__ import annotations

import copy
import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from raytrn.backends.cpu import CpuBackend
from raytrn.config import JobSpec
from raytrn.config.sizes import data_parallel_size, padded_length
from raytrn.config.stages import stage_indices, stage_layers
from raytrn.data.batch import TokenBatch, rows_tensor
from raytrn.data.order import Position, RankSlice, SampleOrder, iter_rows, plan_reads
from raytrn.models import build_model, model_stats
from raytrn.models.context_parallel import ContextParallel, ring_attention
from raytrn.models.lora import apply_lora
from raytrn.models.pipeline import pipeline_targets, split_model
from raytrn.train.build import build_training
from raytrn.train.checks import check_data
from raytrn.train.optim import build_adamw
from raytrn.train.parallelize import grad_norm_and_clip
from raytrn.train.pipelined import PipelineLoss, PipelineRank, checkpoint_and_compile
from raytrn.train.precheck_report import MemoryEstimate, PrecheckReport, StepRecord, at_ring, pipeline_stages
from raytrn.train.step import read_metrics, train_step

#: Micro-batches a precheck step takes (the job's own count where smaller): each has the same shapes.
MAX_MICRO_BATCHES = 2


# -- torch.compile ------------------------------------------------------------------------------------------


class _Recorder:
    """A ``torch.compile`` backend that records each graph Dynamo hands it and runs it eagerly (what TorchNeuron's
    ``backend="neuron"`` would compile), noting the parameters the compiled graphs run with."""

    def __init__(self) -> None:
        self.graphs: list[str] = []
        self.params: set[int] = set()

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs.append(hashlib.sha1(gm.code.encode()).hexdigest()[:16])

        def run(*args: Any) -> Any:
            self.params.update(id(a) for a in args if isinstance(a, torch.nn.Parameter))
            return gm.forward(*args)

        return run


#: What stops a ``fullgraph=True`` trace: Dynamo's graph breaks, and a guard on a data-dependent value (a tensor's
#: values deciding Python control flow, e.g. a dropless MoE's loop over the experts hit).
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode)


def _compile_options(recorder: _Recorder) -> dict[str, Any]:
    """The neuron backend's options (``fullgraph=True, dynamic=False``), with ``recorder`` as the backend."""
    return {"backend": recorder, "fullgraph": True, "dynamic": False}


def _recording_backend(recorder: _Recorder) -> CpuBackend:
    class CompileRecordingBackend(CpuBackend):
        autocast_supported = True  # model.autocast as TorchNeuron applies it (CPU autocast)
        compile_options = _compile_options(recorder)
        tune_malloc = False

    return CompileRecordingBackend()


def precheck_compiled(
    job: JobSpec, *, steps: int, warmup_steps: int, batches: Iterator[Any] | None, memory: MemoryEstimate
) -> PrecheckReport:
    """The step with ``run.compile`` on, each graph Dynamo hands the backend recorded: what TorchNeuron's
    ``backend="neuron"`` would compile. A pipeline: its stages (:func:`_precheck_pipeline`). Context parallelism: a
    rank's step, its blocks compiled around the ring as :func:`raytrn.train.parallelize.parallelize` compiles them
    (``fullgraph=False``: breaks at the ring only; a break at the ring under ``fullgraph=True`` fails the check)."""
    kwargs: dict[str, Any] = {"steps": steps, "warmup_steps": warmup_steps, "memory": memory}
    if job.parallel.pipeline_parallel_size > 1:
        return _precheck_pipeline(job, batches=batches, **kwargs)
    return _run_compiled(job, batches=batches, **kwargs)


def _run_compiled(
    job: JobSpec,
    *,
    steps: int,
    warmup_steps: int,
    batches: Iterator[Any] | None,
    memory: MemoryEstimate,
) -> PrecheckReport:
    """The job's step (:func:`~raytrn.train.step.train_step`) ``steps`` times, its model compiled as the layout
    compiles it (:func:`~raytrn.train.build.build_training`), under a recording backend. Context parallelism: each
    step as the next rank of the group runs it (its share of the rows, the ring without a group)."""
    torch._dynamo.reset()  # graphs cached by an earlier precheck in this process would hide compiles
    recorder = _Recorder()
    backend = _recording_backend(recorder)
    job = job.model_copy(update={"run": job.run.model_copy(update={"compile": True})})
    cp = job.parallel.context_parallel_size
    world = job.scaling.min_workers if job.data.global_batch_size or cp > 1 else 1
    t = build_training(job, backend, world_size=world)
    t.grad_accum = min(t.grad_accum, MAX_MICRO_BATCHES)
    graph_breaks = Counter(torch._dynamo.utils.counters["graph_break"])
    report, device_batches, shapes = report_and_batches(
        job,
        warmup_steps=warmup_steps,
        batches=batches,
        memory=memory,
        mode=(
            "torch.compile(fullgraph=False, dynamic=False) of each decoder block around the ring"
            if job.parallel.context_parallel_size > 1
            else "torch.compile(fullgraph=True, dynamic=False)"
        )
        + f" on CPU, as {job.scaling.accelerator!r} compiles the step",
    )
    if cp > 1:
        padded = padded_length(job.data.seq_len, cp)
        report.mode += (
            f"; context parallel {cp}: a rank's share of each row ({padded // cp} of {padded} tokens), ranks 0-"
            f"{cp - 1} in turn, the ring in one process"
        )
        report.scope = [
            f"checked: a context-parallel rank's step at its shapes (padded_length(seq_len, CP) / CP = {padded // cp} "
            "tokens a row), the model compiled as the layout compiles it, the ring (ring_attention) eager on the "
            "rank's own block (no process group: its single-rank equivalent)",
            "not checked: the ring's point-to-point transfers and the blocks of the other ranks (eager, outside any "
            "graph: no compile), FSDP and tensor parallelism (one process)",
        ]
    for step in range(1, steps + 1):
        if cp > 1:
            t.context_parallel = ContextParallel(group=None, rank=(step - 1) % cp, size=cp)
        compiled_before, n_shapes = len(recorder.graphs), len(shapes)
        try:
            result = train_step(t, device_batches, backend)
        except COMPILE_ERRORS as e:  # fullgraph=True: the first graph break stops the run
            if at_ring(str(e)):
                report.ring_break = _dynamo_reason(e) + f" ({ring_attention.__name__})"
            else:
                report.graph_break = _dynamo_reason(e)
            break
        logged = step % job.run.log_every == 0
        if logged:
            read_metrics(result, 1)
        report.records.append(
            StepRecord(
                step=step,
                compiles=len(recorder.graphs) - compiled_before,
                host_syncs=None,
                graph_hash=hashlib.sha1("".join(recorder.graphs).encode()).hexdigest()[:16],
                input_shape=_odd_one_out(shapes[n_shapes:], shapes[0]),
                logged=logged,
            )
        )
    new = Counter(torch._dynamo.utils.counters["graph_break"]) - graph_breaks
    for reason, n in new.items():
        report.breaks[_break_reason(reason)] = report.breaks.get(_break_reason(reason), 0) + n
    if report.records:
        _report_eager(report, t.model, recorder.params, job)
    return report


# -- pipeline -----------------------------------------------------------------------------------------------


class _StageBreak(Exception):
    """A graph break in stage ``stage``'s compiled blocks."""

    def __init__(self, stage: int, reason: str) -> None:
        super().__init__(f"stage {stage}: {reason}")
        self.stage, self.reason = stage, reason


def _precheck_pipeline(
    job: JobSpec, *, steps: int, warmup_steps: int, batches: Iterator[Any] | None, memory: MemoryEstimate
) -> PrecheckReport:
    """Every stage of the job's pipeline compiled as its rank compiles it (:mod:`raytrn.train.pipelined`: each decoder
    block on its own), a graph counter a stage, run in one process as the schedule runs the stages
    (:func:`_pipeline_step`), ``steps`` times, with AdamW stepping every stage's parameters."""
    torch._dynamo.reset()
    p, n_stages = job.parallel, pipeline_stages(job)
    pp = p.pipeline_parallel_size
    whole = build_model(job.model, seed=job.run.seed)
    if job.model.lora is not None:  # adapters before the layout, as raytrn.train.build adds them
        apply_lora(whole, job.model.lora, seed=job.run.seed)
    recorders = [_Recorder() for _ in range(n_stages)]
    stages = []
    for s in range(n_stages):  # each stage cut from its own copy, as a rank holding several does
        stage = split_model(copy.deepcopy(whole), s, n_stages)  # type: ignore[arg-type]
        checkpoint_and_compile(stage, p.activation_checkpointing, _compile_options(recorders[s]))  # as a rank does
        stages.append(stage)
    del whole
    rank_model = PipelineRank(stages)  # the whole model's names: AdamW's groups and the eager report
    optimizer = build_adamw(rank_model, job)
    params = [q for q in rank_model.parameters() if q.requires_grad]
    loss = PipelineLoss(aux_loss_coef=job.model.router_aux_loss_coef if job.model.is_moe else 0.0)
    autocast = _recording_backend(recorders[0]).autocast_dtype(job)
    micro = min(job.data.grad_accum_for(data_parallel_size(job, job.scaling.min_workers)), MAX_MICRO_BATCHES)
    report, micro_batches, shapes = report_and_batches(
        job,
        warmup_steps=warmup_steps,
        batches=batches,
        memory=memory,
        mode=f"torch.compile(fullgraph=True, dynamic=False) on CPU, as {job.scaling.accelerator!r} compiles each "
        f"pipeline stage: pipeline parallel {pp} ({p.pipeline_schedule}, {n_stages} stages), run in one process",
    )
    report.scope = [
        "checked: every stage as its rank compiles it (raytrn.train.pipelined: each decoder block on its own), "
        "forward and backward on the micro-batch's shapes, each stage fed the previous one's output (hidden states, "
        "and segments or a MoE model's routing sums where the job has them); the embedding, final norm, head and "
        "loss run eagerly, as in the job",
        "not checked: the schedule's sends and receives and their order (torch.distributed.pipelining, eager), FSDP "
        "and tensor parallelism (one process, no process group)",
    ]
    layers = stage_layers(job.model.num_layers, n_stages)
    report.stages = [
        f"pipeline rank {next(r for r in range(pp) if s in stage_indices(p.pipeline_schedule, r, pp))}: "
        + ", ".join(
            ["embedding"] * (s == 0)
            + [f"layer{'s' * (len(layers[s]) > 1)} {_ranges(list(layers[s]))}"]
            + ["final norm, head"] * (s == n_stages - 1)
        )
        for s in range(n_stages)
    ]
    # Every stage's blocks share one code object (Module._call_impl), each stage's graphs its own cache entries: as
    # many entries a stage as one rank's process allows.
    limit = torch._dynamo.config.recompile_limit * n_stages
    for step in range(1, steps + 1):
        before, n_shapes = [len(r.graphs) for r in recorders], len(shapes)
        try:
            with torch._dynamo.config.patch(recompile_limit=limit):
                value = _pipeline_step(stages, loss, [next(micro_batches) for _ in range(micro)], autocast)
        except _StageBreak as e:  # fullgraph=True: the first graph break stops the run
            report.graph_break = str(e)
            break
        grad_norm_and_clip(params, job.optim.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = step % job.run.log_every == 0
        if logged:
            value.item()  # the loss read back on log steps, as the loop does
        stage_compiles = tuple(len(r.graphs) - n for r, n in zip(recorders, before, strict=True))
        report.records.append(
            StepRecord(
                step=step,
                compiles=sum(stage_compiles),
                host_syncs=None,
                graph_hash=hashlib.sha1("".join(g for r in recorders for g in r.graphs).encode()).hexdigest()[:16],
                input_shape=_odd_one_out(shapes[n_shapes:], shapes[0]),
                logged=logged,
                stage_compiles=stage_compiles,
            )
        )
    if report.records:
        _report_eager(report, rank_model, set().union(*(r.params for r in recorders)), job)
    return report


def _pipeline_step(
    stages: Sequence[torch.nn.Module], loss: PipelineLoss, micro: list[Any], autocast: torch.dtype | None
) -> torch.Tensor:
    """One step of ``stages`` in one process, as a pipeline's schedule runs them (no process group): each
    micro-batch forward through every stage, each on what it would receive from the previous one (its output,
    detached: a leaf that takes its gradient), the loss on the last (:class:`PipelineLoss`, scaled as
    :func:`raytrn.train.pipelined.pipeline_step` scales it), then backward through the stages in reverse, each from
    the gradients the next one left on its inputs. Returns the step's loss (the micro-batches' mean)."""
    parts = [(b.tokens, b.loss_mask, b.segments) if isinstance(b, TokenBatch) else (b, None, None) for b in micro]
    counted = [mask[:, 1:].sum() for _, mask, _ in parts if mask is not None]
    loss.language.clear()
    for tokens, mask, segments in parts:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if mask is None:
            loss.scale = 1.0 / targets.numel()
        else:  # the mean over the step's trained targets
            loss.scale = float(len(micro) / torch.stack(counted).sum().clamp(min=1))
            targets = pipeline_targets(targets, mask[:, 1:])
        carried: tuple[torch.Tensor, ...] = (inputs,) if segments is None else (inputs, segments[:, :-1])
        received, sent = [], []
        with torch.autocast(inputs.device.type, dtype=autocast) if autocast else nullcontext():
            for s, stage in enumerate(stages):
                if s:  # as a stage receives them: leaves, those with a gradient taking theirs
                    carried = tuple(x.detach().requires_grad_(x.requires_grad) for x in carried)
                received.append(carried)
                try:
                    out = stage(*carried)
                except COMPILE_ERRORS as e:
                    raise _StageBreak(s, _dynamo_reason(e)) from e
                sent.append(out)
                carried = out if isinstance(out, tuple) else (out,)
            value = loss(out, targets)
        (value / len(micro)).backward()  # the schedule averages the micro-batches' gradients (scale_grads)
        for s in range(len(stages) - 2, -1, -1):
            outputs = sent[s] if isinstance(sent[s], tuple) else (sent[s],)
            pairs = [(o, i.grad) for o, i in zip(outputs, received[s + 1], strict=True) if i.grad is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return torch.stack(loss.language).float().mean()


# -- what ran eagerly ---------------------------------------------------------------------------------------


def _report_eager(report: PrecheckReport, model: torch.nn.Module, compiled: set[int], job: JobSpec) -> None:
    """``report.eager``: ``model``'s modules none of whose parameters a compiled graph ran with; ``uncompiled``:
    whole decoder layers among them, and why."""
    eager = [name for name, q in model.named_parameters() if id(q) not in compiled]
    report.eager, whole = _folded(eager, model)
    if not whole:
        return
    why = "Dynamo skipped them"
    if report.breaks and job.parallel.activation_checkpointing != "none":
        why = (
            "a graph break inside activation checkpointing's region (parallel.activation_checkpointing: "
            f"{job.parallel.activation_checkpointing}; here the ring's) makes Dynamo run the whole checkpointed block "
            "eagerly, so fullgraph=False alone does not compile around the ring"
        )
    report.uncompiled = f"decoder layers {whole} ran in no compiled graph (op by op on the device): {why}"


_LAYER = re.compile(r"^(.*\blayers)\.(\d+)(\..+)?$")


def _folded(params: list[str], model: torch.nn.Module) -> tuple[list[str], str]:
    """The modules holding ``params`` (names of ``model``'s), decoder layers' indices folded
    (``model.layers.0-1.mlp.experts``; layers all of whose parameters are there as ``model.layers.0-1``), and those
    whole layers (or "")."""

    def in_layer(name: str) -> tuple[str, int, str] | None:  # (``model.layers``, index, the rest of the name)
        m = _LAYER.match(name)
        return (m[1], int(m[2]), m[3] or "") if m else None

    held = Counter(where[:2] for name, _ in model.named_parameters() if (where := in_layer(name)))
    listed = Counter(where[:2] for name in params if (where := in_layer(name)))
    whole = {layer for layer, n in listed.items() if n == held[layer]}
    groups: dict[str, set[int]] = {}
    for name in params:
        module = name.rsplit(".", 1)[0]
        where = in_layer(module)
        if where is None:
            groups.setdefault(module, set())
            continue
        prefix, index, rest = where
        groups.setdefault(prefix + ".{}" + ("" if (prefix, index) in whole else rest), set()).add(index)
    folded = {key: key.format(_ranges(list(indices))) if indices else key for key, indices in groups.items()}
    whole_layers = [text for key, text in folded.items() if key.endswith(".{}")]
    return list(folded.values()), ", ".join(whole_layers)


def _ranges(indices: list[int]) -> str:
    """``0-3,6``: sorted indices as runs."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- helpers ------------------------------------------------------------------------------------------------


def _dynamo_reason(e: Exception) -> str:
    """Dynamo's graph-break message, condensed: what broke and where in the user's code."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    where = [line for line in lines if line.startswith("File ")]
    return " ".join(lines[:1] + where[-1:])[:800]


def _break_reason(reason: str) -> str:
    """A graph break Dynamo counted, condensed: its first line and Dynamo's explanation, addresses left out."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    said = lines[:1] + [line.removeprefix("Explanation: ") for line in lines[1:] if line.startswith("Explanation:")]
    return re.sub(r" at 0x[0-9a-f]+", "", ": ".join(said))[:400]


def report_and_batches(
    job: JobSpec,
    *,
    warmup_steps: int,
    batches: Iterator[Any] | None,
    memory: MemoryEstimate,
    mode: str,
    wrap: Callable[[Iterator[Any]], Iterator[Any]] = iter,
) -> tuple[PrecheckReport, Iterator[Any], list[tuple[int, ...]]]:
    """A report's header, and the micro-batches (``batches``, else the job's; ``wrap``: the backend's device
    loader) with the list their shapes are added to as the step draws them (after any prefetch ahead of it)."""
    host_batches, data = (batches, "given batches") if batches is not None else _job_batches(job)
    shapes: list[tuple[int, ...]] = []
    report = PrecheckReport(
        job=job.source,
        warmup_steps=warmup_steps,
        data=data,
        model=model_stats(job.model, job.data.seq_len).describe(),
        memory=memory.describe(),
        mode=mode,
    )
    return report, _shape_recorder(wrap(iter(host_batches)), shapes), shapes


def _odd_one_out(step_shapes: list[tuple[int, ...]], usual: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch shape of a step: one that differs from the usual shape if there is one."""
    return next((s for s in step_shapes if s != usual), usual)


def _shape_recorder(batches: Iterator[Any], shapes: list[tuple[int, ...]]) -> Iterator[Any]:
    for b in batches:
        shapes.append(tuple((b.tokens if isinstance(b, TokenBatch) else b).shape))
        yield b


def _job_batches(job: JobSpec) -> tuple[Iterator[Any], str]:
    """Micro-batches of the job's shape: from its dataset when it is readable here, else random ids."""
    mb, row = job.data.micro_batch_size, job.data.seq_len + 1
    try:
        manifest = check_data(job)
    except Exception as e:  # no local dataset: the shapes are what matters
        gen = torch.Generator().manual_seed(job.run.seed)

        def synthetic() -> Iterator[Any]:
            while True:
                yield torch.randint(0, job.model.vocab_size, (mb, row), generator=gen)

        return synthetic(), f"synthetic token ids [{mb} x {row}] (dataset not readable here: {e.__class__.__name__})"

    def rows() -> Iterator[Any]:  # the job's order, one worker's view: micro-batches as the loop gets them
        plans = plan_reads(SampleOrder.for_job(manifest, job), RankSlice(rank=0, size=1, global_batch=mb), Position())
        for table in iter_rows(manifest.shard_paths(), manifest.column, plans):
            yield rows_tensor(table, row)

    return rows(), f"{manifest.root} ({manifest.num_rows:,} rows), micro-batches [{mb} x {row}]"
