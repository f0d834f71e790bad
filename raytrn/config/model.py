"""The job spec's ``model`` section: the decoder's family (a row of :mod:`raytrn.config.families`) and sizes (filled
by a preset, :mod:`raytrn.config.presets`, or by ``init_from``'s config.json, :mod:`raytrn.config.hf_config`), its
dtype and precision, and LoRA.

Re-exported by :mod:`raytrn.config.schema` with the other sections.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrn.config.families import FAMILIES, Family, moe_families
from raytrn.config.hf_config import rope_scaling
from raytrn.config.presets import PRESETS
from raytrn.config.section import Section
from raytrn.errors import ConfigError


class LoraConfig(Section):
    """Low-rank adapters (raytrn.models.lora): only they train; the base model stays as init_from gave it."""

    rank: int = Field(8, gt=0, le=4096, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False, description="scale: the update is (alpha / rank) * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="linear layers to adapt, by name: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    )


def _listed(names: list[str]) -> str:
    """``a, b or c``."""
    return "".join(names) if len(names) < 2 else f"{', '.join(names[:-1])} or {names[-1]}"


class ModelConfig(Section):
    """A decoder of one of the model families (``family``), sized as its Hugging Face config.json is. ``preset`` or
    ``init_from``'s config.json fills the sizes (the required ones too); explicit fields win over a preset and must
    match init_from."""

    family: Family = Field(
        "llama",
        description="model family: "
        + _listed([f"{name} ({spec.summary})" for name, spec in FAMILIES.items()])
        + "; a preset or init_from's config.json sets it",
    )
    preset: str | None = Field(None, description=f"named size (raytrn.config.presets): {', '.join(PRESETS)}")
    hidden_size: int = Field(..., gt=0, le=1 << 18, description="model width")
    intermediate_size: int = Field(..., gt=0, le=1 << 20, description="MLP width")
    num_layers: int = Field(..., gt=0, le=4096, description="decoder layers")
    num_attention_heads: int = Field(..., gt=0, le=4096, description="attention heads; must divide hidden_size")
    num_key_value_heads: int | None = Field(None, gt=0, le=4096, description="GQA kv heads; default = attention heads")
    head_dim: int | None = Field(
        None, gt=0, le=4096, description="width of an attention head; default hidden_size / num_attention_heads"
    )
    vocab_size: int = Field(..., gt=0, le=1 << 24, description="must be >= the dataset tokenizer's vocabulary")
    max_position_embeddings: int = Field(2048, gt=0, le=1 << 24, description="must be >= data.seq_len")
    rope_theta: float = Field(10000.0, gt=0, allow_inf_nan=False, description="RoPE base frequency")
    rms_norm_eps: float = Field(1e-5, gt=0, lt=1, description="epsilon of the RMSNorm layers")
    tie_word_embeddings: bool = Field(False, description="the output layer shares the input embedding's matrix")
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Llama 3.x RoPE scaling ({rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings}); from config.json with init_from; null: the default RoPE",
    )
    num_experts: int | None = Field(None, gt=0, le=1 << 16, description="qwen3_moe: routed experts per layer")
    num_experts_per_tok: int | None = Field(
        None, gt=0, le=1 << 16, description="qwen3_moe: experts each token is routed to (top-k); at most num_experts"
    )
    moe_intermediate_size: int | None = Field(None, gt=0, le=1 << 20, description="qwen3_moe: each expert's MLP width")
    norm_topk_prob: bool = Field(
        True, description="qwen3_moe: the top-k routing weights are renormalised to sum to one (Qwen3-MoE's: true)"
    )
    router_aux_loss_coef: float = Field(
        0.001,
        ge=0,
        le=1e3,
        allow_inf_nan=False,
        description="qwen3_moe: weight of the load-balancing loss (HF's load_balancing_loss_func, over every layer) "
        "added to the training loss; 0: none. Logged as router_aux_loss",
    )
    moe_capacity_factor: float | None = Field(
        None,
        gt=0,
        le=1e3,
        allow_inf_nan=False,
        description="qwen3_moe: null: dropless (every token reaches its experts; shapes follow the routing, for cpu "
        "and cuda); c: each expert takes ceil(c * tokens * top_k / experts) tokens a micro-batch, the rest dropped "
        "(fixed shapes: the neuron backend needs it, as every new shape is a new compile); logged: moe_dropped_fraction",
    )
    init_from: str | None = Field(
        None,
        description="a Hugging Face checkpoint directory of one of the families (local or s3://): config.json + "
        "*.safetensors; its config gives the family and the sizes (any the job gives must match) and its weights the "
        "starting point",
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
            name = data["preset"]
            if not isinstance(name, str) or name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
            family = PRESETS[name]["family"]
            if data.get("family") is not None and data["family"] != family:
                raise ValueError(
                    f"family {data['family']!r} but preset {name!r} is a {family} model; drop family (the preset "
                    "sets it) or choose a preset of that family"
                )
            return {**PRESETS[name], **data}
        return data

    @property
    def head_size(self) -> int:
        """The width of an attention head: ``head_dim``, else ``hidden_size / num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}), or set head_dim"
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

    @model_validator(mode="after")
    def _check_experts(self) -> ModelConfig:
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.is_moe:
            missing = [f"model.{name}" for name in moe if getattr(self, name) is None]
            if missing:
                preset = next((name for name, p in PRESETS.items() if p["family"] == self.family), None)
                raise ValueError(
                    f"a {self.family} model needs {', '.join(missing)}"
                    + (f" (or a preset: {preset}, ...)" if preset else "")
                )
            if self.num_experts_per_tok > self.num_experts:  # type: ignore[operator]
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) is more than num_experts ({self.num_experts}): "
                    "a token is routed to top-k of the experts"
                )
        else:
            given = [f"model.{name}" for name in (*moe, "moe_capacity_factor") if getattr(self, name) is not None]
            if given:
                experts = _listed(moe_families())
                raise ValueError(f"{', '.join(given)}: only a {experts} model has experts (family is {self.family!r})")
        return self

    @property
    def is_moe(self) -> bool:
        """Routed experts as every MLP (the family's registry row says)."""
        return FAMILIES[self.family].moe

    @property
    def expert_sizes(self) -> tuple[int, int, int]:
        """A MoE model's ``(num_experts, num_experts_per_tok, moe_intermediate_size)`` (set: the validator checks)."""
        sizes = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
        if not self.is_moe or None in sizes:
            raise ValueError(f"model.family {self.family!r} has no experts")
        return sizes  # type: ignore[return-value]

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads
