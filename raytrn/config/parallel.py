"""The job spec's ``parallel`` and ``neuron`` sections: how a model replica is laid out over workers (DDP, FSDP2,
HSDP, tensor, expert, context and pipeline parallelism, activation checkpointing; ZeRO-1 and sequence parallelism on
the frozen XLA path) and the Trainium-only settings.

What a layout needs of the rest of the job (world sizes, nodes, the model's dimensions) is checked by
:mod:`raytrn.config.layout` (and :mod:`raytrn.xla.nxd` on the XLA path); re-exported by
:mod:`raytrn.config.schema` with the other sections.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrn.config.section import Section
from raytrn.config.sizes import MAX_WORKERS


class ParallelConfig(Section):
    """How a model replica is laid out over workers. Defaults: plain data parallelism (DDP)."""

    data_parallel: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp",
        description="ddp: every worker holds the whole model; fsdp: parameters, gradients and optimizer state "
        "sharded over the data-parallel ranks (FSDP2 fully_shard per decoder block and at the root); hsdp: sharded "
        "as fsdp within a shard group of hsdp_shard_size workers, replicated across the groups (gradients "
        "reduce-scattered in the group, then all-reduced across groups)",
    )
    hsdp_shard_size: int | None = Field(
        None,
        gt=0,
        le=MAX_WORKERS,
        description="hsdp: workers in one shard group (consecutive ranks, whole tensor-parallel groups; FSDP shards "
        "over its hsdp_shard_size / TP data-parallel ranks). Must divide every world size the job can take. "
        "Default: one node (scaling.workers_per_node)",
    )
    tensor_parallel_size: int = Field(
        1, gt=0, le=4096, description="workers (consecutive ranks, one node) one model replica is split over"
    )
    expert_parallel_size: int = Field(
        1,
        gt=0,
        le=4096,
        description="qwen3_moe: data-parallel ranks a layer's experts are spread over (each holds num_experts / EP "
        "of them; tokens reach their experts by all-to-all). Taken from the data-parallel ranks: workers / TP must "
        "be a multiple of it (under hsdp, a shard group's data-parallel ranks). Needs data_parallel: fsdp or hsdp",
    )
    context_parallel_size: int = Field(
        1,
        gt=0,
        le=4096,
        description="workers (consecutive ranks, whole tensor-parallel groups) one sequence is split over: each holds "
        "2 of 2 x CP chunks of every row (load-balanced zigzag, padded to a multiple of 2 x CP) and attention runs "
        "as a ring over the group (causal, packed rows' documents kept, RoPE at each token's place). The mesh is "
        "(dp, cp, tp): a group's ranks read the same rows (DP = workers / (CP x TP)); FSDP shards over DP x CP. "
        "Dense models, without pipeline parallelism",
    )
    pipeline_parallel_size: int = Field(
        1,
        gt=0,
        le=64,
        description="stages a model replica is cut into by decoder layers (torch.distributed.pipelining), the "
        "outermost mesh dimension: a rank's stage is rank // (workers / PP); the step's micro-batches "
        "(data.grad_accum, per data-parallel rank) are the pipeline's. Dense or MoE models with untied embeddings",
    )
    pipeline_schedule: Literal[
        "1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
    ] = Field(
        "1f1b",
        description="pipeline_parallel_size > 1: torch.distributed.pipelining's schedule; the interleaved ones hold "
        "2 stages a rank (stage s on rank s mod PP), zbv_zero_bubble and dualpipev 2 in a V (stages r and 2PP-1-r)",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: full (each decoder block keeps only its input), "
        "selective (also keeps matmul and attention outputs); true/false mean full/none",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp, hsdp: free gathered parameters after each block's forward (less memory, more traffic); "
        "not under a zero-bubble pipeline schedule, whose split weight-gradient pass needs them gathered",
    )
    zero1: bool = Field(False, description="neuron XLA path: shard optimizer state over data-parallel ranks (NxD)")
    sequence_parallel: bool = Field(
        False, description="neuron XLA path: shard norm activations along the sequence (TP>1, NxD)"
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _bool_means_full(cls, value: Any) -> Any:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _shard_size_is_hsdps(self) -> ParallelConfig:
        """A shard size without hsdp would be silently ignored: refused."""
        if self.hsdp_shard_size is not None and self.data_parallel != "hsdp":
            raise ValueError(
                f"hsdp_shard_size {self.hsdp_shard_size} with data_parallel {self.data_parallel}: it sizes hsdp's "
                "shard groups; set data_parallel: hsdp, or remove it"
            )
        return self


class NeuronConfig(Section):
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
