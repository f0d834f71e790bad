"""The shipped job specs load and say what their comments promise (so the examples never rot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.config import JobSpec, load_job
from raytrn.models import PRESETS, model_stats
from raytrn.train.checks import check_job

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
JOB_FILES = sorted(JOBS.glob("*.yaml"))


def load(name: str) -> JobSpec:
    return load_job(JOBS / name, base_dir="/base")


def test_jobs_exist() -> None:
    assert {p.name for p in JOB_FILES} >= {"tiny.yaml", "llama3-8b-trn1.yaml"}


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name)
def test_every_job_loads(path: Path) -> None:
    job = load_job(path, base_dir="/base")
    assert job.source == str(path)
    assert job.data.seq_len <= job.model.max_position_embeddings
    assert job.optim.warmup_steps < job.run.max_steps
    assert job.checkpoint.every_n_steps <= job.run.max_steps
    # The batch shape works at both ends of the worker range.
    s = job.scaling
    for n in {s.min_workers, s.max_workers or s.min_workers}:
        assert job.data.grad_accum_for(n) >= 1


def test_tiny() -> None:
    job = load("tiny.yaml")
    assert job.scaling.accelerator == "cpu"
    assert job.model.preset == "tiny"
    for key, value in PRESETS["tiny"].items():
        assert getattr(job.model, key) == value, key
    assert job.model.dtype == "float32"
    assert 10 <= job.run.max_steps <= 1000  # "trained on CPU in about a minute"
    assert job.optim.warmup_steps < job.run.max_steps
    assert job.data.seq_len == 128 and job.model.vocab_size == 4096  # the `data prepare` line in its comment
    assert not job.scaling.elastic
    assert model_stats(job.model, job.data.seq_len).num_params < 5e6


def test_llama3_8b_trn1() -> None:
    job = load("llama3-8b-trn1.yaml")
    s = job.scaling
    assert s.accelerator == "neuron"
    assert s.instance_type == "trn1.32xlarge"
    assert s.workers_per_node == 32  # one worker per NeuronCore-v2
    assert s.min_workers % 32 == 0 and (s.max_workers or s.min_workers) % 32 == 0
    assert s.resources_per_worker == {"neuron_cores": 1.0, "CPU": 1.0}
    assert job.data.seq_len in (4096, 8192)
    assert job.model.dtype == "bfloat16"
    assert job.checkpoint.storage.startswith("s3://")
    stats = model_stats(job.model, job.data.seq_len)
    assert stats.num_params == pytest.approx(8.03e9, rel=0.005)


def _node_counts() -> list[int]:
    s = load("llama3-8b-trn1.yaml").scaling
    return list(range(s.min_workers // 32, (s.max_workers or s.min_workers) // 32 + 1))


@pytest.mark.parametrize("nodes", _node_counts(), ids=lambda n: f"{n}-nodes")
def test_llama3_8b_global_batch_fits_every_node_count(nodes: int) -> None:
    job = load("llama3-8b-trn1.yaml")
    workers = nodes * job.scaling.workers_per_node
    accum = job.data.grad_accum_for(workers)
    assert accum * workers * job.data.micro_batch_size == job.data.global_batch_size


def test_check_job_for_8b_without_data() -> None:
    lines = check_job(load("llama3-8b-trn1.yaml"), data=False)
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "neuron" in notes[0] and "checked again when the job starts" in notes[0]
    assert any(line.startswith("model: llama, 8,030.3M parameters") for line in lines)
    batch = next(line for line in lines if line.startswith("batch: "))
    # Every node count of the elastic range is checked, not only min and max.
    for workers in (32, 64, 96, 128):
        assert f"{workers} workers: 1 x {768 // workers} x {workers} = 768 sequences/step" in batch
    assert lines[-1] == "data: not checked (--no-data): /fsx/data/llama3-8k"
