"""Reading a job spec: a YAML file plus ``--set`` overrides, validated into a :class:`JobSpec`.

Errors name the file, the field path and the fix (``jobs/tiny.yaml: scaling.max_worker: unknown field. Did you
mean 'max_workers'?``); reading is bounded (file size, values after YAML aliases, nesting). Also the field
lookup a sweep uses (:func:`field_info`, :func:`check_field_value`).
"""

from __future__ import annotations

import copy
import difflib
import os
import reprlib
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from raytrn.config.hf_config import merge_config
from raytrn.config.paths import PATH_FIELDS, path_field, resolve_paths, uri_problem
from raytrn.config.schema import JobSpec
from raytrn.errors import ConfigError

#: A job file larger than this is not a job file (a job spec is a few kilobytes).
MAX_JOB_FILE_BYTES = 1 << 20
#: Values in a job spec after YAML aliases are expanded (anchors that expand exponentially are refused).
MAX_SPEC_VALUES = 20_000


def load_job(
    path: str | os.PathLike,
    overrides: list[str] | None = None,
    *,
    base_dir: str | None = None,
    resolve: bool = True,
    values: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
    raw: dict[str, Any] | None = None,
) -> JobSpec:
    """Read, override, validate and path-resolve a job spec; raise ConfigError with a clear message.

    ``resolve=False`` leaves local paths as written (see :func:`relative_local_paths`). ``values`` are typed
    overrides (``{"optim.lr": 0.001}``, applied after the ``--set`` strings), named in messages as ``labels``
    says (default ``--set <field>``). ``raw``: the file's mapping already read (:func:`read_job_mapping`)."""
    path = str(path)
    raw = copy.deepcopy(raw) if raw is not None else read_job_mapping(path)
    if "sweep" in raw:
        raise ConfigError(
            f"{path}: has a sweep: section (a search space over this job): run it with `raytrn sweep {path}`, or "
            "train the job without the section"
        )
    overridden = apply_overrides(raw, overrides or [])
    for key, value in (values or {}).items():
        set_value(raw, key, value, where=(labels or {}).get(key, f"--set {key}"))
        overridden.add(key)
    _check_uris(raw, path, overridden, labels)  # before init_from's config.json is looked for there
    raw = _with_init_from(raw, base_dir or os.getcwd(), source=path)
    job = parse_job(raw, source=path, overridden=overridden, labels=labels)
    return resolve_paths(job, base_dir or os.getcwd()) if resolve else job


def read_job_mapping(path: str) -> dict[str, Any]:
    """A job file's YAML mapping (not validated), or a ConfigError naming what is wrong with the file."""
    text = read_config_text(path, what="job file", examples="jobs/")
    raw = safe_load_yaml(text, path)
    if raw is None:
        raise ConfigError(f"{path}: job file is empty; see jobs/tiny.yaml for the sections a job needs")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a job spec must be a YAML mapping of sections, got {type(raw).__name__}")
    return raw


def read_job_file(path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A job file's mapping without its ``sweep:`` section (:mod:`raytrn.sweep`), and that section (None: none)."""
    raw = read_job_mapping(path)
    return raw, raw.pop("sweep", None)


def set_value(raw: dict[str, Any], key: str, value: Any, *, where: str) -> None:
    """Set the dotted ``key`` of a raw job mapping to ``value``, creating sections on the way."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def check_field_value(key: str, value: Any, *, where: str) -> None:
    """ConfigError when ``value`` is not one the job-spec field ``key`` takes on its own (its type and its range;
    checks across fields are the job's)."""
    info = field_info(key)
    form: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    adapter: Any = TypeAdapter(form)
    try:
        adapter.validate_python(value)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where}: {msg} (got {reprlib.repr(value)})") from None


def field_annotation(key: str) -> Any:
    return field_info(key).annotation


def field_info(key: str) -> Any:
    """The pydantic FieldInfo of the job-spec field ``key`` (``"optim.lr"``); a ConfigError (to be prefixed with where
    the key came from) naming the closest field when there is no such field (did-you-mean, as ``--set``)."""
    model: type[BaseModel] = JobSpec
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {(f.alias or n): f for n, f in model.model_fields.items() if n != "source"}
        if part not in fields:
            prefix = ".".join(parts[:i])
            near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            hint = (
                f"Did you mean '{prefix + '.' if prefix else ''}{near[0]}'?"
                if near
                else f"Known fields{' of ' + prefix if prefix else ''}: {', '.join(fields)}."
            )
            raise ConfigError(f"unknown field. {hint}")
        if i == len(parts) - 1:
            return fields[part]
        section = _section_model(fields[part].annotation)
        if section is None:
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        model = section
    return None  # pragma: no cover - the loop returns


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The section model in an annotation (``LoraConfig | None`` -> ``LoraConfig``), else None."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _with_init_from(raw: dict[str, Any], base_dir: str, *, source: str) -> dict[str, Any]:
    """``model.init_from``'s config.json merged into the model section (the job's own values must agree)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str):
        return raw
    location = model["init_from"]
    if "://" in location:
        # Remote: read where the job starts (the cluster has the credentials), not where it is written or validated
        # (raytrn.train.checks.check_init_from); the job gives the sizes.
        if model.get("preset") is None and model.get("hidden_size") is None:
            raise ConfigError(
                f"{source}: model.init_from {location} is remote: give the model's sizes in the job (model.preset, or "
                "hidden_size, num_layers, ...); its config.json is checked against them when the job starts"
            )
        return raw
    return {
        **raw,
        "model": merge_config(model, str(path_field("model.init_from").absolute(location, base_dir)), where=source),
    }


def read_config_text(path: str, *, what: str, examples: str) -> str:
    """A config file's text, or a ConfigError saying what is wrong with the path (or its size)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOB_FILE_BYTES + 1)
        if len(data) > MAX_JOB_FILE_BYTES:
            raise ConfigError(
                f"{path}: {what} is larger than {MAX_JOB_FILE_BYTES >> 20} MiB; is this the right file? "
                f"(shipped examples are in {examples})"
            )
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found (check the path; shipped examples are in {examples})") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.__class__.__name__}: {e}") from None


#: An integer in a config file with more digits than this is a mistake (the largest setting, a seed, has 20).
MAX_INT_DIGITS = 100


class YamlValueError(yaml.YAMLError):
    """A value YAML can spell but no config file means: a duplicate key, an integer of :data:`MAX_INT_DIGITS`+ digits."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (the last would silently win; keys a merge
    ``<<`` brings in may be overridden, as YAML intends) and integers of more than :data:`MAX_INT_DIGITS` digits
    (Python refuses to read 4,300+ at all), each as a :class:`YamlValueError` at its line and column."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(c.isalnum() for c in str(node.value))  # (hex, octal and binary too)
        if digits > MAX_INT_DIGITS:
            raise YamlValueError(f"an integer of {digits:,} digits; no setting takes more than {MAX_INT_DIGITS}",
                                 node.start_mark)  # fmt: skip
        return int(super().construct_yaml_int(node))

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # unhashable: the base class says so
                continue
            if first is not key_node.start_mark:
                raise YamlValueError(
                    f"key {key!r} given twice in one mapping (first at line {getattr(first, 'line', 0) + 1}); the last one would "
                    "silently win: keep one",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)


def yaml_value(text: str, where: str) -> Any:
    """One value as ``--set`` (or a sweep's ``--grid``) reads it: YAML, else the text itself; a duplicate key or a
    huge integer in it is a ConfigError naming ``where``."""
    try:
        return yaml.load(text, Loader=Loader) if text.strip() else None  # noqa: S506 (Loader is a SafeLoader)
    except YamlValueError as e:
        raise ConfigError(f"{where}: {e.problem}") from None
    except (yaml.YAMLError, RecursionError):
        return text


def safe_load_yaml(text: str, where: str, *, documents: bool = False) -> Any:
    """``yaml.safe_load`` (or ``safe_load_all`` as a list) with bounded work: a syntax error, nesting too
    deep for the parser, aliases that expand to more than :data:`MAX_SPEC_VALUES` values, a key given twice or an
    integer of thousands of digits (:class:`Loader`) is one ConfigError."""
    try:
        if documents:
            data = [d for d in yaml.load_all(text, Loader=Loader) if d is not None]  # noqa: S506 (a SafeLoader)
        else:
            data = yaml.load(text, Loader=Loader)  # noqa: S506 (Loader is a SafeLoader)
    except yaml.YAMLError as e:
        raise yaml_syntax_error(where, e) from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply to be a config file") from None
    check_size(data, where)
    return data


def check_size(data: Any, where: str, limit: int = MAX_SPEC_VALUES, max_depth: int = 64) -> None:
    """ConfigError when ``data`` (YAML/JSON values, aliases expanded) holds more than ``limit`` values or nests
    deeper than ``max_depth``: a config file is small, and everything that walks it must stay bounded."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limit:
            raise ConfigError(
                f"{where}: more than {limit:,} values (YAML anchors and aliases expanded); a config file is much "
                "smaller: check for aliases that repeat large sections"
            )
        if depth > max_depth:
            raise ConfigError(f"{where}: nested more than {max_depth} levels deep; a config file is much flatter")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node)
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)


def yaml_syntax_error(path: str, e: yaml.YAMLError) -> ConfigError:
    """``file:line:col: YAML syntax error: ...`` for a YAML parse error."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
    problem = getattr(e, "problem", None) or str(e)
    if isinstance(e, YamlValueError):
        return ConfigError(f"{where}: {problem}")
    return ConfigError(f"{where}: YAML syntax error: {problem}")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> set[str]:
    """Apply ``a.b=value`` strings in place (value parsed as YAML); return the overridden paths."""
    done: set[str] = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set optim.lr=3e-4")
        parsed = yaml_value(value, f"--set {key}")
        check_size(parsed, f"--set {key}")
        set_value(raw, key, parsed, where=f"--set {item!r}")
        done.add(key)
    return done


def parse_job(
    raw: dict[str, Any],
    *,
    source: str = "<job>",
    overridden: set[str] | frozenset[str] = frozenset(),
    labels: dict[str, str] | None = None,
) -> JobSpec:
    """Validate a raw mapping into a JobSpec, turning pydantic errors into one ConfigError."""
    check_size(raw, source)
    _check_uris(raw, source, overridden, labels)
    lines = []
    if "source" in raw:  # not a YAML field: it would be silently replaced by the file name
        lines.append(_describe_error({"loc": ("source",), "type": "extra_forbidden", "msg": ""}, raw, overridden))
    try:
        job = JobSpec.model_validate({**raw, "source": source})
    except ValidationError as e:
        lines += [_describe_error(err, raw, overridden, labels) for err in e.errors()]
    if lines:
        head = f"{source}: " if len(lines) == 1 else f"{source}: {len(lines)} problems:\n  "
        raise ConfigError(head + "\n  ".join(lines))
    return job


def _check_uris(
    raw: dict[str, Any], source: str, overridden: set[str] | frozenset[str], labels: dict[str, str] | None
) -> None:
    """ConfigError for the first path field holding a malformed storage URI (``s3:/bucket``, ``s3://``, an invalid
    bucket name): refused here, by every command, not when a worker first reads it."""
    for field in PATH_FIELDS:
        section = raw.get(field.section)
        value = section.get(field.name) if isinstance(section, dict) else None
        if field.kind != "path" or not isinstance(value, str) or not field.names_path(value):
            continue
        if problem := uri_problem(value):
            where = field.key
            if _is_overridden(field.key, overridden):
                where = (labels or {}).get(field.key, f"--set {field.key}")
            raise ConfigError(f"{source}: {where}: {problem}")


# ---------------------------------------------------------------------------------------------------
# Error messages


def _describe_error(
    err: Any, raw: dict[str, Any], overridden: set[str] | frozenset[str], labels: dict[str, str] | None = None
) -> str:
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    path = ".".join(loc)
    if not path:  # a cross-section check: its message names the fields
        return err["msg"].removeprefix("Value error, ")
    where = path
    if _is_overridden(path, overridden):
        where = next((label for key, label in (labels or {}).items() if _is_overridden(path, {key})), f"--set {path}")
    kind = err["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        choices = [f.alias or n for n, f in model.model_fields.items() if n != "source"] if model else []
        near = difflib.get_close_matches(loc[-1], choices, n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else f" Known fields: {', '.join(choices)}."
        return f"{where}: unknown field.{hint}"
    if kind == "missing":
        return f"{where}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = reprlib.repr(err.get("input"))
    if kind.endswith("_parsing") or kind.endswith("_type") or kind == "literal_error":
        return f"{where}: {msg} (got {got})"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
        return f"{where}: {msg.lower()} (got {got})"
    return f"{where}: {msg}"


def _is_overridden(path: str, overridden: set[str] | frozenset[str]) -> bool:
    return any(path == o or path.startswith(o + ".") or o.startswith(path + ".") for o in overridden)


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model
