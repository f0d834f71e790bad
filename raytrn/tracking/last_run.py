"""What the last ``raytrn train`` in a directory tracked: ``mlruns/raytrn-last-run.json`` there (beside the default
local store, ``mlruns/mlflow.db``), so that ``raytrn runs compare`` without ``--experiment`` shows that run's
experiment (``make demo`` trains into ``raytrn-demo``, not the default ``raytrn``).

The record holds the tracking URI without credentials, the experiment's name and the run's id; it applies only to
the same tracking URI. Writing it is best effort: a directory that cannot be written loses nothing but the default.
"""

from __future__ import annotations

import json
import os
from typing import Any

from raytrn import jsonfile
from raytrn.tracking.client import split_credentials

RECORD = os.path.join("mlruns", "raytrn-last-run.json")


def record_last_run(tracking_uri: str, experiment: str, run_id: str, directory: str = ".") -> None:
    """Note that the run ``run_id`` of ``experiment`` at ``tracking_uri`` is the last one trained in ``directory``."""
    path = os.path.join(directory, RECORD)
    data = {"tracking_uri": split_credentials(tracking_uri)[0], "experiment": experiment, "run_id": run_id}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def last_experiment(tracking_uri: str, directory: str = ".") -> str | None:
    """The experiment of the last run trained in ``directory`` against ``tracking_uri`` (None: none recorded)."""
    try:
        with open(os.path.join(directory, RECORD)) as fh:
            data: Any = jsonfile.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("tracking_uri") != split_credentials(tracking_uri)[0]:
        return None
    experiment = data.get("experiment")
    return experiment if isinstance(experiment, str) and experiment else None
