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
