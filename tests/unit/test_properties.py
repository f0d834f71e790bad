"""Property-based tests (hypothesis, seeded): for arbitrary YAML/JSON values and for mutations of the shipped
files, the job-spec parser, the cluster-file validators, the manifest reader and the neuron-monitor parser
never raise anything but a raytrn error that names where the problem is, and stay bounded in time and memory.
"""

from __future__ import annotations

import copy
import json
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrn.errors import BackendUnavailableError, RaytrnError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
LAUNCHER = [REPO / "cluster" / n for n in ("aws-trn1.yaml", "aws-trn2.yaml", "local-sim.yaml")]
KUBERAY = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))

SETTINGS = settings(
    derandomize=True,  # the same examples on every run: CI never meets a new input by chance
    # More when hunting: RAYTRN_HYPOTHESIS_EXAMPLES=5000 make unit (CI keeps the seeded 120).
    max_examples=int(os.environ.get("RAYTRN_HYPOTHESIS_EXAMPLES", "120")),
    deadline=5000,  # ms per example: every input is handled in bounded time
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_PEAK_BYTES = 64 << 20  # bounded memory: what one hostile input may allocate at most

# -- values ---------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),  # beyond any float
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "0", "-1", "1e999", "../..", "/etc/passwd", "s3://b/p", "REPLACE_ME", "null", "~"]),
)
keys = st.one_of(st.text(max_size=20), st.sampled_from(["model", "data", "scaling", "max_workers", "resources"]))
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(keys, children, max_size=5)),
    max_leaves=30,
)


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``node`` (dict keys and list indexes)."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


@st.composite
def mutations(draw: Callable, documents: list[Any]) -> Any:
    """A shipped document with 1-3 random edits: a value replaced, a key deleted, or an unknown key added."""
    doc = copy.deepcopy(draw(st.sampled_from(documents)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            doc = draw(values) if action == "replace" else doc
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if action == "replace":
            parent[last] = draw(values)
        elif action == "delete" and isinstance(parent, dict):
            del parent[last]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(keys)] = draw(values)
    return doc


def bounded(call: Callable[[], Any]) -> Any:
    """Run ``call`` and check it allocated at most MAX_PEAK_BYTES."""
    tracemalloc.start()
    try:
        return call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MAX_PEAK_BYTES, f"{peak / 2**20:.0f} MiB for one input"


def raytrn_error_only(call: Callable[[], Any], where: str) -> Any:
    """``call()``'s result, or None when it raised a RaytrnError whose message starts at ``where``."""
    try:
        return bounded(call)
    except RaytrnError as e:
        assert str(e).startswith(where), f"the error does not say where: {e}"
        return None


def _load(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(autouse=True, scope="module")
def _imports_done(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Import what the checks import (Ray Train, the backends) before memory is measured: a first import
    allocates ~100 MB once, whatever the input."""
    from raytrn.cluster.validate import validate_cluster_file
    from raytrn.config import load_job, read_job_file
    from raytrn.train.checks import check_job
    from tests.unit.test_jobs import _base

    base = _base(tmp_path_factory.mktemp("base"))
    for path in JOBS:
        raw, _ = read_job_file(str(path))  # a sweep's job file: the job without its sweep: section
        try:
            check_job(load_job(path, base_dir=base, raw=raw), data=False)
        except BackendUnavailableError:  # a backend this installation lacks (without raytrn.xla: trn1)
            pass
    for path in LAUNCHER + KUBERAY:
        validate_cluster_file(str(path), template=True)


# -- the job spec ---------------------------------------------------------------------------------------


def _check_spec(raw: Any) -> None:
    from raytrn.config import parse_job
    from raytrn.train.checks import check_job

    if not isinstance(raw, dict):
        return
    job = raytrn_error_only(lambda: parse_job(raw, source="job.yaml"), "job.yaml: ")
    if job is not None:  # a valid spec: every check that follows is bounded and raises raytrn errors only
        raytrn_error_only(lambda: check_job(job, data=False), "")


@SETTINGS
@given(values)
def test_job_parser_on_arbitrary_values(raw: Any) -> None:
    _check_spec(raw)


@SETTINGS
@given(mutations([_load(p)[0] for p in JOBS]))
def test_job_parser_on_mutated_shipped_jobs(raw: Any) -> None:
    _check_spec(raw)


@SETTINGS
@given(st.text(max_size=300), st.lists(st.text(max_size=40), max_size=3))
def test_job_files_of_any_text_and_any_overrides(
    tmp_path_factory: pytest.TempPathFactory, text: str, sets: list[str]
) -> None:
    from raytrn.config import load_job

    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_text(text)
    raytrn_error_only(lambda: load_job(path, sets, base_dir="/base"), "")


# -- cluster files -------------------------------------------------------------------------------------


def _check_cluster(doc: Any) -> None:
    from raytrn.cluster.capacity import capacity_of
    from raytrn.cluster.validate import validate_cluster_config

    raytrn_error_only(lambda: validate_cluster_config(doc, source="c.yaml"), "c.yaml: ")
    raytrn_error_only(lambda: capacity_of([doc], "c.yaml"), "c.yaml: ")


@SETTINGS
@given(values)
def test_cluster_validator_on_arbitrary_values(doc: Any) -> None:
    _check_cluster(doc)


@SETTINGS
@given(mutations([_load(p)[0] for p in LAUNCHER]))
def test_cluster_validator_on_mutated_shipped_files(doc: Any) -> None:
    _check_cluster(doc)


@SETTINGS
@given(mutations([_load(p) for p in KUBERAY]))
def test_kuberay_validator_on_mutated_shipped_manifests(docs: Any) -> None:
    from raytrn.cluster.capacity import capacity_of
    from raytrn.cluster.kuberay import validate_kuberay_documents

    docs = docs if isinstance(docs, list) else [docs]
    raytrn_error_only(lambda: validate_kuberay_documents(docs, source="k.yaml"), "k.yaml: ")
    raytrn_error_only(lambda: capacity_of(docs, "k.yaml"), "k.yaml: ")


# -- manifests -----------------------------------------------------------------------------------------


def _manifest_dict() -> dict[str, Any]:
    from tests.unit.test_manifest import _manifest

    return json.loads(_manifest(Path("/d")).to_json())


@SETTINGS
@given(st.one_of(values, mutations([_manifest_dict()])))
def test_manifest_reader_on_arbitrary_and_mutated_manifests(data: Any) -> None:
    from raytrn.data.manifest import Manifest

    raytrn_error_only(lambda: Manifest.from_dict(data, root="/d", where="m.json"), "m.json: ")


@SETTINGS
@given(st.text(max_size=400))
def test_manifest_files_of_any_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from raytrn.data.manifest import load_manifest

    root = tmp_path_factory.mktemp("ds")
    (root / "manifest.json").write_text(text)
    raytrn_error_only(lambda: load_manifest(str(root)), "")


# -- neuron-monitor ------------------------------------------------------------------------------------


def _report() -> dict[str, Any]:
    return json.loads((REPO / "tests" / "fixtures" / "neuron-monitor-report.json").read_text())


@SETTINGS
@given(st.one_of(values, mutations([_report()])))
def test_neuron_monitor_parser_never_raises(doc: Any) -> None:
    import math

    from raytrn.tracking.neuron_monitor import iter_reports, parse_report

    metrics = bounded(lambda: parse_report(doc))
    assert all(isinstance(k, str) and isinstance(v, float) and math.isfinite(v) for k, v in metrics.items())
    line = json.dumps(doc, default=str) if not isinstance(doc, float) or math.isfinite(doc) else "nan"
    list(iter_reports([line, "{not json", "", "[1, 2]"]))


@SETTINGS
@given(st.lists(st.text(max_size=200), max_size=10))
def test_neuron_monitor_stream_of_any_lines(lines: list[str]) -> None:
    from raytrn.tracking.neuron_monitor import iter_reports, parse_report

    for doc in iter_reports(lines):
        parse_report(doc)


@SETTINGS
@given(
    st.sampled_from(["neuroncore_utilization", "neuron_device", "host", "neuron_device_count"]),
    st.one_of(st.integers(min_value=10**300, max_value=10**400), st.floats(), st.text(max_size=5), st.none()),
)
def test_neuron_monitor_numbers_out_of_range_are_skipped(field: str, value: Any) -> None:
    """Targeted: every number the parser reads, replaced by one that is not a finite float."""
    import math

    from raytrn.tracking.neuron_monitor import parse_report

    def put(node: Any) -> None:
        if isinstance(node, dict):
            for k in node:
                if k == field:
                    node[k] = value
                else:
                    put(node[k])
        elif isinstance(node, list):
            for item in node:
                put(item)

    doc = _report()
    put(doc)
    metrics = parse_report(doc)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
