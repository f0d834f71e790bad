"""LoRA (``model.lora``): low-rank adapters on chosen linear layers of raytrn's decoder, everything else frozen.

A small module of raytrn's own rather than ``peft``: peft wraps a model by replacing its layers with its own
classes and expects a ``transformers`` model (a ``PreTrainedModel`` with a config) around them; raytrn's decoder is
plain PyTorch and is laid out by ``torch.distributed`` (FSDP2, DTensor) after the adapters are added, which peft's
wrappers are not written for. What raytrn keeps of peft is its arithmetic and its file format:

- ``y = W x + (alpha / rank) * B(A(dropout(x)))``, ``A`` initialised as peft does (Kaiming uniform, a=sqrt(5)), ``B``
  with zeros, so training starts exactly at the base model;
- names: the base weight keeps its Hugging Face name (``...q_proj.weight``), the adapters are ``...q_proj.lora_A.weight``
  and ``...q_proj.lora_B.weight``; the adapter export is a peft adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``, names under ``base_model.model.``) that ``peft.PeftModel.from_pretrained`` loads, and
  the merged export folds ``(alpha / rank) * B A`` into ``W``.

Only the adapters are trainable: the optimizer and the checkpoints hold nothing else (the base weights come from
``model.init_from`` at every start). Works with ddp and fsdp; tensor parallelism is refused (its plans shard the
base linears, which the adapters would have to follow).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrn.errors import ConfigError

if TYPE_CHECKING:
    from raytrn.config import LoraConfig

ADAPTER = (".lora_A.", ".lora_B.")


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` (same parameter name) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int) -> list[str]:
    """Replace the ``cfg.targets`` linears (by their attribute name: ``q_proj``, ``down_proj``...) with
    :class:`LoRALinear` and freeze every other parameter; the names of the adapted modules. ConfigError listing
    the linear layers when a target matches none. Seeded: every rank draws the same ``A``."""
    targets = set(cfg.targets)
    found = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    unknown = sorted(targets - set(found))
    if unknown:
        raise ConfigError(
            f"model.lora.targets: {', '.join(unknown)} match(es) no linear layer of the model; its linear layers are "
            f"{', '.join(found)}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in targets and isinstance(child, nn.Linear) and not isinstance(child, LoRALinear):
                    setattr(module, child_name, LoRALinear(child, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout))
                    adapted.append(f"{name}.{child_name}" if name else child_name)
    return adapted


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapted_weights(names: Iterable[str]) -> set[str]:
    """The base weights (``...q_proj.weight``) of the adapted modules among state-dict ``names``."""
    return {n[: -len(".lora_A.weight")] + ".weight" for n in names if n.endswith(".lora_A.weight")}


def merged_items(
    items: Iterable[tuple[str, torch.Tensor]], scaling: float, bases: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full state items of a LoRA model (a base weight of ``bases``, then its ``lora_A``, ``lora_B``, as state
    dicts order them) with every adapted weight merged (``W + scaling * B A``) and the adapters dropped: a plain
    Llama's tensors, one at a time."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if name in bases or name.endswith(".lora_A.weight"):
            held[name] = tensor
        elif name.endswith(".lora_B.weight"):
            prefix = name[: -len(".lora_B.weight")]
            a, w = held.pop(prefix + ".lora_A.weight"), held.pop(prefix + ".weight")
            yield prefix + ".weight", (w.float() + scaling * (tensor.float() @ a.float())).to(w.dtype)
        else:
            yield name, tensor
    assert not held, f"unmerged LoRA tensors: {sorted(held)}"


def export_specs(specs: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face export's ``{name: (dtype, shape)}`` of a LoRA model: its adapters' names dropped."""
    return {n: s for n, s in specs.items() if not is_adapter(n)}


def save_adapter(
    cfg: LoraConfig, items: Iterable[tuple[str, torch.Tensor]], out_dir: str | None, *, base: str | None
) -> None:
    """A peft adapter directory from a LoRA model's full state items (every rank iterates them: gathers;
    ``out_dir`` None only consumes): ``adapter_config.json`` and ``adapter_model.safetensors``."""
    tensors = {f"base_model.model.{n}": t.contiguous() for n, t in items if is_adapter(n)}
    if out_dir is None:
        return
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
