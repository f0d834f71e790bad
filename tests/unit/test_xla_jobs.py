"""The shipped jobs of the frozen XLA path (trn1: neuron-xla) load and say what their comments promise; moved from
test_jobs.py with the XLA path's layout checks (raytrn.xla)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.cluster.capacity import check_job_fits
from raytrn.config import PRESETS, JobSpec, load_job, read_job_file
from raytrn.errors import ConfigError
from raytrn.models import model_stats
from raytrn.train.checks import check_job
from raytrn.train.precheck import XLA_ACCELERATORS
from raytrn.xla.nxd import check_parallel, kv_replication

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

JOBS = Path(__file__).resolve().parents[2] / "jobs"
#: The shipped jobs of the XLA path, by their scaling.accelerator.
XLA_JOB_FILES = [
    p for p in sorted(JOBS.glob("*.yaml")) if read_job_file(str(p))[0]["scaling"]["accelerator"] in XLA_ACCELERATORS
]


def load(name: str, base_dir: str = "/base") -> JobSpec:
    return load_job(JOBS / name, base_dir=base_dir)


def test_the_xla_jobs_are_shipped() -> None:
    assert {p.name for p in XLA_JOB_FILES} >= {"llama3-8b-trn1.yaml", "llama3.2-1b-trn1.yaml"}


@pytest.mark.parametrize("path", XLA_JOB_FILES, ids=lambda p: p.name)
def test_every_xla_job_has_a_valid_layout(path: Path) -> None:
    job = load_job(path, base_dir="/base")
    # The parallel layout is valid (neuronx-distributed need not be installed to check it).
    check_parallel(job, require_installed=False)


def test_llama3_8b_trn1() -> None:
    job = load("llama3-8b-trn1.yaml")
    s = job.scaling
    assert s.accelerator == "neuron-xla"
    assert s.instance_type == "trn1.32xlarge"
    assert s.workers_per_node == 32  # one worker per NeuronCore-v2
    assert s.min_workers % 32 == 0 and (s.max_workers or s.min_workers) % 32 == 0
    assert s.resources_per_worker == {"neuron_cores": 1.0, "CPU": 1.0}
    assert job.data.seq_len == 8192 and job.data.micro_batch_size == 1  # AWS's 8B recipe
    assert job.model.dtype == "bfloat16"
    assert job.checkpoint.storage.startswith("s3://")
    stats = model_stats(job.model, job.data.seq_len)
    assert stats.num_params == pytest.approx(8.03e9, rel=0.005)


def test_llama3_8b_parallel_follows_aws_recipe() -> None:
    job = load("llama3-8b-trn1.yaml")
    p = job.parallel
    # tp_zero1_llama3_8B_hf_pretrain.sh: TP 32, ZeRO-1, sequence parallel, --kv_replicator 4.
    assert (p.tensor_parallel_size, p.zero1, p.sequence_parallel) == (32, True, True)
    assert p.activation_checkpointing == "none"  # AWS recomputes selectively; full recompute is off
    assert kv_replication(job.model.kv_heads, p.tensor_parallel_size) == 4
    n = job.neuron
    assert n.compile_cache is not None and n.compile_cache.startswith("s3://")  # shared by every node
    assert n.stochastic_rounding
    assert n.cc_flags == "--model-type transformer --distribution-strategy=llm-training"
    lines = check_parallel(job, require_installed=False)
    assert lines[0].startswith("parallel: TP 32 x DP 1, 2, 3, 4 = 32, 64, 96, 128 workers")


def test_llama32_1b_trn1() -> None:
    job = load("llama3.2-1b-trn1.yaml")
    assert job.model.preset == "llama3.2-1b"
    for key, value in PRESETS["llama3.2-1b"].items():
        if key != "max_position_embeddings":  # capped at the training length
            assert getattr(job.model, key) == value, key
    assert job.model.max_position_embeddings == job.data.seq_len == 8192
    assert job.model.dtype == "bfloat16"
    assert model_stats(job.model, job.data.seq_len).num_params == pytest.approx(1.236e9, rel=0.005)
    s = job.scaling
    assert (s.accelerator, s.instance_type, s.workers_per_node) == ("neuron-xla", "trn1.32xlarge", 32)
    assert (s.min_workers, s.max_workers) == (32, 128)
    assert s.resources_per_worker == {"neuron_cores": 1.0, "CPU": 1.0}
    p = job.parallel
    assert (p.tensor_parallel_size, p.zero1, p.sequence_parallel, p.activation_checkpointing) == (8, True, True, "none")
    assert kv_replication(job.model.kv_heads, p.tensor_parallel_size) == 1  # 8 kv heads, one per TP rank
    assert job.neuron.compile_cache is not None and job.neuron.compile_cache.startswith("s3://")
    assert job.checkpoint.storage.startswith("s3://")
    # "the same prepared data" as the 8B job (its comment says so).
    j8 = load("llama3-8b-trn1.yaml")
    assert (job.data.manifest, job.data.seq_len, job.model.vocab_size) == (j8.data.manifest, j8.data.seq_len, 128256)
    assert check_parallel(job, require_installed=False)[0].startswith(
        "parallel: TP 8 x DP 4, 8, 12, 16 = 32, 64, 96, 128 workers"
    )


def test_check_job_for_8b_without_data() -> None:
    lines = check_job(load("llama3-8b-trn1.yaml"), data=False)
    notes = [line for line in lines if line.startswith("note:")]
    assert notes and all("neuron" in note for note in notes)  # layout notes, or the backend unavailable here
    assert any(line.startswith("model: llama, 8,030.3M parameters") for line in lines)
    batch = next(line for line in lines if line.startswith("batch: "))
    # Every node count of the elastic range is checked, not only min and max. (The per-size arithmetic in
    # this line becomes "micro x grad_accum x DP" once the loop is DP-aware; the total stays 768.)
    for workers in (32, 64, 96, 128):
        assert f"{workers} workers: " in batch
    assert batch.count("= 768 sequences/step") == 4
    assert lines[-1] == "data: not checked (--no-data): /fsx/data/llama3-8k"


# --- cluster capacity of the trn1 jobs (moved from test_capacity.py) -------------------------------------------------


def test_the_trn1_job_fits_its_cluster() -> None:
    lines = fits("llama3-8b-trn1.yaml", "cluster/aws-trn1.yaml")
    assert lines[0].startswith(f"cluster: {REPO}/cluster/aws-trn1.yaml holds up to 256 worker(s)")
    assert "trn1_32xl: 4 node(s) x 32 worker(s) per node (CPU 128 / 1, neuron_cores 32 / 1)" in lines[0]


def test_an_elastic_top_the_cluster_can_never_reach_is_refused() -> None:
    # Elastic: the top of the range is what the cluster must be able to reach.
    with pytest.raises(ConfigError, match=r"scaling.max_workers=160 worker\(s\).*= 128 worker\(s\)"):
        fits(
            "llama3-8b-trn1.yaml", "cluster/kuberay/raycluster-trn1.yaml",
            "scaling.max_workers=160", "data.global_batch_size=3840",
        )  # fmt: skip


def test_nodes_too_small_for_workers_per_node_hold_none() -> None:
    with pytest.raises(ConfigError, match=r"0 worker\(s\) per node \(.*fewer than scaling.workers_per_node=32\)"):
        fits("llama3.2-1b-trn1.yaml", "cluster/local-sim.yaml", "scaling.instance_type=trn1.32xlarge")


def test_the_instance_type_must_be_one_the_cluster_has() -> None:
    with pytest.raises(ConfigError, match=r"instance_type='trn1.32xlarge' but .*aws-trn2.yaml has no worker node type"):
        fits("llama3-8b-trn1.yaml", "cluster/aws-trn2.yaml")


def test_undeclared_cpu_is_not_guessed() -> None:
    lines = fits("llama3-8b-trn1.yaml", "cluster/kuberay/raycluster-trn1.yaml")
    assert any("does not declare CPU for its node types: not checked" in line for line in lines)


def fits(job_file: str, cluster: str, *sets: str) -> list[str]:
    from raytrn.backends import get_backend

    job = load_job(REPO / "jobs" / job_file, list(sets), base_dir="/base")
    return check_job_fits(job, get_backend(job.scaling.accelerator).worker_resources(job), str(REPO / cluster))
