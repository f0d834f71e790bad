"""Starting from a Hugging Face Llama checkpoint (``model.init_from``): its ``config.json`` as raytrn's model
section, and its safetensors weights loaded into raytrn's decoder in any layout.

- **Config.** ``config.json`` (``model_type: llama``) gives the sizes; a job may omit them, and any it gives
  (or its preset gives) must match, else one error naming the field. RoPE: the default, or Llama 3.x's
  ``llama3`` scaling (honoured: :class:`raytrn.models.decoder.RotaryEmbedding`); any other type is refused.
  Both spellings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (5).
- **Weights.** After the model is laid out (DDP, FSDP2, tensor parallel), every rank loads through DCP's
  Hugging Face reader (``torch.distributed.checkpoint.HuggingFaceStorageReader``): it asks for the pieces its
  own shards need and reads them as ``safetensors`` slices, so no rank ever holds the full model unless its
  layout does (DDP). Single-file or sharded (``model.safetensors.index.json``) checkpoints, any dtype (converted
  to the job's). From ``s3://`` the files are first copied to a per-node cache directory, once per node.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from raytrn import storage
from raytrn.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
#: config.json key -> raytrn ``model`` field.
FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
#: The keys of Llama 3.x's ``llama3`` RoPE scaling (transformers' ``_compute_llama3_parameters``).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config(location: str) -> dict[str, Any]:
    """``config.json`` of the checkpoint at ``location`` (a directory or ``s3://`` prefix); ConfigError saying
    what is wrong (missing, unreadable, not JSON)."""
    path = storage.join(location, CONFIG_FILE)
    try:
        text = storage.read_text(path)
    except OSError as e:
        raise ConfigError(f"model.init_from: cannot read {path}: {e}") from None
    if text is None:
        kind = "directory" if _exists(location) else "path"
        raise ConfigError(
            f"model.init_from: {path} not found ({location} is {'a ' + kind if _exists(location) else 'missing'}); "
            "init_from is a Hugging Face checkpoint directory: config.json and *.safetensors"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.init_from: {path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.init_from: {path} holds {type(data).__name__}, not an object")
    return data


def _exists(location: str) -> bool:
    import pyarrow.fs as pafs

    try:
        fs, path = storage.filesystem(location)
        return bool(fs.get_file_info(path).type != pafs.FileType.NotFound)
    except OSError:
        return False


def model_fields(config: dict[str, Any], *, where: str) -> dict[str, Any]:
    """raytrn ``model`` fields from a Llama ``config.json``; ConfigError for another architecture or a RoPE
    raytrn does not implement."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"{where}: model_type is {model_type!r}, not 'llama': raytrn's decoder is Llama's (Llama 2, 3, 3.1, 3.2 "
            "and their fine-tunes); other architectures are not supported"
        )
    fields = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in config]  # fmt: skip
    if missing:
        raise ConfigError(f"{where}: config.json has no {', '.join(missing)}")
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
    scaling = rope if rope is not None else config.get("rope_scaling")
    theta = (rope or {}).get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        fields["rope_theta"] = float(theta)
    fields["rope_scaling"] = rope_scaling(scaling, where=where)
    return fields


def rope_scaling(scaling: Any, *, where: str) -> dict[str, Any] | None:
    """The ``llama3`` RoPE scaling of a config (its four numbers), None for the default; ConfigError otherwise."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be a mapping, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(
            f"{where}: RoPE scaling {kind!r} is not implemented by raytrn's decoder (default and Llama 3.x's 'llama3' "
            "are); training with it ignored would be silently wrong"
        )
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{where}: 'llama3' RoPE scaling without {', '.join(missing)}")
    return {"rope_type": "llama3", **{k: float(scaling[k]) for k in LLAMA3_ROPE_KEYS}}


def merge_config(model: dict[str, Any], location: str, *, where: str) -> dict[str, Any]:
    """The job's ``model`` section with the sizes of ``location``'s config.json filled in; ConfigError naming the
    first field the job (or its preset) sets to another value."""
    from raytrn.models.llama import PRESETS

    given = dict(model)
    if given.get("preset") is not None:
        preset = PRESETS.get(str(given["preset"]))
        if preset is not None:
            given = {**preset, **given}
    theirs = model_fields(read_config(location), where=f"{where}: model.init_from {location}")
    for name, value in theirs.items():
        if name in given and given[name] is not None and not _same(given[name], value):
            raise ConfigError(
                f"{where}: model.{name} is {given[name]!r} but {storage.join(location, CONFIG_FILE)} says {value!r}; "
                f"drop model.{name} (the checkpoint's config decides) or use a checkpoint of that size"
            )
    return {**theirs, **{k: v for k, v in model.items() if v is not None}}  # null: the checkpoint decides


def check_config(model: Any, location: str, *, where: str) -> None:
    """ConfigError naming the first field of the job's ``model`` (a ModelConfig) that ``location``'s config.json
    says otherwise (a remote ``init_from``, checked where the job starts)."""
    theirs = model_fields(read_config(location), where=f"{where}: model.init_from {location}")
    for name, value in theirs.items():
        ours = model.kv_heads if name == "num_key_value_heads" else getattr(model, name)
        if not _same(ours, value) and not (value is None and ours is None):
            raise ConfigError(
                f"{where}: model.{name} is {ours!r} but {storage.join(location, CONFIG_FILE)} says {value!r}; set it "
                "to the checkpoint's value"
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return bool(a == b)


# -- weights --------------------------------------------------------------------------------------


def local_copy(location: str, *, cache_dir: str | None = None) -> str:
    """A local directory holding the checkpoint: ``location`` itself, or for ``s3://`` a per-node cache copy of
    its config, index and safetensors files (made once per node: local ranks wait on a lock file)."""
    if not storage.is_remote(location):
        return location
    import fcntl
    import hashlib

    import pyarrow.fs as pafs

    root = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "raytrn", "init_from")
    target = os.path.join(root, hashlib.sha256(location.encode()).hexdigest()[:16])
    os.makedirs(target, exist_ok=True)
    done = os.path.join(target, ".complete")
    with open(os.path.join(target, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            fs, path = storage.filesystem(location)
            infos = fs.get_file_info(pafs.FileSelector(path))
            wanted = [i for i in infos if i.type == pafs.FileType.File and _is_checkpoint_file(i.base_name)]
            for info in wanted:
                with fs.open_input_stream(info.path) as src, open(os.path.join(target, info.base_name), "wb") as dst:
                    while chunk := src.read(64 << 20):
                        dst.write(chunk)
            open(done, "w").close()
            log.info("model.init_from: copied %d files of %s to %s", len(wanted), location, target)
    return target


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors")


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files; CheckpointError when there are none, or when an index names a
    missing one."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(
            f"model.init_from: {directory} has no *.safetensors weights (a PyTorch .bin checkpoint? convert it with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True))"
        )
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            wanted = set(json.load(f).get("weight_map", {}).values())
        missing = sorted(wanted - set(names))
        if missing:
            raise CheckpointError(f"model.init_from: {index} names {', '.join(missing)}, not in {directory}")
    return names


def load_weights(model: torch.nn.Module, location: str, *, tied: bool, source: str) -> int:
    """Load ``location``'s weights into ``model`` (laid out or not; names as HF's). Every rank calls it (a DCP load:
    collective under a process group). Returns the number of tensors loaded; CheckpointError naming a tensor that
    is missing or of another shape."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    directory = local_copy(location)
    safetensors_files(directory)
    reader = HuggingFaceStorageReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    options = StateDictOptions(ignore_frozen_params=False)
    from raytrn.models.lora import is_adapter

    state: dict[str, Any] = {
        k: v
        for k, v in get_model_state_dict(model, options=options).items()
        if isinstance(v, torch.Tensor) and not is_adapter(k)  # LoRA adapters are new: not in the checkpoint
    }
    if tied:
        state.pop("lm_head.weight", None)  # one matrix: the embedding's (HF writes it once)
    for name, value in state.items():
        entry = saved.get(name)
        if entry is None:
            raise CheckpointError(
                f"{source}: model.init_from {location} has no tensor {name!r}; its tensors are e.g. "
                f"{', '.join(sorted(saved)[:4])}. Is it a Llama checkpoint of this size?"
            )
        if tuple(getattr(entry, "size", ())) != tuple(value.shape):
            raise CheckpointError(
                f"{source}: model.init_from {location}: tensor {name!r} has shape {tuple(entry.size)}, the model's is "  # type: ignore[union-attr]
                f"{tuple(value.shape)}"
            )
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dcp.load(state, storage_reader=reader, no_dist=no_dist)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return len(state)
