"""What the job's MLflow experiment already measured: the MFU, the restart time and the blocking checkpoint save of
finished runs of the same model on the same instance type, to estimate with in place of the shipped figures.

Read-only and bounded: a local store that does not exist or a server that does not answer within seconds is no
history (the estimate says where its figures came from), never an error.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrn.estimate.reference import Measured
from raytrn.models import model_stats

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: Finished runs read, newest first.
MAX_RUNS = 50


@dataclass(frozen=True)
class History:
    mfu: Measured | None = None
    restart_s: Measured | None = None
    #: A periodic checkpoint's blocking save (the loop's wait): the Young/Daly interval's save cost.
    save_s: Measured | None = None


def read_history(job: JobSpec, *, instance_type: str | None = None) -> History:
    """The experiment's finished runs with ``job``'s model (parameter count) on ``instance_type`` (the job's by
    default): the mean of their last ``mfu``, the medians of their ``restart_to_first_step_s`` and
    ``checkpoint_blocking_s``."""
    uri = job.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return History()
    try:
        runs, client = _finished_runs(job, uri)
    except Exception as e:  # unreachable, no such store, refused: no history
        log.info("no MLflow history for the estimate (%s: %s)", type(e).__name__, e)
        return History()
    itype = str(instance_type or job.scaling.instance_type)
    params = str(model_stats(job.model, job.data.seq_len).num_params)
    same = [
        r
        for r in runs
        if r.data.params.get("model.num_params") == params and r.data.params.get("scaling.instance_type") == itype
    ]
    if not same:
        return History()
    where = f"MLflow experiment {job.tracking.experiment!r}"
    mfus = [r.data.metrics["mfu"] for r in same if "mfu" in r.data.metrics]
    mfu = Measured(statistics.fmean(mfus), f"{where}: mean of {len(mfus)} finished run(s)") if mfus else None

    def median(metric: str, what: str) -> Measured | None:
        values = [m.value for r in same for m in client.get_metric_history(r.info.run_id, metric)]
        return Measured(statistics.median(values), f"{where}: median of {len(values)} {what}") if values else None

    return History(
        mfu=mfu,
        restart_s=median("restart_to_first_step_s", "restart(s)"),
        save_s=median("checkpoint_blocking_s", "periodic checkpoint save(s)"),
    )


def _finished_runs(job: JobSpec, uri: str) -> tuple[list[Any], Any]:
    from raytrn.tracking.client import mlflow_client, sqlite_path

    db = sqlite_path(uri)
    if db is not None and not os.path.exists(db):
        return [], None
    client = mlflow_client(uri, fail_fast=True)
    experiment = client.get_experiment_by_name(job.tracking.experiment)
    if experiment is None:
        return [], client
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string="attributes.status = 'FINISHED'",
        max_results=MAX_RUNS,
        order_by=["attributes.start_time DESC"],
    )
    return list(runs), client
