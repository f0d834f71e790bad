"""The job-spec reference, ``docs/job-spec.md``, rendered from the schema (:mod:`raytrn.config.schema`): one
table per section (field, type, default, description), so the reference cannot drift from the code.

Regenerate with ``python -m raytrn.config.reference > docs/job-spec.md`` (a unit test fails when it is stale).
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from raytrn.config.paths import PATH_FIELDS
from raytrn.config.schema import JobSpec

COMMAND = "python -m raytrn.config.reference > docs/job-spec.md"

_INTRO = """\
A job is one YAML file of the sections below (`jobs/*.yaml` are examples, loaded by the tests). Unknown fields are
refused with the nearest known name; `--set section.field=value` overrides any field (the value is parsed as YAML,
e.g. `--set optim.lr=3e-4 --set scaling.max_workers=null`). `raytrn validate JOB.yaml` checks a job without
running it.

Path fields take a local path or a URI (`s3://...`). A relative local path is relative to the directory `raytrn`
runs in; `raytrn submit` makes it absolute for the local simulator and refuses it for any other cluster (there, use
`s3://...` or an absolute path on a shared filesystem). The path fields:
{paths}.

A `sweep:` section (a search space over the job) is read by `raytrn sweep`, not by the job itself.
"""


def render() -> str:
    """``docs/job-spec.md``: the intro, a table of sections, then one table of fields per section."""
    sections = list(_sections(JobSpec, ""))
    paths = ", ".join(f"`{f.key}`" for f in PATH_FIELDS)
    out = [
        "# Job spec reference",
        "",
        f"<!-- Generated from raytrn/config/schema.py by `{COMMAND}`: edit the field descriptions there. -->",
        "",
        _INTRO.format(paths=paths),
        "| section | required | what it sets |",
        "| --- | --- | --- |",
    ]
    for key, field, model in sections:
        required = "yes" if field.is_required() else "no"
        out.append(f"| [`{key}`](#{key.replace('.', '')}) | {required} | {_cell(_summary(model))} |")
    for key, _field, model in sections:
        out += [
            "",
            f"## {key}",
            "",
            _doc(model),
            "",
            "| field | type | default | description |",
            "| --- | --- | --- | --- |",
        ]
        for name, info in _fields(model):
            if _section_of(info.annotation) is not None:
                what = f"the [`{key}.{name}`](#{key.replace('.', '')}{name}) section"
                description = f"{info.description}; {what}" if info.description else what
            else:
                description = info.description or ""
            out.append(f"| `{name}` | {_cell(_type(info))} | {_cell(_default(info))} | {_cell(description)} |")
    return "\n".join(out) + "\n"


def _sections(model: type[BaseModel], prefix: str) -> typing.Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    """``(dotted name, field, section model)`` for every section under ``model``, depth first."""
    for name, info in _fields(model):
        section = _section_of(info.annotation)
        if section is not None:
            key = f"{prefix}{name}"
            yield key, info, section
            yield from _sections(section, key + ".")


def _fields(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """The YAML fields of a section: ``(name as written in YAML, FieldInfo)`` in declaration order."""
    return [(info.alias or name, info) for name, info in model.model_fields.items() if not info.exclude]


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _doc(model: type[BaseModel]) -> str:
    """The section's own docstring (not BaseModel's) as one Markdown line."""
    doc = inspect.cleandoc(model.__dict__.get("__doc__") or "")
    return " ".join(doc.split()).replace("``", "`")


def _summary(model: type[BaseModel]) -> str:
    return _doc(model).split(". ")[0].rstrip(".")


def _type(info: FieldInfo) -> str:
    """The field's type as YAML sees it, with its range: ``int (> 0, <= 4096)``, ``"cpu" | "cuda"``."""
    text = _type_name(info.annotation)
    bounds = []
    for item in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >=")):
            value = getattr(item, attr, None)
            if value is not None:
                bounds.append(f"{sign} {_number(value)}")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a union member with its own bounds: ``int (> 0) | "auto"``
        return _type(FieldInfo.from_annotation(annotation))
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in args)
    if _section_of(annotation) is not None:
        return "section"
    if origin is not None:
        name = {dict: "mapping", list: "list", tuple: "list"}.get(origin, getattr(origin, "__name__", str(origin)))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    return {str: "string", bool: "bool", int: "int", float: "float", Any: "any"}.get(annotation, str(annotation))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(its defaults)"
    return json.dumps(value if not isinstance(value, float) else _number(value))


def _number(value: Any) -> Any:
    """1e-05 as 1e-05, 1048576 as 1048576, 2**63 as 2**63 (short forms of the bounds in the schema)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and (value & (value - 1)) == 0:
        return f"2^{value.bit_length() - 1}"
    if isinstance(value, int) and value >= 10**6 and str(value).rstrip("0") == "1":
        return f"10^{len(str(value)) - 1}"
    return value


def _cell(text: str) -> str:
    """Markdown table cell text: one line, ``|`` escaped."""
    return " ".join(str(text).split()).replace("``", "`").replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(render())
