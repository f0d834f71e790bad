"""Third-party usage telemetry in raytrn's processes: off unless you turn it on.

A training cluster talks to its own MLflow server and storage, nothing else. Two libraries raytrn runs would also
report usage to their makers, by default:

- MLflow 3 (``mlflow.telemetry``): as ``import mlflow`` runs it creates a telemetry client, whose first tracked call
  starts a thread that fetches its configuration from the makers' servers and then posts usage records; at exit the
  process waits for that thread (up to 1 s). Every raytrn process that writes the run does it: the driver, the
  tracking actor, the evaluator, ``raytrn runs``, and ``raytrn mlflow serve``'s server. Measured here (MLflow 3.17):
  one DNS lookup of the makers' configuration host per process (found by Python's audit events).
- Ray (``ray._common.usage``): a Ray cluster started without ``RAY_USAGE_STATS_ENABLED=0`` reports its usage from its
  dashboard process a minute after it starts, then every hour. With it, raytrn's embedded local Ray (``raytrn train``
  without a cluster, ``make demo``: a ``ray.init`` cluster) reports nothing; a cluster a raytrn command starts the
  ``ray start`` way inherits it and sends Ray's one report that usage stats are off, at its start (Ray 2.60's
  ``usage_stats_head``), and none after.

:func:`keep_off` runs when the ``raytrn`` package is first imported in a process, before raytrn imports MLflow or
starts Ray there, and sets each library's own off switch unless that variable is already set: the user's choice,
either way, wins (``MLFLOW_DISABLE_TELEMETRY=false`` or ``RAY_USAGE_STATS_ENABLED=1`` turn them back on; MLflow's
``DO_NOT_TRACK`` is left to MLflow). Child processes (Ray's own, ``mlflow server``) inherit the variables.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: Each library's off switch, as raytrn sets it when the variable is unset.
OFF: dict[str, str] = {"MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0"}


def keep_off(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :data:`OFF`'s variables in ``environ`` where unset; returns those it set."""
    added = {name: value for name, value in OFF.items() if name not in environ}
    environ.update(added)
    return added
