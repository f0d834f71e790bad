"""What a cluster file can ever provide to one job, and whether a job fits: ``raytrn validate JOB --cluster FILE``.

A job asks for ``max_workers`` workers of ``resources_per_worker`` each; a cluster-launcher YAML (or a
KubeRay RayCluster/RayJob) says how many worker nodes of each type it may launch and what Ray resources
each node advertises. The most workers the cluster can ever hold is computed per node type (workers per
node: the tightest resource, capped at ``scaling.workers_per_node``) and over the node budget (the file's
``max_workers``), arithmetically. A job that asks for more is refused before anything is submitted, with
the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raytrn.cluster.common import as_list, load_yaml_documents, mapping_at
from raytrn.cluster.kuberay import INSTANCE_TYPE_LABELS, ray_resources
from raytrn.errors import ConfigError


@dataclass(frozen=True)
class NodeGroup:
    """A worker node type: how many nodes at most, the Ray resources each declares, its instance type (if named)."""

    name: str
    max_nodes: int
    resources: dict[str, float]
    instance_type: str | None = None


@dataclass(frozen=True)
class Capacity:
    """Every worker node type of a cluster file, and the file's overall limit on worker nodes (None: none)."""

    source: str
    groups: list[NodeGroup]
    max_nodes: int | None

    def workers(self, per_worker: dict[str, float], workers_per_node: int | None = None) -> tuple[int, list[str]]:
        """The most workers of ``per_worker`` resources the cluster can hold, and how (one line per node type)."""
        rows = []
        for g in self.groups:
            fits = [
                (math.floor(g.resources.get(r, 0) / need), f"{r} {g.resources.get(r, 0):g} / {need:g}")
                for r, need in sorted(per_worker.items())
                if need > 0
            ]
            per_node = min((n for n, _ in fits), default=0)
            why = ", ".join(w for _, w in fits)
            if workers_per_node:
                if per_node < workers_per_node:
                    per_node, why = 0, f"{why}: fewer than scaling.workers_per_node={workers_per_node}"
                else:
                    per_node = workers_per_node
            rows.append((per_node, g, why))
        rows.sort(key=lambda r: -r[0])
        budget = self.max_nodes
        total, lines = 0, []
        for per_node, g, why in rows:
            nodes = g.max_nodes if budget is None else min(g.max_nodes, budget)
            if budget is not None:
                budget -= nodes
            total += nodes * per_node
            lines.append(f"{g.name}: {nodes} node(s) x {per_node} worker(s) per node ({why})")
        return total, lines


def load_capacity(path: str) -> Capacity:
    """The worker node types of a cluster-launcher YAML or a KubeRay manifest (ConfigError if it has none)."""
    return capacity_of(load_yaml_documents(path, what="cluster file"), path)


def capacity_of(docs: list[Any], path: str) -> Capacity:
    """:func:`load_capacity` for loaded YAML documents (``path`` names them in messages)."""
    if not docs:
        raise ConfigError(f"{path}: cluster file is empty")
    if any(isinstance(d, dict) and "kind" in d for d in docs):
        groups = [g for d in docs if isinstance(d, dict) for g in _kuberay_groups(d)]
        cap = Capacity(path, groups, None)
    else:
        config = docs[0] if isinstance(docs[0], dict) else {}
        head = config.get("head_node_type")
        groups = []
        for name, nt in mapping_at(config, "available_node_types").items():
            if name == head or not isinstance(nt, dict):
                continue
            resources = {k: float(v) for k, v in mapping_at(nt, "resources").items() if _number(v)}
            itype = mapping_at(nt, "node_config").get("InstanceType")
            max_nodes = _count(nt.get("max_workers", config.get("max_workers", 0)))
            groups.append(NodeGroup(str(name), max_nodes or 0, resources, itype if isinstance(itype, str) else None))
        cap = Capacity(path, groups, _count(config.get("max_workers")))
    if not cap.groups:
        raise ConfigError(f"{path}: no worker node types found; is this a cluster file (cluster/*.yaml)?")
    return cap


def _kuberay_groups(doc: dict[str, Any]) -> list[NodeGroup]:
    spec = mapping_at(doc, "spec")
    if doc.get("kind") == "RayJob":
        spec = mapping_at(spec, "rayClusterSpec")
    groups = []
    for i, g in enumerate(as_list(spec.get("workerGroupSpecs"))):
        if not isinstance(g, dict):
            continue
        params = mapping_at(g, "rayStartParams")
        resources = {k: float(v) for k, v in ray_resources(params).items() if _number(v)}
        for flag, name in (("num-cpus", "CPU"), ("num-gpus", "GPU")):
            value = params.get(flag)
            if value is not None and _number(str(value)):
                resources[name] = float(value)
        selector = mapping_at(g, "template", "spec", "nodeSelector")
        itype = next((selector[k] for k in INSTANCE_TYPE_LABELS if k in selector), None)
        name = str(g.get("groupName") or f"workerGroupSpecs[{i}]")
        groups.append(NodeGroup(name, _count(g.get("maxReplicas")) or 0, resources, str(itype) if itype else None))
    return groups


def _count(value: Any) -> int | None:
    """A whole, non-negative count from unvalidated YAML, or None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and float(value) >= 0
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        return False


def check_job_fits(job: Any, per_worker: dict[str, float], cluster_path: str) -> list[str]:
    """ConfigError when ``job`` asks for more workers than ``cluster_path`` can ever provide; info lines otherwise.

    Resources the file does not declare for a node type count as absent (Ray sets CPU from the machine, but a
    cluster file that relies on that cannot be checked: such a resource is left out of the check, with a note).
    """
    cap = load_capacity(cluster_path)
    s = job.scaling
    shown = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(per_worker.items())) + "}"
    if s.instance_type and any(g.instance_type for g in cap.groups):
        # Only nodes of the job's instance type (its topology and price assume it). A file that names no
        # instance type (the local simulator's) is taken as it is.
        typed = [g for g in cap.groups if g.instance_type == s.instance_type]
        if not typed:
            types = sorted({g.instance_type for g in cap.groups if g.instance_type}) or ["none named"]
            raise ConfigError(
                f"{job.source}: scaling.instance_type={s.instance_type!r} but {cluster_path} has no worker node type "
                f"of that instance type (it has: {', '.join(types)}); use a cluster file for {s.instance_type}, or "
                "change scaling.instance_type and workers_per_node to the cluster's"
            )
        cap = Capacity(cap.source, typed, cap.max_nodes)
    # Ray sets CPU from the machine when a node type does not declare it: not checkable from the file.
    declared = {r for g in cap.groups for r in g.resources}
    unknown = sorted(r for r in per_worker if r not in declared and r == "CPU")
    checked = {r: v for r, v in per_worker.items() if r not in unknown}
    if not checked:
        return [f"note: {cluster_path} declares none of the resources a worker needs ({shown}): not checked"]
    total, lines = cap.workers(checked, s.workers_per_node)
    budget = (
        f"at most {cap.max_nodes} worker node(s) in all (max_workers: {cap.max_nodes}); "
        if cap.max_nodes is not None
        else ""
    )
    if s.max_size > total:
        field = "min_workers" if s.min_workers > total else "max_workers"
        asked = s.min_workers if field == "min_workers" else s.max_size
        raise ConfigError(
            f"{job.source}: scaling.{field}={asked:,} worker(s) of {shown} is more than {cluster_path} can ever "
            f"provide: {budget}" + "; ".join(lines) + f" = {total:,} worker(s). Lower scaling.{field} to at most "
            f"{total:,}, or give the cluster more (or larger) worker nodes"
        )
    out = [f"cluster: {cluster_path} holds up to {total:,} worker(s) of {shown} ({'; '.join(lines)})"]
    if unknown:
        out.append(f"note: {cluster_path} does not declare {', '.join(unknown)} for its node types: not checked")
    return out
