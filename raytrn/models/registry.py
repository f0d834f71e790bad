"""The model side of the family registry: what a family's folder, ``raytrn/models/<family>/``, gives the rest of
raytrn (:class:`ModelSpec`), and :func:`model_spec`, which finds it.

The families are the rows of :data:`raytrn.config.families.FAMILIES` (the one list: the config layer reads it
without the models); each row's name is its folder's. A folder's ``__init__`` exports ``SPEC``, built from its own
modules: ``model.py`` (what of the shared decoder, :mod:`raytrn.models.decoder`, the family uses), ``parallelize.py``
(its tensor-parallel plan, expert parallelism, where pipeline stages would be cut), ``hf.py`` (its Hugging Face
adapter: architecture, ``config.json``, parameter names) and ``estimate.py`` (its memory and FLOPs terms).

A family's folder imports no torch at import time (torch only where a model is built or laid out): ``raytrn
estimate`` reads a family's terms in well under a second.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrn.config.families import FAMILIES

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from raytrn.config import ModelConfig
    from raytrn.models.decoder import Decoder


@dataclass(frozen=True, kw_only=True)
class LayerParams:
    """One decoder layer's parameters, by how layouts and the FLOPs count treat them."""

    #: The q, k, v and o projections (split over TP).
    attention: int
    #: Every MLP parameter: a dense MLP's, or a MoE layer's router and all its experts.
    mlp: int
    #: The MLP parameters a token is computed with (a MoE layer's router and top-k experts; ``mlp`` when dense).
    active_mlp: int
    #: The layer's norm weights (replicated over TP).
    norms: int
    #: Stacked experts: split over the data-parallel ranks only (expert parallelism or FSDP), replicated over TP.
    experts: int = 0
    #: A MoE router's weight (replicated over TP).
    router: int = 0


@dataclass(frozen=True, kw_only=True)
class LayerActivations:
    """What one decoder layer keeps for backward, in elements a token (the compute dtype's), beside the
    hidden-size tensors every layer keeps (the residual input and both norms' inputs and outputs:
    :func:`raytrn.estimate.memory.activation_bytes`)."""

    #: Attention's tensors (split over TP where the heads are).
    attention: int
    #: The MLP's.
    mlp: int
    #: What the MLP no longer keeps when it is frozen (LoRA adapting attention only).
    frozen_mlp: int = 0


def _no_renames(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Parameters named as the Hugging Face checkpoint names them."""
    yield from tensors


def _nothing_more(cfg: ModelConfig) -> dict[str, Any]:
    """No ``config.json`` key beyond what the transformers config class writes."""
    return {}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A family's model, parallelization, Hugging Face adapter and estimate terms (torchtitan's ``TrainSpec``)."""

    name: str
    # -- the model (model.py)
    #: The family's decoder (``Decoder``, not yet initialised): :func:`raytrn.models.build.build_model` seeds, wraps
    #: and initialises it.
    build_decoder: Callable[[ModelConfig], Decoder]
    # -- parallelization (parallelize.py)
    #: Tensor parallelism over a TP mesh: ``(model, tp_mesh, tie_word_embeddings)``.
    tensor_parallel: Callable[[nn.Module, DeviceMesh, bool], None]
    #: Expert parallelism over the experts' mesh (:func:`raytrn.models.expert_parallel.expert_mesh`); None: dense.
    expert_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None
    # -- the Hugging Face adapter (hf.py)
    #: The transformers class an export names in ``config.json`` (``architectures``).
    architecture: str
    #: The transformers config of a ``model`` section (the export's ``config.json``).
    hf_config: Callable[[ModelConfig], Any]
    #: The export's ``config.json`` keys beyond what ``hf_config`` writes.
    export_config: Callable[[ModelConfig], dict[str, Any]] = _nothing_more
    #: ``(name, tensor)`` pairs of the model's state as the family's published checkpoints name and shape them.
    hub_tensors: Callable[[Iterable[tuple[str, Any]]], Iterator[tuple[str, Any]]] = _no_renames
    # -- estimate terms (estimate.py)
    layer_params: Callable[[ModelConfig], LayerParams]
    #: ``(cfg, tensor_parallel_size)`` -> one layer's activations a token.
    layer_activations: Callable[[ModelConfig, int], LayerActivations]


def model_spec(family: str) -> ModelSpec:
    """The registered family's :class:`ModelSpec`: ``raytrn.models.<family>.SPEC``, its folder imported on first
    use (by name: the registry's row names the folder). ValueError for a family not in the registry."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not registered ({', '.join(FAMILIES)}: raytrn.config.families)")
    spec = importlib.import_module(f"{__package__}.{family}").SPEC
    assert isinstance(spec, ModelSpec) and spec.name == family, f"raytrn.models.{family}.SPEC is not {family}'s"
    return spec
