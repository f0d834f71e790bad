"""The job spec: a YAML file plus ``--set`` overrides, parsed into typed, range-checked config.

- :mod:`raytrn.config.schema`: the sections (every field described; ``docs/job-spec.md`` is rendered from them
  by :mod:`raytrn.config.reference`); the model section, its families and LoRA: :mod:`raytrn.config.model`.
- :mod:`raytrn.config.load`: reading, ``--set`` overrides, errors that name file, field and fix.
- :mod:`raytrn.config.paths`: the one table of path fields and what reads it (resolution, the relative-path
  refusal, ``raytrn submit``'s frozen overrides).
- :mod:`raytrn.config.presets` and :mod:`raytrn.config.hf_config`: where a model's sizes come from (a preset,
  or ``model.init_from``'s ``config.json``).
"""

from raytrn.config.load import (
    MAX_JOB_FILE_BYTES,
    MAX_SPEC_VALUES,
    apply_overrides,
    check_field_value,
    check_size,
    field_annotation,
    field_info,
    load_job,
    parse_job,
    read_config_text,
    read_job_file,
    read_job_mapping,
    safe_load_yaml,
    set_value,
    yaml_syntax_error,
    yaml_value,
)
from raytrn.config.paths import (
    PATH_FIELDS,
    PathField,
    absolute_overrides,
    path_field,
    relative_local_paths,
    resolve_mlflow_uri,
    resolve_paths,
)
from raytrn.config.presets import PRESETS
from raytrn.config.schema import (
    MAX_WORKERS,
    RUN_NAME,
    Accelerator,
    CheckpointConfig,
    DataConfig,
    JobSpec,
    LoraConfig,
    ModelConfig,
    NeuronConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TrackingConfig,
)

__all__ = [
    "MAX_JOB_FILE_BYTES",
    "MAX_SPEC_VALUES",
    "MAX_WORKERS",
    "PATH_FIELDS",
    "PRESETS",
    "RUN_NAME",
    "Accelerator",
    "CheckpointConfig",
    "DataConfig",
    "JobSpec",
    "LoraConfig",
    "ModelConfig",
    "NeuronConfig",
    "OptimConfig",
    "ParallelConfig",
    "PathField",
    "RunConfig",
    "ScalingConfig",
    "TrackingConfig",
    "absolute_overrides",
    "apply_overrides",
    "check_field_value",
    "check_size",
    "field_annotation",
    "field_info",
    "load_job",
    "parse_job",
    "path_field",
    "read_config_text",
    "read_job_file",
    "read_job_mapping",
    "relative_local_paths",
    "resolve_mlflow_uri",
    "resolve_paths",
    "safe_load_yaml",
    "yaml_value",
    "set_value",
    "yaml_syntax_error",
]
