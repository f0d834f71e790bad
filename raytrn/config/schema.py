"""The job spec's schema: one pydantic model per section (model, data, optim, scaling, checkpoint, tracking,
run, parallel, neuron), typed and range-checked, every field described. The model section (its families, presets
and Hugging Face checkpoints) is :mod:`raytrn.config.model`'s, the parallel and neuron sections
:mod:`raytrn.config.parallel`'s.

Every section has ``extra="forbid"``; reading a YAML file into a :class:`JobSpec` is :mod:`raytrn.config.load`'s,
and ``docs/job-spec.md`` is rendered from these classes by :mod:`raytrn.config.reference`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from raytrn.config.evals import EvalConfig as EvalConfig  # the eval section: its own module
from raytrn.config.families import moe_families
from raytrn.config.model import LoraConfig as LoraConfig  # the model section: its own module
from raytrn.config.model import ModelConfig as ModelConfig
from raytrn.config.parallel import NeuronConfig as NeuronConfig  # the parallel and neuron sections: their own module
from raytrn.config.parallel import ParallelConfig as ParallelConfig
from raytrn.config.section import Section
from raytrn.errors import ConfigError

Accelerator = Literal["cpu", "cuda", "neuron", "neuron-xla", "xla-cpu"]

#: The most workers a job may ask for (see raytrn.config.sizes).
MAX_WORKERS = 100_000
#: Run names become directory names under checkpoint.storage: one path component, no "..", no "/".
RUN_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}\Z")  # \Z: "$" also matches before a final newline


class DataConfig(Section):
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


class OptimConfig(Section):
    """AdamW with linear warmup, then cosine decay (or warmup-stable-decay) to ``lr * min_lr_ratio``."""

    lr: float = Field(..., gt=0, le=1e3, allow_inf_nan=False, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of the peak")
    warmup_steps: int = Field(
        0, ge=0, le=10**12, description="steps over which the lr rises linearly from lr / warmup_steps to lr"
    )
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
    weight_decay: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="AdamW decoupled weight decay, on weight matrices and embeddings (not norms)",
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, lt=1, description="AdamW epsilon (added to the denominator)")
    grad_clip_norm: float | None = Field(
        1.0, gt=0, allow_inf_nan=False, description="max global grad norm; null disables clipping"
    )
    fused: bool = Field(
        False,
        description="fused AdamW kernel (torch.optim.AdamW(fused=True)); a non-finite step's update is then skipped "
        "on the device, with no host sync; cuda only, ignored with a warning elsewhere",
    )

    @model_validator(mode="after")
    def _check_betas(self) -> OptimConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas must each be in [0, 1), got {list(self.betas)}")
        return self


class ScalingConfig(Section):
    """Where workers run: one per CPU slot, GPU or NeuronCore; elastic between min and max."""

    accelerator: Accelerator = Field(
        "cpu",
        description="the device workers train on: cpu, cuda, neuron (TorchNeuron, trn2/trn3), neuron-xla (the "
        "frozen torch-xla path, trn1) or xla-cpu (torch-xla on CPU, for tests)",
    )
    min_workers: int = Field(
        1, gt=0, description="the fewest workers the job trains with (without max_workers: its fixed size)"
    )
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
    recovery: Literal["restart", "live"] = Field(
        "restart",
        description="what a lost worker costs: restart (the group restarts from the in-memory tier or the last "
        "checkpoint) or live (replicas of parallel.data_parallel: hsdp with one worker a replica group: the "
        "survivors keep training, a returning node joins them; docs/elasticity.md 'Live recovery')",
    )
    peer_timeout_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="recovery: live: how long a collective waits for a frozen peer before it counts as lost, and how "
        "long a worker may leave Ray Train's health checks unanswered before it is killed and replaced",
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
            if not 0 < val < 1e9:
                hint = " (leave a resource out rather than ask for 0 of it: Ray places such workers without limit)"
                raise ValueError(
                    f"resources_per_worker.{key} must be > 0 and finite, got {val}{hint if val == 0 else ''}"
                )
        return self

    @property
    def max_size(self) -> int:
        """The largest worker count (``max_workers``; ``min_workers`` for a fixed size)."""
        return self.max_workers or self.min_workers

    @property
    def elastic(self) -> bool:
        return self.max_size != self.min_workers


class CheckpointConfig(Section):
    """Sharded checkpoints (torch.distributed.checkpoint) of the run, under ``storage``; a resume continues from the
    newest committed one."""

    storage: str = Field("checkpoints", min_length=1, description="local directory or s3://bucket/prefix")
    every_n_steps: Annotated[int, Field(gt=0, le=10**12)] | Literal["auto"] = Field(
        100,
        description="save every N optimizer steps (and at the last step); auto: the interval that loses least to "
        "failures (Young/Daly, from raytrn estimate's save time, step time and node MTBF), chosen when the run "
        "starts and logged with its inputs as params",
    )
    keep_last: int | None = Field(3, gt=0, le=10**6, description="checkpoints kept; null keeps all")

    @property
    def interval(self) -> int:
        """``every_n_steps`` as a number: ``auto`` is chosen by the driver before any worker starts
        (:func:`raytrn.estimate.job.resolve_auto_interval`)."""
        assert isinstance(self.every_n_steps, int), "checkpoint.every_n_steps: auto was not resolved by the driver"
        return self.every_n_steps

    keep_best: bool = Field(
        False,
        description="also keep the committed checkpoint with the lowest val_loss (evaluated at its step: evaluate at "
        "checkpoint steps) when keep_last would delete it",
    )
    max_consecutive_failures: int = Field(
        3,
        gt=0,
        le=10**6,
        description="saves in a row that may fail on the storage (each a warning; training goes on) before the job "
        "stops with the error rather than train on without checkpoints",
    )
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
    memory_every_n_steps: int | None = Field(
        None,
        ge=0,
        le=10**12,
        description="in-memory snapshots every N steps and at each checkpoint (raytrn.checkpoint.memory): each rank's shards in host memory "
        "on its node and on memory_replicas other nodes; a restart resumes from the newest complete one when it is "
        "at least as new as the newest checkpoint; written in the background while the next step trains. null (the "
        "default): every step while the worker group spans more than one node (off on one node, and for "
        "neuron-xla; under scaling.recovery: live, on more than one node, the live rank 0's snapshot of its whole "
        "replica at each checkpoint step, for a restart after every replica was lost); 0: off",
    )
    memory_replicas: int = Field(
        1, ge=0, le=16, description="other nodes that keep a copy of each node's snapshot (the next ones on a ring)"
    )
    memory_store_gib: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="each node's snapshot store's bound, in shared memory and its Ray object store (the complete "
        "snapshot and the one being made; one that does not fit is skipped, warned): null: 1/4 of the memory or 1/3 of the object store",
    )


class TrackingConfig(Section):
    """MLflow: the run's params, metrics, system metrics, cost and final model; the run name."""

    enabled: bool = Field(True, description="log to MLflow; false: no MLflow run at all")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db"
    )
    experiment: str = Field("raytrn", min_length=1, description="MLflow experiment the run is logged under")
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
    register_: Literal["best", "last", "none"] | None = Field(
        None,
        alias="register",
        description="what goes into the MLflow model registry under registered_model, with the alias 'candidate': "
        "'best' the checkpoint with the lowest val_loss (its model exported off the training loop; the alias moves "
        "when a later checkpoint is better, and not to a version worse than another run's candidate on the same "
        "validation set), 'last' the final model, 'none' nothing. null: 'last' when "
        "registered_model is set, else 'none'",
    )
    registered_model: str | None = Field(
        None,
        min_length=1,
        validation_alias=AliasChoices("registered_model", "register_model"),
        description="the registered model's name (register_model: its former spelling, still read)",
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

    @property
    def registers(self) -> str:
        """``register`` with its default resolved: best, last or none."""
        return self.register_ or ("last" if self.registered_model else "none")

    @model_validator(mode="after")
    def _check_register(self) -> TrackingConfig:
        if self.registers != "none" and not self.registered_model:
            raise ValueError(f"register: {self.registers} needs registered_model: the name to register under")
        if self.registers == "last" and not self.log_model:
            raise ValueError("register: last needs log_model: true (the registry points at the logged model)")
        return self


class RunConfig(Section):
    """How long the job trains, its seed, and how often it reports and evaluates."""

    max_steps: int = Field(
        ..., gt=0, le=10**12, description="optimizer steps in total (a resumed run continues to this)"
    )
    seed: int = Field(
        0, ge=0, lt=2**63, description="seeds torch (initial weights, LoRA adapters, dropout) and the data order"
    )
    log_every: int = Field(10, gt=0, le=10**12, description="report metrics every N steps")
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        le=10**7,
        description="a worker that completes no step for this long (an evaluation or a checkpoint: 10x this) dumps "
        "every thread's stack into <run>/hangs/ and the MLflow run, and ends: Ray Train restarts the group; null: 10x "
        "the median step time, at least 300 s (not before the first step)",
    )
    max_nonfinite_steps: int = Field(
        3,
        gt=0,
        le=10**6,
        description="steps in a row whose loss or gradient norm is NaN/inf (each skips its optimizer update and is "
        "counted as nonfinite_steps) before run.on_nonfinite acts",
    )
    on_nonfinite: Literal["rollback", "fail"] = Field(
        "rollback",
        description="after run.max_nonfinite_steps non-finite steps in a row: rollback (once per job: the worker group "
        "restarts from the newest committed checkpoint and skips those steps' global batches; the run stops if it "
        "diverges again) or fail (the run stops at once); a stopped run ends FAILED with the steps named",
    )
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
        description="glibc malloc settings on the training workers, set by each worker before its training thread "
        "starts (one arena, blocks up to 1 GB from the heap, free memory kept): the step's activations stop "
        "page-faulting in every step when Ray Train runs the loop in a thread. "
        "Default: on for cpu, off elsewhere. An allocator setting of your own (MALLOC_*, GLIBC_TUNABLES, a "
        "preloaded jemalloc/tcmalloc) wins. See raytrn.backends.host_malloc",
    )


class JobSpec(Section):
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
    eval: EvalConfig = EvalConfig()

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
        off_loop = [x for x, on in (("eval.tasks", bool(self.eval.tasks)),
                                    ("tracking.register: best", self.tracking.registers == "best")) if on]  # fmt: skip
        if off_loop and self.scaling.accelerator in ("neuron-xla", "xla-cpu"):
            raise ValueError(
                f"{' and '.join(off_loop)} with scaling.accelerator {self.scaling.accelerator}: the frozen XLA path's "
                "checkpoints are not the sharded ones an evaluation exports; use register: last (the final model), "
                "or the neuron (TorchNeuron) backend"
            )
        if self.model.is_moe:
            self._check_moe()
        elif self.parallel.expert_parallel_size > 1:
            raise ValueError(
                f"parallel.expert_parallel_size {self.parallel.expert_parallel_size} with model.family "
                f"{self.model.family}: a dense model has no experts to spread; remove it (or use model.family: "
                f"{' or '.join(moe_families())})"
            )
        return self

    def _check_moe(self) -> None:
        """What a Qwen3-MoE model can train with: data parallelism (DDP or FSDP), tensor parallelism of attention (the
        experts replicated over the TP group), expert parallelism under FSDP (the experts spread over
        ``expert_parallel_size`` data-parallel ranks), the dropless dispatch on cpu and cuda, the capacity dispatch
        (fixed shapes) on neuron (the XLA path refuses every family but Llama itself)."""
        ep, experts = self.parallel.expert_parallel_size, self.model.num_experts or 0
        if experts % ep:
            raise ValueError(
                f"parallel.expert_parallel_size {ep} does not divide model.num_experts ({experts}): every rank of an "
                f"expert-parallel group holds the same number of experts; use a divisor of {experts}"
            )
        if ep > 1 and self.parallel.data_parallel == "ddp":
            raise ValueError(
                f"parallel.expert_parallel_size {ep} needs parallel.data_parallel: fsdp or hsdp (DDP would replicate "
                "the experts EP spreads, and reduce their gradients over the wrong ranks); set data_parallel: fsdp"
            )
        if ep > 1 and self.model.lora is not None:
            raise ValueError(
                f"model.lora with parallel.expert_parallel_size {ep}: LoRA adapts attention and keeps the experts "
                "frozen; train it without expert parallelism (data_parallel: fsdp shards the frozen experts)"
            )
        if self.scaling.accelerator == "neuron" and self.model.moe_capacity_factor is None:
            raise ValueError(
                f"model.family {self.model.family} on scaling.accelerator neuron needs model.moe_capacity_factor (e.g. 1.25): "
                "the dropless dispatch's shapes follow the routing, and on Neuron every new shape is a new compile"
            )

    @property
    def reads_checkpoints_off_loop(self) -> bool:
        """Whether committed checkpoints are read off the training loop (``eval.tasks``, or ``register: best``'s
        exports): the driver starts the evaluator (:mod:`raytrn.evals.runner`) and rank 0 pins each checkpoint for
        it (:mod:`raytrn.checkpoint.pins`); the two must agree, so both ask this."""
        return bool(self.eval.tasks) or self.tracking.registers == "best"

    @property
    def run_name(self) -> str:
        """The fixed run name, or a new timestamped one (fixed for the job by ``resolve_paths``)."""
        if self.tracking.run_name:
            return self.tracking.run_name
        stem = re.sub(r"[^A-Za-z0-9._=+-]+", "-", Path(self.source).stem).strip(".-")[:180] or "job"
        return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    def flat(self) -> dict[str, Any]:
        """The spec as ``{"optim.lr": 0.001, ...}`` (for MLflow params), named as the YAML names them
        (``checkpoint.async``, not the attribute ``async_``)."""
        return _flatten(self.model_dump(mode="json", by_alias=True))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
