"""KubeRay manifests: the shipped ones pass; broken variants (loaded from a shipped file and mutated)
fail with the manifest path and the fix; ``raytrn cluster validate`` dispatches on ``kind``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrn.cluster.kuberay import ray_resources, validate_kuberay_documents, validate_kuberay_file
from raytrn.cluster.validate import validate_cluster_file
from raytrn.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
KUBERAY_FILES = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))
RAYCLUSTER = REPO / "cluster" / "kuberay" / "raycluster-trn1.yaml"
RAYCLUSTER_TRN2 = REPO / "cluster" / "kuberay" / "raycluster-trn2.yaml"
RAYJOB = REPO / "cluster" / "kuberay" / "rayjob-llama3-8b.yaml"


def load(path: Path) -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(path.read_text()))


def problems_of(doc: Any) -> str:
    with pytest.raises(ConfigError) as info:
        validate_kuberay_documents([doc], source="k.yaml")
    return str(info.value)


def worker(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return spec["workerGroupSpecs"][0]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return worker(doc)["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", KUBERAY_FILES, ids=lambda p: p.name)
def test_shipped_manifests_validate(path: Path) -> None:
    notes = validate_kuberay_file(str(path))
    cores = "64 NeuronCores at LNC=2 per pod" if "trn2" in path.name else "32 NeuronCores per pod"
    assert any(cores in n for n in notes)
    assert not any(n.startswith("warning:") for n in notes)
    checked = validate_cluster_file(str(path), template=True)  # the generic command dispatches on kind
    assert checked[: len(notes)] == notes and checked[len(notes) :][0].startswith("template: fill these before")


def test_a_trn2_pod_running_the_xla_venv_is_warned() -> None:
    doc = load(RAYCLUSTER_TRN2)
    container(doc)["env"].append(
        {"name": "PATH", "value": "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training/bin:/usr/bin"}
    )
    notes = validate_kuberay_documents([doc], source="c.yaml")
    assert (
        "warning: spec.workerGroupSpecs[0]: trn2.48xlarge trains with scaling.accelerator neuron, but "
        "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training is the neuron-xla venv (PyTorch/XLA + NxD); use "
        "/opt/aws_neuronx_venv_torch_neuronx_2_14_0 (DLAMI 'Deep Learning AMI Neuron torch-neuronx 2.14.0')"
    ) in notes


def test_shipped_manifests_are_autoscaling_trn1() -> None:
    assert {RAYCLUSTER, RAYJOB} <= set(KUBERAY_FILES)
    cluster = load(RAYCLUSTER)
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert worker(cluster)["minReplicas"] == 0
    assert ray_resources(worker(cluster)["rayStartParams"]) == {"neuron_cores": 32}
    assert container(cluster)["resources"]["limits"]["vpc.amazonaws.com/efa"] == 8
    assert container(load(RAYJOB))["resources"]["limits"]["aws.amazon.com/neuron"] == 16


@pytest.mark.parametrize(
    "value, expected",
    [('"{\\"neuron_cores\\": 32}"', {"neuron_cores": 32}), ('{"neuron_cores": 64}', {"neuron_cores": 64}), ("x", {})],
)
def test_ray_resources_parsing(value: str, expected: dict[str, Any]) -> None:
    assert ray_resources({"resources": value}) == expected


def test_neuron_cores_mismatch_with_the_pod() -> None:
    doc = load(RAYCLUSTER)
    worker(doc)["rayStartParams"]["resources"] = '"{\\"neuron_cores\\": 16}"'
    msg = problems_of(doc)
    assert "spec.workerGroupSpecs[0].rayStartParams.resources: neuron_cores=16 but the pod requests 32" in msg
    assert "set neuron_cores to 32" in msg


def test_neuron_cores_missing_from_ray_start_params() -> None:
    doc = load(RAYJOB)
    del worker(doc)["rayStartParams"]["resources"]
    msg = problems_of(doc)
    assert "spec.rayClusterSpec.workerGroupSpecs[0].rayStartParams.resources: no neuron_cores" in msg


def test_pod_asks_more_cores_than_the_instance() -> None:
    doc = load(RAYJOB)
    container(doc)["resources"]["limits"]["aws.amazon.com/neuron"] = 32  # 64 cores on a 32-core node
    msg = problems_of(doc)
    assert "the pod requests 64 NeuronCores but trn1.32xlarge has 32" in msg


def test_requests_differ_from_limits() -> None:
    doc = load(RAYCLUSTER)
    container(doc)["resources"]["requests"]["aws.amazon.com/neuroncore"] = 16
    assert "requests.aws.amazon.com/neuroncore: 16 differs from limits (32)" in problems_of(doc)


def test_efa_count_must_match_the_instance() -> None:
    doc = load(RAYCLUSTER)
    for res in container(doc)["resources"].values():
        res["vpc.amazonaws.com/efa"] = 4
    assert "resources.limits.vpc.amazonaws.com/efa: 4 but trn1.32xlarge has 8 EFA devices; request 8" in problems_of(
        doc
    )
    for res in container(doc)["resources"].values():
        del res["vpc.amazonaws.com/efa"]
    assert "vpc.amazonaws.com/efa: missing" in problems_of(doc)
    worker(doc)["maxReplicas"] = 1
    validate_kuberay_documents([doc], source="k.yaml")  # a single node needs no EFA


def test_trn1n_needs_16_efa() -> None:
    doc = load(RAYCLUSTER)
    worker(doc)["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] = "trn1n.32xlarge"
    assert "trn1n.32xlarge has 16 EFA devices; request 16" in problems_of(doc)


def test_unknown_or_missing_instance_type() -> None:
    doc = load(RAYCLUSTER)
    selector = worker(doc)["template"]["spec"]["nodeSelector"]
    selector["node.kubernetes.io/instance-type"] = "trn9.32xlarge"
    assert "unknown Trainium instance type 'trn9.32xlarge'" in problems_of(doc)
    del selector["node.kubernetes.io/instance-type"]
    assert "spec.workerGroupSpecs[0].template.spec.nodeSelector: no node.kubernetes.io/instance-type" in problems_of(
        doc
    )


def test_required_fields() -> None:
    doc = load(RAYCLUSTER)
    doc["apiVersion"] = "ray.io/v1alpha1"
    del worker(doc)["groupName"]
    del worker(doc)["maxReplicas"]
    del doc["spec"]["headGroupSpec"]
    msg = problems_of(doc)
    assert msg.startswith("k.yaml: 4 problems:")
    assert "apiVersion: 'ray.io/v1alpha1'; use 'ray.io/v1'" in msg
    assert "spec.workerGroupSpecs[0].groupName: required field is missing" in msg
    assert "spec.workerGroupSpecs[0].maxReplicas: required field is missing" in msg
    assert "spec.headGroupSpec: required field is missing" in msg


def test_rayjob_needs_entrypoint_and_cluster() -> None:
    doc = load(RAYJOB)
    del doc["spec"]["entrypoint"]
    del doc["spec"]["rayClusterSpec"]
    msg = problems_of(doc)
    assert "spec.entrypoint: required field is missing" in msg
    assert "spec.rayClusterSpec: required field is missing" in msg


def test_min_above_max_replicas_and_head_on_neuron() -> None:
    doc = load(RAYCLUSTER)
    worker(doc)["minReplicas"] = 5
    head = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["resources"]["limits"]["aws.amazon.com/neuroncore"] = 2
    msg = problems_of(doc)
    assert "spec.workerGroupSpecs[0].minReplicas: 5 exceeds maxReplicas (4)" in msg
    assert "spec.headGroupSpec: the head requests aws.amazon.com/neuroncore=2" in msg


def test_multi_document_manifest_through_the_generic_validator(tmp_path: Path) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ray-auth-token"}}
    bad = load(RAYCLUSTER)
    worker(bad)["rayStartParams"]["resources"] = '"{\\"neuron_cores\\": 8}"'
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all([secret, load(RAYJOB), bad]))
    with pytest.raises(ConfigError) as info:
        validate_cluster_file(str(path))
    assert f"{path}: [2].spec.workerGroupSpecs[0].rayStartParams.resources: neuron_cores=8" in str(info.value)


def test_malformed_and_missing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: ray.io/v1\nkind: RayCluster\nspec: {a: [1, 2}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3:\d+: YAML syntax error"):
        validate_kuberay_file(str(bad))
    with pytest.raises(ConfigError, match="KubeRay manifest not found"):
        validate_kuberay_file(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("service", ["LoadBalancer", "NodePort"])
def test_a_head_service_outside_the_cluster_without_token_auth_is_an_error(service: str) -> None:
    doc = load(RAYCLUSTER)
    head = doc["spec"]["headGroupSpec"]
    head["serviceType"] = service
    notes = validate_kuberay_documents([doc], source="k.yaml")  # token auth on (the shipped env): a note
    assert any(f"serviceType: {service} exposes the (token-authenticated) dashboard" in n for n in notes)
    for c in head["template"]["spec"]["containers"]:
        c["env"] = [e for e in c.get("env", []) if e.get("name") != "RAY_AUTH_MODE"]
    msg = problems_of(doc)
    assert f"spec.headGroupSpec.serviceType: {service} exposes the dashboard and job API beyond" in msg
    assert "token authentication off" in msg and "kubectl port-forward" in msg
    doc["spec"]["authOptions"] = {"mode": "token"}  # KubeRay's own switch counts too
    validate_kuberay_documents([doc], source="k.yaml")
