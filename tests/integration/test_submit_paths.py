"""`raytrn submit` to the local simulator of a job whose every path field is relative (the table
``raytrn.config.PATH_FIELDS``): submit makes each one absolute (the simulator shares this filesystem), the job
trains from ``model.init_from`` on ``data.manifest`` (evaluating on ``data.validation``) and checkpoints and
tracks where the job file said.

A relative ``model.init_from`` or ``data.validation`` used to end in a ``KeyError`` traceback before anything
was submitted. The simulator is the session's shared one (``simulator``, tests/conftest.py); ``raytrn submit`` runs
in a user's shell whose ``HOME`` holds its state file and token, as on a laptop after ``raytrn cluster up --local``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.integration.test_autoscaling import JOB_TIMEOUT_S
from tests.simulator import Simulator

pytestmark = pytest.mark.integration

#: Every path field, relative to the directory `raytrn submit` runs in.
RELATIVE = {
    "model.init_from": "data/model",
    "data.manifest": "data/train",
    "data.validation": "data/val",
    "checkpoint.storage": "checkpoints",
    "neuron.compile_cache": "neuron-cache",
    "tracking.mlflow_uri": "sqlite:///mlruns/mlflow.db",
    "eval.include_path": "eval-tasks",
}


def _hf_model(out: Path) -> None:
    """A tiny Hugging Face Llama (no tokenizer: only the vocabulary size is checked against the data's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)


def test_submit_with_every_path_relative(simulator: Simulator, tiny_dataset: Path, tmp_path: Path) -> None:
    from raytrn.config import PATH_FIELDS

    assert set(RELATIVE) == {f.key for f in PATH_FIELDS}, "a path field this test does not submit"
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train").symlink_to(tiny_dataset)
    (work / "data" / "val").symlink_to(tiny_dataset)
    _hf_model(work / "data" / "model")
    job = {
        "model": {"family": "llama", "init_from": RELATIVE["model.init_from"]},
        "data": {
            "manifest": RELATIVE["data.manifest"],
            "validation": RELATIVE["data.validation"],
            "seq_len": 32,
            "micro_batch_size": 4,
        },  # fmt: skip
        "optim": {"lr": 1e-3},
        # One fake trn node (CPU 1, neuron_cores 2) holds the worker; CPU 0.5 leaves room for Ray Data.
        "scaling": {"accelerator": "cpu", "min_workers": 1, "resources_per_worker": {"neuron_cores": 1, "CPU": 0.5}},
        "checkpoint": {"storage": RELATIVE["checkpoint.storage"], "every_n_steps": 2},
        "tracking": {
            "mlflow_uri": RELATIVE["tracking.mlflow_uri"],
            "experiment": "submit-paths",
            "system_metrics": False,
            "log_model": False,
        },  # fmt: skip
        "run": {"max_steps": 2, "log_every": 1, "eval_batches": 1},
        "neuron": {"compile_cache": RELATIVE["neuron.compile_cache"]},
        "eval": {"include_path": RELATIVE["eval.include_path"]},  # (frozen only: no eval.tasks, nothing evaluated)
    }
    (work / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    # `raytrn submit` recognises the simulator by the state file under HOME (~/.raytrn/local-cluster.json).
    proc = simulator.cli("submit", "job.yaml", "--address", simulator.address, cwd=work, timeout=2 * JOB_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    (tmp_path / "submit.log").write_text(out)
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    match = re.search(r"raytrn: submitted (\S+) to \S+ \(run (\S+)\)", proc.stdout)
    assert match, proc.stdout[:2000]
    job_id, run_name = match.groups()

    # The job ran with every path frozen absolute, under the directory it was submitted from.
    entrypoint = simulator.job_client().get_job_info(job_id).entrypoint
    for key, value in RELATIVE.items():
        absolute = f"sqlite:///{work}/mlruns/mlflow.db" if value.startswith("sqlite:///") else str(work / value)
        assert f" --set {key}={absolute}" in entrypoint, (key, entrypoint)
    assert f"model.init_from: 21 tensors from {work / 'data' / 'model'} in " in proc.stdout, out[-6000:]
    assert "== raytrn: training finished ==" in proc.stdout
    assert (work / "checkpoints" / run_name / "checkpoint_00000002").is_dir()
    assert (work / "mlruns" / "mlflow.db").is_file()
