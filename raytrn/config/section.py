"""The base of every job-spec section (:mod:`raytrn.config.schema`): no unknown keys, frozen, defaults validated,
and no boolean where a number belongs."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def is_numeric(annotation: Any) -> bool:
    """Whether a field's annotation is a number (``int``, ``float``, either or None, or a dict of them)."""
    if annotation in (int, float):
        return True
    args = get_args(annotation)
    if get_origin(annotation) is dict:
        return len(args) == 2 and is_numeric(args[1])
    return bool(args) and bool not in args and any(is_numeric(a) for a in args)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes ``true`` for 1 in a number field (``run.max_steps: true``): refused."""
        if info.field_name is None or not is_numeric(cls.model_fields[info.field_name].annotation):
            return value
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, bool) for v in values):
            raise ValueError(f"expected a number, got a boolean ({value!r})")
        return value
