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

What a layer holds and keeps is its family's (``raytrn/models/<family>/estimate.py``, counted tensor by tensor from
:mod:`raytrn.models.decoder`); ``tests/unit/test_estimate.py`` pins them against measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrn.config.sizes import loss_chunk_rows, shard_size
from raytrn.models import model_stats
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
    #: What each term assumed (layout, dtypes), for the report.
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.gradient_buckets + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.activations + self.logits + self.logits_backward + self.runtime

    @property
    def probed(self) -> int:
        """What :mod:`raytrn.train.memory_probe` measures on a worker without a device allocator (cpu): the state
        held (one gradient per trainable parameter), the tensors saved for backward (activations, the loss's) and
        the logits the step holds."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.logits

    def as_dict(self) -> dict[str, int]:
        keys = ("parameters", "gradients", "gradient_buckets", "optimizer", "gathered", "activations", "logits",
                "logits_backward", "runtime", "total")  # fmt: skip
        return {k: int(getattr(self, k)) for k in keys}

    def describe(self) -> str:
        parts = [f"{k} {v / GIB:,.2f}" for k, v in self.as_dict().items() if k != "total" and v]
        return f"{self.total / GIB:,.2f} GiB a worker ({', '.join(parts)} GiB)"


@dataclass(frozen=True)
class _Split:
    """The model's parameters by how layouts divide them."""

    tp_split: int  # attention, dense MLP, embedding, head: split over TP, then FSDP
    experts: int  # stacked experts: split over the data-parallel ranks (EP and/or FSDP), replicated over TP
    replicated: int  # norms and routers: whole on every TP rank, FSDP-sharded
    block: int  # one decoder layer's parameters (FSDP gathers a block at a time)


def _split(m: ModelConfig, seq_len: int) -> _Split:
    total = model_stats(m, seq_len).num_params
    h, layers = m.hidden_size, m.num_layers
    layer = model_spec(m.family).layer_params(m)
    norms = layers * layer.norms + h  # + the final norm
    experts, router = layers * layer.experts, layers * layer.router
    replicated = norms + router
    embedding_and_head = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    block = (total - embedding_and_head - h) // layers
    return _Split(total - experts - replicated, experts, replicated, block)


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
    """One worker's device memory for ``job`` at ``world_size`` workers (see the module)."""
    m, d, p = job.model, job.data, job.parallel
    tp, acc = p.tensor_parallel_size, job.scaling.accelerator
    dp = max(1, world_size // tp)
    width = _width(m.dtype)
    compute = 2 if m.autocast == "bfloat16" else width
    split = _split(m, d.seq_len)
    fsdp = p.data_parallel != "ddp" and world_size > 1  # fsdp or hsdp: FSDP2 holds the state, gathers blocks
    shard_dp = shard_size(job, world_size)  # hsdp: a shard group's data-parallel ranks only
    held = split.tp_split // tp // shard_dp + split.experts // shard_dp + split.replicated // shard_dp
    over = f" over {dp} data-parallel ranks" if shard_dp == dp else f" over {shard_dp} of {dp} data-parallel ranks"
    notes = [f"{p.data_parallel}" + (over if fsdp else " (whole model a worker)")]
    if tp > 1:
        notes.append(f"TP {tp}")
    if p.pipeline_parallel_size > 1:  # an over-estimate: a stage holds about 1/PP of the layers
        notes.append(f"pipeline parallel {p.pipeline_parallel_size}: counted as the whole model (per-stage memory and "
                     "the in-flight micro-batches' activations are not estimated yet)")  # fmt: skip
    if p.expert_parallel_size > 1:
        notes.append(f"experts over EP {p.expert_parallel_size} x FSDP {shard_dp // p.expert_parallel_size}")
    trainable = held
    if m.lora is not None:
        trainable = lora_params(m) // shard_dp
        notes.append(f"LoRA rank {m.lora.rank}: {lora_params(m):,} trainable parameters")
    xla = acc in ("neuron-xla", "xla-cpu")
    ddp_buckets = not fsdp and not xla and world_size > 1  # DDP's buckets copy the gradients; NxD reduces in place
    gradients = trainable * width
    optimizer = 2 * trainable * width
    if p.zero1 and xla:  # NxD ZeRO-1: fp32 moments and fp32 master weights sharded over the data-parallel ranks
        optimizer = 3 * 4 * trainable // dp
        notes.append(f"ZeRO-1 over {dp}: fp32 moments and master weights")
    # FSDP gathers a block (and prefetches the next): its dense part over the TP shard, its experts over EP's block
    layer_experts = split.experts // m.num_layers
    gathered_block = (split.block - layer_experts) // tp + layer_experts // p.expert_parallel_size
    gathered = 2 * gathered_block * compute if fsdp else 0
    tokens = d.micro_batch_size * d.seq_len
    return MemoryEstimate(
        parameters=held * width + (lora_params(m) // shard_dp * width if m.lora else 0),
        gradients=gradients,
        gradient_buckets=gradients if ddp_buckets else 0,
        optimizer=optimizer,
        gathered=gathered,
        activations=activation_bytes(job, tokens, compute),
        **_logits(tokens, m.vocab_size, compute, nxd_tp=tp if acc == "neuron-xla" else None),
        runtime=RUNTIME_BYTES.get(acc, GIB),
        notes=notes,
    )


def _logits(tokens: int, vocab: int, compute: int, *, nxd_tp: int | None) -> dict[str, int]:
    """The head's output and what the loss keeps of it, and its backward transient: under NxD a TP shard of the
    vocabulary (its parallel cross entropy); elsewhere the whole vocabulary on every rank (raytrn's TP gathers the
    head's output), the loss in one piece (its fp32 log-softmax kept, two fp32 gradients in backward) or, above
    :data:`raytrn.config.sizes.LOSS_CHUNK_LOGITS`, in chunks (:mod:`raytrn.train.loss`: the gradient kept in the
    compute dtype, a chunk's fp32 copy and its exponentials at a time)."""
    if nxd_tp is not None:
        n = tokens * vocab // nxd_tp
        return {"logits": n * (compute + LOGIT_SAVED_FP32), "logits_backward": n * LOGIT_BACKWARD_FP32}
    n, rows = tokens * vocab, loss_chunk_rows(tokens, vocab)
    if rows is None:
        return {"logits": n * (compute + LOGIT_SAVED_FP32), "logits_backward": n * LOGIT_BACKWARD_FP32}
    return {"logits": 2 * n * compute, "logits_backward": rows * vocab * LOGIT_BACKWARD_FP32}


def activation_bytes(job: JobSpec, tokens: int, width: int) -> int:
    """What the decoder layers keep for backward at ``tokens`` tokens a micro-batch (see the module)."""
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
    if job.scaling.accelerator == "xla-cpu":  # XLA on CPU materialises the scores, softmax, gradient (trn1: flash)
        seq = job.data.seq_len
        per_layer += 3 * (tokens // seq) * (m.num_attention_heads // tp) * seq * seq * 4
    final_norm = tokens * 2 * h * width  # its input and output, outside the layers
    mode = p.activation_checkpointing
    if mode == "none":
        return m.num_layers * per_layer + final_norm
    kept = tokens * h * width  # each layer's input
    if mode == "selective":  # the matmul and attention outputs kept as well: about half of a layer's tensors
        kept += per_layer // 2
    return m.num_layers * kept + per_layer + final_norm  # plus one layer recomputed at a time
