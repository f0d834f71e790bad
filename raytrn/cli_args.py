"""Command-line options shared by several ``raytrn`` subcommands (kept apart so that the modules which
register subcommands, like :mod:`raytrn.submit`, need not import :mod:`raytrn.cli`)."""

from __future__ import annotations

import argparse
import math
import os
import reprlib

from raytrn.runtime import DASHBOARD_ENV


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
    """``--verbose``: Ray's own lines on the terminal too (see :func:`raytrn.ray_output.route_ray_output`)."""
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print Ray's own lines (worker-group start, ranks, raylet warnings); by default they go to "
        "logs/<run>.log, whose path is printed",
    )


def add_ray_dashboard_option(p: argparse.ArgumentParser) -> None:
    """``--ray-dashboard``: an embedded local Ray with its dashboard (:data:`~raytrn.runtime.DASHBOARD_ENV`)."""
    p.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start the embedded local Ray (no RAY_ADDRESS) with Ray's dashboard, its URL printed; by default it "
        "starts without (2-4 s sooner). A cluster's dashboard is unaffected",
    )


def use_ray_dashboard_option(args: argparse.Namespace) -> None:
    """Apply ``--ray-dashboard`` before Ray starts (the environment variable; set, it wins when the flag is absent)."""
    if args.ray_dashboard:
        os.environ[DASHBOARD_ENV] = "1"


#: A number on a command line with more digits than this is a mistake (the largest option, a step, has 13).
MAX_DIGITS = 30


def _shown(text: str) -> str:
    return reprlib.repr(text)


def integer(text: str) -> int:
    """``type=`` for an integer option: argparse's own ``int``, but a number of thousands of digits is one short
    line (``argument --workers: an integer of 5,000 digits``), not the whole number echoed back."""
    digits = sum(c.isdigit() for c in text)
    if digits > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"an integer of {digits:,} digits ({_shown(text)}); no option takes that")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {_shown(text)}") from None


def number(text: str) -> float:
    """``type=`` for a number option: finite, of a sane length (see :func:`integer`)."""
    digits = sum(c.isdigit() for c in text)
    if digits > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"a number of {digits:,} digits ({_shown(text)}); no option takes that")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_shown(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {_shown(text)}")
    return value
