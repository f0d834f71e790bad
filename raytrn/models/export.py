"""The Hugging Face export of a model of any family (``config.json`` + ``model.safetensors``, loadable with
``AutoModelForCausalLM.from_pretrained``), streamed tensor by tensor. What differs by family comes from its adapter
(``raytrn/models/<family>/hf.py``, through :func:`raytrn.models.registry.model_spec`): the transformers config, the
architecture named, ``config.json``'s extra keys, the parameters' names and shapes in its published checkpoints.

Also here: :func:`hub_tensors`, the shared MoE block's stacked experts as the published checkpoints hold them (a MoE
family's adapter exports with it; ``model.init_from`` reads with it, :mod:`raytrn.models.hf`). Used only where
``transformers`` is wanted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from raytrn.models.registry import model_spec

if TYPE_CHECKING:
    from raytrn.config import ModelConfig


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config of a ``model`` section, of its family's class (``LlamaConfig``, ``Qwen3Config``, ...)."""
    return model_spec(cfg.family).hf_config(cfg)


def hf_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config's keyword arguments every family takes from its ``model`` section (its adapter adds
    its class's own)."""
    # rope_theta in the 4.x keyword form: transformers 5 folds it into rope_parameters, and the
    # Neuron DLAMI's venvs may still carry 4.x.
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="sdpa",
        use_cache=False,
    )


def save_hf(
    cfg: ModelConfig, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], out_dir: str | None, *, specs: Any = None
) -> None:
    """Write a model's state (of :func:`raytrn.models.build_model`'s model) as a Hugging Face checkpoint of its
    family: ``config.json`` + ``model.safetensors``, loadable with ``AutoModelForCausalLM.from_pretrained``.

    ``tensors``: a state dict, or (name, CPU tensor) pairs arriving one at a time (a sharded model gathered
    tensor by tensor: only one full tensor is in memory at a time), with ``specs`` {name: (dtype, shape)} in
    the same order. ``out_dir=None`` only consumes the pairs (a rank that takes part in the gathers but does not
    write). A tied output head is written once, as the embedding (HF re-ties it). The tensors are named and shaped
    as the family's published checkpoints are (its adapter's ``hub_tensors``: a MoE model's stacked experts one
    expert at a time).
    """
    adapter = model_spec(cfg.family)
    if isinstance(tensors, Mapping):
        specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        tensors = tensors.items()
    assert specs is not None, "specs are needed for streamed tensors"
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    specs = {n: (dtype, tuple(t.shape)) for n, t, dtype in _hub_specs(specs, adapter.hub_tensors) if n not in skip}
    written = write_safetensors(None if out_dir is None else os.path.join(out_dir, "model.safetensors"), specs,
                                ((n, t) for n, t in adapter.hub_tensors(tensors) if n not in skip))  # fmt: skip
    if out_dir is None or not written:
        return
    config = adapter.hf_config(cfg)
    dtypes = {dtype for dtype, _ in specs.values()}
    config.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    config.architectures = [adapter.architecture]
    config.save_pretrained(out_dir)
    extra = adapter.export_config(cfg)
    if extra:  # keys transformers' class writes otherwise, or not at all (its adapter says why)
        import json

        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            written = json.load(f)
        written.update(extra)
        with open(path, "w") as f:
            json.dump(written, f, indent=2, sort_keys=True)
            f.write("\n")


def _hub_specs(
    specs: Mapping[str, tuple[Any, tuple[int, ...]]],
    rename: Callable[[Iterable[tuple[str, Any]]], Iterator[tuple[str, Any]]],
) -> Iterator[tuple[str, Any, Any]]:
    """``rename`` (an adapter's ``hub_tensors``) on specs: ``(name, a meta tensor of the shape, dtype)``."""
    import torch

    meta = ((name, torch.empty(shape, dtype=dtype, device="meta")) for name, (dtype, shape) in specs.items())
    for name, tensor in rename(meta):
        yield name, tensor, tensor.dtype


#: A MoE layer's stacked experts (raytrn's and transformers 5's names).
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def hub_tensors(tensors: Iterable[tuple[str, Any]], *, first_expert: int = 0) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs with each stacked-experts tensor split into the published checkpoints' per-expert
    ones (what transformers 4 and 5, and serving engines, load): ``gate_up_proj`` [E, 2I, H] into
    ``experts.{e}.gate_proj.weight`` and ``up_proj.weight`` [I, H]; ``down_proj`` [E, H, I] into
    ``experts.{e}.down_proj.weight``. Other tensors pass as they are. ``first_expert``: the number of the
    tensors' first expert (a shard of the experts)."""
    for name, tensor in tensors:
        prefix, stacked = split_stacked(name)
        if stacked is None:
            yield name, tensor
        elif stacked == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{first_expert + e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}.{first_expert + e}.up_proj.weight", tensor[e, half:]
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{first_expert + e}.down_proj.weight", tensor[e]


def split_stacked(name: str) -> tuple[str, str | None]:
    """``("model.layers.3.mlp.experts", "gate_up_proj")`` for a stacked-experts tensor, ``(name, None)`` else."""
    for stacked in _STACKED:
        if name.endswith("." + stacked) or name == stacked:
            experts, _, kind = stacked.rpartition(".")
            return name[: len(name) - len(stacked)] + experts, kind
    return name, None


_SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def write_safetensors(path: str | None, specs: dict[str, Any], tensors: Iterable[tuple[str, Any]]) -> bool:
    """Stream tensors into a ``.safetensors`` file: the header from ``specs`` {name: (dtype, shape)} first, then
    each tensor's bytes as it arrives (in ``specs``' order). Every item is consumed even when writing fails or
    ``path`` is None (the producer may be a collective gather); returns whether the file was written, and
    re-raises a write error once all items are consumed."""
    import json
    import math
    import struct

    import torch

    header, start = {}, 0
    for name, (dtype, shape) in specs.items():
        size = math.prod(shape) * _element_size(dtype)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[str(dtype)],
            "shape": list(shape),
            "data_offsets": [start, start + size],
        }
        start += size
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    error: BaseException | None = None
    f = None
    try:
        if path is not None:
            f = open(path, "wb")
            f.write(struct.pack("<Q", len(blob)) + blob)
        for name, tensor in tensors:
            expected = specs.get(name)
            if expected is None or tuple(tensor.shape) != tuple(expected[1]) or tensor.dtype != expected[0]:
                raise ValueError(
                    f"{name}: tensor {tuple(tensor.shape)} {tensor.dtype} does not match its spec {expected}"
                )
            if f is not None and error is None:
                try:
                    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(memoryview(data))
                except OSError as e:  # keep consuming: the other ranks are still gathering
                    error = e
    finally:
        if f is not None:
            f.close()
    if error is not None:
        raise error
    return f is not None


def _element_size(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())
