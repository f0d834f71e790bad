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

Layouts of several processes are checked in this one, without a process group:

- **Pipeline** (``parallel.pipeline_parallel_size``): every stage (:func:`raytrn.models.pipeline.split_model` of the
  shrunk model, one layer a stage at least) compiled as its rank compiles it (:mod:`raytrn.train.pipelined`: each
  decoder block on its own), with one graph counter a stage, and run as the schedule runs it: each micro-batch
  forward through every stage, each on the previous one's output (token ids, then hidden states; packed rows'
  segments and a MoE model's routing sums along), the loss on the last
  (:class:`~raytrn.train.pipelined.PipelineLoss`), then backward through the stages in reverse. Per stage: graphs
  compiled, and compiles after warm-up. The schedule's sends and receives (eager) are not run.
- **Context parallel** (``parallel.context_parallel_size``): a rank's step at its shapes (``padded_length(seq, CP) /
  CP`` tokens a row, every rank's share in turn), the ring (:func:`~raytrn.models.context_parallel.ring_attention`)
  on its own block (no group). The ring runs eagerly (``torch.compiler.disable``): the layout compiles each decoder
  block around it (``fullgraph=False``, before activation checkpointing: :func:`raytrn.train.parallelize.parallelize`),
  so the check counts the graphs and the breaks, which must be at the ring only (a break at the ring under
  ``fullgraph=True`` would mean the layout regressed: it fails). Its point-to-point transfers are not run.

The torch.compile paths also report the modules no compiled graph ran (eager on the device), and fail when a whole
decoder layer is among them.

The step's host memory is estimated first (:func:`estimate_memory`, fitted against measured peaks on
torch-xla's CPU device) and the run refused, with the estimate, when the machine does not have it: the 1B
job at seq_len 8192 and vocabulary 128,256 needs ~27 GiB even with a 2-layer model. ``--tiny`` keeps the
step's graph structure at small shapes, for a laptop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from raytrn.backends import get_backend
from raytrn.config import JobSpec
from raytrn.errors import ConfigError, RaytrnError
from raytrn.models import model_stats
from raytrn.train.precheck_compiled import precheck_compiled
from raytrn.train.precheck_report import MemoryEstimate, PrecheckReport, StepRecord, pipeline_stages

SHRINK_MAX_LAYERS = 2
SHRINK_HIDDEN = 256
#: Experts a shrunk MoE model keeps (top 2 of them a token).
SHRINK_EXPERTS = 8
#: ``--tiny`` also caps these: the step's graph has the same structure (layers, micro-batches, logging cadence,
#: every op), only smaller tensors, so shape instability is caught the same way on a laptop.
TINY_SEQ_LEN = 256
TINY_VOCAB = 4096


def shrink(job: JobSpec, *, shapes: bool = False) -> JobSpec:
    """The job with a small model (depth and width) but the same vocabulary, sequence and batch shapes;
    ``shapes`` (``--tiny``) also caps the sequence length and the vocabulary. A pipelined job keeps a layer a
    stage."""
    m = job.model
    heads = 4
    kv = heads if m.kv_heads == m.num_attention_heads else 2
    small = m.model_copy(
        update={
            "num_layers": min(m.num_layers, max(SHRINK_MAX_LAYERS, pipeline_stages(job))),
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
    return precheck_compiled(job, steps=steps, warmup_steps=warmup_steps, batches=batches, memory=memory)


#: The accelerators whose step precheck runs on torch-xla; the others run it under torch.compile.
XLA_ACCELERATORS = ("neuron-xla", "xla-cpu")


__all__ = [
    "MemoryEstimate",
    "PrecheckReport",
    "StepRecord",
    "XLA_ACCELERATORS",
    "estimate_memory",
    "precheck",
    "shrink",
]
