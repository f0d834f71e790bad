"""`raytrn validate JOB --cluster FILE`: a job that asks for more than a cluster file can ever provide is refused
before submission, with the arithmetic (raytrn.cluster.capacity)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.cli import main
from raytrn.cluster.capacity import check_job_fits, load_capacity
from raytrn.config import load_job
from raytrn.errors import ConfigError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def fits(job_file: str, cluster: str, *sets: str) -> list[str]:
    from raytrn.backends import get_backend

    job = load_job(REPO / "jobs" / job_file, list(sets), base_dir="/base")
    return check_job_fits(job, get_backend(job.scaling.accelerator).worker_resources(job), str(REPO / cluster))


def test_the_shipped_jobs_fit_their_clusters() -> None:
    # the trn1 (XLA path) job: tests/unit/test_xla_jobs.py
    assert fits("tiny.yaml", "cluster/local-sim.yaml")[0].startswith(
        f"cluster: {REPO}/cluster/local-sim.yaml holds up to 2"
    )


def test_more_workers_than_the_cluster_can_ever_hold_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(ConfigError) as e:
        fits("tiny.yaml", "cluster/local-sim.yaml", "scaling.min_workers=3", "scaling.max_workers=3")
    msg = str(e.value)
    assert "scaling.min_workers=3 worker(s) of {CPU: 1} is more than" in msg
    assert (
        "at most 2 worker node(s) in all (max_workers: 2); trn1_32xl_ondemand: 2 node(s) x 1 worker(s) per node" in msg
    )
    assert "= 2 worker(s). Lower scaling.min_workers to at most 2" in msg
    # Elastic (a trn1 job of the XLA path): tests/unit/test_xla_jobs.py


def test_capacity_of_hostile_files_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "max_workers: 1000000000000000000000\nhead_node_type: h\navailable_node_types:\n"
        "  h: {resources: {CPU: 0}}\n  w: {max_workers: -3, resources: {CPU: .inf, neuron_cores: 1e300}}\n"
    )
    cap = load_capacity(str(path))
    assert [(g.max_nodes, g.resources) for g in cap.groups] == [(0, {"neuron_cores": 1e300})]


def test_validate_cluster_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    job, cluster = str(REPO / "jobs" / "tiny.yaml"), str(REPO / "cluster" / "local-sim.yaml")
    assert (
        main(
            [
                "validate",
                job,
                "--no-data",
                "--cluster",
                cluster,
                "--set",
                "scaling.min_workers=5",
                "--set",
                "scaling.max_workers=5",
            ]
        )
        == 2
    )
    assert "is more than" in capsys.readouterr().err
    assert main(["validate", job, "--no-data", "--cluster", cluster]) == 0
    assert "holds up to 2 worker(s)" in capsys.readouterr().out


def test_a_count_too_large_for_a_float_is_not_a_number() -> None:
    """Found by the property test on a mutated KubeRay manifest: float(10**400) raises OverflowError."""
    from raytrn.cluster.capacity import _number

    assert _number(10**400) is False and _number(2.5) is True
