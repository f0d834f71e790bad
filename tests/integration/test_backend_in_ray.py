"""Inside a Ray Train worker the backends lay the model out over the process group Ray formed (the
single-process path of ``bench/gpu.py``, no wrapping, must not leak into real jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _probe(config: dict) -> None:
    import ray.train
    import torch

    from raytrn.backends.base import in_ray_train_worker
    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.models import build_model

    job = load_job(REPO / "jobs" / "tiny.yaml", ["data.manifest=unused"], resolve=False)
    ctx = ray.train.get_context()
    par = CpuBackend().parallelize(build_model(job.model, seed=0), job, world_size=ctx.get_world_size(), compile=None)
    seen = {
        "in_worker": in_ray_train_worker(),
        "process_group": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "layout": par.data_parallel,
        "wrapper": type(par.model).__name__,
    }
    if ctx.get_world_rank() == 0:  # Result.metrics is None for a report without a checkpoint: a file instead
        Path(config["out"]).write_text(json.dumps(seen))


def test_in_a_ray_train_worker_the_model_is_laid_out_over_rays_process_group(ray_session, tmp_path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.backends.base import in_ray_train_worker

    assert not in_ray_train_worker()  # the driver is not a worker
    trainer = TorchTrainer(
        _probe,
        train_loop_config={"out": str(tmp_path / "seen.json")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="backend-in-ray", storage_path=str(tmp_path)),
    )
    trainer.fit()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "in_worker": True,
        "process_group": "gloo",
        "layout": "ddp",
        "wrapper": "DistributedDataParallel",
    }
