"""Command-line options shared by several ``raytrn`` subcommands (kept apart so that the modules which
register subcommands, like :mod:`raytrn.submit`, need not import :mod:`raytrn.cli`)."""

from __future__ import annotations

import argparse


def add_set_option(p: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a job-spec override, parsed as YAML (see raytrn.config.apply_overrides)."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job-spec field, e.g. --set optim.lr=3e-4 (repeatable; VALUE is parsed as YAML)",
    )


def add_verbose_option(p: argparse.ArgumentParser) -> None:
    """``--verbose``: Ray's own lines on the terminal too (see :func:`raytrn.runtime.route_ray_output`)."""
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print Ray's own lines (worker-group start, ranks, raylet warnings); by default they go to "
        "logs/<run>.log, whose path is printed",
    )
