"""Memory per worker device, from the job spec alone: what each kind of tensor costs under the job's layout.

Pure arithmetic (no torch): ``raytrn estimate`` answers in well under a second on a laptop. The terms:

- **state**: parameters (``model.dtype``), gradients (the same dtype, trainable parameters only) and AdamW's two
  moments (the parameters' dtype, trainable only). DDP holds all of it on every worker (and a second copy of the
  gradients in its buckets); FSDP shards it over the data-parallel ranks, HSDP over a shard group's only (the
  groups replicate); tensor parallelism splits attention, the dense MLP, the embedding and the head over the TP
  group first; a MoE model's experts are split over the data-parallel ranks only (expert parallelism or FSDP:
  replicated over TP). LoRA: the frozen base has parameters only; the adapters train.
- **gathered**: FSDP's (and HSDP's) transient full blocks (the one computing and the one prefetched), in the compute
  dtype.
- **activations**: what the decoder layers keep for backward at ``micro_batch_size x seq_len`` tokens: every layer's
  saved tensors, or with activation checkpointing each layer's input plus one layer's tensors recomputed (selective:
  the matmul outputs kept too). Attention is a fused kernel (SDPA; NKI flash attention on trn1): no ``seq x seq``
  scores, except on xla-cpu, which materialises them. NxD's ZeRO-1 (fp32 moments and master weights sharded over
  the data-parallel ranks) and sequence parallelism (the hidden-size activations split over TP) on neuron-xla.
- **logits**: the head's output and the loss's float32 copies (log-softmax, gradient): the whole vocabulary on every
  TP rank (raytrn's TP gathers the head's output), a TP shard of it on neuron-xla (NxD's parallel cross-entropy);
  a large vocabulary's loss runs in chunks (:mod:`raytrn.train.loss`): the logits and their gradient only.
- **runtime**: what the device's runtime and allocator take before the model (an assumption, named as such).

**Pipeline parallelism** (``parallel.pipeline_parallel_size`` P > 1): a worker holds its pipeline rank's stages
(:func:`raytrn.config.stages.stage_indices`, cut by :func:`raytrn.config.stages.stage_layers`): their decoder layers,
the embedding with stage 0, the final norm and the head with the last stage, sharded over a stage's data-parallel
ranks (``world / (P x TP)``; none when there is one) and split over TP as above. FSDP under a pipeline keeps a
stage's parameters gathered and its gradients unsharded from the stage's first backward to the step's end
(``torch.distributed.pipelining`` turns FSDP2's ``reshard_after_backward`` and gradient sync off but for the last
micro-batch): counted as ``gathered``. Activations: the micro-batches in flight at the rank's peak
(:func:`in_flight`), each of its stage's layers; the logits of those on the last stage until their backward
(:func:`logits_in_flight`; the pipeline's loss is chunked as the step's: :class:`raytrn.train.pipelined.PipelineLoss`). The
estimate is the heaviest rank's.

**Context parallelism** (``parallel.context_parallel_size`` CP > 1, :mod:`raytrn.models.context_parallel`): a worker
computes its zigzag share of each row, ``padded_length(seq_len, CP) / CP`` tokens (the row padded to a multiple of
``2 x CP``: :func:`raytrn.config.sizes.padded_length`), so the activations and the logits are counted at
``micro_batch_size`` times that (:class:`ContextSplit`). Attention is the ring, not SDPA: a layer keeps what SDPA's
would (``q, k, v``, the output: the family's terms), a copy of its output (the ring's is laid out ``[batch, heads,
tokens, head_dim]``, so ``o_proj``'s input is a copy, where SDPA's output on CPU is that input: measured in
``tests/unit/test_estimate_context.py``) and its float32 log-sum-exp. While a layer's attention runs, forward or
backward, it holds :data:`RING_SCORE_BLOCKS` float32 blocks of scores ``[batch, heads / TP, 2c, 2c]`` and their
mask (``2c = padded / CP``: the diagonal block, the largest) and float32 accumulators and copies of the queries,
keys and values (:data:`RING_Q_FP32`, :data:`RING_KV_FP32`): ``ring_attention``, a transient of one layer at a time.
FSDP shards the state over the data and context ranks together (``world / TP``:
:func:`raytrn.config.sizes.shard_size`). The ring's transfers cost no memory beyond the buffers counted; their time
is not modelled.

What a layer holds and keeps is its family's (``raytrn/models/<family>/estimate.py``, counted tensor by tensor from
:mod:`raytrn.models.decoder`); ``tests/unit/test_estimate.py`` pins them against measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from raytrn.config.sizes import data_parallel_size, hsdp_shard_size, loss_chunk_rows, padded_length, shard_size
from raytrn.config.stages import SCHEDULES, stage_indices, stage_layers
from raytrn.models.registry import model_spec

if TYPE_CHECKING:
    from raytrn.config import JobSpec, ModelConfig

GIB = 1 << 30

#: Device memory taken before the model: the Neuron runtime's scratch and collectives buffers, the CUDA context
#: and caching allocator's reserve, the CPU worker process with torch loaded. Assumptions, not measurements.
RUNTIME_BYTES = {"neuron": 2 * GIB, "neuron-xla": 2 * GIB, "cuda": GIB, "cpu": GIB, "xla-cpu": 5 * GIB // 4}
#: The share of a device's memory a step may plan to use: the rest is fragmentation and allocator slack.
USABLE = 0.9
#: Bytes per logit: the loss keeps its float32 log-softmax for backward (beside the head's output in the compute
#: dtype); backward adds the log-softmax's gradient and the logits' (float32, then cast): 4 + 4.
LOGIT_SAVED_FP32 = 4
LOGIT_BACKWARD_FP32 = 8
#: Blocks of float32 scores a ring attention holds at its peak: forward a block's scores, their shifted copy and
#: exponentials; backward the probabilities, their product with the output's gradient and the scores' gradient.
#: Measured (``torch.utils._python_dispatch`` counting live storages, one process, the diagonal block): 2.9 blocks
#: forward and 3.0 backward, besides the per-token buffers below.
RING_SCORE_BLOCKS = 3
#: Bytes a token of the ring's transient float32 buffers, per query and per key/value element (heads x head_size
#: over TP): the output's gradient, ``dq``, a float32 copy of the queries and its cast back (4 x 4); the key and
#: value gradients (its own, the incoming and the outgoing accumulators) and a block's float32 keys and values
#: (4 x 8). Measured in one process (no transfers; 8 query and 2 key/value heads of 128, bf16): 22,124 bytes a
#: token against these constants' 24,576.
RING_Q_FP32 = 4 * 4
RING_KV_FP32 = 4 * 8


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one worker's device needs at the step's peak, by kind."""

    parameters: int
    #: One gradient per trainable parameter this worker holds.
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    #: What the head's output and the loss keep for backward (the compute-dtype logits, the fp32 log-softmax).
    logits: int
    runtime: int
    #: DDP's buckets: a second copy of the gradients.
    gradient_buckets: int = 0
    #: The logits' backward transient (the log-softmax's gradient and the logits', fp32).
    logits_backward: int = 0
    #: Context parallelism: a layer's ring attention while it runs (float32 score blocks, accumulators, buffers).
    ring_attention: int = 0
    #: What each term assumed (layout, dtypes), for the report.
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.gradient_buckets + self.optimizer

    @property
    def total(self) -> int:
        return (
            self.state + self.gathered + self.activations + self.logits + self.logits_backward + self.ring_attention
            + self.runtime
        )  # fmt: skip

    @property
    def probed(self) -> int:
        """What :mod:`raytrn.train.memory_probe` measures on a worker without a device allocator (cpu): the state
        held (one gradient per trainable parameter), the tensors saved for backward (activations, the loss's) and
        the logits the step holds."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.logits

    def as_dict(self) -> dict[str, int]:
        keys = ("parameters", "gradients", "gradient_buckets", "optimizer", "gathered", "activations", "logits",
                "logits_backward", "ring_attention", "runtime", "total")  # fmt: skip
        return {k: int(getattr(self, k)) for k in keys}

    def describe(self) -> str:
        parts = [f"{k} {v / GIB:,.2f}" for k, v in self.as_dict().items() if k != "total" and v]
        return f"{self.total / GIB:,.2f} GiB a worker ({', '.join(parts)} GiB)"


@dataclass(frozen=True, kw_only=True)
class ContextSplit:
    """A context-parallel job's rows as a worker holds them (:mod:`raytrn.models.context_parallel`): each padded to
    a multiple of ``2 x size`` and cut into ``2 x size`` chunks, two a worker."""

    size: int
    seq_len: int
    padded_length: int
    micro_batch_size: int

    @classmethod
    def of(cls, job: JobSpec) -> ContextSplit | None:
        """``job``'s split, or None without context parallelism."""
        cp, d = job.parallel.context_parallel_size, job.data
        if cp == 1:
            return None
        return cls(size=cp, seq_len=d.seq_len, padded_length=padded_length(d.seq_len, cp),
                   micro_batch_size=d.micro_batch_size)  # fmt: skip

    @property
    def row_tokens(self) -> int:
        """A row's tokens on a worker: ``2c`` (its two chunks)."""
        return self.padded_length // self.size

    @property
    def tokens(self) -> int:
        """A micro-batch's tokens on a worker: what its activations and logits are counted at."""
        return self.micro_batch_size * self.row_tokens

    def describe(self) -> str:
        """``context parallel 16: 65,536-token rows (no padding), 4,096 tokens a worker; ...``."""
        pad = self.padded_length - self.seq_len
        padding = f"{pad:,} of them padding" if pad else "no padding"
        return (
            f"context parallel {self.size}: {self.padded_length:,}-token rows ({padding}), {self.row_tokens:,} tokens "
            f"a worker; ring attention ({RING_SCORE_BLOCKS} float32 score blocks of {self.row_tokens:,} x "
            f"{self.row_tokens:,} at a time; its transfers not modelled)"
        )

    def as_dict(self) -> dict[str, int]:
        return {"size": self.size, "seq_len": self.seq_len, "padded_length": self.padded_length,
                "tokens_per_worker": self.row_tokens, "micro_batch_tokens_per_worker": self.tokens}  # fmt: skip


@dataclass(frozen=True)
class _Split:
    """The parameters a worker holds by how layouts divide them."""

    tp_split: int  # attention, dense MLP, embedding, head: split over TP, then FSDP
    experts: int  # stacked experts: split over the data-parallel ranks (EP and/or FSDP), replicated over TP
    replicated: int  # norms and routers: whole on every TP rank, FSDP-sharded
    block: int  # one decoder layer's parameters (FSDP gathers a block at a time)


@dataclass(frozen=True, kw_only=True)
class Held:
    """What a worker holds of the model and keeps for backward: the whole model and one micro-batch's activations,
    or under pipeline parallelism its rank's stages and the micro-batches in flight on them."""

    rank: int = 0
    stages: tuple[int, ...] = (0,)
    #: Decoder layers whose parameters it holds.
    layers: int
    embedding: bool = True
    #: The final norm, the output head and the loss (the last stage).
    head: bool = True
    #: Layers x micro-batches whose activations it keeps at its peak (the whole model: every layer, one).
    layer_micro_batches: int
    #: Micro-batches whose final norm it keeps (the last stage's in flight; 0 without the head).
    norm_micro_batches: int = 1
    #: Micro-batches whose logits and loss it keeps (0 without the head).
    logits_micro_batches: int = 1
    #: stage -> micro-batches in flight on it at the peak (pipeline ranks only).
    in_flight: dict[int, int] = field(default_factory=dict)


def _split(m: ModelConfig, held: Held) -> _Split:
    """The parameters of ``held``'s layers, embedding and head, by how layouts divide them (the whole model's are
    :func:`raytrn.models.model_stats`'s ``num_params``: tested)."""
    h, layer = m.hidden_size, model_spec(m.family).layer_params(m)
    dense = layer.attention + layer.mlp - layer.experts - layer.router
    head = held.head and not m.tie_word_embeddings  # tied: the embedding is the head (never pipelined)
    tp_split = held.layers * dense + m.vocab_size * h * (int(held.embedding) + int(head))
    replicated = held.layers * (layer.norms + layer.router) + h * held.head  # + the final norm
    block = layer.attention + layer.mlp + layer.norms
    return _Split(tp_split, held.layers * layer.experts, replicated, block)


def in_flight(schedule: str, rank: int, ranks: int, micro_batches: int) -> dict[int, int]:
    """``{stage: micro-batches}`` whose activations pipeline rank ``rank`` of ``ranks`` keeps for backward at its
    peak under ``schedule`` (``micro_batches`` a step, at least the stages and a multiple of ``ranks``: what
    ``raytrn validate`` asks). Counted from ``torch.distributed.pipelining``'s orders (a forward keeps a micro-batch
    until its full backward, or under the zero-bubble schedules until its weight-gradient pass), checked against
    them in ``tests/unit/test_estimate_pipeline.py``: GPipe runs every forward first; 1F1B's rank ``r`` warms up
    with ``P - r`` forwards; interleaved 1F1B's rank ``r`` with ``(v - 1) P + 2 (P - 1 - r) + 1`` stage forwards in
    rounds of ``P`` micro-batches; the interleaved zero bubble (ZB1P) holds ``P`` on each of its stages; ZB-V's rank
    ``r`` ``2P - 1 - r`` on its first stage and ``r + 1`` on its second, DualPipeV one more on the V's tip."""
    p, m = ranks, micro_batches
    stages = stage_indices(schedule, rank, p)
    v = len(stages)
    if schedule == "gpipe":
        counts = [m]
    elif schedule == "1f1b":
        counts = [p - rank]
    elif schedule == "interleaved_1f1b":
        ops = min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m)
        counts = [sum(1 for i in range(ops) if (i // p) % v == j) for j in range(v)]
    elif schedule == "interleaved_zero_bubble":
        counts = [p] * v
    else:  # zbv_zero_bubble, dualpipev: stages r and 2P - 1 - r
        counts = [2 * p - 1 - rank + (schedule == "dualpipev" and rank == p - 1), rank + 1]
    return {s: min(n, m) for s, n in zip(stages, counts, strict=True)}


def logits_in_flight(schedule: str, micro_batches: int) -> int:
    """Micro-batches whose logits (and the loss's fp32 copies) the last stage keeps at once: every one under GPipe,
    else one, the zero-bubble schedules included (their input-gradient pass keeps the stage's graph for the weight
    gradients, but drops the loss's side of it)."""
    return micro_batches if schedule == "gpipe" else 1


def pipeline_ranks(job: JobSpec, micro_batches: int) -> list[Held]:
    """What each pipeline rank of ``job`` holds (:class:`Held`), with ``micro_batches`` a step."""
    p, layers = job.parallel, job.model.num_layers
    pp = p.pipeline_parallel_size
    num_stages = pp * SCHEDULES[p.pipeline_schedule][1]
    cut = stage_layers(layers, num_stages)
    out = []
    for rank in range(pp):
        stages = tuple(stage_indices(p.pipeline_schedule, rank, pp))
        flight = in_flight(p.pipeline_schedule, rank, pp, micro_batches)
        out.append(
            Held(
                rank=rank,
                stages=stages,
                layers=sum(len(cut[s]) for s in stages),
                embedding=0 in stages,
                head=num_stages - 1 in stages,
                layer_micro_batches=sum(n * len(cut[s]) for s, n in flight.items()),
                norm_micro_batches=flight.get(num_stages - 1, 0),
                logits_micro_batches=logits_in_flight(p.pipeline_schedule, micro_batches) * (num_stages - 1 in stages),
                in_flight=flight,
            )
        )
    return out


def lora_params(m: ModelConfig) -> int:
    """The adapters' parameters: ``rank x (in + out)`` for every targeted linear layer of every decoder layer."""
    assert m.lora is not None
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.head_size, m.kv_heads * m.head_size, m.intermediate_size
    dims = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h),
    }  # fmt: skip
    per_layer = sum(sum(dims[t]) for t in m.lora.targets if t in dims)
    return m.num_layers * m.lora.rank * per_layer


def _width(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def estimate_memory(job: JobSpec, world_size: int) -> MemoryEstimate:
    """One worker's device memory for ``job`` at ``world_size`` workers (see the module): under pipeline
    parallelism the heaviest pipeline rank's, its notes saying which and what it holds."""
    p, layers = job.parallel, job.model.num_layers
    if p.pipeline_parallel_size == 1:
        return _estimate(job, world_size, Held(layers=layers, layer_micro_batches=layers))
    micro = job.data.grad_accum_for(data_parallel_size(job, world_size))
    ranks = [(_estimate(job, world_size, held), held) for held in pipeline_ranks(job, micro)]
    heaviest, held = max(ranks, key=lambda r: r[0].total)  # the first of equals: the lowest rank
    notes = list(heaviest.notes)
    notes.insert(1 + (p.tensor_parallel_size > 1), _describe_rank(job, held, micro))
    return replace(heaviest, notes=notes)


def _describe_rank(job: JobSpec, held: Held, micro_batches: int) -> str:
    """``pipeline parallel 2 (1f1b, 2 stages of 2/2 layers, 8 micro-batches): the heaviest rank, 0, holds stage 0
    (2 layers, the embedding), 2 micro-batches in flight``."""
    p = job.parallel
    pp, schedule = p.pipeline_parallel_size, p.pipeline_schedule
    cut = stage_layers(job.model.num_layers, pp * SCHEDULES[schedule][1])
    what = (
        [f"{held.layers} layer{'s' * (held.layers != 1)}"]
        + ["the embedding"] * held.embedding
        + ["the final norm and head"] * held.head
    )
    stages = " and ".join(map(str, held.stages))
    flight = held.in_flight
    if len(flight) == 1:
        n = next(iter(flight.values()))
        kept = f"{n} micro-batch{'es' * (n != 1)} in flight"
    else:
        kept = "micro-batches in flight: " + ", ".join(f"{n} on stage {s}" for s, n in flight.items())
    return (
        f"pipeline parallel {pp} ({schedule}, {len(cut)} stages of {'/'.join(str(len(c)) for c in cut)} layers, "
        f"{micro_batches} micro-batches): the heaviest rank, {held.rank}, holds stage{'s' * (len(held.stages) > 1)} "
        f"{stages} ({', '.join(what)}), {kept}"
    )


def _estimate(job: JobSpec, world_size: int, held: Held) -> MemoryEstimate:
    """A worker's memory when it holds ``held``: the whole model, or a pipeline rank's stages."""
    m, d, p = job.model, job.data, job.parallel
    tp, pp, acc = p.tensor_parallel_size, p.pipeline_parallel_size, job.scaling.accelerator
    dp = max(1, world_size // (pp * tp))  # a stage's data-parallel ranks under a pipeline; DP x CP under CP
    context = ContextSplit.of(job)
    width = _width(m.dtype)
    compute = 2 if m.autocast == "bfloat16" else width
    split = _split(m, held)
    if pp == 1:
        fsdp = p.data_parallel != "ddp" and world_size > 1  # fsdp or hsdp: FSDP2 holds the state, gathers blocks
        shard_dp = shard_size(job, world_size)  # hsdp: a shard group's data-parallel ranks only
    else:  # FSDP2 over a stage's data-parallel ranks (raytrn.train.pipelined); none when a stage has one
        fsdp = p.data_parallel != "ddp" and dp > 1
        inner = world_size // pp
        shard_dp = min(hsdp_shard_size(job) or inner, inner) // tp if fsdp else 1
    whole = split.tp_split // tp + split.experts + split.replicated  # what the TP rank holds before FSDP
    state = split.tp_split // tp // shard_dp + split.experts // shard_dp + split.replicated // shard_dp
    over = f" over {dp} data-parallel ranks" if shard_dp == dp else f" over {shard_dp} of {dp} data-parallel ranks"
    if context is not None:  # FSDP shards over the data and context ranks together (torchtitan's dp_shard_cp)
        cp = context.size
        over = f" over {shard_dp}{f' of {dp}' * (shard_dp != dp)} data x context ranks (DP {dp // cp} x CP {cp})"
    if pp == 1:
        notes = [f"{p.data_parallel}" + (over if fsdp else " (whole model a worker)")]
    else:
        notes = [f"{p.data_parallel}" + (f"{over} of a stage" if fsdp else " (one data-parallel rank: not sharded)")]
    if tp > 1:
        notes.append(f"TP {tp}")
    if context is not None:
        notes.append(context.describe())
    if p.expert_parallel_size > 1:
        notes.append(f"experts over EP {p.expert_parallel_size} x FSDP {shard_dp // p.expert_parallel_size}")
    trainable_whole = whole
    lora = 0
    if m.lora is not None:
        lora = lora_params(m) * held.layers // m.num_layers  # the adapters of the layers held
        trainable_whole = lora
        notes.append(f"LoRA rank {m.lora.rank}: {lora_params(m):,} trainable parameters")
    trainable = state if m.lora is None else lora // shard_dp
    xla = acc in ("neuron-xla", "xla-cpu")
    # DDP's buckets copy the gradients; NxD reduces in place; a pipeline has no DDP (ddp replicas: refused)
    ddp_buckets = not fsdp and not xla and world_size > 1 and pp == 1
    gradients = trainable * width
    optimizer = 2 * trainable * width
    if p.zero1 and xla:  # NxD ZeRO-1: fp32 moments and fp32 master weights sharded over the data-parallel ranks
        optimizer = 3 * 4 * trainable // dp
        notes.append(f"ZeRO-1 over {dp}: fp32 moments and master weights")
    if pp > 1 and fsdp:
        # torch.distributed.pipelining turns reshard_after_backward and gradient sync off until the last
        # micro-batch: from a stage's first backward its parameters stay gathered (compute dtype) and its
        # gradients accumulate unsharded (FSDP2's reduce dtype, fp32, under mixed precision)
        gathered = whole * compute + trainable_whole * (4 if m.autocast == "bfloat16" else width)
        notes.append("FSDP under a pipeline: the stages stay gathered and their gradients unsharded through the step")
    else:
        # FSDP gathers a block (and prefetches the next): its dense part over the TP shard, its experts over EP's
        layer_experts = model_spec(m.family).layer_params(m).experts
        gathered_block = (split.block - layer_experts) // tp + layer_experts // p.expert_parallel_size
        gathered = 2 * gathered_block * compute if fsdp else 0
    tokens = d.micro_batch_size * d.seq_len if context is None else context.tokens
    logits = _logits(tokens, m.vocab_size, compute, nxd_tp=tp if acc == "neuron-xla" else None)
    return MemoryEstimate(
        parameters=state * width + (lora // shard_dp * width if m.lora else 0),
        gradients=gradients,
        gradient_buckets=gradients if ddp_buckets else 0,
        optimizer=optimizer,
        gathered=gathered,
        activations=activation_bytes(job, tokens, compute, held=held),
        logits=logits["logits"] * held.logits_micro_batches,
        logits_backward=logits["logits_backward"] if held.head else 0,
        ring_attention=0 if context is None else ring_attention_bytes(job, context),
        runtime=RUNTIME_BYTES.get(acc, GIB),
        notes=notes,
    )


def _logits(tokens: int, vocab: int, compute: int, *, nxd_tp: int | None) -> dict[str, int]:
    """The head's output and what the loss keeps of it, and its backward transient: under NxD a TP shard of the
    vocabulary (its parallel cross entropy); elsewhere the whole vocabulary on every rank (raytrn's TP gathers the
    head's output), the loss in one piece (its fp32 log-softmax kept, two fp32 gradients in backward) or, above
    :data:`raytrn.config.sizes.LOSS_CHUNK_LOGITS`, in chunks (:mod:`raytrn.train.loss`: the gradient kept in the compute dtype, a chunk's fp32 copy and its
    exponentials at a time)."""
    if nxd_tp is not None:
        n = tokens * vocab // nxd_tp
        return {"logits": n * (compute + LOGIT_SAVED_FP32), "logits_backward": n * LOGIT_BACKWARD_FP32}
    n, rows = tokens * vocab, loss_chunk_rows(tokens, vocab)
    if rows is None:
        return {"logits": n * (compute + LOGIT_SAVED_FP32), "logits_backward": n * LOGIT_BACKWARD_FP32}
    return {"logits": 2 * n * compute, "logits_backward": rows * vocab * LOGIT_BACKWARD_FP32}


def ring_attention_bytes(job: JobSpec, context: ContextSplit) -> int:
    """What one layer's ring attention holds while it runs, forward or backward (see the module): its float32 score
    blocks of the diagonal, ``[micro_batch, heads / TP, 2c, 2c]``, their boolean mask (no heads) and the per-token
    float32 buffers (:data:`RING_Q_FP32`, :data:`RING_KV_FP32`)."""
    m, tp = job.model, job.parallel.tensor_parallel_size
    b, n = context.micro_batch_size, context.row_tokens
    heads = m.num_attention_heads // tp
    q, kv = heads * m.head_size, m.kv_heads * m.head_size // tp
    blocks = RING_SCORE_BLOCKS * b * heads * n * n * 4 + b * n * n
    return blocks + context.tokens * (RING_Q_FP32 * q + RING_KV_FP32 * kv)


def activation_bytes(job: JobSpec, tokens: int, width: int, *, held: Held | None = None) -> int:
    """What the decoder layers keep for backward at ``tokens`` tokens a micro-batch (see the module): every layer's
    for one micro-batch, or ``held``'s layers for its micro-batches in flight (the final norm's on the last stage).
    Under context parallelism ``tokens`` are a worker's share, and a layer keeps the ring's output copy and its
    float32 log-sum-exp."""
    m, p = job.model, job.parallel
    tp = p.tensor_parallel_size
    h = m.hidden_size
    # Per token, per layer, as decoder.DecoderLayer saves them: the residual input and both norms' inputs and
    # outputs (4 h); attention's and the MLP's tensors are the family's.
    hidden = 4 * h // tp if p.sequence_parallel else 4 * h  # NxD sequence parallel splits them along the sequence
    layer = model_spec(m.family).layer_activations(m, tp)
    attention, mlp = hidden + layer.attention, layer.mlp
    if m.lora is not None:
        # Frozen layers keep no input for a weight gradient: measured (tests/unit/test_estimate.py) on adapters of
        # attention, 4 h + f a token less (the normed inputs and projections' copies, the down projection's input);
        # adapted MLPs keep theirs.
        mlp_adapted = any(t in m.lora.targets for t in ("gate_proj", "up_proj", "down_proj"))
        attention -= 2 * h if mlp_adapted else 4 * h
        mlp -= 0 if mlp_adapted else layer.frozen_mlp
    per_layer = tokens * (attention + mlp) * width
    if p.context_parallel_size > 1:  # the ring's output, copied for o_proj, and its float32 log-sum-exp
        heads = m.num_attention_heads // tp
        per_layer += tokens * heads * (m.head_size * width + 4)
    elif job.scaling.accelerator == "xla-cpu":  # XLA on CPU materialises the scores, softmax, gradient (trn1: flash)
        seq = job.data.seq_len
        per_layer += 3 * (tokens // seq) * (m.num_attention_heads // tp) * seq * seq * 4
    final_norm = tokens * 2 * h * width  # its input and output, outside the layers
    layers, norms = (m.num_layers, 1) if held is None else (held.layer_micro_batches, held.norm_micro_batches)
    mode = p.activation_checkpointing
    if mode == "none":
        return layers * per_layer + norms * final_norm
    kept = tokens * h * width  # each layer's input
    if mode == "selective":  # the matmul and attention outputs kept as well: about half of a layer's tensors
        kept += per_layer // 2
    return layers * kept + per_layer + norms * final_norm  # plus one layer recomputed at a time
