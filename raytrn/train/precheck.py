"""``raytrn precheck``: run the real training step on CPU and catch recompiles before a trn node is rented.

Every new graph shape is a Neuron compile (minutes each). The precheck runs the job's own step
(:func:`raytrn.train.step.train_step`, same batch shape, the job's logging cadence) ``steps`` times and reports
per step: graphs compiled, graph hash, and the input shape. A compile after the warm-up steps fails the check,
with the step and the likely cause.

- ``neuron-xla`` (and ``xla-cpu``): on torch-xla's ``PJRT_DEVICE=CPU``, also counting host-device transfers
  (``.item()`` and friends), which cut XLA's lazy graph.
- ``neuron`` (TorchNeuron) and the other torch.distributed backends: the job's model and loss under
  ``torch.compile(fullgraph=True, dynamic=False)`` on CPU, as ``torch.compile(backend="neuron")`` traces them, with
  a backend that counts the graphs Dynamo hands it. A graph break fails the check with Dynamo's reason (the job
  itself, with ``fullgraph=True``, would stop there); so does a recompile after warm-up.

The step's host memory is estimated first (:func:`estimate_memory`, fitted against measured peaks on
torch-xla's CPU device) and the run refused, with the estimate, when the machine does not have it: the 1B
job at seq_len 8192 and vocabulary 128,256 needs ~27 GiB even with a 2-layer model. ``--tiny`` keeps the
step's graph structure at small shapes, for a laptop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrn.backends import get_backend
from raytrn.backends.cpu import CpuBackend
from raytrn.config import JobSpec
from raytrn.data.batch import rows_tensor
from raytrn.data.order import Position, RankSlice, SampleOrder, iter_rows, plan_reads
from raytrn.errors import ConfigError, RaytrnError
from raytrn.models import model_stats
from raytrn.train.build import build_training
from raytrn.train.checks import check_data
from raytrn.train.step import read_metrics, train_step

SHRINK_MAX_LAYERS = 2
SHRINK_HIDDEN = 256
#: Experts a shrunk MoE model keeps (top 2 of them a token).
SHRINK_EXPERTS = 8
#: ``--tiny`` also caps these: the step's graph has the same structure (layers, micro-batches, logging cadence,
#: every op), only smaller tensors, so shape instability is caught the same way on a laptop.
TINY_SEQ_LEN = 256
TINY_VOCAB = 4096


@dataclass(kw_only=True)
class StepRecord:
    step: int
    compiles: int
    host_syncs: int | None  # None: not measured (the torch.compile path has no lazy graph to cut)
    graph_hash: str
    input_shape: tuple[int, ...]
    logged: bool


@dataclass(kw_only=True)
class PrecheckReport:
    job: str
    warmup_steps: int
    records: list[StepRecord] = field(default_factory=list)
    data: str = ""
    model: str = ""
    memory: str = ""
    #: How the step ran: torch-xla's CPU device, or torch.compile on CPU.
    mode: str = "torch-xla, PJRT_DEVICE=CPU"
    #: The torch.compile path: Dynamo's reason for the first graph break (the run stopped there).
    graph_break: str = ""

    @property
    def late_compiles(self) -> list[StepRecord]:
        return [r for r in self.records if r.step > self.warmup_steps and r.compiles]

    @property
    def distinct_graphs(self) -> int:
        return len({r.graph_hash for r in self.records})

    @property
    def ok(self) -> bool:
        return not self.late_compiles and not self.graph_break

    def reasons(self, r: StepRecord) -> list[str]:
        """Why step ``r`` compiled, judged against the steady steps before it."""
        before = [x for x in self.records if x.step < r.step]
        why = []
        if before and r.input_shape != before[-1].input_shape:
            why.append(f"input shape changed from {list(before[-1].input_shape)} to {list(r.input_shape)}")
        steady_syncs = {
            x.host_syncs for x in before if x.step > self.warmup_steps and x.logged == r.logged and x.host_syncs
        }
        if r.host_syncs and (not steady_syncs or r.host_syncs > max(steady_syncs)):
            why.append(
                f"{r.host_syncs} host-device sync(s) in this step (a lazy tensor read with .item()/float()/print "
                "inside the step cuts the graph: read metrics after the step's sync, as the loop does)"
            )
        if r.host_syncs is None:  # torch.compile: a compile always adds a graph; Dynamo's guards say why
            return why or [
                "a Dynamo guard failed (a Python value the model reads changed): run with TORCH_LOGS=recompiles"
            ]
        if before and r.graph_hash != before[-1].graph_hash and not why:
            why.append("the step built a different graph (Python control flow depends on the step or on values)")
        return why or ["unknown: run with PT_XLA_DEBUG_LEVEL=2 for torch-xla's compilation analysis"]

    def render(self) -> str:
        lines = [f"== raytrn precheck: {self.job} ==", f"mode   {self.mode}", f"model  {self.model}"]
        lines += [f"data   {self.data}"] + [f"memory {self.memory} (estimated before the run)"] * bool(self.memory)
        lines += ["", "step  compiles  host-syncs  graph-hash        input      logged"]
        for r in self.records:
            syncs = "-" if r.host_syncs is None else str(r.host_syncs)
            lines.append(
                f"{r.step:>4}  {r.compiles:>8}  {syncs:>10}  {r.graph_hash}  "
                f"{'x'.join(map(str, r.input_shape)):<9}  {'yes' if r.logged else ''}"
            )
        steady = [r for r in self.records if r.step > self.warmup_steps and not r.logged]
        lines += [
            "",
            f"distinct step graphs: {self.distinct_graphs}; compiles during warm-up (steps 1-{self.warmup_steps}): "
            f"{sum(r.compiles for r in self.records if r.step <= self.warmup_steps)}; after warm-up: "
            f"{sum(r.compiles for r in self.late_compiles)}",
        ]
        if any(r.host_syncs is not None for r in self.records):
            lines.append(
                f"host-device syncs per steady step: {max((r.host_syncs or 0 for r in steady), default=0)} "
                "(metrics are read only on log steps)"
            )
        for r in self.late_compiles:
            lines.append(f"step {r.step}: compiled {r.compiles} new graph(s): " + "; ".join(self.reasons(r)))
        if self.graph_break:
            step = len(self.records) + 1
            lines.append(f"step {step}: graph break (fullgraph=True stops the run here): {self.graph_break}")
            lines.append("verdict: FAIL (graph break)")
        else:
            lines.append(
                "verdict: PASS (no recompiles after warm-up)" if self.ok else "verdict: FAIL (recompiles after warm-up)"
            )
        return "\n".join(lines)


def shrink(job: JobSpec, *, shapes: bool = False) -> JobSpec:
    """The job with a small model (depth and width) but the same vocabulary, sequence and batch shapes;
    ``shapes`` (``--tiny``) also caps the sequence length and the vocabulary."""
    m = job.model
    heads = 4
    kv = heads if m.kv_heads == m.num_attention_heads else 2
    small = m.model_copy(
        update={
            "num_layers": min(m.num_layers, SHRINK_MAX_LAYERS),
            "hidden_size": min(m.hidden_size, SHRINK_HIDDEN),
            "intermediate_size": min(m.intermediate_size, 3 * SHRINK_HIDDEN),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            # A head width of its own (Qwen3) stays one, smaller: the shrunk model keeps the family's attention.
            "head_dim": None if m.head_dim is None else min(m.head_dim, SHRINK_HIDDEN // heads),
            # A MoE model stays one: fewer and narrower experts, routed as sparsely, the same dispatch.
            **(
                {
                    "num_experts": min(m.expert_sizes[0], SHRINK_EXPERTS),
                    "num_experts_per_tok": min(m.expert_sizes[1], 2),
                    "moe_intermediate_size": min(m.expert_sizes[2], SHRINK_HIDDEN),
                }
                if m.is_moe
                else {}
            ),
        }
    )
    if not shapes:
        return job.model_copy(update={"model": small})
    seq_len = min(job.data.seq_len, TINY_SEQ_LEN)
    small = small.model_copy(update={"vocab_size": min(m.vocab_size, TINY_VOCAB)})
    data = job.data.model_copy(update={"seq_len": seq_len})
    return job.model_copy(update={"model": small, "data": data})


# -- memory ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Host memory one precheck step needs on xla-cpu (the XLA "device" is host memory), in bytes."""

    state: int  # parameters, gradients and AdamW's two moments
    activations: int  # what the decoder layers keep for backward, attention scores included
    logits: int  # the output head's logits and the loss's fp32 copies
    runtime: int  # the Python process with torch and torch-xla loaded, and the compiler

    @property
    def total(self) -> int:
        return self.state + self.activations + self.logits + self.runtime

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"about {self.total / gib:.1f} GiB (weights, gradients and AdamW {self.state / gib:.1f} GiB, activations "
            f"{self.activations / gib:.1f} GiB, logits {self.logits / gib:.1f} GiB, runtime {self.runtime / gib:.1f} GiB)"
        )


#: Fitted on xla-cpu (torch-xla 2.9, tests/xla/test_precheck.py measures it): copies of each kind of tensor
#: alive at the step's peak. XLA keeps every layer's activations for the backward pass and materialises the
#: attention scores (no flash attention on CPU); the loss upcasts the logits to fp32 and keeps its softmax.
_ACT_COPIES_HIDDEN = 12  # per layer: residual stream, norms, q/k/v/o, their gradients
_ACT_COPIES_MLP = 4  # per layer: gate, up, their product, its gradient
_SCORE_COPIES = 3  # per layer: scores, softmax, its gradient
_LOGIT_COPIES = 5  # head output, fp32 copy, softmax, their gradients
_RUNTIME_BYTES = 5 << 28  # 1.25 GiB


def estimate_memory(job: JobSpec) -> MemoryEstimate:
    """What one training step of ``job`` (as precheck runs it: one worker, at most 2 micro-batches) needs."""
    m, d = job.model, job.data
    width = 2 if m.dtype == "bfloat16" else 4
    params = model_stats(m, d.seq_len).num_params
    tokens = d.micro_batch_size * d.seq_len
    per_layer = tokens * (_ACT_COPIES_HIDDEN * m.hidden_size + _ACT_COPIES_MLP * m.intermediate_size) * width
    scores = _SCORE_COPIES * d.micro_batch_size * m.num_attention_heads * d.seq_len * d.seq_len * 4
    return MemoryEstimate(
        state=4 * params * width,
        activations=m.num_layers * (per_layer + scores),
        logits=_LOGIT_COPIES * tokens * m.vocab_size * 4,
        runtime=_RUNTIME_BYTES,
    )


def check_memory(job: JobSpec, *, available: int | None = None, shrunk: str = "") -> MemoryEstimate:
    """The step's :class:`MemoryEstimate`; RaytrnError (before anything is built) when it exceeds the memory
    ``available`` (default: what this machine has free now), saying what to shrink (``shrunk``: the job is
    already ``--small`` or ``--tiny``)."""
    estimate = estimate_memory(job)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if estimate.total > available:
        gib = 1 << 30
        tiny = (
            f"--tiny (a 2-layer, 256-wide model at seq_len <= {TINY_SEQ_LEN} and vocabulary <= {TINY_VOCAB:,}: the "
            "same graph structure, so shape instability is still caught)"
        )
        fixes = {
            "": f"Use --small (a 2-layer, 256-wide model: the same shapes) or {tiny}",
            "small": f"Use {tiny}",
            "tiny": "Lower data.micro_batch_size with --set",
        }[shrunk]
        raise RaytrnError(
            f"precheck: {job.source}: one step at seq_len {job.data.seq_len:,}, vocabulary {job.model.vocab_size:,} "
            f"and micro-batch {job.data.micro_batch_size} needs {estimate.describe()}, but this machine has "
            f"{available / gib:.1f} GiB available. {fixes}, or --max-memory-gb to allow more"
        )
    return estimate


def precheck(
    job: JobSpec,
    *,
    steps: int = 12,
    warmup_steps: int = 3,
    small: bool = False,
    tiny: bool = False,
    batches: Iterator[Any] | None = None,
    max_memory_bytes: int | None = None,
) -> PrecheckReport:
    """Run the job's step ``steps`` times on xla-cpu and record compiles, syncs and graph hashes per step.

    ``small`` shrinks the model's depth and width, ``tiny`` also the sequence length and vocabulary. The
    step's memory is estimated first and the run refused (RaytrnError) when it would not fit in
    ``max_memory_bytes`` (default: the memory this machine has available).
    """
    if steps <= warmup_steps:
        raise ConfigError(f"precheck: --steps ({steps}) must be greater than --warmup ({warmup_steps})")
    if small or tiny:
        job = shrink(job, shapes=tiny)
    memory = check_memory(job, available=max_memory_bytes, shrunk="tiny" if tiny else "small" if small else "")
    if job.scaling.accelerator in XLA_ACCELERATORS:  # the frozen XLA path's own (raytrn.xla.precheck), via its backend
        xla: Any = get_backend(job.scaling.accelerator)
        report: PrecheckReport = xla.precheck(
            job, steps=steps, warmup_steps=warmup_steps, batches=batches, memory=memory
        )
        return report
    return _precheck_compiled(job, steps=steps, warmup_steps=warmup_steps, batches=batches, memory=memory)


#: The accelerators whose step precheck runs on torch-xla; the others run it under torch.compile.
XLA_ACCELERATORS = ("neuron-xla", "xla-cpu")


def _precheck_compiled(
    job: JobSpec, *, steps: int, warmup_steps: int, batches: Iterator[Any] | None, memory: MemoryEstimate
) -> PrecheckReport:
    """The step with ``run.compile`` on, under ``torch.compile(fullgraph=True, dynamic=False)`` with a backend that
    records each graph Dynamo hands it (and runs it eagerly): what TorchNeuron's ``backend="neuron"`` would compile."""
    import torch

    graphs: list[str] = []

    def recording_backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(hashlib.sha1(gm.code.encode()).hexdigest()[:16])
        return gm.forward

    class CompileRecordingBackend(CpuBackend):
        autocast_supported = True  # model.autocast as TorchNeuron applies it (CPU autocast)
        compile_options = {"backend": recording_backend, "fullgraph": True, "dynamic": False}
        tune_malloc = False

    torch._dynamo.reset()  # graphs cached by an earlier precheck in this process would hide compiles
    job = job.model_copy(update={"run": job.run.model_copy(update={"compile": True})})
    backend = CompileRecordingBackend()
    t = build_training(job, backend, world_size=job.scaling.min_workers if job.data.global_batch_size else 1)
    t.grad_accum = min(t.grad_accum, 2)
    host_batches, data = (batches, "given batches") if batches is not None else _job_batches(job)
    shapes: list[tuple[int, ...]] = []
    device_batches = _shape_recorder(iter(host_batches), shapes)
    report = PrecheckReport(
        job=job.source,
        warmup_steps=warmup_steps,
        data=data,
        model=model_stats(job.model, job.data.seq_len).describe(),
        memory=memory.describe(),
        mode=f"torch.compile(fullgraph=True, dynamic=False) on CPU, as {job.scaling.accelerator!r} compiles the step",
    )
    for step in range(1, steps + 1):
        compiled_before, n_shapes = len(graphs), len(shapes)
        try:
            result = train_step(t, device_batches, backend)
        except torch._dynamo.exc.TorchDynamoException as e:  # fullgraph=True: the first graph break stops the run
            report.graph_break = _dynamo_reason(e)
            break
        logged = step % job.run.log_every == 0
        if logged:
            read_metrics(result, 1)
        report.records.append(
            StepRecord(
                step=step,
                compiles=len(graphs) - compiled_before,
                host_syncs=None,
                graph_hash=hashlib.sha1("".join(graphs).encode()).hexdigest()[:16],
                input_shape=_odd_one_out(shapes[n_shapes:], shapes[0]),
                logged=logged,
            )
        )
    return report


def _dynamo_reason(e: Exception) -> str:
    """Dynamo's graph-break message, condensed: what broke and where in the user's code."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    where = [line for line in lines if line.startswith("File ")]
    return " ".join(lines[:1] + where[-1:])[:800]


def _odd_one_out(step_shapes: list[tuple[int, ...]], usual: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch shape of a step: one that differs from the usual shape if there is one."""
    return next((s for s in step_shapes if s != usual), usual)


def _shape_recorder(batches: Iterator[Any], shapes: list[tuple[int, ...]]) -> Iterator[Any]:
    for b in batches:
        shapes.append(tuple(b.shape))
        yield b


def _job_batches(job: JobSpec) -> tuple[Iterator[Any], str]:
    """Micro-batches of the job's shape: from its dataset when it is readable here, else random ids."""
    import torch

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
