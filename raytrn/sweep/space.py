"""A sweep's search space and its trials: which job-spec fields vary, how, and the values of every trial.

Four kinds of dimension, on any job-spec field (``--grid optim.lr=1e-4,3e-4``, ``--choice ...``,
``--loguniform optim.lr=1e-5:1e-2``, ``--uniform ...``, or the same under a ``sweep:`` section of a YAML file).
The trials are drawn here, once, before anything runs: the grid's points (first dimension slowest, as
``itertools.product``), ``samples`` times over, each trial drawing its random dimensions from one generator
seeded with ``seed``. The list is what a sweep runs, records and resumes; the same flags and seed give the same
trials on any machine. A random dimension on an integer field draws integers (rounded, within the bounds).
"""

from __future__ import annotations

import itertools
import math
import reprlib
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from raytrn.config import check_size, field_annotation, yaml_value
from raytrn.errors import ConfigError

Kind = Literal["grid", "choice", "loguniform", "uniform"]
KINDS: tuple[Kind, ...] = ("grid", "choice", "loguniform", "uniform")
#: More trials than this is a mistake in the flags (a grid of grids), not a sweep.
MAX_TRIALS = 1000


@dataclass(frozen=True)
class Dimension:
    """One varied field: ``values`` for grid/choice, ``low``/``high`` for the random ranges."""

    field: str
    kind: Kind
    values: tuple[Any, ...] = ()
    low: float = 0.0
    high: float = 0.0
    integer: bool = False

    @property
    def flag(self) -> str:
        return f"--{self.kind} {self.field}"

    def describe(self) -> str:
        """``grid[0.0001, 0.0003]`` / ``loguniform(1e-05, 0.01)``: the parent run's param for this dimension."""
        if self.kind in ("grid", "choice"):
            return f"{self.kind}[{', '.join(format_value(v) for v in self.values)}]"
        return f"{self.kind}({format_value(self.low)}, {format_value(self.high)}){' int' if self.integer else ''}"

    def to_dict(self) -> dict[str, Any]:
        if self.kind in ("grid", "choice"):
            return {"field": self.field, "kind": self.kind, "values": list(self.values)}
        return {"field": self.field, "kind": self.kind, "low": self.low, "high": self.high, "integer": self.integer}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Dimension:
        return cls(
            field=d["field"], kind=d["kind"], values=tuple(d.get("values", ())), low=float(d.get("low", 0.0)),
            high=float(d.get("high", 0.0)), integer=bool(d.get("integer", False)),
        )  # fmt: skip

    def draw(self, rng: Any) -> Any:
        """A random value (choice, loguniform, uniform)."""
        if self.kind == "choice":
            return self.values[int(rng.integers(len(self.values)))]
        if self.kind == "loguniform":
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        if self.integer:
            return int(min(max(round(value), math.ceil(self.low)), math.floor(self.high)))
        return float(value)


def format_value(value: Any) -> str:
    """A value as a table cell or run-name part: floats to 4 significant digits, the rest as YAML writes it."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, bool | int | str) or value is None:
        return str(value)
    return yaml.safe_dump(value, default_flow_style=True).strip()


def parse_flag(kind: Kind, text: str) -> Dimension:
    """``FIELD=v1,v2`` (grid, choice: each value parsed as YAML, as ``--set`` does; ``FIELD=[[1, 2], [3, 4]]`` for
    list values) or ``FIELD=LOW:HIGH`` (loguniform, uniform) into a Dimension; ConfigError naming the flag."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    flag = f"--{kind} {reprlib.repr(text)}"
    if not sep or not key or any(not part for part in key.split(".")):
        example = "optim.lr=1e-4,3e-4" if kind in ("grid", "choice") else "optim.lr=1e-5:1e-2"
        raise ConfigError(f"{flag}: expected FIELD=VALUES with a dotted job-spec field, e.g. --{kind} {example}")
    if kind in ("grid", "choice"):
        return make_dimension(kind, key, _parse_values(rest, flag))
    low, colon, high = rest.partition(":")
    if not colon or not low.strip() or not high.strip():
        raise ConfigError(f"{flag}: expected FIELD=LOW:HIGH, e.g. --{kind} {key}=1e-5:1e-2")
    return make_dimension(kind, key, [_parse_number(low, flag), _parse_number(high, flag)])


def _parse_values(text: str, flag: str) -> list[Any]:
    text = text.strip()
    if not text:
        raise ConfigError(f"{flag}: no values; give at least one, e.g. --grid optim.lr=1e-4,3e-4")
    if text.startswith("["):  # the whole list as YAML (for values that are lists themselves)
        values = yaml_value(text, flag)
        if not isinstance(values, list):
            raise ConfigError(f"{flag}: not a YAML list: {reprlib.repr(text)}")
        return values
    out = []
    for part in text.split(","):
        if not part.strip():
            raise ConfigError(f"{flag}: an empty value between commas")
        out.append(yaml_value(part.strip(), flag))  # as --set reads a value
    return out


def _number(value: Any) -> Any:
    """``"1e-4"`` as the number it is (YAML 1.1, which PyYAML reads, wants ``1.0e-4``); anything else unchanged."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


def _parse_number(text: str, flag: str) -> float:
    value = _number(yaml_value(text.strip(), flag))
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{flag}: {text.strip()!r} is not a finite number")
    return float(value)


def make_dimension(kind: Kind, key: str, values: list[Any], *, where: str | None = None) -> Dimension:
    """A checked Dimension: the field exists (did-you-mean otherwise), grid/choice values are given, ranges are
    ordered (and positive for loguniform); an integer field gets integer draws."""
    where = where or f"--{kind} {key}"
    try:
        annotation = field_annotation(key)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if kind in ("grid", "choice"):
        if not values:
            raise ConfigError(f"{where}: no values; give at least one")
        check_size(values, where)
        if _is_numeric(annotation):
            values = [_number(v) for v in values]
        return Dimension(field=key, kind=kind, values=tuple(values))
    if len(values) != 2:
        raise ConfigError(f"{where}: expected [LOW, HIGH], got {reprlib.repr(values)}")
    low, high = (_parse_number(str(v), where) if not isinstance(v, int | float) else float(v) for v in values)
    if not low < high:
        raise ConfigError(f"{where}: LOW ({format_value(low)}) must be below HIGH ({format_value(high)})")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: a log-uniform range must be positive (got LOW {format_value(low)})")
    integer = _is_int(annotation)
    if integer and math.ceil(low) > math.floor(high):
        raise ConfigError(f"{where}: {key} is an integer field and no integer lies in [{low:g}, {high:g}]")
    return Dimension(field=key, kind=kind, low=low, high=high, integer=integer)


def _is_numeric(annotation: Any) -> bool:
    kinds = [a for a in (getattr(annotation, "__args__", None) or (annotation,)) if a is not type(None)]
    return any(a in (int, float) for a in kinds)


def _is_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return bool(args) and all(a is int for a in args)


@dataclass(frozen=True)
class SearchSpace:
    """The dimensions (grid ones first, in the order given), the samples per grid point and the seed."""

    dimensions: tuple[Dimension, ...]
    samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.dimensions:
            raise ConfigError(
                "nothing to sweep: give at least one --grid, --choice, --loguniform or --uniform (or a sweep: section "
                "with grid/choice/loguniform/uniform)"
            )
        seen: dict[str, Dimension] = {}
        for d in self.dimensions:
            if d.field in seen:
                raise ConfigError(f"{d.flag}: {d.field} is already swept by {seen[d.field].flag}; vary a field once")
            seen[d.field] = d
        if self.samples < 1:
            raise ConfigError(f"--samples {self.samples}: must be at least 1")
        if self.samples > 1 and not self.random:
            raise ConfigError(
                f"--samples {self.samples} with only grid dimensions repeats identical trials (same config, same seed); "
                "to repeat a grid over seeds add --grid run.seed=0,1,2"
            )
        count = self.num_trials
        if count > MAX_TRIALS:
            raise ConfigError(f"the search space has {count:,} trials (grid points x samples); at most {MAX_TRIALS}")

    @property
    def grid(self) -> tuple[Dimension, ...]:
        return tuple(d for d in self.dimensions if d.kind == "grid")

    @property
    def random(self) -> tuple[Dimension, ...]:
        return tuple(d for d in self.dimensions if d.kind != "grid")

    @property
    def fields(self) -> list[str]:
        return [d.field for d in self.dimensions]

    @property
    def num_trials(self) -> int:
        return math.prod(len(d.values) for d in self.grid) * self.samples

    def trials(self) -> list[dict[str, Any]]:
        """Every trial's values ``{field: value}``, in the order they run."""
        import numpy as np

        rng = np.random.default_rng(self.seed)
        points = list(itertools.product(*(d.values for d in self.grid)))
        out = []
        for _ in range(self.samples):
            for point in points:
                values = {d.field: v for d, v in zip(self.grid, point, strict=True)}
                values.update({d.field: d.draw(rng) for d in self.random})
                out.append({f: values[f] for f in self.fields})
        return out

    def describe(self) -> dict[str, str]:
        """``{"space.optim.lr": "grid[0.0001, 0.0003]", ...}``: the parent run's params."""
        return {f"space.{d.field}": d.describe() for d in self.dimensions}

    def to_dict(self) -> dict[str, Any]:
        return {"dimensions": [d.to_dict() for d in self.dimensions], "samples": self.samples, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SearchSpace:
        return cls(
            dimensions=tuple(Dimension.from_dict(x) for x in d["dimensions"]),
            samples=int(d.get("samples", 1)),
            seed=int(d.get("seed", 0)),
        )


def dimensions_from_section(section: dict[str, Any], where: str) -> list[Dimension]:
    """The dimensions of a ``sweep:`` section: ``grid: {optim.lr: [1e-4, 3e-4]}``, ``loguniform: {optim.lr:
    [1e-5, 1e-2]}``, ... (nested mappings are allowed too: ``grid: {optim: {lr: [...]}}``)."""
    out = []
    for kind in KINDS:
        block = section.get(kind)
        if block is None:
            continue
        if not isinstance(block, dict) or not block:
            raise ConfigError(
                f"{where}: sweep.{kind} must be a mapping of field: values, e.g. {kind}: {{optim.lr: ...}}"
            )
        for key, values in _leaves(block):
            label = f"{where}: sweep.{kind}.{key}"
            if not isinstance(values, list):
                shape = "[v1, v2, ...]" if kind in ("grid", "choice") else "[LOW, HIGH]"
                raise ConfigError(f"{label}: expected a list {shape}, got {reprlib.repr(values)}")
            out.append(make_dimension(kind, key, values, where=label))
    return out


def _leaves(block: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in block.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _leaves(v, key + ".")
        else:
            out.append((key, v))
    return out


def label(values: dict[str, Any]) -> str:
    """``optim.lr=0.001 data.global_batch_size=64``: a trial's values on one line."""
    return " ".join(f"{k}={format_value(v)}" for k, v in values.items())
