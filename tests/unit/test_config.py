"""Job-spec parsing: every error path names the file, the field path and the fix.

The specs are built from the shipped ``jobs/tiny.yaml`` (loaded and modified), so these tests follow
the real spec as it changes.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrn.config import JobSpec, apply_overrides, load_job, parse_job, resolve_paths
from raytrn.errors import ConfigError, RaytrnError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny.yaml"
_TINY_RAW: dict[str, Any] = yaml.safe_load(TINY.read_text())


def tiny_raw() -> dict[str, Any]:
    """A fresh, mutable copy of jobs/tiny.yaml as parsed YAML."""
    return copy.deepcopy(_TINY_RAW)


def write_job(tmp_path: Path, raw: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def config_error(path: Path | str, overrides: list[str] | None = None) -> str:
    """The message load_job raises for ``path`` (the test fails if it loads)."""
    with pytest.raises(ConfigError) as info:
        load_job(path, overrides, base_dir="/base")
    return str(info.value)


def error_for(tmp_path: Path, section: str | None, **changes: Any) -> str:
    """Write tiny.yaml with ``changes`` applied to ``section`` (or the top level) and return the error."""
    raw = tiny_raw()
    (raw[section] if section else raw).update(changes)
    path = write_job(tmp_path, raw)
    msg = config_error(path)
    assert msg.startswith(f"{path}: "), msg
    return msg.removeprefix(f"{path}: ")


# --- the shipped example and the file itself ---------------------------------------------------------------


def test_tiny_loads(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, tiny_raw()), base_dir=str(tmp_path))
    assert isinstance(job, JobSpec)
    assert job.model.preset == "tiny" and job.model.hidden_size == 128
    assert job.source.endswith("job.yaml")
    # No run_name in tiny.yaml: a new timestamped run per invocation, fixed once loaded.
    assert re.fullmatch(r"job-\d{8}-\d{6}", job.run_name)
    assert job.tracking.run_name == job.run_name


def test_fixed_run_name_is_kept(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, tiny_raw()), ["tracking.run_name=nightly"], base_dir=str(tmp_path))
    assert job.run_name == "nightly"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert config_error(path) == f"{path}: job file not found (check the path; shipped examples are in jobs/)"


def test_directory_as_job_file(tmp_path: Path) -> None:
    msg = config_error(tmp_path)
    assert msg.startswith(f"{tmp_path}: cannot read job file: IsADirectoryError")


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    text = TINY.read_text()
    line = len(text.splitlines()) + 1
    path = tmp_path / "bad.yaml"
    path.write_text(text + "extra: key: value\n")
    msg = config_error(path)
    assert msg == f"{path}:{line}:11: YAML syntax error: mapping values are not allowed here"


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    msg = config_error(path)
    assert msg == f"{path}: job file is empty; see jobs/tiny.yaml for the sections a job needs"


@pytest.mark.parametrize(("raw", "kind"), [([{"model": {}}], "list"), ("just text", "str"), (3, "int")])
def test_top_level_must_be_a_mapping(tmp_path: Path, raw: Any, kind: str) -> None:
    path = write_job(tmp_path, raw)
    assert config_error(path) == f"{path}: a job spec must be a YAML mapping of sections, got {kind}"


# --- unknown keys ------------------------------------------------------------------------------------------


def test_unknown_nested_key_suggests_near_miss(tmp_path: Path) -> None:
    msg = error_for(tmp_path, "scaling", max_worker=4)
    assert msg == "scaling.max_worker: unknown field. Did you mean 'max_workers'?"


def test_unknown_top_level_key_suggests_near_miss(tmp_path: Path) -> None:
    assert error_for(tmp_path, None, optimm={"lr": 1.0}) == "optimm: unknown field. Did you mean 'optim'?"


def test_unknown_key_without_near_match_lists_known_fields(tmp_path: Path) -> None:
    msg = error_for(tmp_path, None, xyzzy=1)
    assert (
        msg
        == "xyzzy: unknown field. Known fields: model, data, optim, scaling, checkpoint, tracking, run, parallel, neuron, eval."
    )
    msg = error_for(tmp_path, "scaling", zzzzzz=1)
    assert msg.startswith("scaling.zzzzzz: unknown field. Known fields: accelerator, min_workers, max_workers")


def test_source_is_not_a_yaml_field(tmp_path: Path) -> None:
    # JobSpec.source holds the file name; a `source:` key in YAML must be rejected, not silently replaced.
    msg = error_for(tmp_path, None, source="elsewhere.yaml")
    assert msg.startswith("source: unknown field.")
    assert "source" not in msg.split("Known fields:")[-1]


# --- wrong types and ranges -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "changes", "expected"),
    [
        pytest.param(
            "data",
            {"seq_len": "abc"},
            "data.seq_len: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
            id="seq_len-not-int",
        ),
        pytest.param("optim", {"lr": [1]}, "optim.lr: Input should be a valid number (got [1])", id="lr-list"),
        pytest.param(
            "model",
            {"preset": ["tiny"]},
            "model: unknown preset ['tiny']; choose one of ['llama3-8b', 'llama3.1-70b', 'llama3.1-8b', 'llama3.2-1b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-14b', 'qwen3-235b-a22b', 'qwen3-30b-a3b', 'qwen3-32b', 'qwen3-4b', 'qwen3-8b', 'tiny', 'tiny-qwen3', 'tiny-qwen3-moe']",
            id="preset-unhashable",
        ),
        pytest.param(
            None,
            {"scaling": 3},
            "scaling: Input should be a valid dictionary or instance of ScalingConfig (got 3)",
            id="section-not-mapping",
        ),
        pytest.param(None, {"run": None}, "run: Input should be a valid dictionary", id="section-null"),
    ],
)
def test_wrong_type(tmp_path: Path, section: str | None, changes: dict[str, Any], expected: str) -> None:
    assert error_for(tmp_path, section, **changes).startswith(expected)


def test_missing_required_section(tmp_path: Path) -> None:
    raw = tiny_raw()
    del raw["run"]
    path = write_job(tmp_path, raw)
    assert config_error(path) == f"{path}: run: required field is missing"


@pytest.mark.parametrize(
    ("section", "changes", "expected"),
    [
        ("data", {"seq_len": 0}, "data.seq_len: input should be greater than 0 (got 0)"),
        ("data", {"seq_len": -8}, "data.seq_len: input should be greater than 0 (got -8)"),
        ("optim", {"lr": 0}, "optim.lr: input should be greater than 0 (got 0)"),
        ("optim", {"lr": -1e-3}, "optim.lr: input should be greater than 0 (got -0.001)"),
        ("optim", {"min_lr_ratio": 1.5}, "optim.min_lr_ratio: input should be less than or equal to 1 (got 1.5)"),
        ("scaling", {"min_workers": 3, "max_workers": 2}, "scaling: min_workers (3) must be <= max_workers (2)"),
        (
            "scaling",
            {"resources_per_worker": {"CPU": -1}},
            "scaling: resources_per_worker.CPU must be > 0 and finite, got -1.0",
        ),
        (
            "scaling",
            {"resources_per_worker": {"CPU": 0}},
            "scaling: resources_per_worker.CPU must be > 0 and finite, got 0.0 (leave a resource out rather than ask "
            "for 0 of it: Ray places such workers without limit)",
        ),
        ("data", {"micro_batch_size": True}, "data.micro_batch_size: expected a number, got a boolean (True)"),
        ("optim", {"lr": True}, "optim.lr: expected a number, got a boolean (True)"),
        ("run", {"max_steps": True}, "run.max_steps: expected a number, got a boolean (True)"),
        ("data", {"grad_accum": False}, "data.grad_accum: expected a number, got a boolean (False)"),
        ("scaling", {"resize_interval_s": True}, "scaling.resize_interval_s: expected a number, got a boolean (True)"),
        (
            "scaling",
            {"resources_per_worker": {"CPU": True}},
            "scaling.resources_per_worker: expected a number, got a boolean ({'CPU': True})",
        ),
        (
            "tracking",
            {"run_name": "abc\n"},
            "tracking.run_name: 'abc\\n' is not a usable run name: it names a directory under checkpoint.storage, "
            "so use 1-200 letters, digits and . _ = + - (starting with a letter or digit; no '/', no '..')",
        ),
        ("optim", {"betas": [1.0, 0.95]}, "optim: betas must each be in [0, 1), got [1.0, 0.95]"),
        ("optim", {"betas": [0.9, -0.1]}, "optim: betas must each be in [0, 1), got [0.9, -0.1]"),
        ("data", {"global_batch_size": 64}, "data: set either grad_accum or global_batch_size, not both"),
        (
            "model",
            {"hidden_size": 130},
            "model: hidden_size (130) must be divisible by num_attention_heads (4), or set head_dim",
        ),
        (
            "model",
            {"num_key_value_heads": 3},
            "model: num_attention_heads (4) must be divisible by num_key_value_heads (3)",
        ),
        (
            "data",
            {"seq_len": 1024},
            "data.seq_len (1024) exceeds model.max_position_embeddings (512)",
        ),
        (
            "model",
            {"preset": "llama-70b"},
            "model: unknown preset 'llama-70b'; choose one of ['llama3-8b', 'llama3.1-70b', 'llama3.1-8b', 'llama3.2-1b', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-14b', 'qwen3-235b-a22b', 'qwen3-30b-a3b', 'qwen3-32b', 'qwen3-4b', 'qwen3-8b', 'tiny', 'tiny-qwen3', 'tiny-qwen3-moe']",
        ),
        (
            "scaling",
            {"accelerator": "tpu"},
            "scaling.accelerator: Input should be 'cpu', 'cuda', 'neuron', 'neuron-xla' or 'xla-cpu' (got 'tpu')",
        ),
    ],
)
def test_out_of_range(tmp_path: Path, section: str, changes: dict[str, Any], expected: str) -> None:
    assert error_for(tmp_path, section, **changes) == expected


def test_several_problems_are_all_listed(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["data"]["seq_len"] = "abc"
    raw["optim"]["lr"] = 0
    raw["scaling"]["max_worker"] = 4
    path = write_job(tmp_path, raw)
    lines = config_error(path).splitlines()
    assert lines[0] == f"{path}: 3 problems:"
    assert lines[1:] == [
        "  data.seq_len: Input should be a valid integer, unable to parse string as an integer (got 'abc')",
        "  optim.lr: input should be greater than 0 (got 0)",
        "  scaling.max_worker: unknown field. Did you mean 'max_workers'?",
    ]


def test_explicit_fields_override_the_preset(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["model"].update(num_layers=3, vocab_size=512)
    job = load_job(write_job(tmp_path, raw), base_dir=str(tmp_path))
    assert (job.model.num_layers, job.model.vocab_size, job.model.hidden_size) == (3, 512, 128)


# --- --set overrides -------------------------------------------------------------------------------------------


def test_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    path = write_job(tmp_path, tiny_raw())
    job = load_job(
        path,
        [
            "optim.lr=1e-3",
            "run.max_steps=20",
            "scaling.resources_per_worker={CPU: 2}",
            "optim.betas=[0.8, 0.9]",
            "data.shuffle=false",
            "tracking.run_name=other",
        ],
        base_dir=str(tmp_path),
    )
    assert isinstance(job.optim.lr, float) and job.optim.lr == pytest.approx(1e-3)
    assert job.run.max_steps == 20
    assert job.scaling.resources_per_worker == {"CPU": 2.0}
    assert job.optim.betas == (0.8, 0.9)
    assert job.data.shuffle is False
    assert job.run_name == "other"


def test_apply_overrides_in_place() -> None:
    raw = tiny_raw()
    done = apply_overrides(raw, ["run.max_steps=20", "scaling.resources_per_worker={CPU: 2}", "optim.eps="])
    assert done == {"run.max_steps", "scaling.resources_per_worker", "optim.eps"}
    assert raw["run"]["max_steps"] == 20
    assert raw["scaling"]["resources_per_worker"] == {"CPU": 2}
    assert raw["optim"]["eps"] is None  # an empty value is YAML null


def test_override_creates_missing_section(tmp_path: Path) -> None:
    raw = tiny_raw()
    del raw["checkpoint"]
    job = load_job(write_job(tmp_path, raw), ["checkpoint.every_n_steps=7"], base_dir=str(tmp_path))
    assert job.checkpoint.every_n_steps == 7
    assert job.checkpoint.keep_last == 3  # the other fields keep their defaults
    raw = {}
    apply_overrides(raw, ["a.b.c=1"])
    assert raw == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize("item", ["foo", "=1", "a..b=1", ".a=1", "a.=1"])
def test_malformed_override(tmp_path: Path, item: str) -> None:
    msg = config_error(write_job(tmp_path, tiny_raw()), [item])
    assert msg == f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set optim.lr=3e-4"


def test_override_into_a_value(tmp_path: Path) -> None:
    msg = config_error(write_job(tmp_path, tiny_raw()), ["optim.lr.x=1"])
    assert msg == "--set 'optim.lr.x=1': optim.lr is a value, not a section"


def test_override_errors_name_the_set_option(tmp_path: Path) -> None:
    path = write_job(tmp_path, tiny_raw())
    assert config_error(path, ["scaling.max_worker=4"]) == (
        f"{path}: --set scaling.max_worker: unknown field. Did you mean 'max_workers'?"
    )
    assert config_error(path, ["optim.lr=-1"]) == f"{path}: --set optim.lr: input should be greater than 0 (got -1)"
    # A section-level check caused by an override points at the --set too.
    assert config_error(path, ["scaling.min_workers=3"]) == (
        f"{path}: --set scaling: min_workers (3) must be <= max_workers (2)"
    )


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["optim"]["lr"] = 0  # invalid in the file, fixed on the command line
    job = load_job(write_job(tmp_path, raw), ["optim.lr=0.5"], base_dir=str(tmp_path))
    assert job.optim.lr == 0.5


# --- paths ------------------------------------------------------------------------------------------------------


def test_relative_paths_are_made_absolute(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["data"]["manifest"] = "data/ds"
    raw["checkpoint"]["storage"] = "ckpt"
    raw["tracking"]["mlflow_uri"] = "sqlite:///mlruns/mlflow.db"
    job = load_job(write_job(tmp_path, raw), base_dir="/base")
    assert job.data.manifest == "/base/data/ds"
    assert job.checkpoint.storage == "/base/ckpt"
    assert job.tracking.mlflow_uri == "sqlite:////base/mlruns/mlflow.db"


def test_default_base_dir_is_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = load_job(write_job(tmp_path, tiny_raw()))
    assert job.data.manifest == os.path.join(str(tmp_path), "data", "stdlib")


def test_uris_and_absolute_paths_are_left_alone(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["data"]["manifest"] = "/abs/data"
    raw["checkpoint"]["storage"] = "s3://bucket/prefix"
    raw["tracking"]["mlflow_uri"] = "http://127.0.0.1:5000"
    job = load_job(write_job(tmp_path, raw), base_dir="/base")
    assert job.data.manifest == "/abs/data"
    assert job.checkpoint.storage == "s3://bucket/prefix"
    assert job.tracking.mlflow_uri == "http://127.0.0.1:5000"
    absolute_sqlite = job.model_copy(
        update={"tracking": job.tracking.model_copy(update={"mlflow_uri": "sqlite:////abs/mlflow.db"})}
    )
    assert resolve_paths(absolute_sqlite, "/base").tracking.mlflow_uri == "sqlite:////abs/mlflow.db"


def test_mlflow_uri_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = tiny_raw()
    del raw["tracking"]["mlflow_uri"]
    path = write_job(tmp_path, raw)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert load_job(path, base_dir="/base").tracking.mlflow_uri == "http://mlflow.example:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env/mlflow.db")
    assert load_job(path, base_dir="/base").tracking.mlflow_uri == "sqlite:////base/env/mlflow.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert load_job(path, base_dir="/base").tracking.mlflow_uri == "sqlite:////base/mlruns/mlflow.db"
    # A URI in the spec wins over the environment.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    job = load_job(path, ["tracking.mlflow_uri=http://spec:5000"], base_dir="/base")
    assert job.tracking.mlflow_uri == "http://spec:5000"


# --- derived values ----------------------------------------------------------------------------------------------


def test_flat_gives_dotted_keys(tmp_path: Path) -> None:
    flat = load_job(write_job(tmp_path, tiny_raw()), base_dir="/base").flat()
    assert flat["optim.lr"] == 3.0e-3
    assert flat["model.hidden_size"] == 128
    assert flat["scaling.resources_per_worker.CPU"] == 1.0
    assert flat["optim.betas"] == [0.9, 0.95]
    assert flat["data.manifest"] == "/base/data/stdlib"
    assert "source" not in flat
    assert all(not isinstance(v, dict) for v in flat.values())
    assert {k.split(".")[0] for k in flat} == {
        "model",
        "data",
        "optim",
        "scaling",
        "checkpoint",
        "tracking",
        "run",
        "parallel",
        "neuron",
        "eval",
    }


def test_grad_accum_for_world_size() -> None:
    raw = tiny_raw()
    assert parse_job(raw).data.grad_accum_for(8) == 1  # fixed grad_accum ignores the world size
    del raw["data"]["grad_accum"]
    assert parse_job(raw).data.grad_accum_for(8) == 1  # default
    raw["data"]["global_batch_size"] = 256  # micro_batch_size 16
    data = parse_job(raw).data
    assert [data.grad_accum_for(n) for n in (1, 2, 4, 8, 16)] == [16, 8, 4, 2, 1]
    with pytest.raises(ConfigError) as info:
        data.grad_accum_for(3)
    assert str(info.value) == (
        "data.global_batch_size (256) is not divisible by micro_batch_size x workers (16 x 3 = 48); "
        "pick a global batch that is a multiple of 48, or set data.grad_accum instead"
    )


def test_config_error_pickles() -> None:
    err = ConfigError("jobs/x.yaml: scaling.max_worker: unknown field. Did you mean 'max_workers'?")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigError and isinstance(back, RaytrnError)
    assert str(back) == str(err) and back.message == err.message and back.exit_code == 2


def test_job_spec_pickles(tmp_path: Path) -> None:
    # The spec is sent to every Ray Train worker.
    job = load_job(write_job(tmp_path, tiny_raw()), base_dir="/base")
    back = pickle.loads(pickle.dumps(job))
    assert back == job and back.source == job.source


def test_max_workers_null_is_a_fixed_size_everywhere() -> None:
    """``max_workers: null`` is the same job as ``max_workers == min_workers``: the same spec after parsing."""
    raw = tiny_raw()
    raw["scaling"] = {"min_workers": 1, "max_workers": None}
    null = parse_job(raw)
    raw["scaling"] = {"min_workers": 1, "max_workers": 1}
    same = parse_job(raw)
    assert null == same and null.scaling.max_workers == 1 and not null.scaling.elastic
    raw["scaling"] = {"min_workers": 3}
    assert parse_job(raw).scaling.max_workers == 3
    assert parse_job(raw, overridden={"scaling.min_workers"}).flat()["scaling.max_workers"] == 3


def test_run_names_are_one_path_component() -> None:
    raw = tiny_raw()
    for bad in ("../../home", "a/b", ".hidden", "", "x" * 201, "name with space"):
        raw["tracking"] = {"run_name": bad}
        with pytest.raises(ConfigError, match="tracking.run_name: .*not a usable run name|tracking.run_name"):
            parse_job(raw)
    raw["tracking"] = {"run_name": "llama3.2-1b_trn1=v2+x"}
    assert parse_job(raw).run_name == "llama3.2-1b_trn1=v2+x"


def test_generated_run_names_are_safe_for_any_file_name() -> None:
    job = parse_job(tiny_raw(), source="/tmp/my job (copy).yaml")
    assert re.fullmatch(r"my-job-copy-\d{8}-\d{6}", job.run_name), job.run_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            + "".join(
                f"c{i}: &c{i} [" + ", ".join([f"*{'b' if i == 0 else f'c{i - 1}'}"] * 10) + "]\n" for i in range(6)
            ),
            r"more than 20,000 values \(YAML anchors and aliases expanded\)",
        ),
        ("model: " + "[" * 5000 + "]" * 5000, "nested"),
    ],
    ids=["billion-laughs", "deep-nesting"],
)
def test_hostile_yaml_is_refused_quickly(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_job(path)


def test_a_huge_job_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_job(path)


# --- the one table of path fields, the flattened view, the generated reference -----------------------------------


# Free-form string fields of the schema that name no file, directory or store. A new string field must be added
# here or to raytrn.config.PATH_FIELDS: resolution, the relative-path refusal and `raytrn submit` read that table.
NOT_PATHS = {
    "model.preset",
    "model.lora.targets",
    "scaling.instance_type",
    "tracking.experiment",
    "tracking.run_name",
    "tracking.run_id",
    "tracking.registered_model",
    "eval.tasks",
    "neuron.cc_flags",
    "neuron.socket_ifname",
}


def _string_fields() -> set[str]:
    """Every field of the schema whose value may be a free-form string (Literal choices are not), dotted."""
    import typing

    from pydantic import BaseModel

    found: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            if info.exclude:
                continue
            key = prefix + (info.alias or name)
            args = typing.get_args(info.annotation) or (info.annotation,)
            for arg in args:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, key + ".")
            if str in args:
                found.add(key)

    walk(JobSpec, "")
    return found


def test_every_path_field_of_the_schema_is_in_the_table() -> None:
    from raytrn.config import PATH_FIELDS, field_info

    table = {f.key for f in PATH_FIELDS}
    assert len(table) == len(PATH_FIELDS)
    strings = _string_fields()
    assert "data.manifest" in strings and "model.init_from" in strings  # the walk finds optional fields too
    unlisted = strings - table - NOT_PATHS
    assert not unlisted, f"string fields neither in raytrn.config.PATH_FIELDS nor in NOT_PATHS: {sorted(unlisted)}"
    assert not table & NOT_PATHS
    for key in table | NOT_PATHS:
        field_info(key)  # a field of the schema (ConfigError otherwise)


def test_resolution_and_the_relative_path_check_read_the_table(tmp_path: Path) -> None:
    from raytrn.config import PATH_FIELDS, relative_local_paths

    relative = {
        "model.init_from": "hf",
        "data.manifest": "data/train",
        "data.validation": "data/val",
        "checkpoint.storage": "ckpt",
        "neuron.compile_cache": "cache",
        "tracking.mlflow_uri": "sqlite:///mlruns/mlflow.db",
        "eval.include_path": "tasks",
    }
    assert set(relative) == {f.key for f in PATH_FIELDS}  # one case per path field
    _hf_config(tmp_path / "hf")
    sets = [f"{k}={v}" for k, v in relative.items()]
    raw = load_job(write_job(tmp_path, tiny_raw()), sets, base_dir=str(tmp_path), resolve=False)
    assert relative_local_paths(raw) == relative
    job = resolve_paths(raw, "/base")
    for field in PATH_FIELDS:
        value = field.value(job)
        if field.key == "tracking.mlflow_uri":
            assert value == "sqlite:////base/mlruns/mlflow.db"
        elif field.resolve:
            assert value == f"/base/{relative[field.key]}", field.key
        else:  # the backend refuses a relative compile cache with its own message
            assert value == relative[field.key], field.key
    assert relative_local_paths(job) == {"neuron.compile_cache": "cache"}
    none = load_job(write_job(tmp_path, tiny_raw()), ["data.validation=none"], base_dir="/base", resolve=False)
    assert "data.validation" not in relative_local_paths(none)  # 'none' names no path
    assert resolve_paths(none, "/base").data.validation == "none"


def _hf_config(directory: Path) -> Path:
    """A Hugging Face config.json of jobs/tiny.yaml's model (all ``model.init_from`` reads when a job loads)."""
    import json

    from raytrn.config import PRESETS

    tiny = PRESETS["tiny"]
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "num_hidden_layers": tiny["num_layers"]}
    config |= {k: v for k, v in tiny.items() if k != "num_layers"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_flat_names_fields_as_the_yaml_does(tmp_path: Path) -> None:
    """MLflow params: `checkpoint.async` (the YAML's name), not the attribute `async_`."""
    flat = load_job(write_job(tmp_path, tiny_raw()), ["checkpoint.async=true"], base_dir="/base").flat()
    assert flat["checkpoint.async"] is True
    assert "checkpoint.async_" not in flat


def test_every_field_has_a_description() -> None:
    from raytrn.config.reference import _fields, _sections

    missing = [f"{key}.{name}" for key, _, model in _sections(JobSpec, "") for name, info in _fields(model)
               if not info.description]  # fmt: skip
    assert not missing, f"fields without a description (docs/job-spec.md shows them): {missing}"


def test_docs_job_spec_is_generated_from_the_schema() -> None:
    from raytrn.config.reference import COMMAND, render

    doc = REPO / "docs" / "job-spec.md"
    assert doc.exists() and doc.read_text() == render(), f"docs/job-spec.md is stale: regenerate it with `{COMMAND}`"
    for section in ("model", "model.lora", "data", "optim", "scaling", "checkpoint", "tracking", "run", "parallel"):
        assert f"\n## {section}\n" in render()
    assert "| `async` | bool | false |" in render()
