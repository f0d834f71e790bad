"""Check a Ray cluster-launcher YAML (``ray up``) before it costs money: Ray's schema + Trainium rules.

Two layers, all problems reported in one :class:`~raytrn.errors.ConfigError` (each with its YAML path
and the fix):

1. Ray's own JSON schema, shipped in the ray package (``ray/autoscaler/ray-schema.json``, the file
   Ray's own cluster validation uses), applied with ``jsonschema`` to the YAML as
   written, so an error names its path (``available_node_types.trn1_32xl.max_worker``).
2. raytrn's rules for Trainium clusters: ``resources.neuron_cores`` equals the instance type's
   NeuronCores (the INSTANCES table of :mod:`raytrn.backends.neuron_env`; trn2 counts 64 at the default
   LNC=2, 128 when a command of that node type sets ``NEURON_LOGICAL_NC_CONFIG=1``; an instance type the table
   marks unconfirmed, trn3, is checked the same way, with a note saying UNCONFIRMED and its source); multi-node trn
   types have an EFA interface and a cluster placement group; no ``provider.security_group`` rule opens
   Ray's or MLflow's ports to the internet; ``idle_timeout_minutes`` and ``max_workers`` are set and
   consistent; the head is not a Trainium instance.

Files whose ``kind`` is ``RayCluster`` / ``RayJob`` are KubeRay manifests: see :mod:`raytrn.cluster.kuberay`.
"""

from __future__ import annotations

import difflib
import importlib.util
import ipaddress
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from raytrn.backends.neuron_env import INSTANCES
from raytrn.cluster.capacity import capacity_of
from raytrn.cluster.common import (
    PLACEHOLDER,
    as_list,
    expected_neuron_cores,
    image_warnings,
    load_yaml_documents,
    mapping_at,
    placeholder_places,
    placeholder_text,
    raise_problems,
    stack_warnings,
)
from raytrn.cluster.kuberay import validate_kuberay_documents
from raytrn.cluster.shell import ray_starts
from raytrn.config import read_config_text
from raytrn.errors import ConfigError
from raytrn.tracking.server import is_private_host, is_wildcard_host

#: Ports (first, last) that must never be reachable from the internet (Ray has no authorization beyond the token).
SENSITIVE_PORTS = {
    (8265, 8265): "Ray dashboard / job submission API",
    (6379, 6379): "Ray GCS",
    (10001, 10001): "Ray client server",
    (8076, 8076): "Ray object manager",
    (52365, 52365): "Ray dashboard agent",
    (8080, 8080): "Ray metrics export",
    (10002, 19999): "Ray worker ports",
    (5000, 5000): "MLflow server",
}
#: A CIDR outside private networks that holds at least this many addresses is "the internet" (0.0.0.0/1 and
#: 128.0.0.0/1 together are 0.0.0.0/0): judged by prefix length, not by spelling.
_WIDE_V4_PREFIX = 16
_WIDE_V6_PREFIX = 32


def internet_cidr(cidr: Any) -> str | None:
    """Why ``cidr`` opens a port to the internet (a network outside private ranges, /16 or wider for IPv4, /32
    or wider for IPv6; or not a CIDR at all), else None."""
    try:
        net = ipaddress.ip_network(str(cidr).strip(), strict=False)
    except ValueError:
        return f"{cidr!r} is not a CIDR"
    wide = _WIDE_V4_PREFIX if net.version == 4 else _WIDE_V6_PREFIX
    if net.is_private or net.is_loopback or net.prefixlen > wide:
        return None
    return f"{cidr} ({net.num_addresses:.3g} public addresses)" if net.prefixlen else f"{cidr} (the internet)"


_TRN_TYPE = re.compile(r"^trn\d", re.IGNORECASE)
KUBERAY_KINDS = ("RayCluster", "RayJob")


def ray_schema_path() -> str:
    """The cluster-config schema of the installed Ray (``ray/autoscaler/ray-schema.json``).

    Found without importing ray (seconds): ``find_spec`` of a top-level package does not run it.
    """
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.origin:
        raise ConfigError("ray is not installed: `raytrn cluster validate` needs Ray's cluster schema (ray 2.60)")
    return os.path.join(os.path.dirname(spec.origin), "autoscaler", "ray-schema.json")


def validate_cluster_file(path: str, *, template: bool = False) -> list[str]:
    """Validate a cluster-launcher YAML or a KubeRay manifest; return info notes, raise ConfigError.

    ``REPLACE_ME`` placeholders still in the file (counted once per place in it, not per YAML alias expansion) fail
    it: it cannot be launched yet. ``template``: the file is a template (the shipped ones are): they are a note."""
    text = read_config_text(path, what="cluster file", examples="cluster/")
    docs = load_yaml_documents(path, what="cluster file")
    kuberay = any(isinstance(d, dict) and "kind" in d for d in docs)
    if kuberay:
        notes = validate_kuberay_documents(docs, source=path)
        try:
            groups = capacity_of(docs, path).groups
        except ConfigError:  # a RayJob on an existing RayCluster (clusterSelector) has no worker groups of its own
            groups = []
        notes += unconfirmed_notes(g.instance_type for g in groups)
    elif len(docs) != 1:
        raise ConfigError(f"{path}: a cluster-launcher config is one YAML document, found {len(docs)}")
    else:
        notes = validate_cluster_config(docs[0], source=path)
    places = placeholder_places(text)
    if places:
        before = "`kubectl apply`" if kuberay else "`ray up`"
        what = f"{len(places)} place(s) still hold {PLACEHOLDER}: {placeholder_text(places)}"
        if not template:
            raise ConfigError(
                f"{path}: {what}; fill them before {before} (or check the file as a template: --template)"
            )
        notes.append(f"template: fill these before {before}: {what}")
    return notes


def validate_cluster_config(config: Any, *, source: str = "<cluster>") -> list[str]:
    """Validate a loaded cluster-launcher config (see the module doc); return info notes."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: a cluster config must be a YAML mapping, got {type(config).__name__}")
    problems = schema_problems(config)
    notes: list[str] = []
    node_types = config.get("available_node_types")
    if isinstance(node_types, dict):
        problems += _check_sizes(config, node_types)
        problems += _check_head(config, node_types)
        for name, node_type in node_types.items():
            if isinstance(node_type, dict) and name != config.get("head_node_type"):
                problems += _check_trn_node_type(config, name, node_type, notes)
    problems += _check_security_group(config)
    problems += _command_problems(config, notes)
    raise_problems(source, problems)
    itypes = [
        mapping_at(nt, "node_config").get("InstanceType") for nt in mapping_at(config, "available_node_types").values()
    ]
    return notes + unconfirmed_notes(itypes)


def unconfirmed_notes(instance_types: Iterable[Any]) -> list[str]:
    """A note for each instance type (once, however many node types use it) whose layout the INSTANCES table
    marks unconfirmed: UNCONFIRMED, the layout raytrn assumes, and where its figures come from."""
    names = [t for t in instance_types if isinstance(t, str)]  # unvalidated YAML: a list is no instance type
    specs = [INSTANCES[t] for t in dict.fromkeys(names) if t in INSTANCES]
    return [note for spec in specs if (note := spec.unconfirmed_note())]


# ---------------------------------------------------------------------------------------------------
# Ray's schema


def schema_problems(config: dict[str, Any]) -> list[str]:
    """Ray's cluster schema errors, each as ``path: what. fix``."""
    import jsonschema

    with open(ray_schema_path()) as f:
        schema = json.load(f)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    out: list[str] = []
    for err in errors:
        out += _describe_schema_error(err)
    return out


def _dotted(parts: Any) -> str:
    path = ""
    for p in parts:
        path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
    return path


def _describe_schema_error(err: Any) -> list[str]:
    where = _dotted(err.absolute_path)
    prefix = f"{where}." if where else ""
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = list(err.schema.get("properties", {}))
        patterns = list(err.schema.get("patternProperties", {}))
        unknown = [k for k in err.instance if k not in known and not any(re.search(p, str(k)) for p in patterns)]
        lines = []
        for key in unknown:
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"Did you mean '{near[0]}'?" if near else f"Known fields: {', '.join(known)}."
            lines.append(f"{prefix}{key}: unknown field (Ray's cluster schema). {hint}")
        return lines or [f"{where or '<top>'}: {err.message}"]
    if err.validator == "required":
        missing = re.findall(r"'([^']+)' is a required property", err.message)
        key = missing[0] if missing else "?"
        return [f"{prefix}{key}: required field is missing (Ray's cluster schema)"]
    if err.validator == "type":
        return [f"{where}: must be of type {err.validator_value} (got {err.instance!r})"]
    if err.validator == "minimum":
        return [f"{where}: must be >= {err.validator_value} (got {err.instance!r})"]
    return [f"{where or '<top>'}: {err.message} (Ray's cluster schema)"]


# ---------------------------------------------------------------------------------------------------
# raytrn rules


def _check_sizes(config: dict[str, Any], node_types: dict[str, Any]) -> list[str]:
    problems = []
    if "idle_timeout_minutes" not in config:
        problems.append(
            "idle_timeout_minutes: not set; set it explicitly (e.g. 10) so idle Trainium nodes are "
            "terminated on a known schedule instead of Ray's default"
        )
    top = config.get("max_workers")
    if not isinstance(top, int):
        problems.append("max_workers: not set; set the most worker nodes the cluster may launch (e.g. 4)")
        return problems
    min_sum = 0
    for name, nt in node_types.items():
        if not isinstance(nt, dict) or name == config.get("head_node_type"):
            continue
        lo, hi = nt.get("min_workers", 0), nt.get("max_workers")
        if isinstance(lo, int):
            min_sum += lo
        if isinstance(hi, int) and hi > top:
            problems.append(
                f"available_node_types.{name}.max_workers: {hi} exceeds the cluster's max_workers ({top}); "
                f"lower it to <= {top} or raise max_workers"
            )
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            problems.append(
                f"available_node_types.{name}.min_workers: {lo} exceeds its max_workers ({hi}); set min_workers <= {hi}"
            )
    if min_sum > top:
        problems.append(
            f"max_workers: {top} is below the sum of the node types' min_workers ({min_sum}); raise max_workers "
            f"to >= {min_sum} or lower min_workers"
        )
    return problems


def _check_head(config: dict[str, Any], node_types: dict[str, Any]) -> list[str]:
    head = config.get("head_node_type")
    if head is None:
        return ["head_node_type: required field is missing; name one of available_node_types (the head node)"]
    if not isinstance(head, str):
        return [f"head_node_type: must be the name of one of available_node_types (got {head!r})"]
    if head not in node_types:
        near = difflib.get_close_matches(str(head), list(node_types), n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else f" Known: {', '.join(node_types)}."
        return [f"head_node_type: {head!r} is not one of available_node_types.{hint}"]
    node_config = node_types[head].get("node_config") if isinstance(node_types[head], dict) else None
    itype = node_config.get("InstanceType") if isinstance(node_config, dict) else None
    if isinstance(itype, str) and _TRN_TYPE.match(itype):
        return [
            f"available_node_types.{head}.node_config.InstanceType: the head node is a Trainium instance "
            f"({itype}); use a CPU instance (e.g. m7i.2xlarge): the head runs Ray's control plane, job drivers "
            "and MLflow, never training, and a trn head would idle its NeuronCores and never scale to zero"
        ]
    return []


def _node_commands(config: dict[str, Any], node_type: dict[str, Any]) -> list[str]:
    """The shell commands Ray runs on a worker of this type (a node type's own list overrides the global)."""
    cmds: list[Any] = []
    cmds += as_list(node_type.get("initialization_commands", config.get("initialization_commands")))
    cmds += as_list(config.get("setup_commands"))
    cmds += as_list(node_type.get("worker_setup_commands", config.get("worker_setup_commands")))
    cmds += as_list(config.get("worker_start_ray_commands"))
    return [c for c in cmds if isinstance(c, str)]


def _check_trn_node_type(config: dict[str, Any], name: str, nt: dict[str, Any], notes: list[str]) -> list[str]:
    where = f"available_node_types.{name}"
    node_config = nt.get("node_config")
    itype = node_config.get("InstanceType") if isinstance(node_config, dict) else None
    if not isinstance(itype, str) or not _TRN_TYPE.match(itype):
        return []
    assert isinstance(node_config, dict)
    spec = INSTANCES.get(itype)
    if spec is None:
        near = difflib.get_close_matches(itype, list(INSTANCES), n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        return [
            f"{where}.node_config.InstanceType: unknown Trainium instance type {itype!r}.{hint} "
            f"Known: {', '.join(INSTANCES)}"
        ]
    problems = []
    notes += stack_warnings(name, spec, _node_commands(config, nt))
    notes += image_warnings(name, spec, node_config.get("ImageId"))
    cores, lnc = expected_neuron_cores(spec, _node_commands(config, nt))
    lnc_note = f" at LNC={lnc}" if lnc else ""
    lnc_fix = " (or set NEURON_LOGICAL_NC_CONFIG in the node type's worker_setup_commands)" if lnc else ""
    resources = mapping_at(nt, "resources")
    got = resources.get("neuron_cores")
    if got is None:
        problems.append(
            f"{where}.resources.neuron_cores: missing; set it to {cores} ({itype} has {cores} NeuronCores"
            f"{lnc_note}): raytrn's workers request neuron_cores, so the autoscaler never launches this type without it"
        )
    elif got != cores:
        problems.append(
            f"{where}.resources.neuron_cores: {got!r} does not match {itype} ({cores} NeuronCores{lnc_note}); "
            f"set it to {cores}{lnc_fix}"
        )
    max_nodes = nt.get("max_workers", config.get("max_workers", 0))
    multi_node = isinstance(max_nodes, int) and max_nodes > 1
    interfaces = node_config.get("NetworkInterfaces")
    efa = [
        ni
        for ni in (interfaces if isinstance(interfaces, list) else [])
        if isinstance(ni, dict) and str(ni.get("InterfaceType", "")).startswith("efa")
    ]
    placement = node_config.get("Placement")
    group = placement.get("GroupName") if isinstance(placement, dict) else None
    if multi_node and spec.efa_devices:
        if not efa:
            problems.append(
                f"{where}.node_config.NetworkInterfaces: no EFA interface, but up to {max_nodes} {itype} nodes run "
                f"multi-node collectives; add NetworkInterfaces with InterfaceType: efa (one per EFA device: "
                f"{spec.efa_devices} on {itype}, NetworkCardIndex 0..{spec.efa_devices - 1}) or set max_workers: 1"
            )
        elif len(efa) < spec.efa_devices:
            notes.append(
                f"{name}: {len(efa)} of {itype}'s {spec.efa_devices} EFA devices attached; collectives between "
                "nodes get proportionally less bandwidth"
            )
        if not group:
            problems.append(
                f"{where}.node_config.Placement.GroupName: missing; multi-node {itype} nodes need a cluster "
                "placement group for full EFA bandwidth: create one (aws ec2 create-placement-group --group-name "
                "NAME --strategy cluster) and set Placement: {GroupName: NAME}"
            )
    elif multi_node and not spec.efa_devices:
        notes.append(f"{name}: {itype} has no EFA; collectives across its nodes go over TCP (slow)")
    market = node_config.get("InstanceMarketOptions")
    kind = market.get("MarketType", "on-demand") if isinstance(market, dict) else "on-demand"
    notes.append(
        f"{name}: {itype}, neuron_cores {got}{lnc_note}, {nt.get('min_workers', 0)}-{max_nodes} nodes, {kind}, "
        f"{len(efa)} EFA interface(s), placement group {group or '-'}"
    )
    return problems


def _rule_ports(rule: dict[str, Any]) -> tuple[int, int]:
    if str(rule.get("IpProtocol", "")) == "-1":
        return 0, 65535
    lo, hi = rule.get("FromPort", 0), rule.get("ToPort", rule.get("FromPort", 65535))
    return (lo if isinstance(lo, int) else 0), (hi if isinstance(hi, int) else 65535)


def _check_security_group(config: dict[str, Any]) -> list[str]:
    provider = config.get("provider")
    group = provider.get("security_group") if isinstance(provider, dict) else None
    rules = group.get("IpPermissions") if isinstance(group, dict) else None
    problems = []
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        if not isinstance(rule, dict):
            continue
        cidrs = [r.get("CidrIp") for r in as_list(rule.get("IpRanges")) if isinstance(r, dict)]
        cidrs += [r.get("CidrIpv6") for r in as_list(rule.get("Ipv6Ranges")) if isinstance(r, dict)]
        open_cidrs = [why for c in cidrs if c is not None and (why := internet_cidr(c))]
        if not open_cidrs:
            continue
        lo, hi = _rule_ports(rule)
        exposed = [
            f"{first}{f'-{last}' if last != first else ''} ({what})"
            for (first, last), what in SENSITIVE_PORTS.items()
            if lo <= last and first <= hi
        ]
        if exposed:
            problems.append(
                f"provider.security_group.IpPermissions[{i}]: opens {', '.join(exposed)} to {', '.join(open_cidrs)}; "
                "anyone could submit jobs (run code) on the cluster. Remove the rule or restrict CidrIp to your "
                "network, and reach the dashboard through `ray dashboard CLUSTER.yaml` (an SSH tunnel)"
            )
    return problems


_DASHBOARD_HOST = re.compile(r"--dashboard-host[=\s]+['\"]?([^\s'\"]+)")
_RAY_START = re.compile(r"\bray\s+start\b")


def _command_problems(config: dict[str, Any], notes: list[str]) -> list[str]:
    """The head's ``ray start``: a dashboard beyond loopback and private addresses (a wildcard however spelled,
    :func:`~raytrn.tracking.server.is_wildcard_host`; a public address) without token auth is an error (anyone
    who reaches it runs code), with auth a note; auth off alone is a note (the dashboard on loopback).

    Token auth is on when ``ray start`` itself gets ``RAY_AUTH_MODE=token`` from its command
    (``RAY_AUTH_MODE=token ray start ...``, or ``export RAY_AUTH_MODE=token`` before it; read as the shell reads
    it, :mod:`raytrn.cluster.shell`), not when the text appears (``echo RAY_AUTH_MODE=token``). A ``ray start``
    raytrn cannot follow (``eval '...'``) with a ``--dashboard-host`` counts as auth off (the host read as text)."""
    problems: list[str] = []
    starts: list[tuple[bool, list[str]]] = []  # (token auth, dashboard hosts) of each `ray start`
    for i, cmd in enumerate(as_list(config.get("head_start_ray_commands"))):
        if not isinstance(cmd, str):
            continue
        try:
            found = ray_starts(cmd)
        except ValueError as e:
            problems.append(
                f"head_start_ray_commands[{i}]: not a shell command the shell can run ({e}); fix its quotes"
            )
            continue
        starts += [(s.env.get("RAY_AUTH_MODE") == "token", s.option("--dashboard-host")) for s in found]
        if not found and _RAY_START.search(cmd) and (hosts := _DASHBOARD_HOST.findall(cmd)):
            starts.append((False, hosts))  # a `ray start` not followed ($(...), eval): auth unseen
    if not starts:
        return problems
    auth = all(on for on, _ in starts)
    exposed = [h for on, hosts in starts for h in hosts if not is_private_host(h)]
    if unprotected := [h for on, hosts in starts for h in hosts if not on and not is_private_host(h)]:
        return [
            *problems,
            f"head_start_ray_commands: the dashboard listens on {unprotected[0]} (beyond loopback and private addresses) "
            "with Ray token authentication off: anyone who reaches port 8265 can run code on the cluster. Use "
            "--dashboard-host=127.0.0.1 and `ray dashboard CLUSTER.yaml`, and start Ray with RAY_AUTH_MODE=token",
        ]
    if exposed:
        where = "all interfaces" if is_wildcard_host(exposed[0]) else "beyond loopback and private addresses"
        notes.append(
            f"head_start_ray_commands: the dashboard listens on {exposed[0]} ({where}); prefer 127.0.0.1 and "
            "`ray dashboard CLUSTER.yaml`"
        )
    if not auth:
        notes.append("head_start_ray_commands: Ray token authentication is off (no RAY_AUTH_MODE=token)")
    return problems
