"""``raytrn estimate JOB [--cluster FILE] [--set k=v ...] [--json]``: memory, speed, time, cost and the checkpoint
interval of a job, offline (:mod:`raytrn.estimate.job`), after ``raytrn validate --no-data``'s checks of the job.
Exit 0 when it fits or is tight (or its device's memory is unknown), 1 when it does not fit (``raytrn submit``
refuses it), 2 for a bad job or option."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrn.cli_args import add_set_option, integer, number

if TYPE_CHECKING:
    from raytrn.config import JobSpec


def register(subparsers: Any, *, check_job: Callable[[JobSpec], list[str]]) -> None:
    """The ``estimate`` command. ``check_job``: ``raytrn validate --no-data``'s checks of a job (its info lines, or
    a RaytrnError), run first; :mod:`raytrn.cli` passes :func:`raytrn.train.checks.check_job` (the training package
    imports this one: importing it here would be a cycle)."""
    p = subparsers.add_parser(
        "estimate",
        help="memory a worker, tokens/s, time and cost to max_steps, and the checkpoint interval, before renting",
        description="Estimate, from the job spec alone (offline; after the checks of `raytrn validate --no-data`): "
        "each worker's device memory by layout against its device, with a verdict (fits: within the 90% planned "
        "for; tight: within the device; does not fit) and the smallest changes that make it fit, tokens/s a node at "
        "an MFU (measured figures raytrn ships, else an assumption, each named), time and on-demand/spot cost to "
        "run.max_steps with the expected interruptions, and the Young/Daly checkpoint interval. Exit 1 when the "
        "job does not fit its devices (raytrn submit refuses it).",
    )
    p.add_argument("job", metavar="JOB.yaml")
    add_set_option(p)
    p.add_argument("--cluster", metavar="FILE", help="a cluster file (cluster/*.yaml): its worker instance type")
    p.add_argument(
        "--workers", type=integer, metavar="N", help="world size to estimate at (default: the job's largest)"
    )
    p.add_argument(
        "--node-mtbf-hours",
        type=number,
        metavar="H",
        help="mean hours between failures of one node (default: the Llama 3 report's, ~6,300 h)",
    )
    p.add_argument("--mfu", type=number, metavar="F", help="model FLOPs utilisation to assume (0-1)")
    p.add_argument("--spot-usd-per-hour", type=number, metavar="USD", help="spot price of one node-hour")
    p.add_argument("--save-s", type=number, metavar="S", help="measured blocking checkpoint save, seconds")
    p.add_argument(
        "--no-history",
        action="store_true",
        help="do not read the MFU and restart times of the experiment's finished runs from MLflow",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=functools.partial(_cmd_estimate, check_job=check_job))


def _cmd_estimate(args: argparse.Namespace, *, check_job: Callable[[JobSpec], list[str]]) -> int:
    from raytrn.config import load_job
    from raytrn.errors import ConfigError
    from raytrn.estimate.failures import DEFAULT_RATE, FailureRate
    from raytrn.estimate.job import estimate_job
    from raytrn.estimate.reference import Measured

    for name in ("node_mtbf_hours", "spot_usd_per_hour", "save_s", "workers"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive number")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu}: a fraction of the peak, in (0, 1]")
    job = load_job(args.job, args.overrides, resolve=False)
    for line in check_job(job):  # what `raytrn validate --no-data` refuses is refused here with the same line
        if line.startswith("warning: "):
            print(f"raytrn: {line}", file=sys.stderr)
    instance_type = None
    if args.cluster:
        instance_type = _cluster_instance_type(args.cluster, job)
    failures = (
        FailureRate(args.node_mtbf_hours, "--node-mtbf-hours") if args.node_mtbf_hours is not None else DEFAULT_RATE
    )
    from raytrn.estimate.history import History, read_history

    history = History() if args.no_history else read_history(job, instance_type=instance_type)
    estimate = estimate_job(
        job,
        history=history,
        instance_type=instance_type,
        world_size=args.workers,
        failures=failures,
        mfu=Measured(args.mfu, "--mfu") if args.mfu is not None else None,
        spot_usd_per_hour=args.spot_usd_per_hour,
        save_s=Measured(args.save_s, "--save-s") if args.save_s is not None else None,
    )
    print(json.dumps(estimate.as_dict(), indent=2) if args.json else estimate.render())
    return 1 if estimate.memory_verdict == "does not fit" else 0  # tight: submit takes it, and says so


def _cluster_instance_type(path: str, job: Any) -> str | None:
    """The worker instance type of a cluster file: the job's when the file has it, else the file's only one."""
    from raytrn.cluster.capacity import load_capacity
    from raytrn.cluster.validate import validate_cluster_file
    from raytrn.errors import ConfigError

    validate_cluster_file(path, template=True)  # what the job needs of it; placeholders: noted
    types = sorted({g.instance_type for g in load_capacity(path).groups if g.instance_type})
    if job.scaling.instance_type in types or not types:
        return str(job.scaling.instance_type) if job.scaling.instance_type else None
    if len(types) == 1:
        return types[0]
    raise ConfigError(
        f"{path}: worker instance types {', '.join(types)}; the job's scaling.instance_type "
        f"({job.scaling.instance_type}) is none of them: set it to the one to estimate"
    )
