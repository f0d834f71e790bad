"""What a run records about itself at its start: its identity tags, the software stack's versions and the commit of the
job's code (MLflow params and tags, written by :func:`raytrn.train.trainer.run_training` through the tracking actor)."""

from __future__ import annotations

import os

from raytrn import __version__
from raytrn.checkpoint.rundir import RunDir
from raytrn.config import JobSpec
from raytrn.runtime import git_commit, ray_job_submission_id


def run_tags(job: JobSpec) -> dict[str, str]:
    """The run's identity tags: the job file, the versions that matter most, the accelerator, where it checkpoints,
    the instance type and the Ray job it runs as."""
    from importlib import metadata

    import ray

    tags = {
        "raytrn.job_file": job.source,
        "raytrn.version": __version__,
        "ray.version": ray.__version__,
        "torch.version": metadata.version("torch"),  # the driver does not import torch
        "accelerator": job.scaling.accelerator,
        "checkpoint.storage": RunDir.of(job).root,
    }
    if job.scaling.instance_type:
        tags["instance_type"] = job.scaling.instance_type
    submission_id = ray_job_submission_id()
    if submission_id:
        tags["ray.job_submission_id"] = submission_id
    return tags


def versions() -> dict[str, str]:
    """Versions of the software stack (the driver's environment), for the run's params."""
    import platform
    from importlib import metadata

    out = {"versions.python": platform.python_version()}
    for dist in (
        "raytrn", "ray", "torch", "transformers", "mlflow", "torch-xla",
        "torch-neuronx", "neuronx-distributed", "neuronx-cc", "libneuronxla",
    ):  # fmt: skip
        try:
            out[f"versions.{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit_param() -> dict[str, str]:
    """The commit the job's code came from: ``raytrn submit`` records it at submission (the cluster's copy
    of the working dir has no .git); a local run asks git."""
    import json

    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata") or {}
    except json.JSONDecodeError:
        meta = {}
    commit = meta.get("git.commit") or git_commit(os.getcwd())
    return {"git.commit": commit} if commit else {}
