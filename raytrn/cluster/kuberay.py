"""Structural checks of KubeRay manifests (``RayCluster`` / ``RayJob``, ``ray.io/v1``) for Trainium on EKS.

Not a Kubernetes schema validator (``kubectl apply --dry-run=server`` is): it checks what makes a raytrn
cluster silently useless: the required KubeRay fields, and per worker group that the Ray resource
``neuron_cores`` (``rayStartParams.resources``) equals the NeuronCores the pod requests from the Neuron
device plugin (``aws.amazon.com/neuroncore``, or ``aws.amazon.com/neuron`` devices x cores per device)
for the instance type of its node selector, and that multi-node groups request all the instance's EFA
devices (``vpc.amazonaws.com/efa``). Counts come from :data:`raytrn.backends.neuron_env.INSTANCES`.
"""

from __future__ import annotations

import json
from typing import Any

from raytrn import jsonfile
from raytrn.backends.neuron_env import INSTANCES
from raytrn.cluster.common import (
    as_list,
    expected_neuron_cores,
    load_yaml_documents,
    mapping_at,
    raise_problems,
    stack_warnings,
)
from raytrn.errors import ConfigError

API_VERSION = "ray.io/v1"
NEURONCORE = "aws.amazon.com/neuroncore"
NEURON_DEVICE = "aws.amazon.com/neuron"
EFA = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")


def validate_kuberay_file(path: str) -> list[str]:
    """Validate every RayCluster / RayJob document of a manifest; return info notes, raise ConfigError."""
    return validate_kuberay_documents(load_yaml_documents(path, what="KubeRay manifest"), source=path)


def validate_kuberay_documents(docs: list[Any], *, source: str) -> list[str]:
    """Validate loaded manifest documents (others, e.g. a Secret, are skipped with a note)."""
    if not docs:
        raise ConfigError(f"{source}: KubeRay manifest is empty")
    problems: list[str] = []
    notes: list[str] = []
    multi = len(docs) > 1
    for i, doc in enumerate(docs):
        where = f"[{i}]" if multi else ""
        if not isinstance(doc, dict):
            problems.append(f"{where or '<top>'}: a manifest must be a YAML mapping, got {type(doc).__name__}")
            continue
        kind = doc.get("kind")
        if kind not in ("RayCluster", "RayJob"):
            notes.append(f"{where or 'document'}: kind {kind!r} is not checked (only RayCluster / RayJob)")
            continue
        problems += _check_document(doc, f"{where}." if where else "", notes)
    raise_problems(source, problems)
    return notes


def _check_document(doc: dict[str, Any], prefix: str, notes: list[str]) -> list[str]:
    problems = []
    kind = doc["kind"]
    if doc.get("apiVersion") != API_VERSION:
        problems.append(
            f"{prefix}apiVersion: {doc.get('apiVersion')!r}; use {API_VERSION!r} (KubeRay >= 1.0; v1alpha1 is gone)"
        )
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        problems.append(f"{prefix}metadata.name: required field is missing")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems + [f"{prefix}spec: required field is missing (a mapping)"]
    if kind == "RayJob":
        if not spec.get("entrypoint"):
            problems.append(f"{prefix}spec.entrypoint: required field is missing, e.g. 'raytrn train JOB.yaml'")
        if "clusterSelector" in spec:
            notes.append(f"{prefix}spec.clusterSelector: the job runs on an existing RayCluster (not checked here)")
            return problems
        cluster, at = spec.get("rayClusterSpec"), f"{prefix}spec.rayClusterSpec"
        if not isinstance(cluster, dict):
            return problems + [f"{at}: required field is missing (the cluster to create for the job)"]
    else:
        cluster, at = spec, f"{prefix}spec"
    return problems + _check_cluster_spec(cluster, at, notes)


def _check_cluster_spec(spec: dict[str, Any], at: str, notes: list[str]) -> list[str]:
    problems = []
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        problems.append(f"{at}.headGroupSpec: required field is missing (rayStartParams + pod template)")
    else:
        problems += _check_template(head, f"{at}.headGroupSpec")
        problems += _check_exposure(spec, head, f"{at}.headGroupSpec", notes)
        for name, value in _container_resources(head).items():
            if name in (NEURONCORE, NEURON_DEVICE):
                problems.append(
                    f"{at}.headGroupSpec: the head requests {name}={value}; the head runs no training: schedule it "
                    "on a CPU node and drop the Neuron request"
                )
    groups = spec.get("workerGroupSpecs")
    if not isinstance(groups, list) or not groups:
        return problems + [f"{at}.workerGroupSpecs: required field is missing (a list of worker groups)"]
    elastic = False
    for i, group in enumerate(groups):
        where = f"{at}.workerGroupSpecs[{i}]"
        if not isinstance(group, dict):
            problems.append(f"{where}: a worker group must be a mapping")
            continue
        for key in ("groupName", "minReplicas", "maxReplicas", "template"):
            if key not in group:
                problems.append(f"{where}.{key}: required field is missing")
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if isinstance(lo, int) and isinstance(hi, int):
            elastic |= lo != hi
            if lo > hi:
                problems.append(f"{where}.minReplicas: {lo} exceeds maxReplicas ({hi}); set minReplicas <= {hi}")
        if "template" in group:
            problems += _check_template(group, where)
        problems += _check_neuron_group(group, where, notes)
    if elastic and not spec.get("enableInTreeAutoscaling"):
        notes.append(
            f"{at}.enableInTreeAutoscaling: off, so worker groups stay at `replicas` although minReplicas != "
            "maxReplicas; set it to true to scale with the job"
        )
    return problems


def _check_template(group: dict[str, Any], where: str) -> list[str]:
    template = group.get("template")
    pod = template.get("spec") if isinstance(template, dict) else None
    containers = pod.get("containers") if isinstance(pod, dict) else None
    if not isinstance(containers, list) or not containers:
        return [f"{where}.template.spec.containers: required field is missing (the Ray container)"]
    return [
        f"{where}.template.spec.containers[{i}].image: required field is missing"
        for i, c in enumerate(containers)
        if not isinstance(c, dict) or not c.get("image")
    ]


#: Head service types reachable from outside the Kubernetes cluster.
_EXTERNAL_SERVICE_TYPES = ("LoadBalancer", "NodePort")


def token_auth(spec: dict[str, Any], head: dict[str, Any]) -> bool:
    """Ray token authentication on: ``spec.authOptions.mode: token`` (KubeRay) or RAY_AUTH_MODE=token in the head
    container's environment (what raytrn's manifests set)."""
    if mapping_at(spec, "authOptions").get("mode") == "token":
        return True
    env = [e for c in _containers(head) for e in (c.get("env") or []) if isinstance(e, dict)]
    return any(e.get("name") == "RAY_AUTH_MODE" and e.get("value") == "token" for e in env)


def _check_exposure(spec: dict[str, Any], head: dict[str, Any], where: str, notes: list[str]) -> list[str]:
    """A head service reachable from outside the cluster (LoadBalancer, NodePort) without Ray token auth is an
    error: whoever reaches the dashboard port runs code on the cluster. With auth, a note."""
    service = head.get("serviceType")
    if service not in _EXTERNAL_SERVICE_TYPES:
        return []
    if not token_auth(spec, head):
        return [
            f"{where}.serviceType: {service} exposes the dashboard and job API beyond the Kubernetes cluster with Ray "
            "token authentication off: anyone who reaches it can run code. Use ClusterIP and `kubectl port-forward`, "
            "or turn token auth on (RAY_AUTH_MODE=token in the head container, or spec.authOptions.mode: token)"
        ]
    notes.append(
        f"{where}.serviceType: {service} exposes the (token-authenticated) dashboard beyond the Kubernetes cluster; "
        "restrict it (an internal load balancer, loadBalancerSourceRanges)"
    )
    return []


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    template = group.get("template")
    pod = template.get("spec") if isinstance(template, dict) else None
    containers = pod.get("containers") if isinstance(pod, dict) else None
    return [c for c in containers if isinstance(c, dict)] if isinstance(containers, list) else []


def _container_resources(group: dict[str, Any]) -> dict[str, Any]:
    """Extended resources of the pod's containers (limits, else requests), summed over containers."""
    total: dict[str, Any] = {}
    for c in _containers(group):
        limits, requests = mapping_at(c, "resources", "limits"), mapping_at(c, "resources", "requests")
        for name in (NEURONCORE, NEURON_DEVICE, EFA):
            value = limits.get(name, requests.get(name))
            if value is not None:
                total[name] = _as_int(total.get(name, 0)) + _as_int(value)
    return total


def _mismatched_requests(group: dict[str, Any], where: str) -> list[str]:
    problems = []
    for ci, c in enumerate(_containers(group)):
        limits, requests = mapping_at(c, "resources", "limits"), mapping_at(c, "resources", "requests")
        for name in (NEURONCORE, NEURON_DEVICE, EFA):
            if name in limits and name in requests and _as_int(limits[name]) != _as_int(requests[name]):
                problems.append(
                    f"{where}.template.spec.containers[{ci}].resources.requests.{name}: {requests[name]} differs "
                    f"from limits ({limits[name]}); Kubernetes requires them equal for extended resources"
                )
    return problems


def _as_int(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return -1


def ray_resources(start_params: Any) -> dict[str, Any]:
    """The ``resources`` of KubeRay ``rayStartParams`` (a JSON string, often quoted twice) as a dict."""
    value = start_params.get("resources") if isinstance(start_params, dict) else None
    for _ in range(3):  # '"{\"neuron_cores\": 32}"' -> '{"neuron_cores": 32}' -> {...}
        if not isinstance(value, str):
            break
        try:
            value = jsonfile.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _check_neuron_group(group: dict[str, Any], where: str, notes: list[str]) -> list[str]:
    selector = mapping_at(group, "template", "spec", "nodeSelector")
    itype = next((selector[k] for k in INSTANCE_TYPE_LABELS if k in selector), None)
    requested = _container_resources(group)
    ray_cores = ray_resources(group.get("rayStartParams")).get("neuron_cores")
    neuron_asked = NEURONCORE in requested or NEURON_DEVICE in requested or ray_cores is not None
    if not neuron_asked:
        return []
    problems = _mismatched_requests(group, where)
    if itype is None:
        return problems + [
            f"{where}.template.spec.nodeSelector: no node.kubernetes.io/instance-type; pin the group to one "
            "Trainium instance type (e.g. trn1.32xlarge) so its NeuronCore and EFA counts are known"
        ]
    spec = INSTANCES.get(str(itype))
    if spec is None:
        return problems + [
            f"{where}.template.spec.nodeSelector.node.kubernetes.io/instance-type: unknown Trainium instance type "
            f"{itype!r}; known: {', '.join(INSTANCES)}"
        ]
    env = [
        f"{e.get('name')}={e.get('value')}"
        for c in _containers(group)
        for e in as_list(c.get("env"))
        if isinstance(e, dict)
    ]
    node_cores, lnc = expected_neuron_cores(spec, env)
    commands = [str(x) for c in _containers(group) for x in as_list(c.get("command")) + as_list(c.get("args"))]
    notes += stack_warnings(where, spec, env + commands + [str(c.get("image", "")) for c in _containers(group)])
    per_device = node_cores // spec.neuron_devices
    if NEURONCORE in requested and NEURON_DEVICE in requested:
        problems.append(
            f"{where}: requests both {NEURONCORE} and {NEURON_DEVICE}; the Neuron device plugin allocates one "
            f"or the other: keep {NEURONCORE}: {node_cores}"
        )
    pod_cores = requested.get(NEURONCORE, _as_int(requested.get(NEURON_DEVICE, 0)) * per_device)
    lnc_note = f" at LNC={lnc}" if lnc else ""
    if not (NEURONCORE in requested or NEURON_DEVICE in requested):
        problems.append(
            f"{where}.template.spec.containers[0].resources.limits: no {NEURONCORE} request; the pod gets no "
            f"NeuronCores. Add {NEURONCORE}: {node_cores} (or {NEURON_DEVICE}: {spec.neuron_devices})"
        )
    elif pod_cores > node_cores:
        problems.append(
            f"{where}: the pod requests {pod_cores} NeuronCores but {itype} has {node_cores}{lnc_note}; the pod "
            f"can never be scheduled: request {node_cores}"
        )
    elif pod_cores < node_cores:
        notes.append(f"{where}: the pod uses {pod_cores} of {itype}'s {node_cores} NeuronCores")
    if ray_cores is None:
        problems.append(
            f"{where}.rayStartParams.resources: no neuron_cores; raytrn's workers request it, so no worker "
            f'would be placed here. Set resources: \'"{{\\"neuron_cores\\": {pod_cores}}}"\''
        )
    elif ray_cores != pod_cores:
        problems.append(
            f"{where}.rayStartParams.resources: neuron_cores={ray_cores!r} but the pod requests {pod_cores} "
            f"NeuronCores ({itype}{lnc_note}); set neuron_cores to {pod_cores}"
        )
    max_pods = group.get("maxReplicas", 0)
    efa = _as_int(requested.get(EFA, 0))
    if isinstance(max_pods, int) and max_pods > 1 and spec.efa_devices:
        if efa == 0:
            problems.append(
                f"{where}.template.spec.containers[0].resources.limits.{EFA}: missing; up to {max_pods} {itype} "
                f"pods run multi-node collectives: request all {spec.efa_devices} EFA devices"
            )
        elif efa != spec.efa_devices:
            problems.append(
                f"{where}.template.spec.containers[0].resources.limits.{EFA}: {efa} but {itype} has "
                f"{spec.efa_devices} EFA devices; request {spec.efa_devices}"
            )
    notes.append(
        f"{where}: {group.get('groupName')} on {itype}, {pod_cores} NeuronCores{lnc_note} per pod, "
        f"{group.get('minReplicas')}-{max_pods} pods, {efa} EFA"
    )
    return problems
