"""``raytrn runs compare`` (runs, a sweep's trials, a run's or an experiment's checkpoint models) and ``raytrn models
promote``: the command line over :mod:`raytrn.tracking.compare`, :mod:`raytrn.tracking.compare_sweeps` and
:mod:`raytrn.tracking.registry`.
"""

from __future__ import annotations

import argparse
from typing import Any

from raytrn.cli_args import integer
from raytrn.config import resolve_mlflow_uri as resolve_tracking_uri
from raytrn.errors import RaytrnError
from raytrn.tracking.compare import DEFAULT_METRICS, ESTIMATE_METRICS, HIGHER_IS_BETTER, compare_runs, plot
from raytrn.tracking.compare_goodput import plot_goodput
from raytrn.tracking.compare_sweeps import compare_sweep, plot_sweep
from raytrn.tracking.last_run import last_experiment
from raytrn.tracking.links import ui_command
from raytrn.tracking.registry import compare_models, promote


def register(subparsers: Any) -> None:
    """Add ``runs compare`` to the ``raytrn`` command line."""
    p_runs = subparsers.add_parser("runs", help="look at the MLflow runs of past jobs")
    runs_sub = p_runs.add_subparsers(dest="runs_command", metavar="SUBCOMMAND")
    runs_sub.required = True
    p = runs_sub.add_parser(
        "compare",
        help="the runs of an experiment side by side (final metrics, key params), optionally plotted",
        description="Print one line per run of an MLflow experiment (newest first): key params, status, "
        "duration and the final value of each metric, best marked '*' (lower is better except for "
        f"{', '.join(sorted(HIGHER_IS_BETTER))} and lm-eval scores such as task/acc; unknown metrics count as "
        "lower-is-better). An experiment "
        "without runs prints a message and exits 0.",
    )
    p.add_argument(
        "--experiment",
        metavar="NAME",
        help="MLflow experiment (default: the one the last `raytrn train` in this directory logged to, at the same "
        "tracking URI; else raytrn)",
    )
    p.add_argument(
        "--filter",
        dest="filter_string",
        default="",
        metavar="EXPR",
        help="MLflow search filter; backtick dotted params, e.g. \"params.`optim.lr` = '0.001'\"",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="M1,M2",
        help=f"comma-separated metrics to compare (default: val_loss when a run has it, then {','.join(DEFAULT_METRICS)})",
    )
    p.add_argument(
        "--estimates",
        action="store_true",
        help=f"also {' and '.join(ESTIMATE_METRICS)}: how far raytrn estimate was from each run (signed fractions "
        "of the estimate; best: closest to 0)",
    )
    p.add_argument(
        "--goodput",
        action="store_true",
        help="where each run's wall time went instead (its goodput ledger: goodput, the wall time, the seconds of "
        "each cause); --plot draws a stacked bar per run",
    )
    p.add_argument("--plot", metavar="OUT.png", help="also write loss and tokens_per_s vs step to this PNG")
    p.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)",
    )
    p.add_argument("--max-runs", type=integer, default=20, metavar="N", help="newest N runs (default 20)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--sweep",
        metavar="NAME",
        help="the trials of this sweep (raytrn sweep), ranked by its metric, its varied fields as columns; --plot "
        "draws the metric of every trial against step and the final metric against each varied field",
    )
    which.add_argument(
        "--parent",
        metavar="RUN_ID",
        help="the same, for the sweep whose parent run this is (its id, or the id's first characters)",
    )
    which.add_argument(
        "--models",
        nargs="?",
        const="",
        metavar="RUN_ID",
        help="the checkpoints (MLflow LoggedModels, one a committed checkpoint) of this run (its id, or the first "
        "characters of it that the tables print), or of every run of the experiment, ranked by --rank-by: step, run, "
        "kept or deleted, registered version and aliases, metrics",
    )
    p.add_argument("--rank-by", default="val_loss", metavar="METRIC",
                   help="with --models: the metric to rank by (default val_loss; an lm-eval score such as "
                   "stdlib_next_line/acc ranks higher first)")  # fmt: skip
    p.set_defaults(func=_cmd_runs_compare)


def _cmd_runs_compare(args: argparse.Namespace) -> int:
    uri = resolve_tracking_uri(args.tracking_uri)
    experiment = args.experiment or last_experiment(uri) or "raytrn"
    if args.goodput and (args.metrics is not None or args.estimates):
        raise RaytrnError("--goodput compares the runs' goodput ledgers: it takes no --metrics or --estimates")
    if args.models is not None:
        for flag, value in (("--filter", args.filter_string), ("--metrics", args.metrics), ("--plot", args.plot),
                            ("--goodput", args.goodput)):  # fmt: skip
            if value:
                raise RaytrnError(f"{flag} does not apply to --models (the checkpoints are ranked by --rank-by)")
        table = compare_models(tracking_uri=uri, experiment=experiment, run_id=args.models or None,
                               metric=args.rank_by)  # fmt: skip
        print(table.render())
        return 0
    if args.sweep or args.parent:
        for flag, value in (
            ("--filter", args.filter_string),
            ("--metrics", args.metrics),
            ("--estimates", args.estimates),
            ("--goodput", args.goodput),
        ):
            if value:
                raise RaytrnError(f"{flag} does not apply to --sweep/--parent (a sweep is ranked by its own metric)")
        sweep = compare_sweep(tracking_uri=uri, sweep=args.sweep, parent=args.parent)
        print(sweep.render())
        if args.plot and sweep.rows:
            print(f"plot: {plot_sweep(sweep, args.plot)}")
        return 0
    comparison = compare_runs(
        tracking_uri=uri,
        experiment=experiment,
        filter_string=args.filter_string,
        metrics=args.metrics.split(",") if args.metrics is not None else None,
        max_runs=args.max_runs,
        estimates=args.estimates,
        goodput=args.goodput,
    )
    print(comparison.render())
    if args.plot and comparison.rows:
        print(f"plot: {plot_goodput(comparison, args.plot) if args.goodput else plot(comparison, args.plot)}")
    if comparison.rows:  # the experiment's runs in the MLflow UI's training view
        print(f"mlflow ui: {ui_command(uri, comparison.experiment_id)}")
    return 0


def register_models(subparsers: Any) -> None:
    """Add ``models promote`` to the ``raytrn`` command line."""
    p_models = subparsers.add_parser("models", help="the MLflow model registry: aliases of registered models")
    sub = p_models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser(
        "promote",
        help="point an alias (e.g. champion) of a registered model at one of its versions",
        description="Point ALIAS of the registered model NAME at VERSION (raytrn moves 'candidate' itself: "
        "tracking.register). Prints what it was before.",
    )
    p.add_argument("name", metavar="NAME", help="the registered model (tracking.registered_model)")
    p.add_argument("version", metavar="VERSION", help="its version to promote")
    p.add_argument("--alias", required=True, help="the alias to set, e.g. champion")
    p.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI)")
    p.set_defaults(func=_cmd_models_promote)


def _cmd_models_promote(args: argparse.Namespace) -> int:
    if not args.version.isdigit():
        raise RaytrnError(f"VERSION {args.version!r}: a registered model's version number, e.g. 3")
    line = promote(tracking_uri=resolve_tracking_uri(args.tracking_uri), name=args.name, version=args.version,
                   alias=args.alias)  # fmt: skip
    print(line)
    return 0
