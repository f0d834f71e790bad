"""Links into the MLflow UI that raytrn prints (the training summary's ``mlflow ui`` line, ``raytrn runs compare``'s
last line): a run's own page, or an experiment's runs, in the UI's training view. MLflow 3 opens an experiment on its
GenAI overview unless the link asks for ``workflowType=machine_learning``."""

from __future__ import annotations

import os
import sys

from raytrn.tracking.client import is_http, redact_uri, split_credentials

#: Where ``mlflow ui`` (and ``raytrn mlflow serve``) listens by default.
LOCAL_UI = "http://127.0.0.1:5000"


def ui_url(uri: str, experiment_id: str | None, run_id: str | None = None) -> str:
    """The UI's page of ``run_id`` (or, without one, of the experiment's runs) for the tracking URI ``uri``: on a
    server, the server's own base URL (without credentials); for a local store, where ``mlflow ui`` listens."""
    base = split_credentials(uri)[0].rstrip("/") if is_http(uri) else LOCAL_UI
    if run_id is None:
        page = f"experiments/{experiment_id}"
    else:  # the UI's /runs/ID finds the run's experiment itself
        page = f"experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"runs/{run_id}"
    return f"{base}/#/{page}?workflowType=machine_learning"


def ui_command(uri: str, experiment_id: str | None, run_id: str | None = None) -> str:
    """What to open (a local store: after starting ``mlflow ui`` on it) to see a run or an experiment's runs."""
    url = ui_url(uri, experiment_id, run_id)
    if is_http(uri):
        return f"open {url}"
    exe = os.path.join(os.path.dirname(sys.executable), "mlflow")  # the venv's, even if not activated
    mlflow = exe if os.path.exists(exe) else "mlflow"
    return f"{mlflow} ui --backend-store-uri {redact_uri(uri)} --port 5000   # then open {url}"
