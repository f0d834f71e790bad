"""Trainium3 (issue 49, item 4): the trn3 instance types are in raytrn's table, marked unconfirmed with their
sources; `raytrn estimate`, `raytrn validate --cluster` and `raytrn cluster validate` take them and say UNCONFIRMED,
with the source, once. Offline: no Ray, no Neuron."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrn.backends.neuron_env import INSTANCES
from raytrn.cli import main
from raytrn.config import load_job
from raytrn.estimate.devices import GIB, worker_device

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "llama3-8b-trn2.yaml")  # 64 workers a node: trn3.48xlarge's logical cores at LNC 2 too
CLUSTER = str(REPO / "cluster" / "aws-trn3.yaml")
ON_TRN3 = ["--set", "scaling.instance_type=trn3.48xlarge"]
LNC1 = ["--set", "neuron.lnc=1", "--set", "scaling.workers_per_node=128", "--set", "scaling.min_workers=128",
        "--set", "scaling.max_workers=256"]  # fmt: skip


@pytest.mark.parametrize("lnc", [2, 1])
def test_the_estimate_says_unconfirmed_with_the_source_and_144_over_8_gib_a_core(
    lnc: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's device memory is 144 GiB a chip / 8 NeuronCore-v4 x LNC: 36 GiB at LNC 2, 18 at LNC 1."""
    extra = LNC1 if lnc == 1 else []
    assert main(["estimate", JOB, "--no-history", *ON_TRN3, *extra]) == 0
    out = capsys.readouterr().out
    device = next(line for line in out.splitlines() if line.startswith("device: "))
    gib = 144 / 8 * lnc
    assert device.startswith(f"device: trn3.48xlarge logical NeuronCore (LNC={lnc}): {gib:.1f} GiB, ")
    assert f"{671 / 8 * lnc:,.1f} TFLOP/s bf16" in device  # 671 dense BF16 TFLOPS a chip of 8 cores
    assert f"(UNCONFIRMED: 144 GiB HBM a chip x 16 over {128 // lnc} cores; " in device
    assert INSTANCES["trn3.48xlarge"].source in device
    assert out.count("UNCONFIRMED") == 1  # once
    assert "memory a worker: " in out and f" planned for ({gib * 0.9:,.1f} GiB)" in out
    assert "cost spot: pass --spot-usd-per-hour" in out and "cost on-demand" not in out  # no trn3 price
    job = load_job(JOB, ["scaling.instance_type=trn3.48xlarge", *LNC1[1::2]] if lnc == 1 else ON_TRN3[1::2],
                   resolve=False)  # fmt: skip
    device_ = worker_device(job)
    assert device_.memory_bytes == int(gib * GIB) and device_.confirmed is False


def test_the_estimate_json_and_a_cluster_file_name_the_unconfirmed_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", JOB, "--no-history", "--cluster", CLUSTER, "--json"]) == 0  # the file's instance type
    device = json.loads(capsys.readouterr().out)["device"]
    assert device["name"] == "trn3.48xlarge logical NeuronCore (LNC=2)" and device["confirmed"] is False
    assert device["memory_bytes"] == 36 * GIB and INSTANCES["trn3.48xlarge"].source in device["source"]


def test_validate_against_the_trn3_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    """A trn2 job on the trn3 cluster file: one clear error naming the instance types; moved over by its
    instance type, it validates, the layout UNCONFIRMED once, and fits the cluster."""
    assert main(["validate", JOB, "--no-data", "--cluster", CLUSTER]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scaling.instance_type='trn2.48xlarge' but" in err
    assert "has no worker node type of that instance type (it has: trn3.48xlarge)" in err
    assert main(["validate", JOB, "--no-data", "--cluster", CLUSTER, *ON_TRN3]) == 0
    out = capsys.readouterr().out
    assert "note: neuron layout: trn3.48xlarge (64 NeuronCores at LNC=2), 64 workers per node" in out
    assert out.count("UNCONFIRMED") == 1 and INSTANCES["trn3.48xlarge"].source in out
    assert "cluster: " in out and " holds up to 256 worker(s)" in out
    assert "estimate: fits (9.8 GiB a worker of 36.0)" in out  # no price: no $/hour
    assert out.rstrip().endswith(f"{JOB}: OK")


def test_neuron_xla_is_still_refused_on_trn3(capsys: pytest.CaptureFixture[str]) -> None:
    trn1 = str(REPO / "jobs" / "llama3-8b-trn1.yaml")
    assert main(["validate", trn1, "--no-data", *ON_TRN3]) == 2
    assert "never ran on Trainium3 (trn3.48xlarge)" in capsys.readouterr().err


def test_cluster_validate_the_trn3_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "validate", CLUSTER, "--template"]) == 0
    out = capsys.readouterr().out
    assert out.count("UNCONFIRMED") == 1 and INSTANCES["trn3.48xlarge"].source in out
    assert "trn3_48xl: trn3.48xlarge, neuron_cores 64 at LNC=2" in out
    assert out.rstrip().endswith(f"{CLUSTER}: OK")


def test_a_kuberay_manifest_on_trn3_says_so_once(tmp_path: Path) -> None:
    from raytrn.cluster.validate import validate_cluster_file

    text = (REPO / "cluster" / "kuberay" / "raycluster-trn2.yaml").read_text()
    manifest = tmp_path / "raycluster-trn3.yaml"
    text = text.replace("trn2.48xlarge", "trn3.48xlarge").replace(
        "vpc.amazonaws.com/efa: 16", "vpc.amazonaws.com/efa: 8"
    )
    manifest.write_text(text)
    notes = validate_cluster_file(str(manifest), template=True)
    assert [n for n in notes if "UNCONFIRMED" in n] == [INSTANCES["trn3.48xlarge"].unconfirmed_note()]
    job = tmp_path / "rayjob.yaml"  # a RayJob on an existing RayCluster: no worker groups of its own, no note
    job.write_text(
        "apiVersion: ray.io/v1\nkind: RayJob\nmetadata: {name: j}\n"
        "spec: {entrypoint: raytrn train jobs/tiny.yaml, clusterSelector: {ray.io/cluster: c}}\n"
    )
    assert not [n for n in validate_cluster_file(str(job)) if "UNCONFIRMED" in n]


def test_unconfirmed_notes_read_unvalidated_yaml() -> None:
    from raytrn.cluster.validate import unconfirmed_notes

    hostile = [["trn3.48xlarge"], {"a": 1}, None, 3, "trn2.48xlarge", "trn3e.24xlarge", "trn3e.24xlarge"]
    assert unconfirmed_notes(hostile) == [INSTANCES["trn3e.24xlarge"].unconfirmed_note()]
