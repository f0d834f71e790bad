"""The Neuron code path without Neuron: a 1-worker xla-cpu job through Ray Train, checkpoint and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrn.train.trainer import run_training
from tests.integration.test_train import _job, _metric_history

pytestmark = pytest.mark.xla


def test_xla_cpu_trains_checkpoints_and_resumes(ray_session, tiny_dataset: Path, tmp_path: Path) -> None:
    job = _job(
        tiny_dataset,
        tmp_path,
        "scaling.accelerator=xla-cpu",
        "scaling.min_workers=1",
        "scaling.max_workers=1",
        "run.max_steps=20",
        "run.log_every=5",
        "checkpoint.every_n_steps=10",
    )
    first = run_training(job, live_progress=False)
    assert (first.start_step, first.final_step) == (0, 20)
    assert first.final_loss < first.first_loss - 0.3, (first.first_loss, first.final_loss)
    state = torch.load(Path(first.checkpoint) / "state.pt", map_location="cpu", weights_only=False)
    # Saved from XLA: every tensor came back to the CPU.
    assert all(t.device.type == "cpu" for t in state["model"].values())

    more = job.model_copy(update={"run": job.run.model_copy(update={"max_steps": 25})})
    second = run_training(more, live_progress=False)
    assert (second.start_step, second.final_step) == (20, 25)
    state = torch.load(Path(second.checkpoint) / "state.pt", map_location="cpu", weights_only=False)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {25.0}  # AdamW state restored
    steps = [s for s, _ in _metric_history(job, second.mlflow_run_id, "loss")]
    assert steps == [5, 10, 15, 20, 25]
    # Its final model logged: the resumed run (5 steps) may end while rank 0 still imports transformers ahead of the
    # export (seen once here: the export failed beside that import; tests/unit/test_import_ahead.py reproduces it)
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(job.tracking.mlflow_uri).list_artifacts(second.mlflow_run_id, "model")
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= {a.path for a in logged}
