"""The job spec: a YAML file plus ``--set`` overrides, parsed into typed, range-checked config.

Every section owns a pydantic model with ``extra="forbid"``; errors name the file, the field path
and the fix (``jobs/tiny.yaml: scaling.max_worker: unknown field. Did you mean 'max_workers'?``).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import reprlib
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raytrn.errors import ConfigError

_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
Accelerator = Literal["cpu", "cuda", "neuron", "neuron-xla", "xla-cpu"]

#: A job file larger than this is not a job file (a job spec is a few kilobytes).
MAX_JOB_FILE_BYTES = 1 << 20
#: Values in a job spec after YAML aliases are expanded (anchors that expand exponentially are refused).
MAX_SPEC_VALUES = 20_000
#: The most workers a job may ask for (see raytrn.train.sizes).
MAX_WORKERS = 100_000
#: Run names become directory names under checkpoint.storage: one path component, no "..", no "/".
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class LoraConfig(_Section):
    """Low-rank adapters (raytrn.models.lora): only they train; the base model stays as init_from gave it."""

    rank: int = Field(8, gt=0, le=4096, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False, description="scale: the update is (alpha / rank) * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="linear layers to adapt, by name: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    )


class ModelConfig(_Section):
    """A Llama-family decoder (HF ``LlamaConfig``). ``preset`` fills sizes; explicit fields win."""

    family: Literal["llama"] = Field("llama", description="model family; only HF Llama for now")
    preset: str | None = Field(None, description="named size: tiny, llama3.2-1b, llama3-8b (see raytrn.models)")
    hidden_size: int = Field(..., gt=0, le=1 << 18, description="model width")
    intermediate_size: int = Field(..., gt=0, le=1 << 20, description="MLP width")
    num_layers: int = Field(..., gt=0, le=4096, description="decoder layers")
    num_attention_heads: int = Field(..., gt=0, le=4096)
    num_key_value_heads: int | None = Field(None, gt=0, le=4096, description="GQA kv heads; default = attention heads")
    vocab_size: int = Field(..., gt=0, le=1 << 24, description="must be >= the dataset tokenizer's vocabulary")
    max_position_embeddings: int = Field(2048, gt=0, le=1 << 24, description="must be >= data.seq_len")
    rope_theta: float = Field(10000.0, gt=0, allow_inf_nan=False)
    rms_norm_eps: float = Field(1e-5, gt=0, lt=1)
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Llama 3.x RoPE scaling ({rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings}); from config.json with init_from; null: the default RoPE",
    )
    init_from: str | None = Field(
        None,
        description="a Hugging Face Llama checkpoint directory (local or s3://): config.json + *.safetensors; its "
        "config gives the sizes (any the job gives must match) and its weights the starting point",
    )
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters only (needs init_from): rank, alpha, dropout, targets"
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype")
    autocast: Literal["none", "bfloat16"] = Field(
        "none",
        description="mixed precision: forward/backward under torch.autocast in this dtype while parameters and "
        "AdamW state stay float32 (master weights); cuda and neuron (TorchNeuron), ignored with a warning elsewhere",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            from raytrn.models.llama import PRESETS

            name = data["preset"]
            if not isinstance(name, str) or name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
            return {**PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.kv_heads})"
            )
        return self

    @model_validator(mode="after")
    def _check_autocast(self) -> ModelConfig:
        if self.autocast != "none" and self.dtype != "float32":
            raise ValueError(
                f"autocast={self.autocast!r} needs dtype='float32' (autocast keeps float32 master weights); "
                f"got dtype={self.dtype!r}: set model.dtype: float32, or model.autocast: none for pure bf16 parameters"
            )
        return self

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _check_rope_scaling(cls, value: Any) -> Any:
        from raytrn.models.hf import rope_scaling

        try:
            return rope_scaling(value, where="model.rope_scaling")
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("model.rope_scaling: ")) from None

    @model_validator(mode="after")
    def _lora_needs_a_base(self) -> ModelConfig:
        if self.lora is not None and not self.init_from:
            raise ValueError(
                "model.lora trains adapters on a pretrained model: set model.init_from (a Hugging Face checkpoint); "
                "adapters on random weights learn nothing useful"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads


class DataConfig(_Section):
    """Packed token shards from ``raytrn data prepare`` and the batch shape (fixed shapes: no recompiles)."""

    manifest: str = Field(..., min_length=1, description="path (or s3:// URI) of manifest.json or its directory")
    seq_len: int = Field(..., gt=0, le=1 << 22, description="tokens per sequence; must equal the manifest's seq_len")
    micro_batch_size: int = Field(..., gt=0, le=1 << 16, description="sequences per worker per forward/backward")
    grad_accum: int | None = Field(None, gt=0, le=1 << 20, description="micro-batches per optimizer step (default 1)")
    global_batch_size: int | None = Field(
        None,
        gt=0,
        le=1 << 31,
        description="sequences per optimizer step over all workers (model replicas); sets grad_accum per world size. "
        "An elastic job needs it (see allow_variable_global_batch)",
    )
    allow_variable_global_batch: bool = Field(
        False,
        description="let an elastic job with grad_accum change its global batch (micro x grad_accum x workers) when "
        "it resizes; default: refused, set global_batch_size instead",
    )
    shuffle: bool = Field(
        True,
        description="a new order every epoch, seeded by run.seed and the epoch, the same at every world size: the "
        "row groups (~8 MiB of tokens) are permuted, then the rows of every shuffle_window consecutive groups; "
        "false: manifest order",
    )
    shuffle_window: int = Field(
        4,
        gt=0,
        le=4096,
        description="row groups whose rows are shuffled together (memory and reads per data-parallel rank grow "
        "with it: each rank reads a window's row groups and keeps its share)",
    )
    attention: Literal["causal", "document"] | None = Field(
        None,
        description="causal: every token of a row attends to every earlier one; document: only to earlier tokens of "
        "its own document (positions restart at each; for text, documents end at EOS). Default: document for "
        "instruction data (its examples are packed), causal for text",
    )
    packing: bool | None = Field(
        None,
        description="instruction data: whether its rows pack several examples (set by `raytrn data prepare "
        "--no-packing`); the job refuses a dataset prepared otherwise. null: as prepared",
    )
    validation: str | None = Field(
        None,
        description="the validation set: a prepared dataset's manifest (or directory), or 'none'. null: the split "
        "`raytrn data prepare --validation-fraction` wrote with the training set, if any",
    )

    @model_validator(mode="after")
    def _one_batch_rule(self) -> DataConfig:
        if self.grad_accum is not None and self.global_batch_size is not None:
            raise ValueError("set either grad_accum or global_batch_size, not both")
        return self

    def grad_accum_for(self, world_size: int) -> int:
        """Micro-batches per step at this world size (global_batch_size must divide evenly)."""
        if self.global_batch_size is None:
            return self.grad_accum or 1
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"data.global_batch_size ({self.global_batch_size}) is not divisible by micro_batch_size x "
                f"workers ({self.micro_batch_size} x {world_size} = {per_step}); pick a global batch that is a "
                f"multiple of {per_step}, or set data.grad_accum instead"
            )
        return self.global_batch_size // per_step


class OptimConfig(_Section):
    """AdamW with linear warmup, then cosine decay (or warmup-stable-decay) to ``lr * min_lr_ratio``."""

    lr: float = Field(..., gt=0, le=1e3, allow_inf_nan=False, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of the peak")
    warmup_steps: int = Field(0, ge=0, le=10**12)
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine",
        description="after warmup: 'cosine' decays over decay_steps; 'wsd' (warmup-stable-decay) holds the peak and "
        "decays over the last decay_fraction of the steps, so a run can be continued before its decay",
    )
    decay_steps: int | None = Field(
        None,
        gt=0,
        le=10**12,
        description="steps after warmup until the lr reaches its floor; default run.max_steps - warmup, pinned when "
        "the run starts (a resume with another run.max_steps keeps it; set this to change it)",
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the share of the steps spent decaying")
    decay_shape: Literal["linear", "cosine"] = Field("linear", description="wsd: the shape of the final decay")
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, lt=1)
    grad_clip_norm: float | None = Field(
        1.0, gt=0, allow_inf_nan=False, description="max global grad norm; null disables clipping"
    )
    fused: bool = Field(
        False,
        description="fused AdamW kernel (torch.optim.AdamW(fused=True)); cuda only, ignored with a warning elsewhere",
    )

    @model_validator(mode="after")
    def _check_betas(self) -> OptimConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas must each be in [0, 1), got {list(self.betas)}")
        return self


class ScalingConfig(_Section):
    """Where workers run: one per CPU slot, GPU or NeuronCore; elastic between min and max."""

    accelerator: Accelerator = "cpu"
    min_workers: int = Field(1, gt=0)
    max_workers: int | None = Field(None, gt=0, description="default (null) = min_workers: a fixed size")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources per worker; default by accelerator (CPU:1, GPU:1, neuron_cores:1)"
    )
    instance_type: str | None = Field(None, description="e.g. trn1.32xlarge; used for topology and cost")
    workers_per_node: int | None = Field(None, gt=0, description="workers on one node (NeuronCores per instance)")
    max_failures: int = Field(3, ge=0, le=10**6, description="worker-group restarts from the last checkpoint")
    resize_interval_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="elastic: how often a running group checks for more capacity (a returning node is used within "
        "this); each resize restarts the group from the last checkpoint",
    )

    @model_validator(mode="before")
    @classmethod
    def _fixed_size_default(cls, data: Any) -> Any:
        """``max_workers: null`` means a fixed size: the same job as ``max_workers == min_workers``."""
        if isinstance(data, dict) and data.get("max_workers") is None:
            low = data.get("min_workers", 1)
            if isinstance(low, int) and not isinstance(low, bool):
                data = {**data, "max_workers": low}
        return data

    @field_validator("min_workers", "max_workers", "workers_per_node")
    @classmethod
    def _bounded(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_WORKERS:
            raise ValueError(
                f"{value:,} workers is more than raytrn runs ({MAX_WORKERS:,}: one worker per NeuronCore or GPU, "
                "and no cluster file here allows that many); ask for the workers your cluster can hold"
            )
        return value

    @model_validator(mode="after")
    def _check_range(self) -> ScalingConfig:
        if self.min_workers > self.max_size:
            raise ValueError(f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})")
        for key, val in (self.resources_per_worker or {}).items():
            if not 0 <= val < 1e9:
                raise ValueError(f"resources_per_worker.{key} must be >= 0 and finite, got {val}")
        return self

    @property
    def max_size(self) -> int:
        """The largest worker count (``max_workers``; ``min_workers`` for a fixed size)."""
        return self.max_workers or self.min_workers

    @property
    def elastic(self) -> bool:
        return self.max_size != self.min_workers


class CheckpointConfig(_Section):
    storage: str = Field("checkpoints", min_length=1, description="local directory or s3://bucket/prefix")
    every_n_steps: int = Field(100, gt=0, le=10**12, description="save every N optimizer steps (and at the last step)")
    keep_last: int | None = Field(3, gt=0, le=10**6, description="checkpoints kept; null keeps all")
    async_: bool = Field(
        False,
        alias="async",
        description="write sharded checkpoints in the background: the step waits only for the copy to host "
        "memory; a checkpoint is recorded (resumable) once written, at the next save or at the end",
    )
    verify: Literal["sha256", "size"] = Field(
        "sha256",
        description="what a resume checks of a committed checkpoint's files against its manifest: sizes and "
        "sha256 (every byte read once more, split over the workers) or sizes only",
    )


class TrackingConfig(_Section):
    enabled: bool = True
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db"
    )
    experiment: str = Field("raytrn", min_length=1)
    usd_per_hour: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="price of one node per hour; default: raytrn's on-demand table for instance_type",
    )
    spot_usd_per_hour: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="spot price per node-hour; wins when set"
    )
    run_name: str | None = Field(
        None,
        description="MLflow run name and Ray Train run (checkpoint) name. Set: re-running resumes that run. "
        "Unset: a new run '<job file stem>-<date>-<time>' each time",
    )
    required: bool = Field(
        False,
        description="fail at start when MLflow is unreachable; default: warn, keep training, buffer the metrics "
        "and deliver them when the server answers",
    )
    run_id: str | None = Field(
        None, description="attach to this existing MLflow run instead of creating one (it must exist)"
    )
    log_model: bool = Field(True, description="log the final model in Hugging Face format as the run's 'model'")
    export: Literal["merged", "adapter"] = Field(
        "merged",
        description="with model.lora: log the model with the adapters merged into its weights (a plain Llama), or "
        "only the adapters (a peft adapter directory, loaded on top of init_from)",
    )
    register_model: str | None = Field(
        None, min_length=1, description="register the final model under this name in the MLflow model registry"
    )
    system_metrics: bool = Field(True, description="log CPU/memory/disk/network (and NeuronCore) metrics per node")
    system_metrics_interval_s: float = Field(10.0, gt=0, le=86400, description="seconds between system metric samples")
    flush_timeout_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="at the end, how long to wait for buffered metrics to reach an unreachable server",
    )

    @field_validator("run_name")
    @classmethod
    def _one_path_component(cls, value: str | None) -> str | None:
        if value is not None and not RUN_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a usable run name: it names a directory under checkpoint.storage, so use 1-200 "
                "letters, digits and . _ = + - (starting with a letter or digit; no '/', no '..')"
            )
        return value

    @model_validator(mode="after")
    def _check_register(self) -> TrackingConfig:
        if self.register_model and not self.log_model:
            raise ValueError("register_model needs log_model: true (the registry points at the logged model)")
        return self


class RunConfig(_Section):
    max_steps: int = Field(
        ..., gt=0, le=10**12, description="optimizer steps in total (a resumed run continues to this)"
    )
    seed: int = Field(0, ge=0, lt=2**63)
    log_every: int = Field(10, gt=0, le=10**12, description="report metrics every N steps")
    eval_every: int | None = Field(
        None,
        gt=0,
        le=10**12,
        description="compute val_loss / val_perplexity on the validation set every N steps and at the last step "
        "(null: at the last step only, when there is a validation set)",
    )
    eval_batches: int = Field(
        8,
        gt=0,
        le=1 << 20,
        description="global batches of the validation set each evaluation covers: the same rows every time, at any "
        "world size",
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (in place: checkpoint keys unchanged) and the loss; the first steps "
        "compile. cuda (inductor) and neuron (backend='neuron', fullgraph=True, dynamic=False); ignored with a "
        "warning elsewhere (XLA compiles whole steps anyway)",
    )
    tune_malloc: bool | None = Field(
        None,
        description="glibc malloc settings on the training workers (one arena, fixed mmap threshold, no trimming): "
        "the step's activations stop page-faulting in every step when Ray Train runs the loop in a thread. "
        "Default: on for cpu, off elsewhere. An allocator setting of your own (MALLOC_*, GLIBC_TUNABLES, a "
        "preloaded jemalloc/tcmalloc) wins. See raytrn.backends.host_malloc",
    )


class ParallelConfig(_Section):
    """How a model replica is laid out over workers. Defaults: plain data parallelism (DDP)."""

    data_parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every worker holds the whole model; fsdp: parameters, gradients and optimizer state "
        "sharded over the data-parallel ranks (FSDP2 fully_shard per decoder block and at the root)",
    )
    tensor_parallel_size: int = Field(
        1, gt=0, le=4096, description="workers (consecutive ranks, one node) one model replica is split over"
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: full (each decoder block keeps only its input), "
        "selective (also keeps matmul and attention outputs); true/false mean full/none",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free gathered parameters after each block's forward (less memory, more traffic)"
    )
    zero1: bool = Field(False, description="neuron XLA path: shard optimizer state over data-parallel ranks (NxD)")
    sequence_parallel: bool = Field(
        False, description="neuron XLA path: shard norm activations along the sequence (TP>1, NxD)"
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _bool_means_full(cls, value: Any) -> Any:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


class NeuronConfig(_Section):
    """Trainium-only settings; ignored (with a warning) on other accelerators."""

    compile_cache: str | None = Field(
        None,
        description="neuron: TorchNeuron's NEFF cache directory, local or shared (per-host subdirs); neuron-xla: "
        "NEURON_COMPILE_CACHE_URL, s3://bucket/prefix or a local/shared path",
    )
    lnc: Literal[1, 2] | None = Field(
        None,
        description="trn2 logical NeuronCore config, 1 or 2 (default 2: 64 workers per trn2.48xlarge); trn1 has none",
    )
    stochastic_rounding: bool = Field(
        True, description="neuron-xla: NEURON_RT_STOCHASTIC_ROUNDING_EN for bf16 parameters (TorchNeuron: use autocast)"
    )
    cc_flags: str = Field("--model-type transformer", description="NEURON_CC_FLAGS for the Neuron compiler")
    socket_ifname: str = Field(
        "eth0", description="neuron-xla: network interface for collective bootstrap (CCOM_SOCKET_IFNAME)"
    )


class JobSpec(_Section):
    """A whole training job."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    scaling: ScalingConfig = ScalingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    run: RunConfig
    parallel: ParallelConfig = ParallelConfig()
    neuron: NeuronConfig = NeuronConfig()

    # Where the spec came from (file name), for messages; not a YAML field.
    source: str = Field("<job>", exclude=True)

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        if self.model.lora is not None and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "model.lora with parallel.tensor_parallel_size > 1 is not supported: the adapters would have to be "
                "sharded like the layers they adapt; use data_parallel ddp or fsdp (TP 1): LoRA keeps optimizer "
                "memory small enough for it"
            )
        return self

    @property
    def run_name(self) -> str:
        """The fixed run name, or a new timestamped one (fixed for the job by ``resolve_paths``)."""
        if self.tracking.run_name:
            return self.tracking.run_name
        stem = re.sub(r"[^A-Za-z0-9._=+-]+", "-", Path(self.source).stem).strip(".-")[:180] or "job"
        return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    def flat(self) -> dict[str, Any]:
        """The spec as ``{"optim.lr": 0.001, ...}`` (for MLflow params)."""
        return _flatten(self.model_dump(mode="json"))


# ---------------------------------------------------------------------------------------------------
# Loading


def load_job(
    path: str | os.PathLike,
    overrides: list[str] | None = None,
    *,
    base_dir: str | None = None,
    resolve: bool = True,
    values: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
    raw: dict[str, Any] | None = None,
) -> JobSpec:
    """Read, override, validate and path-resolve a job spec; raise ConfigError with a clear message.

    ``resolve=False`` leaves local paths as written (see :func:`relative_local_paths`). ``values`` are typed
    overrides (``{"optim.lr": 0.001}``, applied after the ``--set`` strings), named in messages as ``labels``
    says (default ``--set <field>``). ``raw``: the file's mapping already read (:func:`read_job_mapping`)."""
    path = str(path)
    raw = copy.deepcopy(raw) if raw is not None else read_job_mapping(path)
    if "sweep" in raw:
        raise ConfigError(
            f"{path}: has a sweep: section (a search space over this job): run it with `raytrn sweep {path}`, or "
            "train the job without the section"
        )
    overridden = apply_overrides(raw, overrides or [])
    for key, value in (values or {}).items():
        set_value(raw, key, value, where=(labels or {}).get(key, f"--set {key}"))
        overridden.add(key)
    raw = _with_init_from(raw, base_dir or os.getcwd(), source=path)
    job = parse_job(raw, source=path, overridden=overridden, labels=labels)
    return resolve_paths(job, base_dir or os.getcwd()) if resolve else job


def read_job_mapping(path: str) -> dict[str, Any]:
    """A job file's YAML mapping (not validated), or a ConfigError naming what is wrong with the file."""
    text = read_config_text(path, what="job file", examples="jobs/")
    raw = safe_load_yaml(text, path)
    if raw is None:
        raise ConfigError(f"{path}: job file is empty; see jobs/tiny.yaml for the sections a job needs")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a job spec must be a YAML mapping of sections, got {type(raw).__name__}")
    return raw


def read_job_file(path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A job file's mapping without its ``sweep:`` section (:mod:`raytrn.sweep`), and that section (None: none)."""
    raw = read_job_mapping(path)
    return raw, raw.pop("sweep", None)


def set_value(raw: dict[str, Any], key: str, value: Any, *, where: str) -> None:
    """Set the dotted ``key`` of a raw job mapping to ``value``, creating sections on the way."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def check_field_value(key: str, value: Any, *, where: str) -> None:
    """ConfigError when ``value`` is not one the job-spec field ``key`` takes on its own (its type and its range;
    checks across fields are the job's)."""
    from typing import Annotated

    from pydantic import TypeAdapter

    info = field_info(key)
    form: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    adapter: Any = TypeAdapter(form)
    try:
        adapter.validate_python(value)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where}: {msg} (got {reprlib.repr(value)})") from None


def field_annotation(key: str) -> Any:
    return field_info(key).annotation


def field_info(key: str) -> Any:
    """The pydantic FieldInfo of the job-spec field ``key`` (``"optim.lr"``); a ConfigError (to be prefixed with where
    the key came from) naming the closest field when there is no such field (did-you-mean, as ``--set``)."""
    model: type[BaseModel] = JobSpec
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {(f.alias or n): f for n, f in model.model_fields.items() if n != "source"}
        if part not in fields:
            prefix = ".".join(parts[:i])
            near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            hint = (
                f"Did you mean '{prefix + '.' if prefix else ''}{near[0]}'?"
                if near
                else f"Known fields{' of ' + prefix if prefix else ''}: {', '.join(fields)}."
            )
            raise ConfigError(f"unknown field. {hint}")
        if i == len(parts) - 1:
            return fields[part]
        section = _section_model(fields[part].annotation)
        if section is None:
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        model = section
    return None  # pragma: no cover - the loop returns


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The section model in an annotation (``LoraConfig | None`` -> ``LoraConfig``), else None."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _with_init_from(raw: dict[str, Any], base_dir: str, *, source: str) -> dict[str, Any]:
    """``model.init_from``'s config.json merged into the model section (the job's own values must agree)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str):
        return raw
    from raytrn.models.hf import merge_config

    location = model["init_from"]
    if "://" in location:
        # Remote: read where the job starts (the cluster has the credentials), not where it is written or validated
        # (raytrn.train.checks.check_init_from); the job gives the sizes.
        if model.get("preset") is None and model.get("hidden_size") is None:
            raise ConfigError(
                f"{source}: model.init_from {location} is remote: give the model's sizes in the job (model.preset, or "
                "hidden_size, num_layers, ...); its config.json is checked against them when the job starts"
            )
        return raw
    location = os.path.abspath(os.path.join(base_dir, os.path.expanduser(location)))
    return {**raw, "model": merge_config(model, location, where=source)}


def read_config_text(path: str, *, what: str, examples: str) -> str:
    """A config file's text, or a ConfigError saying what is wrong with the path (or its size)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_FILE_BYTES + 1)
        if len(data) > MAX_JOB_FILE_BYTES:
            raise ConfigError(
                f"{path}: {what} is larger than {MAX_JOB_FILE_BYTES >> 20} MiB; is this the right file? "
                f"(shipped examples are in {examples})"
            )
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found (check the path; shipped examples are in {examples})") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.__class__.__name__}: {e}") from None


def safe_load_yaml(text: str, where: str, *, documents: bool = False) -> Any:
    """``yaml.safe_load`` (or ``safe_load_all`` as a list) with bounded work: a syntax error, nesting too
    deep for the parser, or aliases that expand to more than :data:`MAX_SPEC_VALUES` values is one ConfigError."""
    try:
        data = [d for d in yaml.safe_load_all(text) if d is not None] if documents else yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise yaml_syntax_error(where, e) from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply to be a config file") from None
    check_size(data, where)
    return data


def check_size(data: Any, where: str, limit: int = MAX_SPEC_VALUES, max_depth: int = 64) -> None:
    """ConfigError when ``data`` (YAML/JSON values, aliases expanded) holds more than ``limit`` values or nests
    deeper than ``max_depth``: a config file is small, and everything that walks it must stay bounded."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limit:
            raise ConfigError(
                f"{where}: more than {limit:,} values (YAML anchors and aliases expanded); a config file is much "
                "smaller: check for aliases that repeat large sections"
            )
        if depth > max_depth:
            raise ConfigError(f"{where}: nested more than {max_depth} levels deep; a config file is much flatter")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node)
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)


def yaml_syntax_error(path: str, e: yaml.YAMLError) -> ConfigError:
    """``file:line:col: YAML syntax error: ...`` for a YAML parse error."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
    problem = getattr(e, "problem", None) or str(e)
    return ConfigError(f"{where}: YAML syntax error: {problem}")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> set[str]:
    """Apply ``a.b=value`` strings in place (value parsed as YAML); return the overridden paths."""
    done: set[str] = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set optim.lr=3e-4")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except (yaml.YAMLError, RecursionError):
            parsed = value
        check_size(parsed, f"--set {key}")
        set_value(raw, key, parsed, where=f"--set {item!r}")
        done.add(key)
    return done


def parse_job(
    raw: dict[str, Any],
    *,
    source: str = "<job>",
    overridden: set[str] | frozenset[str] = frozenset(),
    labels: dict[str, str] | None = None,
) -> JobSpec:
    """Validate a raw mapping into a JobSpec, turning pydantic errors into one ConfigError."""
    check_size(raw, source)
    lines = []
    if "source" in raw:  # not a YAML field: it would be silently replaced by the file name
        lines.append(_describe_error({"loc": ("source",), "type": "extra_forbidden", "msg": ""}, raw, overridden))
    try:
        job = JobSpec.model_validate({**raw, "source": source})
    except ValidationError as e:
        lines += [_describe_error(err, raw, overridden, labels) for err in e.errors()]
    if lines:
        head = f"{source}: " if len(lines) == 1 else f"{source}: {len(lines)} problems:\n  "
        raise ConfigError(head + "\n  ".join(lines))
    return job


def resolve_mlflow_uri(uri: str | None = None, base_dir: str = ".") -> str:
    """``uri`` > $MLFLOW_TRACKING_URI > ``sqlite:///mlruns/mlflow.db``, with local paths made absolute."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlruns/mlflow.db"

    def absolute(p: str) -> str:
        return os.path.abspath(os.path.join(base_dir, os.path.expanduser(p)))

    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + absolute(uri[len("sqlite:///") :])
    if not _URI_SCHEME.match(uri) and uri != "databricks":  # a bare path: MLflow's file store
        return absolute(uri)
    return uri


def relative_local_paths(job: JobSpec) -> dict[str, str]:
    """The fields of an unresolved job (``load_job(..., resolve=False)``) that name a local path relative to
    the directory the job runs in (or to a home directory): ``{field: value}``. On a cluster that directory is
    a temporary copy of the uploaded working dir, so such a path points at nothing, or at files lost when the
    job ends. ``tracking.mlflow_uri: null`` is not listed: it is decided where the job runs."""
    candidates = {
        "model.init_from": job.model.init_from or "",
        "data.manifest": job.data.manifest,
        "data.validation": job.data.validation if job.data.validation != "none" else "",
        "checkpoint.storage": job.checkpoint.storage,
        "neuron.compile_cache": job.neuron.compile_cache,
    }
    out = {k: v for k, v in candidates.items() if v and _is_relative_path(v)}
    uri = job.tracking.mlflow_uri
    if uri and _is_relative_path(uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri):
        out["tracking.mlflow_uri"] = uri
    return out


def _is_relative_path(value: str) -> bool:
    return not _URI_SCHEME.match(value) and not os.path.isabs(value)


def resolve_paths(job: JobSpec, base_dir: str) -> JobSpec:
    """Make local paths absolute (workers do not share the driver's cwd); leave URIs alone."""

    def absolute(p: str) -> str:
        return p if "://" in p else os.path.abspath(os.path.join(base_dir, os.path.expanduser(p)))

    tracking = {"mlflow_uri": resolve_mlflow_uri(job.tracking.mlflow_uri, base_dir), "run_name": job.run_name}
    return job.model_copy(
        update={
            "model": job.model.model_copy(
                update={"init_from": absolute(job.model.init_from) if job.model.init_from else None}
            ),
            "data": job.data.model_copy(
                update={
                    "manifest": absolute(job.data.manifest),
                    "validation": absolute(v) if (v := job.data.validation) and v != "none" else v,
                }
            ),
            "checkpoint": job.checkpoint.model_copy(update={"storage": absolute(job.checkpoint.storage)}),
            "tracking": job.tracking.model_copy(update=tracking),
        }
    )


# ---------------------------------------------------------------------------------------------------
# Error messages


def _describe_error(
    err: Any, raw: dict[str, Any], overridden: set[str] | frozenset[str], labels: dict[str, str] | None = None
) -> str:
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    path = ".".join(loc)
    if not path:  # a cross-section check: its message names the fields
        return err["msg"].removeprefix("Value error, ")
    where = path
    if _is_overridden(path, overridden):
        where = next((label for key, label in (labels or {}).items() if _is_overridden(path, {key})), f"--set {path}")
    kind = err["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        choices = [f.alias or n for n, f in model.model_fields.items() if n != "source"] if model else []
        near = difflib.get_close_matches(loc[-1], choices, n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else f" Known fields: {', '.join(choices)}."
        return f"{where}: unknown field.{hint}"
    if kind == "missing":
        return f"{where}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = reprlib.repr(err.get("input"))
    if kind.endswith("_parsing") or kind.endswith("_type") or kind == "literal_error":
        return f"{where}: {msg} (got {got})"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
        return f"{where}: {msg.lower()} (got {got})"
    return f"{where}: {msg}"


def _is_overridden(path: str, overridden: set[str] | frozenset[str]) -> bool:
    return any(path == o or path.startswith(o + ".") or o.startswith(path + ".") for o in overridden)


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
