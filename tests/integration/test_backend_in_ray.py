"""Inside a Ray Train worker the backends still use Ray's device and ``prepare_model`` (the single-process
fallback of ``bench/gpu.py`` must not leak into real jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _probe(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from raytrn.backends.base import in_ray_train_worker
    from raytrn.backends.cpu import CpuBackend

    calls = []
    original = ray.train.torch.prepare_model

    def spy(model, **kwargs):
        calls.append(kwargs)
        return original(model, **kwargs)

    ray.train.torch.prepare_model = spy
    try:
        CpuBackend().prepare_model(torch.nn.Linear(2, 2))
    finally:
        ray.train.torch.prepare_model = original
    # Result.metrics is None for a report without a checkpoint: the worker writes what it saw to a file.
    Path(config["out"]).write_text(json.dumps({"in_worker": in_ray_train_worker(), "prepare_model_calls": len(calls)}))


def test_in_a_ray_train_worker_prepare_model_goes_through_ray(ray_session, tmp_path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.backends.base import in_ray_train_worker

    assert not in_ray_train_worker()  # the driver is not a worker
    trainer = TorchTrainer(
        _probe,
        train_loop_config={"out": str(tmp_path / "seen.json")},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="backend-in-ray", storage_path=str(tmp_path)),
    )
    trainer.fit()
    assert json.loads((tmp_path / "seen.json").read_text()) == {"in_worker": True, "prepare_model_calls": 1}
