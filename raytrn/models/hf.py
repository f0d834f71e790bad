"""Starting from a Hugging Face checkpoint (``model.init_from``): its safetensors weights loaded into
raytrn's decoder in any layout. (Its ``config.json`` as raytrn's model section: :mod:`raytrn.config.hf_config`.)

- **Weights.** After the model is laid out (DDP, FSDP2, tensor parallel), every rank loads through DCP's
  Hugging Face reader (``torch.distributed.checkpoint.HuggingFaceStorageReader``): it asks for the pieces its
  own shards need and reads them as ``safetensors`` slices, so no rank ever holds the full model unless its
  layout does (DDP). Single-file or sharded (``model.safetensors.index.json``) checkpoints, any dtype (converted
  to the job's). From ``s3://`` the files are first copied to a per-node cache directory, once per node.
- **Experts.** A Qwen3-MoE checkpoint holds one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``:
  the published ones, and what transformers 4 and 5 save); raytrn's model stacks them (``mlp.experts.gate_up_proj``).
  Each rank asks for the experts its shard of the stacked tensor holds, read straight into it (:func:`_expert_views`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from raytrn import jsonfile, storage
from raytrn.config.hf_config import CONFIG_FILE
from raytrn.config.hf_config import check_config as check_config  # re-exported: raytrn.train.checks imports it here
from raytrn.errors import CheckpointError
from raytrn.models.export import hub_tensors, split_stacked
from raytrn.one_process import no_dist

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


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
        try:
            with open(index) as f:
                wanted = set(jsonfile.load(f).get("weight_map", {}).values())
        except (ValueError, AttributeError, TypeError) as e:
            raise CheckpointError(f"model.init_from: {index} is not a safetensors index ({e})") from None
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
    from raytrn.models.lora import is_adapter  # torch (~2 s, measured): train.checks reads check_config here

    state: dict[str, Any] = {
        k: v
        for k, v in get_model_state_dict(model, options=options).items()
        if isinstance(v, torch.Tensor) and not is_adapter(k)  # LoRA adapters are new: not in the checkpoint
    }
    if tied:
        state.pop("lm_head.weight", None)  # one matrix: the embedding's (HF writes it once)
    stacked = {name: value for name, value in state.items() if name not in saved and _is_stacked(name)}
    wanted = {k: v for k, v in state.items() if k not in stacked}
    for name, value in stacked.items():
        wanted.update(_expert_views(name, value, source=source))
    for name, value in wanted.items():
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
    # (safetensors: tensors and a JSON header, no pickle to refuse; raytrn's DCP checkpoints load through
    # raytrn.checkpoint.plain)
    dcp.load(wanted, storage_reader=reader, no_dist=no_dist())  # the experts' views fill their stacked tensors
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return len(wanted)


def _is_stacked(name: str) -> bool:
    return split_stacked(name)[1] is not None


def _expert_views(name: str, value: Any, *, source: str) -> dict[str, Any]:
    """The per-expert checkpoint names of stacked-experts tensor ``name`` (:func:`raytrn.models.export.hub_tensors`)
    for the experts this rank holds, each a view into ``value`` (a tensor, or a DTensor sharded on the experts, as
    FSDP2 shards it): loading into the views loads the stacked tensor."""
    from torch.distributed.tensor import DTensor

    first, local = 0, value
    if isinstance(value, DTensor):
        # Where this rank's block starts: DCP's own record of a DTensor's local chunk (FSDP's Shard(0), expert
        # parallelism's Shard(0) over EP, FSDP's _StridedShard over the EP holders, a TP replica: all on dim 0).
        chunks = value.__create_chunk_list__()
        local = value.to_local()
        chunk = chunks[0] if len(chunks) == 1 else None
        if (
            chunk is None
            or tuple(chunk.offsets[1:]) != (0,) * (value.ndim - 1)
            or tuple(local.shape[1:]) != tuple(value.shape[1:])
        ):
            raise CheckpointError(
                f"{source}: model.init_from into {name} laid out as {tuple(value.placements)}: a MoE model's "
                "experts load into whole experts on each rank only (one run of them, split on the experts dimension)"
            )
        first = int(chunk.offsets[0])
    views = dict(hub_tensors([(name, local)], first_expert=first))
    return views
