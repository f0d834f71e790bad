"""The job spec's path fields, in one table: :data:`PATH_FIELDS`.

Three things read it and nothing else lists path fields: :func:`resolve_paths` (local paths made absolute
where the job is loaded: workers do not share the driver's cwd), :func:`relative_local_paths` (the relative
local paths a job cannot use in a Ray job's temporary working dir) and :func:`absolute_overrides` (the
``--set`` values ``raytrn submit`` freezes for the local simulator, which shares this filesystem).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

from raytrn.config.schema import JobSpec

_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class PathField:
    """One path field of the job spec and how it is treated."""

    key: str  # the dotted field, "data.manifest"
    #: ``resolve_paths`` makes it absolute. False: kept as written, the backend refuses a relative one with its own
    #: message (a compile cache must be a path every host can use), but ``raytrn submit`` still freezes it.
    resolve: bool = True
    #: A value that names no path ("none": data.validation's "no validation set").
    none: str | None = None
    #: "path": a local path or a URI (anything with "://"); "mlflow_uri": an MLflow tracking URI (a relative
    #: ``sqlite:///`` file or bare path is local; null means $MLFLOW_TRACKING_URI or the default store).
    kind: Literal["path", "mlflow_uri"] = "path"

    @property
    def section(self) -> str:
        return self.key.split(".")[0]

    @property
    def name(self) -> str:
        return self.key.split(".")[1]

    def value(self, job: JobSpec) -> str | None:
        """This field's value in ``job``."""
        value: str | None = getattr(getattr(job, self.section), self.name)
        return value

    def names_path(self, value: str | None) -> bool:
        """Whether ``value`` names a path at all (not null, empty or :attr:`none`)."""
        return bool(value) and value != self.none

    def is_relative(self, value: str) -> bool:
        """Whether ``value`` is a local path relative to the cwd (or to a home directory: ``~``)."""
        if self.kind == "mlflow_uri" and value.startswith("sqlite:///"):
            value = value.removeprefix("sqlite:///")
        return not _URI_SCHEME.match(value) and not os.path.isabs(value)

    def absolute(self, value: str | None, base_dir: str) -> str | None:
        """``value`` with a local path made absolute against ``base_dir`` (URIs as they are)."""
        if self.kind == "mlflow_uri":
            return resolve_mlflow_uri(value, base_dir)
        if value is None or not self.names_path(value):
            return value
        return value if "://" in value else os.path.abspath(os.path.join(base_dir, os.path.expanduser(value)))


#: Every field of the job spec that names a file, directory or store (tests/unit/test_config.py checks that every
#: free-form string field of the schema is here or named as not a path).
PATH_FIELDS: tuple[PathField, ...] = (
    PathField("model.init_from"),
    PathField("data.manifest"),
    PathField("data.validation", none="none"),
    PathField("checkpoint.storage"),
    PathField("neuron.compile_cache", resolve=False),
    PathField("tracking.mlflow_uri", kind="mlflow_uri"),
    PathField("eval.include_path"),
)


#: An S3 bucket name (AWS's rules for general purpose buckets): 3-63 lowercase letters, digits, dots and hyphens,
#: starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def uri_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a storage location (a local path or ``s3://BUCKET/PREFIX``), or None: a
    malformed S3 URI (``s3:/bucket``, ``s3://``, ``S3://``) or an invalid bucket name."""
    scheme, sep, _ = value.partition(":")
    if sep and scheme.lower() == "s3" and not value.startswith("s3://"):
        return f"{value!r} is not an S3 URI: write s3://BUCKET/PREFIX (lowercase s3, two slashes)"
    if not value.startswith("s3://"):  # a local path, or another filesystem pyarrow may know
        return None
    bucket = urlparse(value).netloc
    if not bucket:
        return f"{value!r} names no bucket: write s3://BUCKET/PREFIX"
    if not _BUCKET.match(bucket) or ".." in bucket or _IPV4.match(bucket) or bucket.startswith("xn--"):
        return (
            f"{value!r}: {bucket!r} is not a valid S3 bucket name (3-63 characters: lowercase letters, digits, dots "
            "and hyphens, starting and ending with a letter or digit)"
        )
    return None


def path_field(key: str) -> PathField:
    """The entry of :data:`PATH_FIELDS` for the dotted field ``key``."""
    return next(f for f in PATH_FIELDS if f.key == key)


def resolve_mlflow_uri(uri: str | None = None, base_dir: str = ".") -> str:
    """``uri`` > $MLFLOW_TRACKING_URI > ``sqlite:///mlruns/mlflow.db``, with local paths made absolute."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlruns/mlflow.db"

    def absolute(p: str) -> str:
        return os.path.abspath(os.path.join(base_dir, os.path.expanduser(p)))

    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + absolute(uri[len("sqlite:///") :])
    if not _URI_SCHEME.match(uri) and uri != "databricks":  # a bare path: MLflow's file store
        return absolute(uri)
    return uri


def relative_local_paths(job: JobSpec) -> dict[str, str]:
    """The fields of an unresolved job (``load_job(..., resolve=False)``) that name a local path relative to
    the directory the job runs in (or to a home directory): ``{field: value}``. On a cluster that directory is
    a temporary copy of the uploaded working dir, so such a path points at nothing, or at files lost when the
    job ends. ``tracking.mlflow_uri: null`` is not listed: it is decided where the job runs."""
    out = {}
    for field in PATH_FIELDS:
        value = field.value(job)
        if value is not None and field.names_path(value) and field.is_relative(value):
            out[field.key] = value
    return out


def absolute_overrides(job: JobSpec, base_dir: str) -> dict[str, str]:
    """``{field: absolute value}`` for every relative local path of an unresolved job (see
    :func:`relative_local_paths`), made absolute against ``base_dir``: ``raytrn submit``'s ``--set`` values
    for the local simulator, whose job runs elsewhere on this filesystem."""
    return {key: str(path_field(key).absolute(value, base_dir)) for key, value in relative_local_paths(job).items()}


def resolve_paths(job: JobSpec, base_dir: str) -> JobSpec:
    """Make local paths absolute (workers do not share the driver's cwd); leave URIs alone. Also fixes the run
    name (``tracking.run_name``), so a timestamped one is decided once."""
    updates: dict[str, dict[str, object]] = {"tracking": {"run_name": job.run_name}}
    for field in PATH_FIELDS:
        if field.resolve:
            updates.setdefault(field.section, {})[field.name] = field.absolute(field.value(job), base_dir)
    return job.model_copy(
        update={section: getattr(job, section).model_copy(update=values) for section, values in updates.items()}
    )
