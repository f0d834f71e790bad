"""``raytrn sweep``: the command line of :mod:`raytrn.sweep`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from raytrn.backends import get_backend
from raytrn.cli_args import (
    add_ray_dashboard_option,
    add_set_option,
    add_verbose_option,
    integer,
    number,
    use_ray_dashboard_option,
)
from raytrn.config import load_job
from raytrn.errors import ConfigError, RaytrnError
from raytrn.ray_output import route_ray_output
from raytrn.runtime import DASHBOARD_ENV, ensure_ray
from raytrn.submit import _client as jobs_client
from raytrn.submit import _token_arg, follow_logs, job_file_in, submit
from raytrn.sweep.space import label, parse_flag
from raytrn.tracking.compare_sweeps import plot_sweep

# Commands import their heavy modules when they run (measured, CPU s): raytrn.sweep.driver pulls in torch and Ray
# Train (~4.7 s), sweep.plan and raytrn.storage pyarrow (+0.15 s on the 0.45 s of `raytrn --help`, which imports this).

_EPILOG = """\
examples:
  raytrn sweep jobs/tiny.yaml --grid optim.lr=1e-3,3e-3,1e-2 --set run.eval_every=10
  raytrn sweep jobs/tiny.yaml --loguniform optim.lr=1e-4:1e-2 --samples 8 --seed 1 \\
      --scheduler asha --metric val_loss --grace-steps 20 --max-concurrent 2
  raytrn sweep jobs/sweep-tiny.yaml                     # a job file with a sweep: section
  raytrn sweep --resume tiny-sweep-20261125-101500      # after the driver died or was stopped
  raytrn sweep jobs/sweep-tiny.yaml --address http://127.0.0.1:8265   # the driver as a Ray job on a cluster
  raytrn runs compare --sweep tiny-sweep-20261125-101500 --plot sweep.png
"""


def sweep_ray_defaults(environ: MutableMapping[str, str]) -> None:
    """An embedded local Ray started for a sweep starts with its dashboard (``RAYTRN_RAY_DASHBOARD``; a value of the
    user's own wins): a trial its scheduler stops (ASHA) can lose its actor before the trial's worker group has removed
    its placement group, and Ray Train's ``PlacementGroupCleaner`` removes it then only through Ray's State API, which
    the dashboard serves. Without it (stop 70's default for `raytrn train`) that group's CPUs stayed taken and the
    next trial waited for them without end (`make demo-sweep`, 2026-12-02: "Failed to query Ray Train Controller
    actor state" from every cleaner)."""
    environ.setdefault(DASHBOARD_ENV, "1")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="run many training jobs over a search space as one experiment (Ray Tune, early stopping, MLflow)",
        description="Run JOB.yaml once per point of a search space, each trial a full `raytrn train` job "
        "(checkpoints, elasticity, tracking) in a Ray Tune trial, a few at a time; optionally stop the trials that "
        "fall behind (ASHA). Every trial is validated before any starts. MLflow gets one parent run for the sweep "
        "and one child run per trial. Ends with the trials ranked by the metric and the best trial's job file "
        "(best.yaml). Search-space flags take any job-spec field; a `sweep:` section in the YAML file takes the same "
        "keys (grid, choice, loguniform, uniform, samples, seed, scheduler, metric, mode, grace_steps, "
        "reduction_factor, max_concurrent, name), and flags win.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job", metavar="JOB.yaml", nargs="?", help="job spec (optionally with a sweep: section)")
    space = p.add_argument_group("search space")
    for kind, example, text in (
        ("grid", "FIELD=V1,V2,...", "every value, crossed with the other --grid fields"),
        ("choice", "FIELD=V1,V2,...", "one value drawn per trial"),
        ("loguniform", "FIELD=LOW:HIGH", "drawn log-uniformly per trial (integers for an integer field)"),
        ("uniform", "FIELD=LOW:HIGH", "drawn uniformly per trial (integers for an integer field)"),
    ):
        space.add_argument(f"--{kind}", action="append", default=[], metavar=example, help=f"{text}; repeatable")
    space.add_argument(
        "--samples", type=integer, metavar="N", help="trials per grid point, each drawing its random fields (default 1)"
    )
    space.add_argument("--seed", type=integer, metavar="S", help="seed of the random draws (default 0)")
    add_set_option(p)
    sched = p.add_argument_group("scheduling")
    sched.add_argument(
        "--scheduler", choices=("none", "asha"), help="asha: stop trials that fall behind (default none)"
    )
    sched.add_argument(
        "--metric", help="what trials are judged and ranked on (default val_loss when the job has a validation set, "
        "else loss)"
    )  # fmt: skip
    sched.add_argument("--mode", choices=("min", "max"), help="default: max for throughput metrics, else min")
    sched.add_argument(
        "--grace-steps", type=integer, metavar="N", help="asha: steps every trial gets before it can be stopped"
    )
    sched.add_argument(
        "--reduction-factor", type=number, metavar="RF", help="asha: keep the best 1/RF at each rung (default 2)"
    )
    sched.add_argument(
        "--max-concurrent",
        type=integer,
        metavar="N",
        help="trials at once (default: as many as the cluster holds at their min_workers; on an autoscaling cluster "
        "give --cluster)",
    )
    sched.add_argument(
        "--cluster", metavar="FILE", help="the cluster file of an autoscaling cluster: what it can grow to"
    )
    p.add_argument("--name", help="the sweep's name (default <job>-sweep-<date>-<time>); trials are <name>-t00, ...")
    p.add_argument(
        "--resume",
        metavar="NAME|DIR",
        help="continue a sweep (by name under checkpoint.storage/sweeps, or its directory): the trials that did not end",
    )
    p.add_argument("--dry-run", action="store_true", help="validate and print the trials, run nothing")
    add_verbose_option(p)
    add_ray_dashboard_option(p)
    remote = p.add_argument_group("on a cluster (the driver as a Ray job, like raytrn submit)")
    remote.add_argument("--address", metavar="URL", help="the cluster's Ray dashboard, e.g. http://127.0.0.1:8265")
    remote.add_argument("--token-file", metavar="PATH", help="Ray auth token file (default: Ray's own lookup)")
    remote.add_argument("--working-dir", default=".", metavar="DIR", help="directory uploaded with the job")
    remote.add_argument("--no-follow", action="store_true", help="print the job id and return")
    p.set_defaults(func=cmd_sweep)


#: Flags a resumed sweep keeps from its first run (only --max-concurrent may change).
_FIXED_ON_RESUME = (
    "grid", "choice", "loguniform", "uniform", "samples", "seed", "overrides", "scheduler", "metric", "mode",
    "grace_steps", "reduction_factor", "name",
)  # fmt: skip


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.resume:
        given = [
            f"--{k.replace('_', '-')}" if k != "overrides" else "--set" for k in _FIXED_ON_RESUME if getattr(args, k)
        ]
        if given:
            raise ConfigError(
                f"--resume {args.resume}: {', '.join(given)} cannot change a sweep that exists (its trials are in its "
                "sweep.json); only --max-concurrent can. Start a new sweep (another --name) to search another space"
            )
        if args.address:
            raise ConfigError("--resume with --address: submit the resume from the cluster's head, or with `ray job "
                              "submit -- raytrn sweep --resume NAME`")  # fmt: skip
        return _resume(args)
    if not args.job:
        raise ConfigError("raytrn sweep: give JOB.yaml (or --resume NAME); see raytrn sweep --help")
    opts = _options(args)
    if args.address:
        return _submit(args, opts)
    from raytrn.sweep.plan import SweepState, plan_sweep

    plan = plan_sweep(opts)
    if args.dry_run:
        _print_plan(plan.state, plan.notes)
        return 0
    if SweepState.load(plan.state.root) is not None:
        raise ConfigError(
            f"sweep {plan.state.name} exists ({plan.state.path}); continue it with --resume {plan.state.name}, or "
            "choose another --name"
        )
    return _run(plan.state, args, notes=plan.notes)


def _options(args: argparse.Namespace) -> Any:
    from raytrn.sweep.plan import SweepOptions

    dims = [
        parse_flag(kind, text) for kind in ("grid", "choice", "loguniform", "uniform") for text in getattr(args, kind)
    ]
    return SweepOptions(
        job_path=args.job, overrides=list(args.overrides), dimensions=dims, samples=args.samples, seed=args.seed,
        scheduler=args.scheduler, metric=args.metric, mode=args.mode, grace_steps=args.grace_steps,
        reduction_factor=args.reduction_factor, max_concurrent=args.max_concurrent, name=args.name,
    )  # fmt: skip


def _print_plan(state: Any, notes: list[str]) -> None:
    for line in notes:
        print(line)
    print(f"sweep {state.name}: {len(state.trials)} trial(s); {state.sched.describe()}")
    for t in state.trials:
        print(f"  {t.tag}  {label(t.values)}")


def _resume(args: argparse.Namespace) -> int:
    from raytrn import storage
    from raytrn.sweep.driver import reopen
    from raytrn.sweep.plan import DONE, SweepState, read_section, sweeps_root

    given = args.resume.removesuffix("/sweep.json")
    if "/" in given:  # the sweep's directory (what an interrupted sweep prints), local or s3://
        root = given if storage.is_remote(given) else os.path.abspath(given)
        where = f"in {root}"
    else:
        if args.job:
            raw, _ = read_section(args.job)
            base = sweeps_root(load_job(args.job, raw=raw))
            where = f"named {given} under {base} ({args.job}'s checkpoint.storage)"
        else:
            base = os.path.abspath("checkpoints/sweeps")  # checkpoint.storage's default
            where = f"named {given} under {base} (give the job file, or the sweep's directory, when it is elsewhere)"
        root = storage.join(base, given)
    state = SweepState.load(root)
    if state is None:
        raise ConfigError(f"--resume {args.resume}: no sweep {where}")
    left = [t for t in state.trials if t.status not in DONE]
    print(f"raytrn: resuming sweep {state.name}: {len(state.trials) - len(left)} trial(s) ended, {len(left)} to run")
    reopen(state)
    return _run(state, args, notes=[])


def _run(state: Any, args: argparse.Namespace, *, notes: list[str]) -> int:
    import ray

    from raytrn.sweep.driver import create_runs, mark_interrupted, run_sweep, trial_slots
    from raytrn.sweep.plan import DONE

    jobs = [t.job_spec(state.job_file) for t in state.trials]
    wanted = args.max_concurrent if args.max_concurrent is not None else state.max_concurrent
    if wanted is not None and wanted < 1:
        raise ConfigError(f"--max-concurrent {wanted}: must be at least 1")

    per_trial_cpus = max(
        get_backend(j.scaling.accelerator).worker_resources(j).get("CPU", 0) * j.scaling.min_workers for j in jobs
    )
    route_ray_output(state.name, verbose=args.verbose)
    use_ray_dashboard_option(args)
    sweep_ray_defaults(os.environ)
    ensure_ray(min_cpus=per_trial_cpus * (wanted or 1))
    slots, why = trial_slots(jobs, cluster_file=args.cluster, resources=ray.cluster_resources())
    if slots < 1:
        raise RaytrnError(f"no trial fits: {why}; lower scaling.min_workers, or give the cluster more capacity")
    if wanted is not None and wanted > slots:
        raise ConfigError(
            f"--max-concurrent {wanted}: the cluster holds at most {slots} trial(s) at once ({why}); lower it"
            + ("" if args.cluster else ", or give --cluster FILE when the cluster autoscales beyond what it has now")
        )
    left = sum(t.status not in DONE for t in state.trials)
    concurrent = max(1, min(wanted or slots, left))
    if args.max_concurrent is not None:
        state.max_concurrent = args.max_concurrent
    for line in notes:
        print(line)
    print(
        f"raytrn: sweep {state.name}: {len(state.trials)} trial(s) of {state.job_file}, {concurrent} at a time; "
        f"{state.sched.describe()}",
        flush=True,
    )
    create_runs(state)
    try:
        outcome = run_sweep(state, max_concurrent=concurrent)
    except KeyboardInterrupt:
        mark_interrupted(state)
        print(f"raytrn: sweep {state.name} stopped; continue it with: raytrn sweep --resume {_resume_arg(state)}",
              file=sys.stderr)  # fmt: skip
        return 130
    _print_outcome(outcome)
    failed = [t for t in outcome.state.trials if t.status == "failed"]
    return 0 if outcome.best is not None and len(failed) < len(outcome.state.trials) else 1


def _resume_arg(state: Any) -> str:
    """What ``--resume`` takes for this sweep: its name when it is under ./checkpoints/sweeps, else its directory."""
    default = os.path.join(os.path.abspath("checkpoints/sweeps"), state.name)
    return state.name if state.root == default else state.root


def _print_outcome(outcome: Any) -> None:
    from raytrn import storage
    from raytrn.sweep.driver import table_of

    state = outcome.state
    table = table_of(state)
    print(table.render())
    if not storage.is_remote(state.root) and table.rows:
        print(f"plot: {plot_sweep(table, os.path.join(state.root, 'sweep.png'))}")
    if outcome.best is not None and outcome.best_yaml:
        print(f"best: {outcome.best.tag} -> {outcome.best_yaml}  (raytrn train {outcome.best_yaml})")
    if state.tracking_uri:
        print(f"compare: raytrn runs compare --sweep {state.name} --plot {state.name}.png")
    else:
        print("(tracking.enabled is false: no MLflow runs; sweep.json has the trials)")


def _submit(args: argparse.Namespace, opts: Any) -> int:
    """Validate here (data is checked on the cluster), then run this sweep's driver as a Ray job there."""
    from raytrn.sweep.plan import plan_sweep, read_section

    plan = plan_sweep(opts, check_data=False)
    raw, _ = read_section(args.job)
    job_file = job_file_in(args.job, Path(args.working_dir).resolve())
    command = ["sweep", job_file, "--name", plan.state.name]
    for kind in ("grid", "choice", "loguniform", "uniform"):
        for text in getattr(args, kind):
            command += [f"--{kind}", text]
    for flag in ("samples", "seed", "scheduler", "metric", "mode", "grace_steps", "reduction_factor", "max_concurrent",
                 "cluster"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    job_id = submit(
        args.job, address=args.address, overrides=opts.overrides, follow=False, working_dir=args.working_dir,
        token=_token_arg(args), command=command, mapping=raw, name=plan.state.name,
    )  # fmt: skip
    if args.no_follow:
        return 0
    return 0 if follow_logs(jobs_client(args)[0], job_id) == "SUCCEEDED" else 1
