"""``raytrn cluster ...``: commands about the cluster itself (not a job). Wired in by raytrn/cli.py."""

from __future__ import annotations

import argparse
from typing import Any

from raytrn.cli_args import integer
from raytrn.cluster import local
from raytrn.cluster.validate import validate_cluster_file


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cluster`` command (with ``validate FILE``) to the main CLI's subparsers; return it."""
    p_cluster = subparsers.add_parser(
        "cluster", help="cluster config tools", description="Tools for Ray cluster configs (ray up, KubeRay)."
    )
    cluster_sub = p_cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    cluster_sub.required = True
    p_val = cluster_sub.add_parser(
        "validate",
        help="check a cluster-launcher YAML or a KubeRay manifest before launching it",
        description="Check a `ray up` YAML against Ray's own cluster schema and raytrn's Trainium rules "
        "(neuron_cores per instance type, EFA and placement group for multi-node types, no Ray port open to "
        "0.0.0.0/0, idle timeout, max_workers bounds, CPU head), or a KubeRay RayCluster / RayJob manifest "
        "(required fields, neuron_cores vs the pod's Neuron and EFA requests). Starts nothing.",
    )
    p_val.add_argument("file", metavar="FILE", help="cluster/*.yaml or cluster/kuberay/*.yaml")
    p_val.add_argument(
        "--template",
        action="store_true",
        help="check FILE as a template: REPLACE_ME placeholders are listed, not refused (the shipped files are ones)",
    )
    p_val.set_defaults(func=cmd_validate)

    for name, doc in (
        ("up", "start the local trn-cluster simulator (fake_multinode autoscaler, cluster/local-sim.yaml)"),
        ("down", "stop the local simulator: exactly the processes `up --local` started"),
    ):
        p = cluster_sub.add_parser(name, help=doc, description=doc[0].upper() + doc[1:] + ".")
        p.add_argument(
            "--local", action="store_true", required=True, help="the simulator on this machine (the only target)"
        )
        p.add_argument("--state-file", metavar="PATH", help="where the started processes are recorded")
        if name == "up":
            p.add_argument("--config", metavar="FILE", help="simulator config (default cluster/local-sim.yaml)")
            p.add_argument("--port", type=integer, help="GCS port (default 6379)")
            p.add_argument("--dashboard-port", type=integer, help="dashboard / job API port (default 8265)")
            p.add_argument(
                "--auth",
                choices=["token", "disabled"],
                help="Ray token auth (default token: generated on first use, ~/.raytrn/local-cluster.token, 0600)",
            )
            p.add_argument("--mlflow-port", type=integer, help="the head's MLflow server port (default 5000)")
            p.add_argument("--no-mlflow", action="store_true", help="do not run an MLflow server on the head")
        p.set_defaults(func=_local(name))
    return p_cluster


def _local(name: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        return local.cmd_up(args) if name == "up" else local.cmd_down(args)

    return run


def cmd_validate(args: argparse.Namespace) -> int:
    """Print the notes and ``FILE: OK``; a problem raises ConfigError (the main CLI exits 2)."""
    for line in validate_cluster_file(args.file, template=args.template):
        print(line)
    print(f"{args.file}: OK")
    return 0
