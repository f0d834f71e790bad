"""A Hugging Face checkpoint's ``config.json`` as raytrn's ``model`` section (``model.init_from``), for every family
of the registry (:data:`raytrn.config.families.FAMILIES`: its ``plain``, ``defaults`` and ``aliases`` say how a
family's ``config.json`` differs). The other direction, the export's ``config.json``, is the family's Hugging Face
adapter (``raytrn/models/<family>/hf.py``); this one stays in the config layer, which loads a job without the models.

``config.json`` (``model_type``: a family's name) gives the family and the sizes; a job may omit them, and
any it gives (or its preset gives) must match, else one error naming the field. RoPE: the default, or Llama 3.x's ``llama3`` scaling
(honoured by :class:`raytrn.models.decoder.RotaryEmbedding`); any other type is refused. Both spellings are
read: ``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (5). The weights are
:mod:`raytrn.models.hf`'s.
"""

from __future__ import annotations

import math
from typing import Any

from raytrn import jsonfile
from raytrn.config.families import FAMILIES
from raytrn.config.presets import PRESETS
from raytrn.errors import ConfigError

CONFIG_FILE = "config.json"
#: config.json key -> raytrn ``model`` field.
FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    # Qwen3-MoE's
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "router_aux_loss_coef": "router_aux_loss_coef",
}
#: config.json keys raytrn's decoder implements at one value only, in every family (a family adds its own: ``plain``).
PLAIN: tuple[tuple[str, Any], ...] = (("attention_bias", False), ("use_sliding_window", False))
#: The keys of Llama 3.x's ``llama3`` RoPE scaling (transformers' ``_compute_llama3_parameters``).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config(location: str) -> dict[str, Any]:
    """``config.json`` of the checkpoint at ``location`` (a directory or ``s3://`` prefix); ConfigError saying
    what is wrong (missing, unreadable, not JSON)."""
    from raytrn import storage  # measured: pyarrow.fs adds ~0.22 s to `import raytrn.config` (~0.3 s)

    path = storage.join(location, CONFIG_FILE)
    try:
        text = storage.read_text(path)
    except OSError as e:
        raise ConfigError(f"model.init_from: cannot read {path}: {storage.short_error(e)}") from None
    if text is None:
        kind = "directory" if _exists(location) else "path"
        raise ConfigError(
            f"model.init_from: {path} not found ({location} is {'a ' + kind if _exists(location) else 'missing'}); "
            "init_from is a Hugging Face checkpoint directory: config.json and *.safetensors"
        )
    try:
        data = jsonfile.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer of over 4,300 digits
        raise ConfigError(f"model.init_from: {path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.init_from: {path} holds {type(data).__name__}, not an object")
    return data


def _exists(location: str) -> bool:
    import pyarrow.fs as pafs

    from raytrn import storage  # measured: pyarrow.fs adds ~0.22 s to `import raytrn.config` (~0.3 s)

    try:
        fs, path = storage.filesystem(location)
        return bool(fs.get_file_info(path).type != pafs.FileType.NotFound)
    except OSError:
        return False


def model_fields(config: dict[str, Any], *, where: str) -> dict[str, Any]:
    """raytrn ``model`` fields from a ``config.json`` of a registered family; ConfigError for another architecture,
    or a variant (attention biases, sliding windows, a RoPE) raytrn's decoder does not implement."""
    model_type = config.get("model_type")
    spec = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        published = ", ".join(s.checkpoints for s in FAMILIES.values())
        raise ConfigError(
            f"{where}: model_type is {model_type!r}; raytrn's decoder implements {', '.join(map(repr, FAMILIES))} "
            f"({published}, and their fine-tunes); other architectures are not supported"
        )
    for key, plain in PLAIN + spec.plain:
        if config.get(key, plain) != plain:
            raise ConfigError(
                f"{where}: config.json has {key}: {config[key]!r}; raytrn's decoder implements {key}: "
                f"{str(plain).lower()} only (training with it ignored would be silently wrong)"
            )
    fields: dict[str, Any] = {"family": model_type}  # first: another family is named as such
    fields.update({ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None})
    for key, default in spec.defaults:
        value = config.get(key)
        fields[key] = default if value is None else type(default)(value)
    for other, key in spec.aliases:
        if config.get(key) is None and config.get(other) is not None:
            fields[FIELDS.get(key, key)] = config[other]
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
    given = dict(model)
    if given.get("preset") is not None:
        preset = PRESETS.get(str(given["preset"]))
        if preset is not None:
            given = {**preset, **given}
    theirs = model_fields(read_config(location), where=f"{where}: model.init_from {location}")
    for name, value in theirs.items():
        if name in given and given[name] is not None and not _same(given[name], value):
            raise ConfigError(
                f"{where}: model.{name} is {given[name]!r} but {_config_path(location)} says {value!r}; "
                f"drop model.{name} (the checkpoint's config decides) or use a checkpoint of that "
                f"{'family' if name == 'family' else 'size'}"
            )
    return {**theirs, **{k: v for k, v in model.items() if v is not None}}  # null: the checkpoint decides


def check_config(model: Any, location: str, *, where: str) -> None:
    """ConfigError naming the first field of the job's ``model`` (a ModelConfig) that ``location``'s config.json
    says otherwise (a remote ``init_from``, checked where the job starts)."""
    theirs = model_fields(read_config(location), where=f"{where}: model.init_from {location}")
    for name, value in theirs.items():
        ours = {"num_key_value_heads": model.kv_heads, "head_dim": model.head_size}.get(name, getattr(model, name))
        if not _same(ours, value) and not (value is None and ours is None):
            raise ConfigError(
                f"{where}: model.{name} is {ours!r} but {_config_path(location)} says {value!r}; set it "
                "to the checkpoint's value"
            )


def _config_path(location: str) -> str:
    from raytrn import storage  # measured: pyarrow.fs adds ~0.22 s to `import raytrn.config` (~0.3 s)

    return storage.join(location, CONFIG_FILE)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return bool(a == b)
